"""GPU check and timing of the persistent decode-layer kernel (tinyvllm/kernels/csrc/cuda/decode_layer.inc), in one
command:

  DEV=CUDA python3 bench/check_decode_layer.py      (bash bench/run_on_device.sh layer; `check` runs it too)

1. Random layers (Qwen3-0.6B's shape at 1-8 rows, 1-4 layers a launch, bf16 and FP8 caches; a GQA-4 head_dim-64 shape
   with a qkv bias in float16; weights in the activations' dtype and packed: int8, int4, FP8, mixed, GGUF's groups of
   16 and 32; verifications of proposals as decode rows, a sequence's tokens in consecutive rows): the kernel against
   the same layers op by op (a verification's in its multi-query layout), on the per-op CUDA kernels and on the
   portable path in float32. h within bf16 tolerance (per layer), every layer's new K/V written, no other cache slot
   touched, every row finite.
2. A TinyJit capture of three layers in two launches (MAX_LAYERS lowered to 2) replayed over steps with different
   contexts: the barrier counters reset at every launch (a stale counter would let blocks run ahead) and the layers
   match the per-op kernels each step.
3. The engine (Qwen3-0.6B, random weights): decode tok/s at batch 1, 2, 4 and 8 with and without the layer kernel
   (decode_layer_kernel=True / False: at every row count the tuning table bounds), and the greedy tokens of both at
   batch 2 (random weights have near-ties, so the first difference is reported, not asserted).
Writes $OUT/check_decode_layer.json; exits 1 on any failure.
"""
from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
QWEN3 = dict(hidden=1024, intermediate=3072, heads=16, kv_heads=8, head_dim=128, qk_norm=True, qkv_bias=False)
GQA4 = dict(hidden=1024, intermediate=2816, heads=16, kv_heads=4, head_dim=64, qk_norm=False, qkv_bias=True)
ELEM = (("elem", 0),) * 4
# (name, shape, contexts, dtype, FP8 cache, layers, each product's weight form and scale group)
CASES = [("qwen3 b1 ctx 300 4 layers", QWEN3, [300], "bfloat16", False, 4, ELEM),
         ("qwen3 b1 ctx 2000 fp8", QWEN3, [2000], "bfloat16", True, 1, ELEM),
         ("qwen3 b1 ctx 6000 (bucket 8192)", QWEN3, [6000], "bfloat16", False, 2, ELEM),
         ("qwen3 b3 2 layers", QWEN3, [5, 900, 1500], "bfloat16", False, 2, ELEM),
         ("qwen3 b4 fp8 3 layers", QWEN3, [1, 17, 400, 2048], "bfloat16", True, 3, ELEM),
         ("gqa4 bias b2 f16 2 layers", GQA4, [33, 1200], "float16", False, 2, ELEM),
         # packed (quantized) weights: random codes, scales, zero points and offsets (tests/emulator/cases.packed_weight)
         ("qwen3 b1 int8 per channel 2 layers", QWEN3, [300], "bfloat16", False, 2,
          (("int8", 1024), ("int8", 2048), ("int8", 1024), ("int8", 3072))),
         ("qwen3 b2 int4 g128 2 layers", QWEN3, [40, 1500], "bfloat16", False, 2, (("int4", 128),) * 4),
         ("qwen3 b4 fp8 g128 fp8 cache", QWEN3, [1, 17, 400, 2048], "bfloat16", True, 1, (("fp8", 128),) * 4),
         ("gqa4 bias b1 f16 mixed", GQA4, [700], "float16", False, 2, (("int4", 64), ("elem", 0), ("fp8", 1024), ("int8", 128))),
         # GGUF files' packed forms (tinyvllm/model/gguf): Q4_K_M (Q6_K as int8 groups of 16 beside Q4_K's int4 groups
         # of 32) and Q8_0 (int8 groups of 32)
         ("qwen3 b1 gguf q4_k_m forms 2 layers", QWEN3, [300], "bfloat16", False, 2,
          (("int8", 16), ("int4", 32), ("int4", 32), ("int8", 16))),
         ("qwen3 b8 gguf q8_0 forms", QWEN3, [5, 900, 1500, 2048, 1, 77, 300, 1200], "bfloat16", False, 1, (("int8", 32),) * 4),
         ("qwen3 b8 2 layers", QWEN3, [5, 900, 1500, 2048, 1, 77, 300, 1200], "bfloat16", False, 2, ELEM),
         # verifications as decode rows: each sequence's new tokens (the last argument)
         ("qwen3 verify 5 + 3 rows 2 layers", QWEN3, [700, 1300], "bfloat16", False, 2, ELEM, [5, 3]),
         ("qwen3 verify 5 rows fp8 cache int4", QWEN3, [129], "bfloat16", True, 2, (("int4", 128),) * 4, [5])]
RESULTS: dict = {"cases": [], "jit": [], "engine": {}, "failures": []}


def rel(a: np.ndarray, b: np.ndarray) -> float: return float(np.abs(a - b).max() / max(np.abs(b).max(), 1e-6))


def fused_backend(device: str):
  from tinyvllm.kernels.fused import FusedBackend
  from tinyvllm.kernels.tinygrad_program import device_target
  return FusedBackend(device_target(device))


def check_case(name: str, dims: dict, contexts: list[int], dtype: str, fp8: bool, layers: int, weights: tuple,
               new_tokens: list[int] | None = None, *, device: str) -> None:
  from tests.emulator.cases import layer_as_decode_rows, layer_outputs, layer_tensors, make_layer_case
  case = make_layer_case(np.random.default_rng(len(name)), contexts, **dims, dtype=dtype, kv_fp8=fp8, layers=layers,
                         weights=weights, new_tokens=new_tokens)
  backend = fused_backend(device)
  rows = layer_as_decode_rows(case) if new_tokens else case
  model, stack, (h, cos, sin, caches, meta) = layer_tensors(rows, device, dtype)
  fused = backend.decode_layers(stack, h, cos, sin, caches, meta, case.eps)
  if fused is None: raise RuntimeError(f"the layer kernel did not take the case: {backend.calls}")
  got_h, got_caches = layer_outputs(case, *fused)
  model, stack, (h, cos, sin, caches, meta) = layer_tensors(case, device, dtype, backend=backend)   # op by op, fused ops
  per_op = layer_outputs(case, *model.decoder_layers(h, cos, sin, caches, meta))
  model, stack, (h, cos, sin, caches, meta) = layer_tensors(case, device, "float32")
  portable = layer_outputs(case, *model.decoder_layers(h, cos, sin, caches, meta))
  slots = case.paged.arrays["slot_mapping"][case.paged.arrays["slot_mapping"] >= 0]
  others = np.setdiff1d(np.arange(case.paged.k_cache.shape[0]), slots)
  pairs = list(zip(got_caches, per_op[1], strict=True))
  record = {"name": name, "rows": rows.rows, "layers": layers, "err_vs_per_op": rel(got_h, per_op[0]),
            "err_vs_portable": rel(got_h, portable[0]),
            "k_err": max(rel(k[slots], want_k[slots]) for (k, _), (want_k, _) in pairs),
            "v_err": max(rel(v[slots], want_v[slots]) for (_, v), (_, want_v) in pairs),
            "others_untouched": all(np.array_equal(k[others], wk[others]) and np.array_equal(v[others], wv[others])
                                    for (k, v), (wk, wv) in pairs),
            "finite": bool(np.isfinite(fused[0].float().numpy()).all())}
  tol = (0.1 if fp8 else 2.5e-2) * layers
  record["ok"] = (record["err_vs_per_op"] <= tol and record["err_vs_portable"] <= tol and record["k_err"] <= 0.13
                  and record["v_err"] <= 0.13 and record["others_untouched"] and record["finite"])
  RESULTS["cases"].append(record)
  print(f"{'ok  ' if record['ok'] else 'FAIL'} {name}: {record}", flush=True)
  if not record["ok"]: RESULTS["failures"].append(name)


def step_inputs(case, table: np.ndarray, ctx: int, dtype, device: str) -> list:
  """One sequence's decode inputs for check_jit: h, cos, sin, slot mapping, block table, context length, query start."""
  from tinygrad import Tensor
  pos = ctx - 1
  arrays = [np.array([table[0, pos // 16] * 16 + pos % 16], np.int32), table, np.array([ctx], np.int32), np.array([0, 1], np.int32)]
  return [Tensor(case.h_in, device=device).cast(dtype).contiguous().realize(), Tensor(case.cos, device=device).realize(),
          Tensor(case.sin, device=device).realize(), *[Tensor(a, device=device).realize() for a in arrays]]


def check_jit(device: str) -> None:
  """Three layers in one capture, as two launches (MAX_LAYERS lowered to 2: the barrier counters chained from one to
  the next), replayed over 4 steps of different contexts."""
  from tinygrad import Tensor, TinyJit

  from tests.emulator.cases import layer_tensors, make_layer_case
  from tinyvllm.backend.metadata import AttentionMetadata
  from tinyvllm.kernels import decode_layer
  backend = fused_backend(device)
  steps = [[40], [700], [1999], [3]]
  cases = [make_layer_case(np.random.default_rng(i), c, **QWEN3, dtype="bfloat16", layers=3) for i, c in enumerate(steps)]
  model, stack, _ = layer_tensors(cases[0], device, "bfloat16", backend=backend)
  slots = 4096 * 16
  caches = [tuple(Tensor.randn(slots, 1024, device=device).cast(stack[0].qkv_proj.dtype).contiguous().realize() for _ in range(2))
            for _ in range(3)]

  def run(h, cos, sin, slot_mapping, block_tables, context_lens, query_start, fused: bool):
    meta = AttentionMetadata(slot_mapping, block_tables, query_start[:1].reshape(1, 1), query_start[:1].reshape(1, 1),
                             query_start[:1], context_lens, query_start, query_start[1:] - query_start[:-1],
                             query_start[:1], 16, 2048)   # (one row: its launch order [0] is query_start[:1])
    out = backend.decode_layers(stack, h, cos, sin, caches, meta, 1e-6) if fused else None
    h, new = out or model.decoder_layers(h, cos, sin, caches, meta)
    return h.realize(*[t for pair in new for t in pair])

  jit = TinyJit(lambda *a: run(*a, fused=True))
  rng = np.random.default_rng(7)
  saved, decode_layer.MAX_LAYERS = decode_layer.MAX_LAYERS, 2   # read at each call by fused.py and step_shape
  try:
    for step, ctx in enumerate(steps):
      table = rng.permutation(4096)[:128].astype(np.int32)[None]
      dtype = stack[0].qkv_proj.dtype
      got = jit(*step_inputs(cases[step], table, ctx[0], dtype, device)).float().numpy()
      want = run(*step_inputs(cases[step], table, ctx[0], dtype, device), fused=False).float().numpy()
      record = {"step": step, "context": ctx[0], "err": rel(got, want), "ok": rel(got, want) <= 2.5e-2 * 3}
      RESULTS["jit"].append(record)
      print(f"{'ok  ' if record['ok'] else 'FAIL'} jit step {step}: {record}", flush=True)
      if not record["ok"]: RESULTS["failures"].append(f"jit step {step}")
  finally:
    decode_layer.MAX_LAYERS = saved
  if backend.calls["decode-layers"] == 0: RESULTS["failures"].append("jit: the layer kernel never ran")


def engine_ab(device: str) -> None:
  from tinyvllm.bench.decode import random_prompts, run_decode_bench
  from tinyvllm.config import EngineConfig
  from tinyvllm.engine.llm_engine import LLMEngine
  from tinyvllm.sampling_params import SamplingParams
  tokens = {}
  for on in (True, False):
    engine = LLMEngine(EngineConfig(model="qwen3-0.6b", load_format="dummy", device=device, max_model_len=2048,
                                    max_num_seqs=8, num_gpu_blocks=1024, decode_layer_kernel=on))
    runs = {b: run_decode_bench(engine, batch=b, prompt_len=128, new_tokens=128, no_kv_cache=False)[0] for b in (1, 2, 4, 8)}
    for i, prompt in enumerate(random_prompts(engine, 2, 16, seed=3)):
      engine.add_request(f"g{i}", prompt, SamplingParams(temperature=0, max_tokens=64, ignore_eos=True))
    outs = {}
    while engine.has_unfinished_requests():
      for o in engine.step(): outs[o.request_id] = o
    tokens[on] = outs["g0"].outputs[0].token_ids + outs["g1"].outputs[0].token_ids
    key = "layer_kernel" if on else "per_op"
    RESULTS["engine"][key] = {**{f"b{b}_tok_s": r.decode_tok_s for b, r in runs.items()},
                              **{f"b{b}_ms_step": r.decode_s / (r.new_tokens - 1) * 1e3 for b, r in runs.items()},
                              "calls": dict(engine.model.backend.calls)}
    print(f"engine {key}: " + " | ".join(r.line() for r in runs.values()), flush=True)
    del engine
  a, b = tokens[True], tokens[False]
  RESULTS["engine"]["greedy_first_difference"] = next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), None)
  print(f"greedy 64 tokens, layer kernel vs per-op: first difference at {RESULTS['engine']['greedy_first_difference']}", flush=True)


def main() -> int:
  from tinyvllm.platform.device import select_device
  device = select_device(os.environ.get("DEV", "CUDA"))
  t = time.perf_counter()
  for case in CASES:
    try: check_case(*case, device=device)
    except Exception as e:
      RESULTS["failures"].append(f"{case[0]}: {type(e).__name__}: {e}")
      print(f"FAIL {case[0]}: {type(e).__name__}: {e}", flush=True)
  for name, fn in (("jit", check_jit), ("engine", engine_ab)):
    if name in os.environ.get("SKIP", ""): continue
    try: fn(device)
    except Exception as e:
      RESULTS["failures"].append(f"{name}: {type(e).__name__}: {e}")
      print(f"FAIL {name}: {type(e).__name__}: {e}", flush=True)
  RESULTS["seconds"] = round(time.perf_counter() - t, 1)
  out = Path(os.environ.get("OUT", "/tmp/out"))
  out.mkdir(parents=True, exist_ok=True)
  (out / "check_decode_layer.json").write_text(json.dumps(RESULTS, indent=1, default=str))
  print("PASS" if not RESULTS["failures"] else f"FAIL: {RESULTS['failures']}", flush=True)
  return 1 if RESULTS["failures"] else 0


if __name__ == "__main__":
  sys.exit(main())
