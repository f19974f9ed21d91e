"""GGUF files' packed linears on the GPU (docs/benchmarks.md section 10): random llama GGUFs of about Qwen3-0.6B's
shape written here in llama.cpp's quantization mixes (tests/gguf_files.py: random blocks of ggml's published layouts;
qwen3moe_q4_k_m: a qwen3moe file of 64 experts a layer in Q4_K_M's mix), then for each mix
- check: the hand-written kernels' logits against the portable path's on a 4-layer file (the packed products'
  correctness, including the common form of q/k/v parts of different types), beside the same gap of the file
  dequantized to bf16 at load (`GGUFSource`'s packed types emptied: the control, bf16 rounding through random layers);
- decode: batch-1 / batch-8 decode tok/s of a 28-layer file, packed and dequantized to bf16 at load;
- replay: the GPU's decode step of that file at batch 1 and 8, packed and dequantized (bench/gpu_profile.py's captured
  graph replayed back to back in five rounds, the median round: free of the host's pace, which moves engine steps by
  more than a kernel change).

  DEV=CUDA python3 bench/gguf_bench.py [--mixes q4_k_m,q4_k_m_by_layer,q5_k_m,q8_0] [--parts check,decode,replay] [--layers 28]
  (bash bench/run_on_device.sh gguf; GGUF_MIXES and GGUF_PARTS pick)
The `gguf` package writes the file: carry its wheel (`pip download gguf==0.19.0 --no-deps -d .whl`; numpy, pyyaml and
tqdm are on the GPU machine). Writes $OUT/gguf_bench.json; exits 1 if a mix's packed logits part from the portable
path's by more than 2e-2 and twice the control's gap.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
LINEARS = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")
# llama.cpp's mixes for these tensors (the output layer is dequantized at load); the uniform ones put every layer in one form
def more_bits(layer: int, layers: int) -> str:
  """llama.cpp's use_more_bits: the layers whose attn_v and ffn_down its Q4_K_M / Q5_K_M keep in Q6_K."""
  return "Q6_K" if layer < layers // 8 or layer >= 7 * layers // 8 or (layer - layers // 8) % 3 == 2 else "Q4_K"


MIXES = {"q4_k_m": {**dict.fromkeys(LINEARS, "Q4_K"), "attn_v": "Q6_K", "ffn_down": "Q6_K"},
         # as llama.cpp's quantizer writes it: Q6_K on some layers only, so the fused qkv and down change form by layer
         "q4_k_m_by_layer": {**dict.fromkeys(LINEARS, "Q4_K"), "attn_v": more_bits, "ffn_down": more_bits},
         "q5_k_m": {**dict.fromkeys(LINEARS, "Q5_K"), "attn_v": "Q6_K", "ffn_down": "Q6_K"},
         "q8_0": dict.fromkeys(LINEARS, "Q8_0"), "q4_0": dict.fromkeys(LINEARS, "Q4_0"),
         # the non-linear 4-bit formats: their levels held as 8-bit codes in groups of 32
         "iq4_xs": {**dict.fromkeys(LINEARS, "IQ4_XS"), "attn_v": "IQ4_NL"}}
MIXES["qwen3moe_q4_k_m"] = MIXES["q4_k_m_by_layer"]
SHAPE = dict(hidden=1024, ffn=3072, heads=8, kv_heads=4)   # head_dim 128, GQA 2, as Qwen3-0.6B's attention
# mixes written as another architecture: a qwen3moe file of 64 experts of 768, 8 a token (Qwen3-30B-A3B's experts' size
# and top-k at a smaller width and count), every layer sparse, its experts' down in Q6_K where llama.cpp's mix puts it
FILE_ARGS = {"qwen3moe_q4_k_m": dict(arch="qwen3moe", experts=(64, 8, 768))}
TOLERANCE = 2e-2   # bf16 activations on both paths, summed in different orders
CHECK_LAYERS = 4   # the logits check's depth: random layers amplify bf16 rounding with every layer


def engine(path: Path, backend: str | None, dtype: str):
  from tinyvllm import LLM
  kwargs = {"attention_backend": backend} if backend else {}
  return LLM(str(path), dtype=dtype, max_num_seqs=8, kv_cache_memory=2, max_model_len=512, **kwargs)


def logits_gap(path: Path, prompt: list[int], dtype: str) -> float:
  """The kernels' logits against the portable path's, relative to the largest."""
  ours = engine(path, None, dtype).engine.compute_logits(prompt)
  ref = engine(path, "portable", dtype).engine.compute_logits(prompt)
  return float(np.abs(ours - ref).max() / np.abs(ref).max())


def dequantized_at_load():
  """The GGUF reader with no packed types: every linear dequantized to the compute dtype at load (the control)."""
  import contextlib

  from tinyvllm.model.gguf import blocks

  @contextlib.contextmanager
  def unpacked():
    packed_types, blocks.PACKED_TYPES = blocks.PACKED_TYPES, ()
    try: yield
    finally: blocks.PACKED_TYPES = packed_types
  return unpacked()


def check_mix(name: str, dtype: str, folder: Path) -> dict:
  """The packed kernels' logits gap from the portable path beside the control's (the same file dequantized at load,
  through the same kernels): a wrong scale or code order parts by far more than bf16's rounding, which the control
  shows at this depth."""
  from tests.gguf_files import write_tiny_llama
  path = write_tiny_llama(folder / f"{name}_check.gguf", MIXES[name], "F16", None, layers=CHECK_LAYERS, **SHAPE,
                          **FILE_ARGS.get(name, {}))
  prompt = [int(t) for t in np.random.default_rng(0).integers(0, 256, 64)]
  packed = logits_gap(path, prompt, dtype)
  with dequantized_at_load(): control = logits_gap(path, prompt, dtype)
  ok = packed < max(TOLERANCE, 2 * control)
  print(f"{name}: logits against the portable path {packed:.2e} packed, {control:.2e} dequantized at load "
        f"({CHECK_LAYERS} layers): {'ok' if ok else 'PARTS'}", flush=True)
  return {"logits_gap": packed, "control_gap": control, "check_layers": CHECK_LAYERS, "ok": ok}


def decode(path: Path, batch: int, new_tokens: int, dtype: str) -> dict:
  from tinyvllm.bench.decode import run_decode_bench
  llm = engine(path, None, dtype)
  (run,) = run_decode_bench(llm.engine, batch, 128, new_tokens, no_kv_cache=False)
  print(f"  batch {batch}: {run.line()}", flush=True)
  return {"batch": batch, "decode_tok_s": run.decode_tok_s, "median_step_ms": run.median_step_ms}


def replay(path: Path, batch: int, dtype: str) -> dict:
  from bench.gpu_profile import step_breakdown
  ms = step_breakdown(engine(path, None, dtype).engine, batch, rounds=5)["graph_replay_ms"]
  print(f"  batch {batch}: GPU step {ms:.3f} ms (graph replay, median of 5 rounds)", flush=True)
  return {"batch": batch, "graph_replay_ms": ms}


def bench_mix(name: str, layers: int, new_tokens: int, dtype: str, folder: Path, parts: set[str]) -> dict:
  from tests.gguf_files import write_tiny_llama
  types = {k: v if isinstance(v, str) else f"{v.__name__} (by layer)" for k, v in MIXES[name].items()}
  result = {"mix": name, "types": types, **(check_mix(name, dtype, folder) if "check" in parts else {})}
  timed = [part for part in ("decode", "replay") if part in parts]
  if not timed: return result
  path = write_tiny_llama(folder / f"{name}.gguf", MIXES[name], "F16", None, layers=layers, **SHAPE, **FILE_ARGS.get(name, {}))
  run = lambda part, b: decode(path, b, new_tokens, dtype) if part == "decode" else replay(path, b, dtype)
  for part in timed:
    print(f"{name} packed, {part}:", flush=True)
    result[f"packed_{part}"] = [run(part, b) for b in (1, 8)]
    print(f"{name} dequantized at load, {part}:", flush=True)
    with dequantized_at_load(): result[f"dequantized_{part}"] = [run(part, b) for b in (1, 8)]
  return result


def main() -> int:
  p = argparse.ArgumentParser()
  p.add_argument("--mixes", default="q4_k_m,q4_k_m_by_layer,q5_k_m,q8_0")
  p.add_argument("--parts", default="check,decode",
                 help="check: logits against the portable path; decode: tok/s; replay: the GPU's step alone")
  p.add_argument("--layers", type=int, default=28, help="the decode part's depth")
  p.add_argument("--new-tokens", type=int, default=256)
  p.add_argument("--dtype", default="bfloat16", help="the compute dtype (float32 for a run on the CPU)")
  args = p.parse_args()
  with tempfile.TemporaryDirectory() as tmp:
    results = [bench_mix(name, args.layers, args.new_tokens, args.dtype, Path(tmp), set(args.parts.split(",")))
               for name in args.mixes.split(",")]
  if out := os.environ.get("OUT"): Path(out, "gguf_bench.json").write_text(json.dumps(results, indent=1))
  bad = [r["mix"] for r in results if not r.get("ok", True)]
  print("logits match the portable path" if not bad else f"LOGITS PART FROM THE PORTABLE PATH: {bad}")
  return 1 if bad else 0


if __name__ == "__main__":
  sys.exit(main())
