"""Where a batch-1 decode step's time goes: the layers against everything around them (embedding gathers, the final
norm and logits product, sampling), each part timed alone under TinyJit, and the engine's captured step replayed with
1 and 28 layers of Qwen3-0.6B's shape (the difference over 27 is a layer; what is left of the 1-layer step is the rest).

  DEV=CUDA python3 bench/batch1_anatomy.py      (bash bench/run_on_device.sh anatomy)
Writes $OUT/batch1_anatomy.json.
"""
from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
ITERS = 200
RESULTS: dict = {}


def timed_us(fn, *args) -> float:
  from tinygrad import Device
  for _ in range(5): fn(*args)
  Device[args[0].device].synchronize()
  t = time.perf_counter()
  for _ in range(ITERS): fn(*args)
  Device[args[0].device].synchronize()
  return (time.perf_counter() - t) / ITERS * 1e6


def parts(device: str) -> None:
  """The pieces outside the layers, alone: the sampler (greedy and random rows) and the logits product."""
  from tinygrad import Tensor, TinyJit, dtypes

  from tinyvllm.kernels.fused import FusedBackend
  from tinyvllm.layers.sampler import NUM_PARAMS, SamplerVariant
  backend = FusedBackend("cuda", device)
  vocab, hidden = 151936, 1024
  rng = np.random.default_rng(0)
  logits = Tensor(rng.standard_normal((1, vocab), dtype=np.float32), device=device).realize()
  for name, temp in (("sample greedy", 0.0), ("sample random", 1.0)):
    params = np.zeros((1, NUM_PARAMS), np.float32)
    params[0, 0] = temp
    p = Tensor(params.view(np.int32), device=device).realize()
    r = Tensor(np.array([[7, 3]], np.int32), device=device).realize()
    variant = SamplerVariant(random=temp > 0, filters=False, penalties=False)
    jit = TinyJit(lambda lg, p, r, variant=variant: backend.sample(lg, p, r, variant).realize())
    RESULTS[f"{name} us"] = round(timed_us(jit, logits, p, r), 2)
  x = Tensor(rng.standard_normal((1, hidden), dtype=np.float32), device=device).cast(dtypes.bfloat16).realize()
  w = (Tensor.randn(vocab, hidden, device=device) * 0.02).cast(dtypes.bfloat16).realize()
  g = Tensor.ones(hidden, device=device).cast(dtypes.bfloat16).realize()
  jit = TinyJit(lambda x: backend.linear(x, w, norm=g, eps=1e-6, out_float32=True).realize())
  us = timed_us(jit, x)
  RESULTS["logits product us"] = round(us, 2)
  RESULTS["logits product GB/s"] = round(vocab * hidden * 2 / us / 1e3, 1)
  print({k: v for k, v in RESULTS.items()}, flush=True)


def engines(device: str) -> None:
  """The engine's captured batch-1 step, replayed, with 1 and 28 layers, per-op layers and the layer kernel."""
  import tinyvllm.kernels.fused as fused
  from bench.gpu_profile import step_breakdown
  from tinyvllm.bench.decode import run_decode_bench
  from tinyvllm.config import EngineConfig
  from tinyvllm.engine.llm_engine import LLMEngine
  from tinyvllm.model.presets import PRESETS
  PRESETS["qwen3-0.6b-1layer"] = {**PRESETS["qwen3-0.6b"], "num_hidden_layers": 1}
  for layer_kernel in (False, True):
    fused.DECODE_LAYER = layer_kernel
    for model in ("qwen3-0.6b-1layer", "qwen3-0.6b"):
      engine = LLMEngine(EngineConfig(model=model, load_format="dummy", device=device, max_model_len=2048,
                                      max_num_seqs=8, num_gpu_blocks=1024))
      run = run_decode_bench(engine, batch=1, prompt_len=128, new_tokens=128, no_kv_cache=False)[0]
      key = f"{model} {'layer kernel' if layer_kernel else 'per-op'}"
      RESULTS[key] = {"tok_s": round(run.decode_tok_s, 1), **step_breakdown(engine, 1)}
      print(key, RESULTS[key], flush=True)
      del engine


def main() -> None:
  from tinyvllm.device import select_device
  device = select_device(os.environ.get("DEV", "CUDA"))
  for fn in (parts, engines):
    try: fn(device)
    except Exception as e:
      RESULTS[f"{fn.__name__} failed"] = f"{type(e).__name__}: {e}"
      print(f"FAIL {fn.__name__}: {type(e).__name__}: {e}", flush=True)
  out = Path(os.environ.get("OUT", "/tmp/out"))
  out.mkdir(parents=True, exist_ok=True)
  (out / "batch1_anatomy.json").write_text(json.dumps(RESULTS, indent=1))


if __name__ == "__main__":
  main()
