"""The persistent decode-layer kernel (csrc/cuda/decode_layer.inc) in the CPU emulator, against the model's own per-op
layers (TransformerLM.decoder_layers on the portable path: tinygrad ops, float32, on the CPU).

The emulator runs every block of the grid at once with a real grid barrier (emu::launch_cooperative), so a phase that
read another block's results before the barrier would show. Grids are small (a few blocks of 64-128 threads) and
chosen so that the last blocks own no rows of some products, as the H100's 132 blocks do for Qwen3-0.6B's 1,024
hidden rows. The GPU check (bench/check_kernels.py) runs the real kernel against the same reference on an H100.
"""
from __future__ import annotations

import re
import shutil
import subprocess
from dataclasses import replace

import numpy as np
import pytest

from tests.emulator.cases import FP8, LayerCase, from_bits, layer_as_decode_rows, layer_outputs, layer_tensors, make_layer_case, to_bits
from tests.emulator.emulator import LazyKernels, Spec, emulate
from tinyvllm.config import KernelOptions
from tinyvllm.kernels.decode_layer import (
  ELEM,
  THREADS,
  DecodeLayerShape,
  decode_layer_plan,
  decode_layer_source,
  layer_launches,
  max_layers,
  shared_bytes,
  shared_layout,
  step_shape,
  unsupported_reason,
)
from tinyvllm.kernels.tuning import tuning_for
from tinyvllm.platform.target import DeviceTarget

H100 = DeviceTarget.nominal("cuda")   # sm_90 (bulk copies), 132 SMs (grid barriers); the emulated grids are the shapes' own

MODELS = {
  "qwen3": dict(hidden=48, intermediate=80, heads=4, kv_heads=2, head_dim=16, qk_norm=True, qkv_bias=False),
  "qwen2": dict(hidden=64, intermediate=96, heads=8, kv_heads=2, head_dim=8, qk_norm=False, qkv_bias=True),
  # inputs of 64-column blocks (128 and 64 wide): every product on tensor cores where a block owns 16+ of its rows
  "wide": dict(hidden=128, intermediate=64, heads=4, kv_heads=2, head_dim=32, qk_norm=True, qkv_bias=False),
}
# name: (model, decode contexts, kv_fp8, dtype, blocks, threads, layers[, smallest context bucket])
CASES = {
  "qwen3_b1_splits": ("qwen3", [300], False, "bfloat16", 9, 64, 1),   # 3 of 4 splits see keys: the merge
  "qwen3_b3_fp8": ("qwen3", [5, 70, 1], True, "bfloat16", 9, 64, 1),
  "qwen2_long_f16": ("qwen2", [300, 17], False, "float16", 5, 128, 1),
  # 8 warps, 4 o / down rows a block: each row's K split over 2 warps (as the H100's 16 warps split its 8 rows)
  "qwen3_split_rows": ("qwen3", [40], False, "bfloat16", 13, 256, 1),
  # the products on tensor cores: 52 qkv rows a block (four 16-row tiles over 8 warps, the last tile and the last
  # block's partly empty), 26 of the others, K split over up to 4 warps (some with no 64-column block)
  "wide_tensor_cores": ("wide", [300, 40, 7], False, "bfloat16", 5, 256, 2),
  # 12 warps (the sm_90 table's 384 threads past four rows): a warp count that is no power of two, tiles of 192 keys
  "qwen3_12_warps": ("qwen3", [300, 40, 7, 90, 1], False, "bfloat16", 9, 384, 1),
  # several layers in one launch: h through h_out, the next layer's slices prefetched during the down phase
  "qwen3_3_layers": ("qwen3", [300, 40], False, "bfloat16", 9, 64, 3),
  "qwen2_2_layers_fp8": ("qwen2", [33], True, "float16", 5, 128, 2),
  # block tables read from global memory, as for long contexts: a 32,768-key bucket's 2 x 2,048-entry tables (16 KB) do
  # not fit the shared-memory copy
  "qwen3_global_tables": ("qwen3", [300, 7], False, "bfloat16", 9, 64, 2, 32768),
}
# packed (quantized) weights: name -> (model, decode contexts, kv_fp8, dtype, blocks, threads, layers, each product's
# (form, group) in qkv, o, gate_up, down order). The blocks' first scales sit at every offset of their 16-byte windows:
# qwen3's 128 qkv rows over 9 blocks are 15 a block, its per-channel scales 60 bytes a block; qwen2's 192 gate_up rows
# over 5 are 39, 312 bytes of scales at group 32.
channel = lambda form, *ks: tuple((form, k) for k in ks)
PACKED = {
  "qwen3_int8_channel": ("qwen3", [300, 40], False, "bfloat16", 9, 64, 2, channel("int8", 48, 64, 48, 80)),
  "qwen2_int4_g32": ("qwen2", [33, 5], False, "float16", 5, 128, 1, (("int4", 32),) * 4),
  "qwen3_fp8_g16_fp8_cache": ("qwen3", [70, 1], True, "bfloat16", 9, 64, 1, (("fp8", 16),) * 4),
  # one scale a row in every form (its sums scaled once): FP8 without shifts, int4 with
  "qwen2_fp8_int4_channel": ("qwen2", [33, 5], False, "float16", 5, 128, 1, (("fp8", 64), ("int4", 64), ("fp8", 64), ("int4", 96))),
  # GGUF-like: each product its own form, o left in the activations' dtype
  "qwen2_mixed": ("qwen2", [300, 17], False, "float16", 5, 128, 2, (("int8", 32), ("elem", 0), ("fp8", 64), ("int4", 32))),
  # six rows: each warp's rows' grouped codes held while x' is read row by row
  "qwen3_groups_6_rows": ("qwen3", [40, 5, 70, 1, 9, 33], False, "bfloat16", 9, 64, 1,
                          (("int8", 16), ("int4", 32), ("fp8", 16), ("int8", 16))),
}
CASES.update({name: case[:7] for name, case in PACKED.items()})
# verifications of proposals laid out as decode rows (as_decode_rows): name -> each sequence's new tokens. A row sees its
# sequence's earlier rows' keys, which no block has written to the cache yet: its own item norms and rotates them. In
# qwen3_verify_rows the 259-key sequence's new keys 254-258 cross its splits' boundary (33 blocks: chunks of 256 keys);
# qwen2_verify_rows_fp8 has 7 rows (a verification's rows are not padded).
VERIFY = {"qwen3_verify_rows": [5, 1, 2], "qwen2_verify_rows_fp8": [3, 4]}
CASES.update({"qwen3_verify_rows": ("qwen3", [259, 40, 2], False, "bfloat16", 33, 64, 2),
              "qwen2_verify_rows_fp8": ("qwen2", [33, 17], True, "float16", 5, 128, 1)})
# cases whose blocks own gate_up's rows in pairs (paired_gate_up: silu(gate) * up written by phase 4), on tensor cores
# and by FMAs, with a short last block (qwen2_long_f16: 96 = 4 x 20 + 16) and blocks that own none (qwen3_verify_rows:
# 33 blocks of 3 pairs for 80)
PAIRED_GATE_UP = frozenset({"qwen2_long_f16", "wide_tensor_cores", "qwen3_verify_rows", "qwen2_verify_rows_fp8"})
# the cases that run in a few seconds with `-m "not slow"` (their own small library); the rest are marked slow
QUICK = frozenset({"qwen3_split_rows", "qwen2_mixed", "qwen3_verify_rows", "wide_tensor_cores"})


def make(name: str) -> tuple[LayerCase, DecodeLayerShape]:
  """The case as the kernel takes it (a verification's tokens as decode rows) and its shape."""
  case, shape = make_multi_query(name)
  return (layer_as_decode_rows(case), replace(shape, rows=case.paged.total_tokens)) if name in VERIFY else (case, shape)


def make_multi_query(name: str) -> tuple[LayerCase, DecodeLayerShape]:
  """The case with each sequence's new tokens in one query row (the reference's layout)."""
  model, contexts, kv_fp8, dtype, blocks, threads, layers, *bucket = CASES[name]
  weights = PACKED[name][7] if name in PACKED else (("elem", 0),) * 4
  case = make_layer_case(np.random.default_rng(len(name)), contexts, **MODELS[model], dtype=dtype, kv_fp8=kv_fp8, layers=layers,
                         min_bucket=bucket[0] if bucket else 16, weights=weights, new_tokens=VERIFY.get(name))
  d, p = case.dims, case.paged
  shape = DecodeLayerShape(dtype, case.rows, d["hidden"], d["heads"], d["kv_heads"], d["head_dim"], d["intermediate"], d["qk_norm"],
                           d["qkv_bias"], case.eps, p.shape.block_size, p.arrays["block_tables"].shape[1], p.k_cache.shape[0],
                           kv_fp8, blocks, threads, layers=layers, weights=weights, paired_gate_up=name in PAIRED_GATE_UP)
  return case, shape


def run_emulated(emu: LazyKernels, name: str, case: LayerCase, shape: DecodeLayerShape, order: str, seed: int = 0,
                 late_copies: bool = False):
  plan = decode_layer_plan(shape, H100)
  kv = FP8 if shape.kv_fp8 else case.dtype
  given = {"h_in": to_bits(case.h_in, case.dtype), "rope_cos": case.cos, "rope_sin": case.sin,
           **{k: case.paged.arrays[k] for k in ("slot_mapping", "block_tables", "context_lens", "query_start", "new_keys")}}
  for li, (weights, (k_cache, v_cache)) in enumerate(zip(case.weights, case.caches, strict=True)):
    for k, v in weights.items():
      if isinstance(v, np.ndarray): given[f"{k}_{li}"] = to_bits(v, case.dtype)
      else: given.update({f"{k}_{li}": v.codes.numpy(), f"{k}_scale_{li}": v.scales.numpy(),
                          **({f"{k}_shift_{li}": v.shifts.numpy()} if v.shifts is not None else {})})
    given.update({f"k_cache_{li}": to_bits(k_cache, kv), f"v_cache_{li}": to_bits(v_cache, kv)})
  poison = {"float": np.float32(np.nan), "uint": 0, "elem": 0x7FC0 if case.dtype == "bfloat16" else 0x7E00}
  buffers = []
  for p in plan.launch.params:
    if p.name in given: buffers.append(np.ascontiguousarray(given[p.name]).reshape(-1).copy())
    else: buffers.append(np.full(p.numel, poison[p.kind], {"float": np.float32, "uint": np.uint32}.get(p.kind, np.uint16)))
  emu.launch(name, 0, buffers, order, seed, late_copies)
  out = dict(zip((p.name for p in plan.launch.params), buffers, strict=True))
  slots, width = case.paged.k_cache.shape
  caches = [tuple(from_bits(out[f"{c}_cache_{li}"], kv).reshape(slots, width) for c in "kv") for li in range(shape.layers)]
  return from_bits(out["h_out"], case.dtype).reshape(case.rows, -1)[:case.paged.total_tokens], caches, out["sync"]


def run_reference(case: LayerCase):
  """TransformerLM.decoder_layers on the portable path, float32 on the CPU (FP8 caches as codes, as the engine has them).
  The kernel rounds the new k and v to the activations' dtype before FP8, as the engine's bf16 path does; float32 goes
  to FP8 directly, so a value may land one FP8 step away (12.5%), and the attention output of a short context with it."""
  model, _, (h, cos, sin, caches, meta) = layer_tensors(case)
  return layer_outputs(case, *model.decoder_layers(h, cos, sin, caches, meta))


@pytest.fixture(scope="module")
def emu() -> LazyKernels:
  specs = [Spec(name, "decode_layer", (plan := decode_layer_plan(make(name)[1], H100)).defines, (plan.launch,)) for name in CASES]
  return emulate("cuda", specs, QUICK)


@pytest.mark.parametrize("name", [pytest.param(name, marks=() if name in QUICK else pytest.mark.slow) for name in CASES])
def test_decode_layer_matches_per_op_layers(emu, name):
  """The kernel against the per-op layers; a verification's decode rows against the per-op layers on its multi-query
  layout (one row a sequence, the prefill attention's causal mask)."""
  case, shape = make(name)
  want_h, want_caches = run_reference(make_multi_query(name)[0])
  written = case.paged.arrays["slot_mapping"][case.paged.arrays["slot_mapping"] >= 0]
  others = np.setdiff1d(np.arange(case.paged.k_cache.shape[0]), written)
  cache_tol = dict(rtol=0.13, atol=0.02) if shape.kv_fp8 else dict(rtol=0.02, atol=0.02)
  # each layer's error feeds the next: a looser bound on h after several
  h_tol = dict(rtol=0.03 * shape.layers, atol=(0.1 if shape.kv_fp8 else 0.03) * shape.layers)
  # the random order with every cp.async copy landing at the wait that covers it (a read before its wait shows)
  for order, seed, late in (("forward", 0, False), ("reverse", 0, False), ("random", 3, True)):
    h, caches, sync = run_emulated(emu, name, case, shape, order, seed, late)   # padding rows (no sequence) are not compared
    order += " with late copies" if late else ""
    np.testing.assert_allclose(h, want_h, **h_tol, err_msg=f"{name} {order}")
    for li, ((k, v), (want_k, want_v)) in enumerate(zip(caches, want_caches, strict=True)):
      np.testing.assert_allclose(k[written], want_k[written], **cache_tol, err_msg=f"{name} {order}: layer {li}'s new keys")
      np.testing.assert_allclose(v[written], want_v[written], **cache_tol, err_msg=f"{name} {order}: layer {li}'s new values")
      np.testing.assert_array_equal(k[others], want_k[others])   # nothing else written
      np.testing.assert_array_equal(v[others], want_v[others])
    np.testing.assert_array_equal(sync, [0, 0])


def test_block_tables_cached_up_to_8kb():
  """The step's block tables are copied to shared memory where they take up to 8 KB; qwen3_global_tables reads them from
  global memory."""
  cached = {name: decode_layer_plan(make(name)[1], H100).defines["TV_CACHE_TABLES"] for name in CASES}
  assert cached.pop("qwen3_global_tables") == 0 and set(cached.values()) == {1}
  shape = lambda rows, max_blocks: DecodeLayerShape("bfloat16", rows, 1024, 16, 8, 128, 3072, True, False, 1e-6, 16, max_blocks,
                                                    1 << 20, False, 132)
  assert decode_layer_plan(shape(4, 512), H100).defines["TV_CACHE_TABLES"] == 1     # 8 KB
  assert decode_layer_plan(shape(4, 513), H100).defines["TV_CACHE_TABLES"] == 0


def test_plan_fits_qwen3_06b_on_h100():
  """Qwen3-0.6B on 132 SMs, all 28 layers in one launch: rows 1-8 fit an SM's shared memory, the arguments CUDA's 4 KB;
  the last blocks own no o/down rows (1,024 = 128 x 8)."""
  for rows in (1, 2, 4, 8):
    shape = DecodeLayerShape("bfloat16", rows, 1024, 16, 8, 128, 3072, True, False, 1e-6, 16, 128, 1 << 20, False, 132, layers=28)
    assert unsupported_reason(shape, H100) is None
    plan = decode_layer_plan(shape, H100)
    assert plan.launch.grid == (132, 1, 1) and plan.launch.cooperative and shared_bytes(shape) <= 227 * 1024
    assert len(plan.launch.params) == 16 + 28 * 10 and 8 * len(plan.launch.params) <= 4096
    assert [p.name for p in plan.launch.params if p.written] == ["h_out", "qkv", "part_o", "part_ml", "h_mid", "gu", "sync", "attn",
                                                                  *(f"{c}_cache_{li}" for li in range(28) for c in "kv")]
    d = plan.defines
    assert (d["TV_R_O"], d["TV_R_GU"], d["TV_GU_PAIRS"]) == (8, 47, 0) and d["TV_NSPLIT"] * d["TV_CHUNK"] == 2048
    # qkv (32 rows a block) and gate_up take the tensor cores, o and down (8) the FMA form
    assert d["TV_R_QKV"] >= d["TV_TC_MIN_ROWS"] == 16 and d["TV_R_GU"] >= 16 > max(d["TV_R_O"], d["TV_R_DN"])
    assert d["TV_CHUNK"] == 128 * rows   # about one attention item per block at full context


def test_packed_plan_fits_qwen3_06b_on_h100():
  """Packed weights on 132 SMs: int4 g128's codes, scales and shifts fit an SM with room to spare; their 18 pointers a
  layer let 27 layers into CUDA's 4 KB of arguments, so a 28-layer step is two launches of 14 (one specialisation); FP8
  (no shifts, 14 pointers a layer) keeps all 28 in one."""
  base = dict(dtype="bfloat16", rows=1, hidden=1024, heads=16, kv_heads=8, head_dim=128, intermediate=3072, qk_norm=True,
              qkv_bias=False, eps=1e-6, block_size=16, max_blocks=128, num_slots=4096, kv_fp8=False, blocks=132)
  bf16 = DecodeLayerShape(**base, layers=28)
  int4 = DecodeLayerShape(**base, layers=14, weights=(("int4", 128),) * 4)
  assert max_layers(int4) == 27 and unsupported_reason(int4, H100) is None
  assert "28 layers in one launch (it takes 1 to 27)" in unsupported_reason(replace(int4, layers=28), H100)
  plan = decode_layer_plan(int4, H100)
  assert len(plan.launch.params) == 16 + 14 * 18 and 8 * len(plan.launch.params) <= 4096
  assert shared_bytes(int4) < shared_bytes(bf16) <= 227 * 1024
  layout = shared_layout(int4)   # gate_up's 47 rows: 47 x 512 bytes of codes, 47 x 8 scales and shifts in 16-byte windows
  assert layout["TV_A_BYTES"] == 47 * 512 + 2 * (47 * 8 * 4 + 16)
  d = plan.defines
  assert (d["TV_WQ_QKV"], d["TV_WG_QKV"], d["TV_P_QKV_S"], d["TV_P_QKV_Z"]) == (2, 128, 10, 11)
  fp8 = DecodeLayerShape(**base, layers=28, weights=(("fp8", 128),) * 4)
  assert max_layers(fp8) == 32 and unsupported_reason(fp8, H100) is None
  d = decode_layer_plan(fp8, H100).defines
  assert (d["TV_WQ_QKV"], d["TV_P_QKV_S"], d["TV_P_QKV_Z"]) == (3, 10, 3)   # no shifts: the codes' slot, never read
  mixed = DecodeLayerShape(**base, weights=(("int8", 1024), ("elem", 0), ("fp8", 1024), ("int4", 128)))
  d = decode_layer_plan(mixed, H100).defines
  assert (d["TV_WQ_O"], d["TV_P_O_S"], d["TV_P_O_Z"]) == (0, 4, 4)   # no scales: the codes' own slot, never read


def test_packed_shapes_say_why():
  base = dict(dtype="bfloat16", rows=1, hidden=1024, heads=16, kv_heads=8, head_dim=128, intermediate=3072, qk_norm=True,
              qkv_bias=False, eps=1e-6, block_size=16, max_blocks=128, num_slots=4096, kv_fp8=False, blocks=132)
  packed = lambda *forms: unsupported_reason(DecodeLayerShape(**base, weights=forms), H100)
  assert "qkv scale group 12" in packed(("int8", 12), ("elem", 0), ("elem", 0), ("elem", 0))
  assert "o scale group 96" in packed(("elem", 0), ("int4", 96), ("elem", 0), ("elem", 0))   # does not divide 2,048
  assert "nf4 weights (gu)" in packed(("elem", 0), ("elem", 0), ("nf4", 64), ("elem", 0))
  odd = DecodeLayerShape(**{**base, "hidden": 1000, "heads": 8, "head_dim": 125}, weights=(("int4", 8),) + (("elem", 0),) * 3)
  assert "whole 16-byte rows of codes" in unsupported_reason(odd, H100)


def test_unsupported_shapes_say_why():
  base = dict(dtype="bfloat16", rows=1, hidden=1024, heads=16, kv_heads=8, head_dim=128, intermediate=3072, qk_norm=True,
              qkv_bias=False, eps=1e-6, block_size=16, max_blocks=128, num_slots=4096, kv_fp8=False, blocks=132)
  assert unsupported_reason(DecodeLayerShape(**base), H100) is None
  assert "9 rows" in unsupported_reason(DecodeLayerShape(**{**base, "rows": 9}), H100)
  assert "dtype" in unsupported_reason(DecodeLayerShape(**{**base, "dtype": "float32"}), H100)
  assert "group" in unsupported_reason(DecodeLayerShape(**{**base, "heads": 64}), H100)
  assert "33 layers" in unsupported_reason(DecodeLayerShape(**{**base, "layers": 33}), H100)
  # Llama-3.2-1B's gate_up slice alone (16,384 rows over 132 blocks, 4 KB each) is past an SM's shared memory
  assert "shared memory" in unsupported_reason(DecodeLayerShape(**{**base, "hidden": 2048, "intermediate": 8192, "heads": 32}), H100)
  with pytest.raises(ValueError, match="rows"): decode_layer_plan(DecodeLayerShape(**{**base, "rows": 9}), H100)
  # the kernel needs Hopper's bulk copies and a grid barrier: not an A100, not Metal
  for target in (DeviceTarget.nominal("cuda", arch="sm_80", multiprocessors=108), DeviceTarget.nominal("metal")):
    assert "grid barrier" in unsupported_reason(DecodeLayerShape(**base), target)


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not installed (the CUDA compile check needs it)")
@pytest.mark.parametrize("rows,kv_fp8,weights", [(1, False, None), (4, True, None), (5, False, None), (8, False, None),
                                                 (1, False, ("int4", 128)), (4, False, ("int8", 128)), (1, True, ("fp8", 128))])
def test_cuda_source_compiles_without_spills(tmp_path, rows, kv_fp8, weights):
  """Qwen3-0.6B's 28 layers as an H100 plans them (14 a launch with int8 / int4 weights' scales and shifts; blocks of
  the sm_90 table's threads: 512 up to 4 rows, 384 from 5, and its paired gate_up rows from 5), through nvcc (sm_90a): no
  errors, and within 512 threads' 128 registers at most a few loop-invariant words in local memory (the bf16 build keeps
  ~40 bytes there: barrier and copy bookkeeping, read a few times a phase, never in a product's or an attention tile's
  loop); with 384 threads' 168 none at 5 rows and a few such words at 8 (512 threads spill 100+ bytes at 5 rows)."""
  layers = 14 if weights and weights[0] != "fp8" else 28
  threads = tuning_for(H100.kind).decode_layer.threads(rows, THREADS)
  assert threads == (512 if rows <= 4 else 384)
  shape = DecodeLayerShape("bfloat16", rows, 1024, 16, 8, 128, 3072, True, False, 1e-6, 16, 128, 1 << 16, kv_fp8, 132, threads,
                           layers=layers, weights=(weights,) * 4 if weights else (("elem", 0),) * 4,
                           paired_gate_up=tuning_for(H100.kind).decode_layer.pairs_gate_up(rows))
  path = tmp_path / "layer.cu"
  path.write_text(decode_layer_source(shape, H100)[1])
  run = subprocess.run(["nvcc", "-gencode=arch=compute_90a,code=sm_90a", "-cubin", "-o", str(tmp_path / "layer.cubin"),
                        "-Xptxas", "-v", str(path)], capture_output=True, text=True, timeout=300)
  out = run.stdout + run.stderr
  assert run.returncode == 0 and "error" not in out.lower(), out
  spills = re.findall(r"(\d+) bytes spill stores", out)
  assert len(spills) == 1 and int(spills[0]) <= {512: 64, 384: 0 if rows == 5 else 32}[threads], out


@pytest.mark.slow
def test_backend_takes_only_small_decode_steps_it_supports():
  """FusedBackend's choice, on CPU tensors with the nominal H100 (132 SMs): decode steps of 1-8 rows of a supported model
  with context buckets up to 8,192 at batch 1, 4,096 at 2-4 rows and 2,048 at 5-8 (the sm_90 tuning table) get a shape
  (the H100 plan, every layer in one launch), 16-row steps and longer contexts do not (the per-op kernels run them),
  and a model the kernel cannot take is refused with one log line naming the reason."""
  from tinyvllm.kernels.fused import FusedBackend
  from tinyvllm.kernels.tinygrad_program import collecting_sources
  messages: list[str] = []
  backend = FusedBackend(replace(H100, device="CPU"), log=messages.append)
  assert backend.decode_layer_bounds == {1: 8192, 2: 4096, 3: 4096, 4: 4096, 5: 2048, 6: 2048, 7: 2048, 8: 2048}
  assert backend.decode_verify_tokens == 8
  qwen3 = dict(hidden=1024, intermediate=3072, heads=16, kv_heads=8, head_dim=128, qk_norm=True, qkv_bias=False)

  def step(contexts: list[int], layers: int = 2, **change):
    case = make_layer_case(np.random.default_rng(0), contexts, **{**qwen3, **change}, dtype="float16", layers=layers)   # (no CPU bf16)
    _, stack, (h, cos, sin, caches, meta) = layer_tensors(case, dtype="float16")
    return case, stack, h, cos, sin, caches, meta

  def shape_for(contexts: list[int], layers: int = 2, **change):
    """The shape the backend plans the step's layers with (step_shape, within the backend's bound for the rows)."""
    case, stack, h, cos, _, caches, meta = step(contexts, layers, **change)
    shape, reason = step_shape(stack, h, cos, *caches[0], meta, case.eps, backend.target, backend.decode_layer_bounds.get(h.shape[0], 0))
    assert reason is None, reason
    return shape

  shape = shape_for([5, 900, 17, 40])
  assert shape is not None
  assert (shape.dtype, shape.rows, shape.blocks, shape.heads, shape.kv_heads, shape.head_dim, shape.intermediate,
          shape.qk_norm, shape.layers) == ("float16", 4, 132, 16, 8, 128, 3072, True, 2)
  assert unsupported_reason(shape, H100) is None and not messages
  assert shape_for([300], layers=1).rows == 1   # batch 1 too
  assert shape_for([300] * 8, layers=1).rows == 8
  assert shape_for([300] * 9, layers=1) is None and not messages   # 16 rows: per-op kernels, by design (nothing to report)
  assert shape_for([2048] * 8, layers=1) is not None and shape_for([2049] * 8, layers=1) is None
  # context buckets up to 8,192 at batch 1, 4,096 at 2-4 rows (beyond: the split decode kernel, nothing to report)
  assert shape_for([8192], layers=1) is not None and shape_for([8193], layers=1) is None and not messages
  assert shape_for([4096, 5], layers=1) is not None and shape_for([4097, 5], layers=1) is None and not messages
  # through the backend's op: a step it takes becomes the layer kernel's graph (built, never run: no binaries on the CPU)
  case, stack, h, cos, sin, caches, meta = step([5, 900, 17, 40])
  with collecting_sources() as pending:
    fused = backend.decode_layers(stack, h, cos, sin, caches, meta, case.eps)
  assert fused is not None and len(fused[1]) == 2 and backend.calls["decode-layers"] == 1 and len(pending) == 1
  assert backend.decode_layers(*step([300] * 9, layers=1)[1:], case.eps) is None and not messages
  # G 8: refused, once in the log
  case, stack, h, cos, sin, caches, meta = step([5, 900, 17, 40], heads=64, kv_heads=8)
  for _ in range(2): assert backend.decode_layers(stack, h, cos, sin, caches, meta, case.eps) is None
  assert len(messages) == 1 and "group above 4" in messages[0] and "per-op kernels" in messages[0]
  assert backend.calls["decode-layers"] == 1


def test_layers_of_different_weight_forms_launch_by_runs():
  """A GGUF file's mix differs from layer to layer (llama.cpp's Q4_K_M holds attn_v and ffn_down in Q6_K on some layers
  only, and a fused q/k/v takes one form): each run of consecutive layers with the same forms gets its own launches and
  specialisation, within the arguments' room; every run's shape must fit (else the per-op kernels run the step)."""
  qwen3 = dict(hidden=1024, intermediate=3072, heads=16, kv_heads=8, head_dim=128, qk_norm=True, qkv_bias=False)
  q4 = (("int4", 32),) * 4
  q6 = (("int8", 16), ("int4", 32), ("int4", 32), ("int8", 16))
  cases = [make_layer_case(np.random.default_rng(0), [40], **qwen3, dtype="float16", layers=4, weights=w) for w in (q6, q4)]
  (_, six, (h, cos, sin, caches, meta)), (_, four, _) = (layer_tensors(c, dtype="float16") for c in cases)
  layers = [six[0], six[1], four[2], six[3]]
  shape, reason = step_shape(layers, h, cos, *caches[0], meta, cases[0].eps, H100, 8192)
  assert reason is None and shape.weights == q6 and shape.layers == 2
  assert [(first, s.layers, s.weights) for first, s in layer_launches(shape, layers)] == [(0, 2, q6), (2, 1, q4), (3, 1, q6)]
  # through the backend: the three launches' graph, three specialisations built (never run: no binaries on the CPU)
  from tinyvllm.kernels.fused import FusedBackend
  from tinyvllm.kernels.tinygrad_program import collecting_sources
  backend = FusedBackend(replace(H100, device="CPU"))
  with collecting_sources() as pending:
    fused = backend.decode_layers(layers, h, cos, sin, caches, meta, cases[0].eps)
  assert fused is not None and len(fused[1]) == 4 and len(pending) == 3
  # a run longer than a launch takes: equal launches (and a shorter last one)
  most = max_layers(shape)
  assert most == 27 and [(f, s.layers) for f, s in layer_launches(shape, [six[0]] * (most + 2))] == [(0, 15), (15, 14)]


@pytest.mark.slow
def test_backend_takes_packed_layers(monkeypatch):
  """Packed (int4 g128) layers through FusedBackend on CPU tensors with the nominal H100: the step's shape carries each
  product's form; with the arguments' room cut to two layers a launch, three layers run as launches of 2 and 1 (two
  specialisations, both built); act-order weights (g_idx, or columns sorted by group) are refused, once in the log."""
  from dataclasses import replace as swap

  from tinygrad import Tensor, dtypes

  from tinyvllm.kernels import decode_layer
  from tinyvllm.kernels.fused import FusedBackend
  from tinyvllm.kernels.tinygrad_program import collecting_sources
  messages: list[str] = []
  backend = FusedBackend(replace(H100, device="CPU"), log=messages.append)
  qwen3 = dict(hidden=1024, intermediate=3072, heads=16, kv_heads=8, head_dim=128, qk_norm=True, qkv_bias=False)
  case = make_layer_case(np.random.default_rng(0), [40], **qwen3, dtype="float16", layers=3, weights=(("int4", 128),) * 4)
  _, stack, (h, cos, sin, caches, meta) = layer_tensors(case, dtype="float16")
  shape, reason = step_shape(stack, h, cos, *caches[0], meta, case.eps, backend.target, 8192)
  assert reason is None and shape.weights == (("int4", 128),) * 4 and shape.layers == 3
  monkeypatch.setattr(decode_layer, "ARGUMENT_POINTERS", decode_layer.STEP_PARAMS + 2 * len(shape.layer_params))
  with collecting_sources() as pending:
    fused = backend.decode_layers(stack, h, cos, sin, caches, meta, case.eps)
  assert fused is not None and len(fused[1]) == 3 and len(pending) == 2 and not messages
  act_order = [swap(layer, qkv_proj=swap(layer.qkv_proj, g_idx=Tensor.zeros(1024, dtype=dtypes.int32).contiguous()))
               for layer in stack]
  for _ in range(2): assert backend.decode_layers(act_order, h, cos, sin, caches, meta, case.eps) is None
  assert len(messages) == 1 and "act-order (g_idx) weights" in messages[0]
  # sorted by group (QuantizedWeight.perm): the kernel would read x' in the wrong order, so it is refused as well
  sorted_order = [swap(layer, down_proj=swap(layer.down_proj, perm=Tensor.arange(3072, dtype=dtypes.int32).contiguous()))
                  for layer in stack]
  assert backend.decode_layers(sorted_order, h, cos, sin, caches, meta, case.eps) is None


def test_backend_decode_layer_options():
  """KernelOptions: the layer kernel off, or one context bound for every row count; no bounds on a target without
  Hopper's bulk copies and a grid barrier (an A100, Metal)."""
  from tinyvllm.kernels.fused import FusedBackend
  cpu = lambda target: replace(target, device="CPU")
  assert FusedBackend(cpu(H100), KernelOptions(decode_layer=False)).decode_layer_bounds == {}
  assert FusedBackend(cpu(H100), KernelOptions(decode_layer_max_context=2048)).decode_layer_bounds == {r: 2048 for r in range(1, 9)}
  assert FusedBackend(cpu(H100), KernelOptions(decode_layer=False)).decode_verify_tokens == 0
  for target in (DeviceTarget.nominal("cuda", arch="sm_80", multiprocessors=108), DeviceTarget.nominal("metal")):
    assert FusedBackend(cpu(target)).decode_layer_bounds == {}


def test_gate_up_rows_paired_from_the_tables_row_count():
  """The sm_90 table pairs gate_up's rows from five rows on (384-thread blocks): a block owns 24 gate rows of Qwen3-0.6B
  and their 24 up rows (128 blocks of 3,072; the last four own none) and the gate_up buffer holds silu(gate) * up,
  [rows][I]; packed gate_up weights are never paired (their scale windows take one run of rows)."""
  tuned = tuning_for(H100.kind).decode_layer
  assert [tuned.pairs_gate_up(rows) for rows in range(1, 9)] == [False] * 4 + [True] * 4
  shape = lambda rows, weights=ELEM: DecodeLayerShape("bfloat16", rows, 1024, 16, 8, 128, 3072, True, False, 1e-6, 16, 128,
                                                      1 << 16, False, 132, tuned.threads(rows, THREADS), layers=14,
                                                      weights=(weights,) * 4, paired_gate_up=tuned.pairs_gate_up(rows))
  for rows, pairs, r_gu, gu in ((4, 0, 47, 2 * 4 * 3072), (5, 24, 48, 5 * 3072)):
    plan = decode_layer_plan(shape(rows), H100)
    assert (plan.defines["TV_GU_PAIRS"], plan.defines["TV_R_GU"]) == (pairs, r_gu)
    assert next(p.numel for p in plan.launch.params if p.name == "gu") == gu
  assert decode_layer_plan(shape(5, ("int4", 128)), H100).defines["TV_GU_PAIRS"] == 0
