"""A real `python main.py serve` process for the server tests: a free loopback port, its log in a file, /health polled."""
from __future__ import annotations

import json
import shutil
import signal
import socket
import subprocess
import sys
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
  def __init__(self, model: Path | None, log_path: Path, *args: str, api_key: str | None = None):
    """model None: no --model (the model shipped in the package)."""
    self.port, self.log_path, self.api_key = free_port(), log_path, api_key
    self.url = f"http://127.0.0.1:{self.port}"
    cmd = [sys.executable, str(REPO / "main.py"), "serve", *(["--model", str(model)] if model is not None else []),
           "--port", str(self.port), "--seed", "0", *args]
    if api_key: cmd += ["--api-key", api_key]
    self._log = open(log_path, "w")  # noqa: SIM115 -- stays open as long as the process runs
    self.proc = subprocess.Popen(cmd, cwd=REPO, stdout=self._log, stderr=subprocess.STDOUT)

  @property
  def headers(self) -> dict[str, str]: return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

  def log(self) -> str: return self.log_path.read_text()

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
