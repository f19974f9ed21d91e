"""The command line against bad input: every numeric flag refused at parse time (one line, status 2, nothing loaded);
a missing or mismatched tokenizer found before the weights load; bench decode's arithmetic; chat outgrowing its
context and Ctrl-C during a reply."""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import math
import multiprocessing
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from tests.conftest import assert_all_free
from tests.test_tokenizer import LLAMA3, QWEN3
from tinyvllm.cli import build_parser, main
from tinyvllm.cli.args import TABLE_TYPES
from tinyvllm.cli.chat import Conversation, turn
from tinyvllm.config import ConfigError, EngineConfig
from tinyvllm.engine_args import TABLE
from tinyvllm.model.embedded import embedded_model_path
from tinyvllm.sampling_params import SamplingParams
from tinyvllm.tokenizer import TokenizerError, load_tokenizer

REPO = Path(__file__).resolve().parents[1]
LOADING = "[tinyvllm] backend"   # the first line of the weights' load (engine/core_setup.py)
SUBPROCESS_SECONDS = 20          # Python, the imports and a parse on a slow CI machine; a model load takes longer


def cli(*argv: str, timeout: float = 600, **kwargs) -> tuple[subprocess.CompletedProcess, float]:
  start = time.perf_counter()
  run = subprocess.run([sys.executable, "main.py", *argv], cwd=REPO, capture_output=True, text=True, timeout=timeout, **kwargs)
  return run, time.perf_counter() - start


def error_lines(stderr: str) -> list[str]:
  """stderr without the engine's progress lines ([tinyvllm] ...): what the user is told went wrong."""
  return [line for line in stderr.splitlines() if line.strip() and not line.startswith("[tinyvllm]")]


# ---- 1. numeric flags: refused at parse time, one line naming the flag
BAD_FLAGS = [
  # bench decode (the spinning, ZeroDivisionError and numpy-traceback cases)
  (["bench", "decode", "--batch-size", "0"], "--batch-size"),
  (["bench", "decode", "--batch-size", "-1"], "--batch-size"),
  (["bench", "decode", "--max-tokens", "1"], "--max-tokens: must be >= 2 for a decode measurement"),
  (["bench", "decode", "--prompt-len", "0"], "--prompt-len"),
  # bench throughput and serve
  (["bench", "throughput", "--num-prompts", "0"], "--num-prompts"),
  (["bench", "throughput", "--input-len", "-5"], "--input-len"),
  (["bench", "throughput", "--output-len", "0"], "--output-len"),
  (["bench", "throughput", "--random-range-ratio", "1"], "--random-range-ratio: must be a number in [0, 1)"),
  (["bench", "throughput", "--num-iters-warmup", "-1"], "--num-iters-warmup"),
  (["bench", "throughput", "--output-json", "/no/such/folder/t.json"], "--output-json: folder '/no/such/folder' does not exist"),
  (["bench", "serve", "--num-prompts", "0"], "--num-prompts"),
  (["bench", "serve", "--request-rate", "0"], "--request-rate"),
  (["bench", "serve", "--request-rate", "nan"], "--request-rate"),
  (["bench", "serve", "--max-concurrency", "0"], "--max-concurrency"),
  (["bench", "serve", "--num-warmups", "-1"], "--num-warmups"),
  (["bench", "serve", "--vocab-size", "0"], "--vocab-size"),
  (["bench", "serve", "--seed", "-1"], "--seed"),
  (["bench", "serve", "--goodput", "ttft:-5"], "--goodput: a goodput SLO must be a number of milliseconds > 0"),
  (["bench", "serve", "--goodput", "latency:5"], "--goodput: goodput takes ttft:MS"),
  # sampling flags
  (["generate", "--prompt", "x", "--max-tokens", "0"], "--max-tokens: must be an integer >= 1, got '0'"),
  (["generate", "--prompt", "x", "--max-tokens", "2.5"], "--max-tokens"),
  (["generate", "--prompt", "x", "--temperature", "-1"], "--temperature"),
  (["generate", "--prompt", "x", "--temperature", "inf"], "--temperature: must be a finite number, got 'inf'"),
  (["generate", "--prompt", "x", "--top-p", "0"], "--top-p: top_p must be a number in (0, 1]"),
  (["generate", "--prompt", "x", "--top-p", "1.5"], "--top-p"),
  (["generate", "--prompt", "x", "--top-k", "-2"], "--top-k: top_k must be -1 or 0 (off) or a positive integer"),
  (["generate", "--prompt", "x", "--min-p", "2"], "--min-p"),
  (["generate", "--prompt", "x", "--presence-penalty", "3"], "--presence-penalty"),
  (["generate", "--prompt", "x", "--frequency-penalty", "-3"], "--frequency-penalty"),
  (["generate", "--prompt", "x", "--repetition-penalty", "0"], "--repetition-penalty"),
  (["generate", "--prompt", "x", "--temperature", "abc"], "--temperature: must be a finite number, got 'abc'"),
  (["generate", "--prompt", "x", "--seed", str(2**70)], "--seed: seed must be"),
  (["generate", "--prompt", "x", "--seed", "-1"], "--seed"),
  (["chat", "--max-tokens", "-3"], "--max-tokens"),
  # the shared engine flags
  (["generate", "--prompt", "x", "--max-model-len", "0"], "--max-model-len"),
  (["generate", "--prompt", "x", "--block-size", "0"], "--block-size"),
  (["chat", "--block-size", "12"], "--block-size: must be a power of two"),
  (["generate", "--prompt", "x", "--num-gpu-blocks", "0"], "--num-gpu-blocks"),
  (["generate", "--prompt", "x", "--max-num-seqs", "0"], "--max-num-seqs"),
  (["generate", "--prompt", "x", "--max-num-seqs", "many"], "--max-num-seqs: must be an integer >= 1, got 'many'"),
  (["generate", "--prompt", "x", "--max-num-batched-tokens", "-1"], "--max-num-batched-tokens"),
  (["generate", "--prompt", "x", "--kv-cache-memory", "0"], "--kv-cache-memory"),
  (["generate", "--prompt", "x", "--gpu-memory-utilization", "0"], "--gpu-memory-utilization"),
  (["generate", "--prompt", "x", "--gpu-memory-utilization", "1.1"], "--gpu-memory-utilization"),
  (["generate", "--prompt", "x", "--swap-space", "-1"], "--swap-space"),
  (["generate", "--prompt", "x", "--max-logprobs", "21"], "--max-logprobs: must be an integer in [0, 20]"),
  (["generate", "--prompt", "x", "--long-prefill-token-threshold", "-1"], "--long-prefill-token-threshold"),
  (["generate", "--prompt", "x", "--decode-layer-max-context", "0"], "--decode-layer-max-context"),
  (["generate", "--prompt", "x", "--cuda-graph-sizes", "4", "0"], "--cuda-graph-sizes"),
  (["generate", "--prompt", "x", "-tp", "0"], "--tensor-parallel-size/-tp"),
  (["generate", "--prompt", "x", "--kv-cache-memory-bytes", "0"], "--kv-cache-memory-bytes"),
  (["generate", "--prompt", "x", "--cpu-offload-gb", "-1"], "--cpu-offload-gb"),
  # serve's own
  (["serve", "--port", "-1"], "--port"),
  (["serve", "--port", "65536"], "--port: must be an integer in [0, 65535]"),
  (["serve", "--shutdown-timeout", "-1"], "--shutdown-timeout"),
  (["serve", "--max-log-len", "-1"], "--max-log-len"),
  (["serve", "--ssl-cert-reqs", "3"], "--ssl-cert-reqs"),
]


@pytest.mark.parametrize("argv, message", BAD_FLAGS, ids=[" ".join(a) for a, _ in BAD_FLAGS])
def test_a_bad_numeric_flag_is_one_usage_line(argv, message, capsys):
  with pytest.raises(SystemExit) as exit_:
    main(argv)
  err = capsys.readouterr().err
  assert exit_.value.code == 2
  assert len(err.splitlines()) == 1 and f"error: argument {message}" in err and "Traceback" not in err


def test_edge_values_still_parse():
  parse = build_parser().parse_args
  args = parse(["generate", "--prompt", "x", "--top-k", "-1", "--temperature", "0", "--top-p", "1", "--min-p", "0",
                "--swap-space", "0", "--long-prefill-token-threshold", "0", "--gpu-memory-utilization", "1", "--max-logprobs", "0",
                "--cuda-graph-sizes", "--block-size", "32", "--seed", "0", "--presence-penalty", "-2"])
  assert (args.top_k, args.temperature, args.top_p, args.swap_space, args.cuda_graph_sizes, args.block_size) == (-1, 0, 1, 0, [], 32)
  assert parse(["bench", "serve", "--request-rate", "inf"]).request_rate == math.inf
  assert parse(["bench", "decode", "--max-tokens", "2"]).max_tokens == 2
  assert parse(["serve", "--port", "0"]).port == 0


def _options(parser: argparse.ArgumentParser):
  """(subcommand, action) of every option of every subcommand."""
  for action in parser._actions:
    if isinstance(action, argparse._SubParsersAction):
      for sub in action.choices.values(): yield from _options(sub)
    else: yield parser.prog, action


def test_every_numeric_flag_checks_its_value():
  """No flag takes a bare int or float (any value), now or when one is added: each has a checking type or choices."""
  unchecked = [f"{prog} {action.option_strings}" for prog, action in _options(build_parser())
               if action.type in (int, float) and action.choices is None]
  assert not unchecked
  assert {arg.name for arg in TABLE if arg.kind in (int, float)} == set(TABLE_TYPES)   # vLLM's numeric arguments too


@pytest.mark.parametrize("argv, flag", [
  (["bench", "decode", "--batch-size", "0"], "--batch-size"),
  (["bench", "decode", "--batch-size", "-1"], "--batch-size"),
  (["bench", "decode", "--max-tokens", "1"], "--max-tokens"),
  (["generate", "--prompt", "x", "--max-tokens", "0"], "--max-tokens"),
  (["chat", "--gpu-memory-utilization", "2"], "--gpu-memory-utilization"),
])
def test_argument_errors_exit_before_the_model_loads(stories_dir, argv, flag):
  run, seconds = cli(*argv, "--model", str(stories_dir), timeout=120)
  assert run.returncode == 2 and seconds < SUBPROCESS_SECONDS
  assert len(run.stderr.splitlines()) == 1 and f"argument {flag}:" in run.stderr and "Traceback" not in run.stderr
  assert LOADING not in run.stderr and not run.stdout


def test_bench_decode_refuses_a_run_longer_than_the_context_before_loading(stories_dir):
  run, seconds = cli("bench", "decode", "--model", str(stories_dir), "--max-model-len", "64", "--prompt-len", "60",
                     "--max-tokens", "8", timeout=120)
  assert run.returncode == 2 and seconds < SUBPROCESS_SECONDS and LOADING not in run.stderr
  assert run.stderr.splitlines() == ["error: --prompt-len 60 + --max-tokens 8 exceeds the context (64 tokens): lower them"]


def test_decode_bench_refuses_what_it_cannot_measure():
  """The library entry point too: no batch would spin forever, one token has no decode phase (nothing to divide by)."""
  from tinyvllm.bench.decode import run_decode_bench
  with pytest.raises(ValueError, match="batch"): run_decode_bench(None, 0, 8, 8, False)
  with pytest.raises(ValueError, match="new_tokens must be >= 2 for a decode measurement"): run_decode_bench(None, 1, 8, 1, False)


@pytest.mark.slow
def test_decode_bench_with_two_tokens_measures_one_decode_step(stories_dir):
  from tinyvllm import LLM
  from tinyvllm.bench.decode import run_decode_bench
  llm = LLM(str(stories_dir), max_num_seqs=2, num_gpu_blocks=32, max_model_len=64)
  (result,) = run_decode_bench(llm.engine, batch=2, prompt_len=1, new_tokens=2, no_kv_cache=False, repeated=True)
  assert [len(t) for t in result.token_ids] == [2, 2] and math.isfinite(result.decode_tok_s) and result.decode_tok_s > 0
  assert "2 new tokens" in result.line()


def test_ctrl_c_outside_chat_is_quiet(monkeypatch, capsys):
  from tinyvllm.cli import generate
  def interrupted(args): raise KeyboardInterrupt
  monkeypatch.setattr(generate, "run", interrupted)
  assert main(["generate", "--prompt", "x"]) == 130
  assert "Traceback" not in capsys.readouterr().err


# ---- 2 and 3. the tokenizer: missing or not the model's, found before the weights load
@pytest.mark.parametrize("command", [["generate", "--prompt", "hi"], ["chat"]])
def test_a_dummy_preset_without_tokenizer_is_refused_at_once(command):
  run, seconds = cli(*command, "--load-format", "dummy", "--model", "qwen3-0.6b", timeout=120)
  assert run.returncode == 2 and seconds < SUBPROCESS_SECONDS and LOADING not in run.stderr and "Traceback" not in run.stderr
  assert error_lines(run.stderr) == ["error: this model has no tokenizer (a --load-format dummy preset has none): pass --tokenizer FOLDER"]


def test_chat_without_a_template_is_refused_before_the_weights(stories_dir):
  run, seconds = cli("chat", "--model", str(stories_dir), input="hello\n", timeout=120)
  assert run.returncode == 2 and seconds < SUBPROCESS_SECONDS and LOADING not in run.stderr
  (line,) = error_lines(run.stderr)
  assert line.startswith("error: this model's tokenizer has no chat template")


def test_a_tokenizer_beyond_the_model_vocabulary_is_refused(stories_dir, shared_data):
  run, seconds = cli("generate", "--model", str(stories_dir), "--tokenizer", str(shared_data / QWEN3), "--prompt", "hi", timeout=120)
  assert run.returncode == 2 and seconds < SUBPROCESS_SECONDS and LOADING not in run.stderr and not run.stdout
  (line,) = error_lines(run.stderr)
  assert "151669 token ids" in line and "vocabulary has 512" in line and str(stories_dir / "config.json") in line


class WeightsLoaded(Exception):
  """Raised by a stand-in EngineCore: the engine got as far as loading the weights."""


@pytest.fixture
def no_weights(monkeypatch):
  def core(*args, **kwargs): raise WeightsLoaded
  monkeypatch.setattr("tinyvllm.engine.llm_engine.EngineCore", core)


def test_llm_checks_the_frontend_files_before_the_weights(stories_dir, shared_data, no_weights):
  from tinyvllm import LLM
  with pytest.raises(TokenizerError, match=r"151669 token ids .* vocabulary has 512"):
    LLM(str(stories_dir), tokenizer=str(shared_data / QWEN3))
  def refuse(files): raise ConfigError(f"refused {files.tokenizer.name}")
  with pytest.raises(ConfigError, match="refused"): LLM(str(stories_dir), check_frontend_files=refuse)
  seen = []
  with pytest.raises(WeightsLoaded): LLM(str(stories_dir), check_frontend_files=seen.append)   # checked, then the weights
  assert seen[0].tokenizer.vocab_size == 512


def test_a_tokenizer_smaller_than_the_vocabulary_is_fine(shared_data):
  """Models often have more embedding rows than the tokenizer has ids (padding): that is accepted."""
  from tinyvllm.engine.input_processor import load_frontend_files
  for tokenizer in (QWEN3, LLAMA3):   # 151669 and 128256 ids, the preset's vocabulary 151936
    config = EngineConfig(model="qwen3-0.6b", load_format="dummy", tokenizer=str(shared_data / tokenizer))
    assert load_frontend_files(config, None).tokenizer is not None


@pytest.mark.slow
def test_the_server_engine_refuses_the_mismatch_and_stops_its_core(stories_dir, shared_data):
  from tinyvllm.engine.async_llm import AsyncLLM
  config = EngineConfig(model=str(stories_dir), tokenizer=str(shared_data / QWEN3), num_gpu_blocks=16)
  with pytest.raises(TokenizerError, match=r"151669 token ids .* vocabulary has 512"):
    asyncio.run(AsyncLLM.from_config(config))
  assert not [p for p in multiprocessing.active_children() if p.name == "tinyvllm-engine-core"]   # its core was stopped


# ---- 4. chat: the context and Ctrl-C
@pytest.fixture(scope="module")
def tokenizer():
  return load_tokenizer(embedded_model_path())


def exchange(i: int) -> list[dict]:
  return [{"role": "user", "content": f"Tom saw a big dog number {i} in the park."},
          {"role": "assistant", "content": f"The dog number {i} was happy and they played all day in the sun."}]


def test_conversation_drops_the_oldest_exchanges_to_fit(tokenizer, capsys):
  chat = Conversation(tokenizer, context=96, system="A story.")
  chat.turns = exchange(1) + exchange(2) + exchange(3)
  full = len(chat.render([*chat.turns, {"role": "user", "content": "Then it rained."}])[1])
  text, ids = chat.ask("Then it rained.", room=40)
  assert full > 96 - 40 >= len(ids) and ids == tokenizer.encode(text, add_special_tokens=False)
  kept = len(chat.turns) - 1
  assert kept in (0, 2, 4)   # whole exchanges dropped
  assert chat.turns[0]["role"] == "user" and chat.turns[-1]["content"] == "Then it rained." and text.startswith("<s>A story.")
  assert capsys.readouterr().err == (f"[dropped the {6 - kept} oldest turns to fit the 96-token context; "
                                     "/reset clears the conversation]\n")
  chat.answer("It stopped.")
  assert chat.ask("The sun came out.", room=8) is not None and capsys.readouterr().err == ""   # it fits: nothing dropped


def test_a_message_that_cannot_fit_alone_is_dropped_and_the_conversation_kept(tokenizer, capsys):
  chat = Conversation(tokenizer, context=64)
  chat.turns = exchange(1)
  assert chat.ask("Once upon a time " * 20, room=16) is None
  assert chat.turns == exchange(1)
  assert "[this message does not fit" in capsys.readouterr().err


@pytest.fixture(scope="module")
def chat_llm():
  from tinyvllm import LLM
  return LLM(str(embedded_model_path()), max_model_len=128, num_gpu_blocks=32, max_num_seqs=2)


@pytest.mark.slow
def test_a_reply_is_capped_to_the_context_left(chat_llm, monkeypatch):
  """max_tokens far beyond the context: the request is capped to what the prompt leaves, not refused."""
  engine, asked = chat_llm.engine, []
  add_request = engine.add_request
  def spy(request_id, prompt, params, priority=0):
    asked.append((len(prompt["prompt_token_ids"]), params.max_tokens))
    add_request(request_id, prompt, params, priority)
  monkeypatch.setattr(engine, "add_request", spy)
  chat = Conversation(engine.tokenizer, engine.max_model_len)
  reply = turn(engine, chat, "Once upon a time", SamplingParams(temperature=0, max_tokens=100000, ignore_eos=True))
  assert reply and chat.turns[-1] == {"role": "assistant", "content": reply}
  (prompt_len, max_tokens), = asked
  assert max_tokens == 128 - prompt_len
  assert_all_free(chat_llm)


@pytest.mark.slow
def test_a_stopped_reply_leaves_nothing_behind(chat_llm, capsys):
  chat = Conversation(chat_llm.engine.tokenizer, chat_llm.engine.max_model_len)
  checks = iter(range(1000))
  reply = turn(chat_llm.engine, chat, "Once upon a time", SamplingParams(temperature=0, max_tokens=60, ignore_eos=True),
               interrupted=lambda: next(checks) >= 5)
  assert reply and chat.turns[-1] == {"role": "assistant", "content": reply}   # the partial reply stays
  assert "[stopped: the partial reply stays in the conversation" in capsys.readouterr().err
  assert_all_free(chat_llm)   # its request was aborted: no blocks, no state
  stopped_at_once = turn(chat_llm.engine, chat, "The end", SamplingParams(max_tokens=5), interrupted=lambda: True)
  assert stopped_at_once is None and chat.turns[-1]["content"] == reply   # nothing shown: the message goes too
  assert_all_free(chat_llm)


def replies(stdout: str) -> list[str]:
  """What followed each "> " prompt on stdout (the reply to the line read there)."""
  return [part.strip() for part in stdout.split("> ")[1:]]


@pytest.mark.slow
def test_chat_outgrows_its_context_and_goes_on():
  messages = ["Once upon a time there was a cat", "The cat was happy and she liked to play", "Then the dog came",
              "Once upon a time " * 40, "And they played all day long in the sun"]
  run, _ = cli("chat", "--model", str(embedded_model_path()), "--max-model-len", "96", "--max-tokens", "30", "--temperature", "0",
               "--num-gpu-blocks", "32", input="".join(m + "\n" for m in messages), timeout=600)   # then EOF: quit
  assert run.returncode == 0 and "Traceback" not in run.stderr, run.stderr
  assert "[dropped the 2 oldest turns to fit the 96-token context; /reset clears the conversation]" in run.stderr
  assert "[this message does not fit: the prompt would be" in run.stderr
  answered = replies(run.stdout)
  assert len(answered) == len(messages) + 1 and answered[-1] == ""   # a prompt per line read, and the last one met EOF
  assert all(answered[i] for i in (0, 1, 2, 4)) and answered[3] == ""   # the too-long message got no reply, the next one did


def _sigint_as_from_a_terminal() -> None:
  signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
  signal.signal(signal.SIGINT, signal.SIG_DFL)


class Chat:
  """A chat subprocess, its stdout and stderr read as they come."""

  def __init__(self, *argv: str):
    # faulthandler: a chat that does not exit is made to print every thread's stack (exit_code). SIGINT starts at its
    # default, unblocked, as from a terminal: a child inherits an ignored or blocked signal, and a test earlier in this
    # worker process (or a library it loaded) may have left SIGINT so, which no chat could then see
    self.proc = subprocess.Popen([sys.executable, "-X", "faulthandler", "main.py", "chat", *argv], cwd=REPO,
                                 stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                 preexec_fn=_sigint_as_from_a_terminal)
    self.out, self.err = bytearray(), bytearray()
    for stream, buffer in ((self.proc.stdout, self.out), (self.proc.stderr, self.err)):
      threading.Thread(target=self._pump, args=(stream, buffer), daemon=True).start()

  @staticmethod
  def _pump(stream, buffer: bytearray) -> None:
    while chunk := os.read(stream.fileno(), 4096): buffer.extend(chunk)

  def wait_for(self, condition, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
      assert self.proc.poll() is None, f"chat exited early ({self.proc.returncode}): {self.err.decode()}"
      assert time.monotonic() < deadline, f"timed out: stdout {self.out.decode()!r} stderr {self.err.decode()!r}"
      time.sleep(0.02)

  def send(self, line: str) -> None:
    self.proc.stdin.write(line.encode() + b"\n")
    self.proc.stdin.flush()

  def prompts(self) -> int: return self.out.count(b"> ")

  def exit_code(self, timeout: float = 60) -> int:
    """The chat's exit status; one still running after `timeout` seconds fails the test with its threads' stacks."""
    try: return self.proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
      with contextlib.suppress(OSError):   # which signals it blocks, ignores, catches, has pending (Linux)
        masks = [line for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines() if line.startswith(("Sig", "ShdPnd"))]
        self.err.extend(("\n".join(masks) + "\n").encode())
      self.proc.send_signal(signal.SIGABRT)   # faulthandler dumps the stacks to stderr, then the process dies
      with contextlib.suppress(subprocess.TimeoutExpired): self.proc.wait(timeout=10)
      time.sleep(0.5)   # the pump threads drain stderr
      raise AssertionError(f"chat did not exit within {timeout} s; its stacks and stderr:\n{self.err.decode()[-8000:]}") from None


def test_lines_sent_at_once_are_each_answered():
  """Two lines in one write, standard input left open: the second is answered without waiting for more input."""
  chat = Chat("--model", str(embedded_model_path()), "--num-gpu-blocks", "16", "--max-tokens", "3", "--temperature", "0")
  try:
    chat.wait_for(lambda: chat.prompts() == 1)
    chat.send("Once upon a time\nThe cat sat")
    chat.wait_for(lambda: chat.prompts() == 3, timeout=120)
    chat.send("/exit")
    assert chat.exit_code() == 0
  finally:
    chat.proc.kill()
  assert len([reply for reply in replies(chat.out.decode()) if reply]) == 2, chat.out.decode()


@pytest.mark.slow
def test_ctrl_c_stops_the_reply_and_chat_goes_on():
  chat = Chat("--model", str(embedded_model_path()), "--max-tokens", "100000", "--ignore-eos", "--num-gpu-blocks", "64")
  try:
    chat.wait_for(lambda: chat.prompts() == 1)
    for message in ("Once upon a time", "The cat sat"):
      shown = len(chat.out)
      chat.send(message)
      chat.wait_for(lambda n=shown: len(chat.out) > n + 3)   # the reply is streaming
      chat.proc.send_signal(signal.SIGINT)
      chat.wait_for(lambda n=shown: chat.out.count(b"> ", n) == 1)   # back at the prompt
    chat.send("/exit")
    assert chat.exit_code() == 0
  finally:
    chat.proc.kill()
  err = chat.err.decode()
  assert err.count("[stopped: the partial reply stays in the conversation; /reset clears it]") == 2 and "Traceback" not in err
  assert "KeyboardInterrupt" not in err


@pytest.mark.slow
def test_ctrl_c_at_the_prompt_quits_quietly():
  chat = Chat("--model", str(embedded_model_path()), "--num-gpu-blocks", "16")
  try:
    chat.wait_for(lambda: chat.prompts() == 1)
    chat.proc.send_signal(signal.SIGINT)
    assert chat.exit_code() == 0
  finally:
    chat.proc.kill()
  assert "Traceback" not in chat.err.decode() and "KeyboardInterrupt" not in chat.err.decode()
