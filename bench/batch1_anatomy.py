"""Where a batch-1 decode step's time goes: the layers against everything around them (embedding gathers, the final
norm and logits product, sampling): the engine's captured step replayed with 1 and 28 layers of Qwen3-0.6B's shape,
per-op and with the layer kernel (the difference over 27 is a layer; what is left of the 1-layer step is the rest).

  DEV=CUDA python3 bench/batch1_anatomy.py      (bash bench/run_on_device.sh anatomy)
Writes $OUT/batch1_anatomy.json.
"""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
RESULTS: dict = {}


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
  try: engines(select_device(os.environ.get("DEV", "CUDA")))
  except Exception as e:
    RESULTS["failed"] = f"{type(e).__name__}: {e}"
    print(f"FAIL: {type(e).__name__}: {e}", flush=True)
  out = Path(os.environ.get("OUT", "/tmp/out"))
  out.mkdir(parents=True, exist_ok=True)
  (out / "batch1_anatomy.json").write_text(json.dumps(RESULTS, indent=1))


if __name__ == "__main__":
  main()
