"""The hand-written kernels, CUDA and Metal dialect, run on the CPU through the C++ emulation (tests/emulator) and
compared with the portable tinygrad path (layers/attention.paged_attention) on random paged batches.

What this checks: the algorithm text of every kernel, compiled with each dialect's real prelude against a shim of
that dialect's builtins, with real barrier and 32-lane SIMD semantics, in three thread orders (a missing barrier
changes the result with the order); block tables with holes, out of order and shared between sequences; GQA 1, 2, 4,
8; head_dim 8, 64, 128; float32, float16, bfloat16; FP8 E4M3 caches; decode with and without split-K, prefill with a cached prefix,
mixed decode/prefill batches; padding sequences and tokens; every output element written (outputs start as NaN).
What it cannot check: the GPU compilers themselves (NVRTC, Metal's), address-space rules the C++ compiler does not
enforce, memory-model effects beyond barriers, and speed. See docs/kernels.md.
"""
from __future__ import annotations

import functools
import zlib

import numpy as np
import pytest

from tests.emulator.cases import FP8, make_case, portable_attention, reference_attention, round_to
from tests.emulator.emulator import (
  EmulatedKernels,
  EmulatorError,
  LazyKernels,
  Spec,
  emulate,
  find_compiler,
  run_attention,
  run_kv_write,
)
from tinyvllm.kernels.plan import TC_DECODE_KEY_WARPS, Launch, Param, decode_plan, prefill_plan, tc_prefill_plan, write_plan
from tinyvllm.platform.target import DeviceTarget

DIALECTS = ("cuda", "metal")
# the plans' targets: an H100 for CUDA (tensor cores, cp.async), an Apple GPU for Metal; "fma" cases plan the CUDA
# dialect for a GPU without tensor cores (the FMA prefill, as Metal's)
TARGETS = {"cuda": DeviceTarget.nominal("cuda"), "metal": DeviceTarget.nominal("metal")}
NO_TENSOR_CORES = DeviceTarget.nominal("cuda", arch="sm_75")
TOLERANCE = {"float32": 2e-5, "float16": 3e-3, "bfloat16": 2e-2}   # max |kernel - portable| / max |portable|

# name -> (seqs [(context, new tokens)], heads, kv_heads, head_dim, dtype, share, plan overrides)
ATTENTION_CASES = {
  "dec_f32_g1": ([(1, 1), (2, 1), (15, 1), (16, 1), (17, 1), (100, 1)], 4, 4, 64, "float32", 0, None),
  "dec_f32_g2_shared": ([(60, 1), (45, 1), (33, 1), (7, 1), (130, 1)], 8, 4, 64, "float32", 2, None),
  "dec_f32_g2_nosplit": ([(60, 1), (45, 1), (33, 1), (7, 1), (130, 1)], 8, 4, 64, "float32", 2, {"splits": 1}),
  "dec_bf16_g2_d128": ([(60, 1), (200, 1), (3, 1)], 4, 2, 128, "bfloat16", 1, None),
  "dec_bf16_g7": ([(70, 1), (1, 1), (129, 1)], 14, 2, 64, "bfloat16", 1, None),
  "dec_f16_g4": ([(1, 1), (16, 1), (17, 1), (100, 1), (250, 1)], 8, 2, 64, "float16", 1, None),
  "dec_bf16_g8_d128": ([(15, 1), (33, 1), (200, 1)], 16, 2, 128, "bfloat16", 1, None),
  # decode steps on the tensor-core kernel with its warps over each tile's keys (CUDA; Metal's decode kernel): one
  # token's 8 (or 2) heads a block, contexts over several key tiles, inside one, shorter than a warp's keys of it
  "dec_bf16_g8_d128_tc": ([(15, 1), (200, 1), (64, 1), (1, 1)], 16, 2, 128, "bfloat16", 1, {"tensor_cores": True}),
  "dec_f16_g2_d64_tc": ([(130, 1), (17, 1), (40, 1)], 4, 2, 64, "float16", 2, {"tensor_cores": True}),
  "dec_bf16_g7_d64_tc": ([(70, 1), (1, 1), (129, 1)], 14, 2, 64, "bfloat16", 1, {"tensor_cores": True}),   # 14 of 16 rows
  "dec_bf16_g4_d64_kv8_tc": ([(90, 1), (5, 1), (140, 1)], 8, 2, 64, "bfloat16", 1, {"tensor_cores": True}),   # FP8 cache
  "dec_f32_d8": ([(1, 1), (9, 1), (40, 1)], 8, 4, 8, "float32", 0, None),
  "pre_f32_g2": ([(40, 40), (50, 7), (20, 1), (16, 16)], 8, 4, 64, "float32", 1, None),
  "pre_f16_g4_mixed": ([(100, 37), (3, 3), (70, 1), (64, 2), (17, 1)], 8, 2, 64, "float16", 2, None),
  "pre_bf16_g8_d128": ([(33, 33), (20, 5), (15, 1)], 16, 2, 128, "bfloat16", 0, None),
  "pre_f32_g1_d8": ([(30, 30), (10, 1), (18, 3)], 4, 4, 8, "float32", 0, None),
  "pre_bf16_g1_d128": ([(70, 70), (2, 2)], 2, 2, 128, "bfloat16", 0, None),
  "pre_bf16_g7": ([(40, 21), (5, 1), (9, 9)], 14, 2, 64, "bfloat16", 0, None),
  # 16-bit prefill takes the tensor-core kernel in the CUDA dialect; these keep the FMA one (Metal's) covered there too
  "pre_bf16_g2_d128_fma": ([(70, 70), (50, 7), (20, 1)], 4, 2, 128, "bfloat16", 1, {"fma": True}),
  "pre_f16_g4_fma": ([(100, 37), (3, 3), (70, 1)], 8, 2, 64, "float16", 2, {"fma": True}),
  # the tensor-core kernel over several key tiles and query tiles (64 keys, 32 tokens a tile at G 2); head_dim 16
  "pre_bf16_g2_d128_tiles": ([(200, 130), (150, 150), (64, 1)], 4, 2, 128, "bfloat16", 1, None),
  "pre_f16_g1_d16": ([(90, 70), (33, 2)], 4, 4, 16, "float16", 0, None),
  # FP8 E4M3 caches (names with _kv8): Qwen3's head shape, with and without split-K, prefill with a cached prefix
  "dec_bf16_g2_d128_kv8": ([(60, 1), (300, 1), (3, 1), (17, 1)], 4, 2, 128, "bfloat16", 1, None),
  "dec_f16_g4_kv8_nosplit": ([(1, 1), (100, 1), (33, 1)], 8, 2, 64, "float16", 1, {"splits": 1}),
  # decode's KV vector: 16 codes (G <= 2, head_dim a multiple of 16; d16: one lane a key) or 8 (G 8, head_dim 8)
  "dec_f16_g1_d64_kv8": ([(1, 1), (129, 1), (40, 1)], 4, 4, 64, "float16", 0, None),
  "dec_bf16_g8_d128_kv8": ([(15, 1), (200, 1), (33, 1)], 16, 2, 128, "bfloat16", 1, None),
  "dec_bf16_g2_d16_kv8": ([(70, 1), (300, 1), (2, 1)], 4, 2, 16, "bfloat16", 1, None),
  "dec_f16_g2_d8_kv8": ([(9, 1), (140, 1)], 4, 2, 8, "float16", 0, None),
  "pre_bf16_g2_d128_kv8": ([(70, 70), (50, 7), (20, 1)], 4, 2, 128, "bfloat16", 1, None),
  # _staged: in the CUDA dialect K/V tiles through a cp.async ring in dynamic shared memory, the ring wrapping several
  # times, contexts ending inside a tile, split and not (Metal has no cp.async: there the register path)
  "dec_bf16_g2_d128_kv8_staged": ([(60, 1), (700, 1), (3, 1), (129, 1)], 4, 2, 128, "bfloat16", 1, {"stages": 2, "splits": 2}),
  "dec_f16_g4_staged_nosplit": ([(1, 1), (300, 1), (33, 1)], 8, 2, 64, "float16", 1, {"stages": 3, "splits": 1}),
  "dec_bf16_g1_d64_staged": ([(500, 1), (17, 1)], 2, 2, 64, "bfloat16", 0, {"stages": 4, "splits": 1}),
  "pre_f16_g8_kv8": ([(33, 33), (20, 5), (15, 1)], 16, 2, 64, "float16", 0, None),
  # _coarse: a prompt step in the fused backends' coarse buckets (256 token rows, query runs of 256: most queries padded)
  "pre_bf16_g2_d128_coarse": ([(70, 37), (50, 7), (20, 1)], 4, 2, 128, "bfloat16", 1, None),
  "pre_f32_g2_coarse": ([(40, 40), (20, 1), (16, 16)], 8, 4, 64, "float32", 0, None),
}
# name -> (dtype, kv_heads, head_dim, FP8 caches)
WRITE_CASES = {"write_f32": ("float32", 2, 64, False), "write_bf16": ("bfloat16", 2, 128, False),
               "write_f16_d8": ("float16", 1, 8, False), "write_bf16_kv8": ("bfloat16", 2, 128, True),
               "write_f16_kv8": ("float16", 1, 64, True)}
# cases that run in a few seconds with `-m "not slow"` (their own small library per dialect): decode (float32, FP8
# codes), the FMA and the tensor-core prefill, the KV write; the rest are marked slow
QUICK = frozenset({"dec_f32_g1", "dec_f16_g2_d8_kv8", "pre_f32_g1_d8", "pre_f16_g1_d16", "write_f32", "write_bf16_kv8"})
SELFTESTS = frozenset({"race_ok", "race_bad", "simd", "divergent"})


def quick_or_slow(names) -> list:
  return [pytest.param(name, marks=() if name in QUICK else pytest.mark.slow) for name in names]


def _case(name: str):
  seqs, heads, kv_heads, head_dim, dtype, share, _ = ATTENTION_CASES[name]
  rng = np.random.default_rng(zlib.crc32(name.encode()))
  coarse = "_coarse" in name
  return make_case(rng, seqs, heads=heads, kv_heads=kv_heads, head_dim=head_dim, dtype=dtype, share=share, pad_seqs=1,
                   kv_fp8="_kv8" in name, min_tokens=256 if coarse else 1, min_query_run=256 if coarse else 1)


CASES = {name: _case(name) for name in ATTENTION_CASES}


def _specs(dialect: str) -> list[Spec]:
  specs = []
  for name, case in CASES.items():
    overrides = dict(ATTENTION_CASES[name][-1] or {})
    fma = overrides.pop("fma", False)
    target = NO_TENSOR_CORES if fma and dialect == "cuda" else TARGETS[dialect]
    # the register path unless a case asks for a ring (Metal has no cp.async: always the register path)
    stages = overrides.pop("stages", 0)
    if dialect != "cuda": stages = 0
    tensor_cores = overrides.pop("tensor_cores", False) and dialect == "cuda"
    plan = prefill_plan(case.shape, target) if case.shape.query_len > 1 else \
      tc_prefill_plan(case.shape, TC_DECODE_KEY_WARPS) if tensor_cores else decode_plan(case.shape, target, stages=stages, **overrides)
    specs.append(Spec(name, plan.algorithm, plan.defines, plan.launches))
  for name, (dtype, kv_heads, head_dim, kv_fp8) in WRITE_CASES.items():
    plan = write_plan(dtype, kv_heads * head_dim, 8, 40, kv_fp8)
    specs.append(Spec(name, "kv_write", plan.defines, plan.launches))
  return specs + _selftest_specs()


# ---- emulator self-test kernels: the emulation must catch what would break on a GPU
RACE = """
TV_KERNEL(tv_race) TV_ARG(float, out, 0) TV_KERNEL_END
{
  TV_SHARED float buf[TV_NT];
  const int tid = TV_TID;
  buf[tid] = (float)(tid + 1) + (float)TV_BID_X;
#if WITH_BARRIER
  TV_BARRIER();
#endif
  out[TV_BID_X * TV_NT + tid] = buf[(tid + 1) % TV_NT];
}
"""
SIMD = """
TV_KERNEL(tv_simd) TV_ARG(float, out, 0) TV_KERNEL_END
{
  const int tid = TV_TID;
  const float x = (float)(tid * tid % 7);
  out[3 * tid + 0] = TV_WARP_SUM(x);
  out[3 * tid + 1] = TV_WARP_MAX(x);
  out[3 * tid + 2] = TV_SHFL_XOR(x, 5);
}
"""
DIVERGENT = """
TV_KERNEL(tv_divergent) TV_ARG(float, out, 0) TV_KERNEL_END
{
  if (TV_TID < 16) return;
  TV_BARRIER();
  out[TV_TID] = 1.0f;
}
"""


def _selftest_specs() -> list[Spec]:
  nt = 64
  launch = lambda name, numel, grid=1: (Launch(name, (grid, 1, 1), nt, (Param("out", "float", True, numel),)),)
  base = {"TV_DTYPE": 0, "TV_NT": nt}
  return [Spec("race_ok", "race", {**base, "WITH_BARRIER": 1}, launch("tv_race", 3 * nt, 3), RACE),
          Spec("race_bad", "race", {**base, "WITH_BARRIER": 0}, launch("tv_race", 3 * nt, 3), RACE),
          Spec("simd", "simd", base, launch("tv_simd", 3 * nt), SIMD),
          Spec("divergent", "divergent", base, launch("tv_divergent", nt), DIVERGENT)]


@pytest.fixture(scope="module")
def emu(dialect: str) -> LazyKernels:
  """Every case's plan; the C++ libraries are built when a launch needs them (the quick cases and the emulator's
  self-tests in one, the rest in another)."""
  return emulate(dialect, _specs(dialect), QUICK | SELFTESTS)


@functools.cache
def portable(name: str) -> np.ndarray:
  """The portable path's output for a case (computed once, shared by both dialects)."""
  return portable_attention(CASES[name])


@pytest.mark.parametrize("name", quick_or_slow(ATTENTION_CASES))
def test_portable_matches_float64_reference(name):
  case = CASES[name]
  np.testing.assert_allclose(portable(name)[:case.total_tokens], reference_attention(case), atol=2e-5, err_msg=name)


@pytest.mark.parametrize("name", quick_or_slow(ATTENTION_CASES))
def test_attention_matches_portable(emu, name):
  case = CASES[name]
  n = case.total_tokens
  want = portable(name)[:n]
  tol = TOLERANCE[case.shape.dtype] * np.abs(want).max()
  # kernels that stage with cp.async run once more with each copy landing at its wait (a missing wait shows)
  spec = emu.specs[name]
  staged = spec.algorithm == "prefill_tc" or spec.defines.get("TV_KV_STAGES", 0) > 0
  runs = (("forward", 0, False), ("reverse", 0, False), ("random", 7, False)) + ((("forward", 0, True),) if staged else ())
  for order, seed, late in runs:
    got = run_attention(emu, name, case, order, seed, late)
    order += " with late copies" if late else ""
    assert not np.isnan(got).any(), f"{name} ({order}): output elements left unwritten (NaN poison survived)"
    assert np.all(got[n:] == 0), f"{name} ({order}): padding rows not zeroed"
    err = np.abs(got[:n] - want).max()
    assert err <= tol, f"{name} ({order}): max error {err:.3g} > {tol:.3g}"


def test_decode_cases_split(emu, dialect):
  """The split-K path is what most decode cases exercise (on CUDA one kernel, the last split of each sequence's KV head
  merging them, in every block order the cases run; on Metal a second kernel); the no-split one is covered too."""
  on_tensor_cores = {name for name in emu.specs if name.endswith("_tc") and dialect == "cuda"}   # (Metal: the decode kernel)
  assert on_tensor_cores == {"dec_bf16_g8_d128_tc", "dec_f16_g2_d64_tc", "dec_bf16_g7_d64_tc", "dec_bf16_g4_d64_kv8_tc"} \
    if dialect == "cuda" else not on_tensor_cores
  assert all(emu.specs[name].defines["TV_KW"] == TC_DECODE_KEY_WARPS for name in on_tensor_cores)
  # 16-bit caches' tiles go through a ring of two (cp.async); an FP8 cache's are converted in registers: one stage
  assert {name: emu.specs[name].defines["TV_TC_STAGES"] for name in on_tensor_cores} == \
    {name: 1 if "_kv8" in name else 2 for name in on_tensor_cores}
  kernels = [launch.kernel for name in on_tensor_cores for launch in emu.specs[name].launches]
  assert kernels == ["tv_paged_prefill_tc"] * len(on_tensor_cores)
  splits = {name: emu.specs[name].defines["TV_NSPLIT"] for name in emu.specs if name.startswith("dec_") and name not in on_tensor_cores}
  assert splits["dec_f32_g2_nosplit"] == 1 and sum(v > 1 for v in splits.values()) >= 4, splits
  for name, n in splits.items():
    kernels = [launch.kernel for launch in emu.specs[name].launches]
    want = ["tv_paged_decode"] if n == 1 else ["tv_paged_decode_split"] if dialect == "cuda" else \
      ["tv_paged_decode_split", "tv_paged_decode_reduce"]
    assert kernels == want, (name, kernels)


def test_decode_staged_ring(emu):
  """The cp.async ring (CUDA) wraps: each split's keys span more tiles than the ring has stages (2 to 4), split and not;
  Metal builds the same cases on the register path."""
  staged = {name: emu.specs[name].defines for name in emu.specs if "_staged" in name}
  if emu.dialect != "cuda":
    assert len(staged) == 3 and all(d["TV_KV_STAGES"] == 0 for d in staged.values())
    return
  assert {d["TV_KV_STAGES"] for d in staged.values()} == {2, 3, 4} and {d["TV_NSPLIT"] > 1 for d in staged.values()} == {True, False}
  for name, d in staged.items():
    longest = max(s for s, _ in ATTENTION_CASES[name][0])
    assert min(longest, d["TV_CHUNK"]) > d["TV_KV_STAGES"] * d["TV_TILE"], name


def test_decode_kv8_vector_widths(emu):
  """FP8 decode cases cover both KV vector widths (16 codes in 16 bytes, 8 in 8), split and not, and one lane a key."""
  d = {name: emu.specs[name].defines for name in emu.specs
       if name.startswith("dec_") and "_kv8" in name and emu.specs[name].algorithm != "prefill_tc"}
  wide = {name for name, v in d.items() if v["TV_KVEC"] == 16}
  assert wide and len(wide) < len(d) and {v["TV_NSPLIT"] > 1 for v in d.values()} == {True, False}, d
  assert any(d[name]["TV_LPK"] == 1 for name in wide)


def test_prefill_kernels(emu):
  """16-bit prefill with head_dim a multiple of 16 takes the tensor-core kernel on the CUDA target; the _fma cases (a
  target without tensor cores) and Metal the FMA one."""
  algorithms = {name: emu.specs[name].algorithm for name in emu.specs if name.startswith("pre_")}
  if emu.dialect != "cuda":
    assert set(algorithms.values()) == {"prefill"}
    return
  assert algorithms["pre_bf16_g2_d128_fma"] == algorithms["pre_f16_g4_fma"] == algorithms["pre_f32_g2"] == "prefill"
  assert algorithms["pre_bf16_g2_d128_tiles"] == algorithms["pre_f16_g1_d16"] == "prefill_tc"


@pytest.mark.parametrize("name", quick_or_slow(WRITE_CASES))
def test_kv_write(emu, name):
  dtype, kv_heads, head_dim, kv_fp8 = WRITE_CASES[name]
  kv_dtype = FP8 if kv_fp8 else dtype
  rng = np.random.default_rng(3)
  row, slots = kv_heads * head_dim, 40
  kc, vc = (round_to(rng.standard_normal((slots, row)), kv_dtype) for _ in range(2))
  # FP8: magnitudes from 1e-4 (subnormal codes) to 1e3 (saturated) in the new rows
  k, v = (round_to(rng.standard_normal((8, row)) * (np.exp(rng.uniform(-9, 7, (8, row))) if kv_fp8 else 1), dtype)
          for _ in range(2))
  slot_mapping = np.array([5, -1, 39, 0, 17, -1, 40, 22], np.int32)   # -1: padding; 40 is out of range: skipped too
  for order in ("forward", "random"):
    got_k, got_v = run_kv_write(emu, name, kc, vc, k, v, slot_mapping, dtype, order, kv_dtype)
    want_k, want_v = kc.copy(), vc.copy()
    for i, s in enumerate(slot_mapping):
      if 0 <= s < slots: want_k[s], want_v[s] = round_to(k[i], kv_dtype), round_to(v[i], kv_dtype)
    np.testing.assert_array_equal(got_k, want_k)
    np.testing.assert_array_equal(got_v, want_v)


def test_emulator_barriers_and_simd(emu):
  nt = 64
  expect = np.array([[(t + 1) % nt + 1 + b for t in range(nt)] for b in range(3)], np.float32).reshape(-1)
  results = {}
  for spec in ("race_ok", "race_bad"):
    for order in ("forward", "reverse", "random"):
      out = np.full(3 * nt, np.nan, np.float32)
      emu.launch(spec, 0, [out], order, seed=1)
      results[spec, order] = out
  for order in ("forward", "reverse", "random"): np.testing.assert_array_equal(results["race_ok", order], expect)
  # without the barrier some thread reads its neighbour's slot before it is written: caught in some order
  assert any(not np.array_equal(results["race_bad", o], expect) for o in ("forward", "reverse", "random"))
  out = np.full(3 * nt, np.nan, np.float32)
  emu.launch("simd", 0, [out], "random", seed=3)
  x = np.array([t * t % 7 for t in range(nt)], np.float32)
  got = out.reshape(nt, 3)
  for t in range(nt):
    warp = x[t // 32 * 32:(t // 32 + 1) * 32]
    assert got[t, 0] == warp.sum() and got[t, 1] == warp.max() and got[t, 2] == x[t ^ 5], t


def test_emulator_reports_divergent_barrier(emu):
  with pytest.raises(EmulatorError):
    emu.launch("divergent", 0, [np.zeros(64, np.float32)])


# ---- cooperative launches (persistent kernels, CUDA dialect): every block resident at once, grid barriers
# two grid barriers: each block publishes values, reads another block's, publishes again, reads a third block's
COOP = """
TV_KERNEL(tv_coop) TV_ARG(float, scratch, 0), TV_ARG(float, out, 1) TV_KERNEL_END
{
  const int b = TV_BID_X, t = TV_TID;
  scratch[b * TV_NT + t] = (float)(b * 100 + t);
  tv_emu_grid_sync();
  scratch[(TV_NB + b) * TV_NT + t] = 2.0f * scratch[((b + 1) % TV_NB) * TV_NT + (t + 1) % TV_NT];
  tv_emu_grid_sync();
  out[b * TV_NT + t] = scratch[(TV_NB + (b + 2) % TV_NB) * TV_NT + t] + (float)b;
}
"""
# dynamic shared memory is each block's own and lives across a grid barrier (first half of out: the fresh memory)
COOP_SHARED = """
TV_KERNEL(tv_coop_shared) TV_ARG(float, out, 0) TV_KERNEL_END
{
  TV_TPTR(float) s = (TV_TPTR(float))tv_emu_dynamic_shared();
  out[TV_BID_X * 2 * TV_NT + TV_TID] = s[TV_TID];
  s[TV_TID] = (float)(TV_BID_X * TV_NT + TV_TID);
  tv_emu_grid_sync();
  out[(TV_BID_X * 2 + 1) * TV_NT + TV_TID] = s[(TV_TID + 1) % TV_NT];
}
"""
# block 0 leaves before the grid barrier the others wait at: a GPU would hang
COOP_EARLY = """
TV_KERNEL(tv_coop_early) TV_ARG(float, out, 0) TV_KERNEL_END
{
  if (TV_BID_X == 0) return;
  tv_emu_grid_sync();
  out[TV_BID_X * TV_NT + TV_TID] = 1.0f;
}
"""
COOP_NT, COOP_NB = 64, 4


def _cooperative_specs() -> list[Spec]:
  nt, nb, base = COOP_NT, COOP_NB, {"TV_DTYPE": 0, "TV_NT": COOP_NT, "TV_NB": COOP_NB}
  def launch(name, params, cooperative=True, shared=0):
    return (Launch(name, (nb, 1, 1), nt, tuple(Param(p, "float", True, n) for p, n in params), shared, cooperative),)
  coop_params = (("scratch", 2 * nb * nt), ("out", nb * nt))
  return [Spec("coop", "coop", base, launch("tv_coop", coop_params), COOP),
          Spec("coop_plain", "coop", base, launch("tv_coop", coop_params, cooperative=False), COOP),
          Spec("coop_block_barrier", "coop", base, launch("tv_coop", coop_params),   # the bug: __syncthreads for grid.sync
               "#define tv_emu_grid_sync() TV_BARRIER()\n" + COOP),
          Spec("coop_shared", "coop_shared", base, launch("tv_coop_shared", (("out", 2 * nb * nt),), shared=4 * nt),
               COOP_SHARED),
          Spec("coop_early", "coop_early", base, launch("tv_coop_early", (("out", nb * nt),)), COOP_EARLY)]


@pytest.fixture(scope="module")
def cuda_emu() -> EmulatedKernels:
  find_compiler()
  return EmulatedKernels("cuda", _cooperative_specs())


def test_cooperative_grid_barrier(cuda_emu):
  nt, nb = COOP_NT, COOP_NB
  expect = np.array([[2 * ((b + 3) % nb * 100 + (t + 1) % nt) + b for t in range(nt)] for b in range(nb)],
                    np.float32).reshape(-1)
  for order, seed in (("forward", 0), ("reverse", 0), ("random", 5), ("random", 11)):
    scratch, out = np.full(2 * nb * nt, np.nan, np.float32), np.full(nb * nt, np.nan, np.float32)
    cuda_emu.launch("coop", 0, [scratch, out], order, seed)
    np.testing.assert_array_equal(out, expect, err_msg=order)
    # with a threadgroup barrier in place of the grid barrier, a block runs ahead and reads what is not written yet
    scratch, out = np.full(2 * nb * nt, np.nan, np.float32), np.full(nb * nt, np.nan, np.float32)
    cuda_emu.launch("coop_block_barrier", 0, [scratch, out], order, seed)
    assert not np.array_equal(out, expect), order
  # the same kernel launched block after block: its grid barrier never releases
  with pytest.raises(EmulatorError):
    cuda_emu.launch("coop_plain", 0, [np.full(2 * nb * nt, np.nan, np.float32), np.full(nb * nt, np.nan, np.float32)])


def test_cooperative_dynamic_shared_is_per_block(cuda_emu):
  nt, nb = COOP_NT, COOP_NB
  for order in ("forward", "reverse", "random"):
    out = np.full(2 * nb * nt, 7.0, np.float32)
    cuda_emu.launch("coop_shared", 0, [out], order, seed=2)
    fresh, after = out.reshape(nb, 2, nt)[:, 0], out.reshape(nb, 2, nt)[:, 1]
    assert np.isnan(fresh).all(), order   # each block's buffer starts poisoned
    np.testing.assert_array_equal(after, np.arange(nb * nt).reshape(nb, nt)[:, np.r_[1:nt, 0]], err_msg=order)


def test_cooperative_reports_early_exit_before_grid_barrier(cuda_emu, capfd):
  with pytest.raises(EmulatorError):
    cuda_emu.launch("coop_early", 0, [np.zeros(COOP_NB * COOP_NT, np.float32)])
  err = capfd.readouterr().err
  assert f"{COOP_NT} threads exited" in err and f"{(COOP_NB - 1) * COOP_NT} at the grid barrier" in err, err
