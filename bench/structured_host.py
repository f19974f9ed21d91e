"""Host time of a structured step against a free one, on the CPU (the issue's structured-output target is host-bound on
the GPU): a tiny random Qwen3-shaped model with the real Qwen3 tokenizer (its 151,936-token vocabulary sets the bitmask's
size) so that the model's compute is small, batch 64, free decoding against every row under structured_bench's JSON
schema, both under asynchronous scheduling as on the GPU.

Reports per mode the time in the CPU's kernels (the "device": on the GPU it runs beside the host) and the engine step's
stages (host ms a call, bench/stage_timers.py, less the kernels run inside them), and with --profile N the N functions
of most own time in each run. The greedy tokens of both runs go to --tokens FILE (to check a change leaves them as they were).

Usage: python bench/structured_host.py --tokenizer ../shared/data/tokenizers/qwen3 [--profile 30] [--tokens FILE]
"""
from __future__ import annotations

import argparse
import cProfile
import inspect
import json
import pstats
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import structured_bench
from stage_timers import Timers  # (this script's folder is on sys.path)
from structured_bench import SCHEMA, decode, stage_timers

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

# as small as the Qwen3 architecture allows, with Qwen3's vocabulary
CONFIG = {"architectures": ["Qwen3ForCausalLM"], "hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 1,
          "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 8, "vocab_size": 151936,
          "max_position_embeddings": 2048, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "tie_word_embeddings": True,
          "torch_dtype": "float32", "bos_token_id": 151643, "eos_token_id": 151645}


def tiny_qwen3(tokenizer: Path, folder: Path) -> Path:
  for name in ("vocab.json", "merges.txt", "tokenizer_config.json"): shutil.copy(tokenizer / name, folder / name)
  (folder / "config.json").write_text(json.dumps(CONFIG))
  return folder


class KernelClock:
  """The CPU kernels' seconds so far (what the GPU would run beside the host): each stage's host time is its wall time
  less the kernel time inside it."""

  def __init__(self) -> None:
    from tinygrad.runtime.ops_cpu import CPUProgram
    self.seconds, self.original = 0.0, CPUProgram.__call__

    def timed(program, *args, **kwargs):
      t = time.perf_counter()
      try: return self.original(program, *args, **kwargs)
      finally: self.seconds += time.perf_counter() - t
    CPUProgram.__call__ = timed

  def restore(self) -> None:
    from tinygrad.runtime.ops_cpu import CPUProgram
    CPUProgram.__call__ = self.original


class HostTimers(Timers):
  """Timers whose stages count host time only (the kernels inside them taken out)."""

  def __init__(self, clock: KernelClock) -> None:
    super().__init__()
    self.clock = clock

  def wrap(self, owner: object, attr: str, name: str) -> None:
    original, static = getattr(owner, attr), inspect.getattr_static(owner, attr)

    def timed(*args, **kwargs):
      t, k = time.perf_counter(), self.clock.seconds
      try: return original(*args, **kwargs)
      finally: self.add(name, time.perf_counter() - t - (self.clock.seconds - k))
    setattr(owner, attr, staticmethod(timed) if isinstance(static, staticmethod) else timed)
    self._undo.append((lambda: setattr(owner, attr, static)) if isinstance(owner, type) else (lambda: delattr(owner, attr)))


class DeviceWindows:
  """The host time (kernels taken out) of the two windows in which a split grammar step leaves the GPU one graph of
  work: from a sampling's launch to the next forward pass's (the GPU has only the sampling graph) and from a step's
  tokens landing to the next sampling's launch (it has only the forward pass). Past those graphs' device time, the
  GPU waits for the host."""

  def __init__(self, engine, clock: KernelClock) -> None:
    from tinyvllm.worker.runner_steps import LaunchedStep
    self.clock, self.runner = clock, engine.core.runner
    self.sampled_at = self.landed_at = None   # (wall, kernel seconds) at the last split sampling's launch / landing
    self.to_forward: list[float] = []
    self.to_sampling: list[float] = []
    launch, launch_forward, result = self.runner.launch, self.runner.launch_forward, LaunchedStep.result
    self.result = result

    def launched(step):
      split, out = step.logits is not None, launch(step)
      if split:
        self.sampled_at = self.now()
        if self.landed_at is not None: self.to_sampling.append(self.since(self.landed_at))
      return out

    def forward(step):
      if self.sampled_at is not None: self.to_forward.append(self.since(self.sampled_at))
      self.sampled_at = None
      return launch_forward(step)

    def landed(flight):
      out = result(flight)
      self.landed_at = self.now()
      return out
    self.runner.launch, self.runner.launch_forward, LaunchedStep.result = launched, forward, landed

  def now(self) -> tuple[float, float]: return time.perf_counter(), self.clock.seconds

  def since(self, then: tuple[float, float]) -> float:
    wall, kernels = self.now()
    return (wall - then[0]) - (kernels - then[1])

  def restore(self) -> None:
    from tinyvllm.worker.runner_steps import LaunchedStep
    for name in ("launch", "launch_forward"): vars(self.runner).pop(name, None)
    LaunchedStep.result = self.result

  def report(self) -> str:
    def ms(xs: list[float]) -> str: return f"{np.median(xs) * 1e3:.3f} ms (median of {len(xs)})" if xs else "none"
    return (f"  host while the GPU has only the sampling graph (its launch -> the next forward pass's): {ms(self.to_forward)}\n"
            f"  host while the GPU has only the forward pass (tokens landed -> the next sampling's launch): {ms(self.to_sampling)}")


def host_stages(engine, clock: KernelClock) -> HostTimers:
  timers = HostTimers(clock)
  saved, structured_bench.Timers = structured_bench.Timers, lambda: timers
  try: stage_timers(engine)
  finally: structured_bench.Timers = saved
  timers.wrap(engine.output_processor, "process_outputs", "output processing (frontend)")
  from tinyvllm.worker.token_controls import TokenControlsBuilder
  timers.wrap(TokenControlsBuilder, "build", "  token controls build")
  timers.wrap(engine.core.runner, "_upload", "  upload")
  return timers


def run(engine, prompts: list[list[int]], new_tokens: int, structured: bool, profile: int, profile_out: str | None
        ) -> tuple[str, list[list[int]]]:
  """One decode of every prompt, timed from the step after the prompt step (whose layouts may still be captured)."""
  from tinyvllm import SamplingParams
  from tinyvllm.sampling_params import StructuredOutputsParams
  mode = "json" if structured else "free"
  constraint = StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True) if structured else None
  params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True, structured_outputs=constraint)
  ids = [f"{mode}-{i}" for i in range(len(prompts))]
  for rid, prompt in zip(ids, prompts, strict=True): engine.add_request(rid, prompt, params)
  finals: dict = {}
  while not finals:
    for out in engine.step(): finals[out.request_id] = out
  clock = KernelClock()
  windows = DeviceWindows(engine, clock) if structured else None
  timers = host_stages(engine, clock)
  profiler = cProfile.Profile() if profile else None
  if profiler is not None: profiler.enable()
  t, steps = time.perf_counter(), 0
  while engine.has_unfinished_requests():
    for out in engine.step(): finals[out.request_id] = out
    steps += 1
  wall = time.perf_counter() - t
  if profiler is not None:
    profiler.disable()
    pstats.Stats(profiler).sort_stats("tottime").print_stats(profile)
    if profile_out: profiler.dump_stats(f"{profile_out}.{mode}.prof")
  timers.restore()
  if windows is not None: windows.restore()
  clock.restore()
  report, kernels = timers.report(), clock.seconds
  print(f"== {mode}: {steps} steps, {wall / steps * 1e3:.2f} ms a step, of which CPU kernels {kernels / steps * 1e3:.2f} ms, "
        f"host {(wall - kernels) / steps * 1e3:.2f} ms")
  for name, stage in report.items(): print(f"  {name:45s} {stage['ms_per_call']:8.3f} ms x {stage['calls']}")
  if windows is not None: print(windows.report())
  return mode, [finals[rid].outputs[0].token_ids for rid in ids]


def main() -> int:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--tokenizer", default=str(REPO.parent / "shared/data/tokenizers/qwen3"))
  p.add_argument("--batch", type=int, default=64)
  p.add_argument("--prompt-len", type=int, default=16)
  p.add_argument("--new-tokens", type=int, default=32)
  p.add_argument("--profile", type=int, default=0, help="print the N functions of most own host time in each run")
  p.add_argument("--modes", default="free,json", help="which runs to time (free, json)")
  p.add_argument("--tokens", help="write both runs' greedy tokens to this JSON file")
  p.add_argument("--profile-out", help="with --profile: also dump each run's profile to PREFIX.MODE.prof")
  args = p.parse_args()
  from tinyvllm import LLM
  folder = tiny_qwen3(Path(args.tokenizer), Path(tempfile.mkdtemp()))
  llm = LLM(str(folder), load_format="dummy", max_num_seqs=args.batch, num_gpu_blocks=args.batch * 4 + 8,
            max_model_len=256, enable_prefix_caching=False, async_scheduling=True, cuda_graph_sizes=[args.batch])
  engine = llm.engine
  prompts = np.random.default_rng(0).integers(0, 10000, size=(args.batch, args.prompt_len)).tolist()
  modes = [m == "json" for m in args.modes.split(",")]
  for structured in modes: decode(engine, prompts, args.new_tokens, structured)   # warm: captures, the grammar
  tokens = {}
  for structured in modes:
    mode, token_ids = run(engine, prompts, args.new_tokens, structured, args.profile, args.profile_out)
    tokens[mode] = token_ids
  if args.tokens: Path(args.tokens).write_text(json.dumps(tokens))
  return 0


if __name__ == "__main__":
  sys.exit(main())
