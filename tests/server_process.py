"""A real `python main.py serve` process for the server tests: a free loopback port, its log in a file, /health polled."""
from __future__ import annotations

import json
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]

# A plain chat template ("<s>user: ...\nassistant:") for stories260K, which has none; like Qwen3's, it reads
# enable_thinking (from chat_template_kwargs).
CHAT_TEMPLATE = ("{{ bos_token }}{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}assistant:{% if enable_thinking is false %} Once{% endif %}{% endif %}")


def model_with_chat_template(model_dir: Path, dest: Path) -> Path:
  """A copy of the model folder whose tokenizer_config.json has CHAT_TEMPLATE."""
  shutil.copytree(model_dir, dest)
  config = json.loads((dest / "tokenizer_config.json").read_text())
  (dest / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": CHAT_TEMPLATE}))
  return dest


def free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


class ServerProcess:
  def __init__(self, model: Path | None, log_path: Path, *args: str, api_key: str | None = None, positional: bool = False):
    """model None: no model given (the one shipped in the package); positional: `serve MODEL` (vLLM's form) rather than
    `serve --model MODEL`."""
    self.port, self.log_path, self.api_key = free_port(), log_path, api_key
    self.url = f"http://127.0.0.1:{self.port}"
    where = [] if model is None else [str(model)] if positional else ["--model", str(model)]
    cmd = [sys.executable, str(REPO / "main.py"), "serve", *where, "--port", str(self.port), "--seed", "0", *args]
    if api_key: cmd += ["--api-key", api_key]
    self._log = open(log_path, "w")  # noqa: SIM115 -- stays open as long as the process runs
    self.proc = subprocess.Popen(cmd, cwd=REPO, stdout=self._log, stderr=subprocess.STDOUT)

  @property
  def headers(self) -> dict[str, str]: return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

  def log(self) -> str: return self.log_path.read_text()

  def core_pid(self) -> int:
    """The engine core process's pid (the server logs it when it starts the process)."""
    found = re.search(r"engine core process started \(pid (\d+)\)", self.log())
    assert found, f"no engine core process in the log:\n{self.log()}"
    return int(found.group(1))

  def wait_ready(self, timeout: float = 120) -> list[int]:
    """Poll /health until it says 200; returns every status seen on the way (503 while the model loads)."""
    seen, deadline = [], time.monotonic() + timeout
    while time.monotonic() < deadline:
      if self.proc.poll() is not None: raise RuntimeError(f"the server exited with {self.proc.returncode}:\n{self.log()}")
      try: status = httpx.get(f"{self.url}/health", timeout=5).status_code
      except httpx.TransportError: status = None
      if status is not None: seen.append(status)
      if status == 200: return seen
      time.sleep(0.05)
    raise TimeoutError(f"the server was not ready after {timeout} s:\n{self.log()}")

  def stop(self, sig: int = signal.SIGINT, timeout: float = 60) -> int:
    if self.proc.poll() is None:
      self.proc.send_signal(sig)
      try: self.proc.wait(timeout)
      except subprocess.TimeoutExpired:
        self.proc.kill()
        self.proc.wait()
    self._log.close()
    return self.proc.returncode

  def __enter__(self) -> ServerProcess:
    try: self.wait_ready()
    except BaseException:
      self.stop()
      raise
    return self

  def __exit__(self, *exc: object) -> None: self.stop()


class StreamReader(threading.Thread):
  """Reads one streamed completion on a thread; `started` is set at its first chunk."""

  def __init__(self, url: str, body: dict):
    super().__init__(daemon=True)
    self.url, self.body, self.started = url, body, threading.Event()
    self.lines: list[str] = []
    self.error: Exception | None = None

  def run(self) -> None:
    try:
      with httpx.stream("POST", self.url, json=self.body, timeout=120) as r:
        for line in r.iter_lines():
          if not line.startswith("data: "): continue
          self.lines.append(line)
          self.started.set()
    except httpx.HTTPError as e:
      self.error = e
    self.started.set()

  def chunks(self) -> list[dict]: return [json.loads(line[6:]) for line in self.lines if line != "data: [DONE]"]
