"""The tensor-core matrix-product kernel (csrc/cuda/gemm_tc.inc, CUDA only) run on the CPU through the C++ emulation,
whose mma.sync follows PTX's documented m16n8k16 fragment layout, and compared with the portable form
(tinyvllm/layers/linear.py, tinygrad ops) on the same rounded inputs: every tile shape the planner picks, row counts
and output counts that are not multiples of the tile, split-K with its reduce kernel, the RMSNorm / SwiGLU prologues,
bias, residual, float32 logits, bfloat16 and float16, stage rings in more than 48 KB of dynamic shared memory, K
slices of 32 and 64, Hopper's wgmma from swizzled stages (emulated from the PTX ISA's layouts); every output written
(outputs start as NaN)."""
from __future__ import annotations

import numpy as np
import pytest

from tests.emulator.cases import from_bits, linear_inputs, packed_weight, portable_linear_reference, to_bits
from tests.emulator.emulator import EmulatedKernels, EmulatorError, Spec, find_compiler, poisoned
from tinyvllm.kernels.gemm import GemmTiles, choose_tiles, gemm_plan, unsupported_reason
from tinyvllm.kernels.linear import LinearShape, pick_kernel
from tinyvllm.kernels.plan import Launch, Param
from tinyvllm.kernels.tuning import tuning_for
from tinyvllm.platform.target import DeviceTarget

# the emulated kernels' target, an H100 (wgmma); the planner's mma.sync choices on a GPU without wgmma with the same
# memory (an sm_80 part with an H100's shared memory and registers)
HOPPER, MMA = DeviceTarget.nominal("cuda"), DeviceTarget.nominal("cuda", arch="sm_80")
SHARED_BYTES = tuning_for(MMA.kind).gemm.shared_bytes   # the mma.sync ring's budget (99 KB)

TOLERANCE = {"float16": 3e-3, "bfloat16": 2e-2}
EPS = 1e-5
# name -> (dtype, rows, K, NOUT, bias, norm, silu_mul, residual, out_float32, tiles or None for the planner's)
CASES = {
  "bf16_m1_plain": ("bfloat16", 1, 64, 40, False, False, False, False, False, None),
  "bf16_m17_norm_split": ("bfloat16", 17, 256, 72, False, True, False, False, False, GemmTiles(32, 64, 2, 2, 2)),
  "f16_m33_silu_residual": ("float16", 33, 128, 64, False, False, True, True, False, GemmTiles(32, 64, 2, 2, 1)),
  "bf16_m70_bias_residual_split2": ("bfloat16", 70, 256, 136, True, False, False, True, False, GemmTiles(64, 128, 2, 2, 2)),
  "bf16_m130_norm_logits": ("bfloat16", 130, 96, 136, False, True, False, False, True, GemmTiles(128, 128, 2, 4, 1)),
  "f16_m9_bias_logits_split4": ("float16", 9, 512, 24, True, False, False, False, True, GemmTiles(16, 64, 1, 4, 4)),
  # more than XPRIME_COLUMN_BLOCKS column blocks: the prologue runs once as tv_gemm_xprime
  "bf16_m130_norm_xprime": ("bfloat16", 130, 64, 520, False, True, False, False, False, GemmTiles(32, 64, 2, 2, 1)),
  "f16_m140_silu_residual_xprime_split2": ("float16", 140, 128, 330, False, False, True, True, False, GemmTiles(16, 64, 1, 4, 2)),
  # more than 48 KB of dynamic shared memory, K long enough for the ring to wrap: 4 stages of the 128x128 tile (82 KB),
  # 3 of it with SwiGLU's two halves in the loop (93 KB), 5 with the RMSNorm in the loop and split K (103 KB)
  "bf16_m130_big_4stages_residual": ("bfloat16", 130, 320, 136, False, False, False, True, False, GemmTiles(128, 128, 2, 4, 1)),
  "f16_m129_big_silu_3stages": ("float16", 129, 256, 72, False, False, True, False, False, GemmTiles(128, 128, 2, 4, 1)),
  "bf16_m40_big_norm_5stages_split2": ("bfloat16", 40, 512, 130, True, True, False, False, False, GemmTiles(128, 128, 2, 4, 2, ring=5)),
  # 64-wide K slices (8 chunks a staged row, 144-byte rows), K long enough for each ring to wrap
  "bf16_m70_plain_bk64": ("bfloat16", 70, 320, 136, False, False, False, False, False, GemmTiles(64, 128, 2, 2, 1, bk=64)),
  "bf16_m33_norm_bk64": ("bfloat16", 33, 384, 72, False, True, False, False, False, GemmTiles(32, 64, 2, 2, 1, bk=64)),
  "f16_m40_silu_residual_bk64": ("float16", 40, 256, 72, False, False, True, True, False, GemmTiles(64, 64, 2, 2, 1, bk=64)),
  "bf16_m20_bias_residual_split2_bk64": ("bfloat16", 20, 768, 72, True, False, False, True, False,
                                         GemmTiles(16, 64, 1, 4, 2, bk=64)),
  "bf16_m130_norm_xprime_bk64": ("bfloat16", 130, 320, 330, False, True, False, False, False, GemmTiles(64, 64, 2, 2, 1, bk=64)),
  "f16_m129_big_norm_2stages_bk64": ("float16", 129, 192, 136, False, True, False, False, False,
                                     GemmTiles(128, 128, 2, 4, 1, bk=64)),
  "bf16_m130_big_residual_3stages_bk64": ("bfloat16", 130, 384, 136, False, False, False, True, False,
                                          GemmTiles(128, 128, 2, 4, 1, ring=3, bk=64)),
  # Hopper's wgmma from 128-byte-swizzled stages (the emulator reads them through the swizzle), rows and outputs
  # that are not multiples of the tile, the ring wrapping, split K, the prologue in the loop and as its own pass
  "bf16_m70_wgmma_64x64_residual": ("bfloat16", 70, 384, 72, False, False, False, True, False, GemmTiles.warpgroup(64, 64, ring=3)),
  "f16_m130_wgmma_128x128_norm": ("float16", 130, 320, 136, False, True, False, False, False, GemmTiles.warpgroup(128, 128)),
  # long_k_tiles' tall row block (four warpgroups), rows past the last ones, split K with the residual in the reduce
  "bf16_m200_wgmma_256x64_residual_split2": ("bfloat16", 200, 512, 136, False, False, False, True, False,
                                             GemmTiles.warpgroup(256, 64, 2)),
  "bf16_m65_wgmma_64x256_silu_split2": ("bfloat16", 65, 512, 260, True, False, True, True, False,
                                        GemmTiles.warpgroup(64, 256, 2, ring=2)),
  "bf16_m130_wgmma_64x64_norm_xprime_logits": ("bfloat16", 130, 128, 330, False, True, False, False, True,
                                               GemmTiles.warpgroup(64, 64)),
  # four warpgroups over 256 rows (the planner's gate_up tile at 192-256-row decode batches), the row block partial
  "bf16_m200_wgmma_256x64_norm": ("bfloat16", 200, 256, 72, False, True, False, False, False, GemmTiles.warpgroup(256, 64)),
  # a router's float32 logits from a 128x64 tile with K split four ways (Qwen3-30B-A3B's at a 256-sequence step)
  "bf16_m130_wgmma_128x64_logits_split4": ("bfloat16", 130, 1024, 72, False, False, False, False, True,
                                           GemmTiles.warpgroup(128, 64, 4)),
  # the pipelined wgmma loop (four stages: one slice's product in flight across the next slice's barrier) with the ring
  # wrapping, over two row blocks in the tuning table's column-walking order (the emulator fails a launch whose stage
  # refills while a product still reads it)
  "bf16_m300_wgmma_256x128_pipelined": ("bfloat16", 300, 640, 264, False, False, False, True, False,
                                        GemmTiles.warpgroup(256, 128, ring=4)),
  # ten row blocks walking the columns in runs of four (the last run of two)
  "f16_m150_raster4": ("float16", 150, 64, 136, True, False, False, False, False, GemmTiles(16, 64, 1, 4, 1, raster=4)),
}
# emulator self-tests of dynamic shared memory: each thread writes its slot (TV_SHIFT slots further on: past the end
# for a shift of 1), then reads its neighbour's
DYNAMIC = """
TV_KERNEL(tv_dynamic) TV_ARG(float, out, 0) TV_KERNEL_END
{
  TV_TPTR(float) s = (TV_TPTR(float))tv_emu_dynamic_shared();
  out[TV_BID_X * 2 * TV_NT + TV_TID] = s[TV_TID];
  TV_BARRIER();
  s[TV_TID + TV_SHIFT] = (float)(TV_BID_X * TV_NT + TV_TID);
  TV_BARRIER();
  out[(TV_BID_X * 2 + 1) * TV_NT + TV_TID] = s[(TV_TID + 1) % TV_NT + TV_SHIFT];
}
"""
DYNAMIC_NT = 64


def _shape(name: str) -> LinearShape:
  dtype, m, k, o, bias, norm, silu, res, f32, _ = CASES[name]
  return LinearShape(dtype, m, k, o, bias, EPS if norm else None, silu, res, f32)


@pytest.fixture(scope="module")
def emu() -> EmulatedKernels:
  find_compiler()
  specs = []
  for name in CASES:
    defines, launches = gemm_plan(_shape(name), HOPPER, CASES[name][-1])
    specs.append(Spec(name, "gemm_tc", defines, launches))
  launch = (Launch("tv_dynamic", (2, 1, 1), DYNAMIC_NT, (Param("out", "float", True, 4 * DYNAMIC_NT),), 4 * DYNAMIC_NT),)
  for name, shift in (("dynamic_ok", 0), ("dynamic_overrun", 1)):
    specs.append(Spec(name, "dynamic", {"TV_DTYPE": 0, "TV_NT": DYNAMIC_NT, "TV_SHIFT": shift}, launch, DYNAMIC))
  return EmulatedKernels("cuda", specs)


def _inputs(name: str) -> dict[str, np.ndarray]: return linear_inputs(np.random.default_rng(len(name)), _shape(name))


def _run(emu: EmulatedKernels, name: str, a: dict[str, np.ndarray], order: str = "forward", late_copies: bool = False
         ) -> np.ndarray:
  """The plan's launches in order, buffers found by parameter name (as kernels/linear.py does); scratch ones poisoned;
  with `late_copies` each cp.async copy lands at its wait."""
  shape = _shape(name)
  bits = {key: to_bits(v, shape.dtype).reshape(-1) for key, v in a.items()}
  buffers = {**bits, "g": bits.get("norm"), "y": np.full(shape.rows * shape.out_features, np.nan, np.float32)
             if shape.out_float32 else poisoned(shape.rows * shape.out_features, shape.dtype)}
  for i, launch in enumerate(emu.specs[name].launches):
    for p in launch.params:
      if buffers.get(p.name) is None:
        buffers[p.name] = np.full(p.numel, np.nan, np.float32) if p.kind == "float" else poisoned(p.numel, shape.dtype)
    emu.launch(name, i, [buffers[p.name] for p in launch.params], order, late_copies=late_copies)
  out = buffers["y"]
  return (out if shape.out_float32 else from_bits(out, shape.dtype)).reshape(shape.rows, shape.out_features)


@pytest.mark.parametrize("name", list(CASES))
def test_gemm_matches_portable(emu, name):
  """In a random thread order with each copy landing at its issue (a stage refilled under its readers shows), then in
  order with each landing at the wait that covers it (a slice read before its wait shows)."""
  shape, a = _shape(name), _inputs(name)
  assert unsupported_reason(shape.dtype, shape.rows, shape.in_features, shape.out_features, HOPPER) is None
  ref = portable_linear_reference(a, shape)
  for order, late in (("random", False), ("forward", True)):
    got = _run(emu, name, a, order, late)
    assert not np.isnan(got).any(), f"an output element was never written ({order}, late copies {late})"
    assert np.abs(got - ref).max() / np.abs(ref).max() < TOLERANCE[shape.dtype], f"{order}, late copies {late}"


def test_planner_fills_the_gpu_and_splits_only_whole_slices():
  mma = lambda rows, k, o, silu_mul=False: choose_tiles(rows, k, o, MMA, silu_mul)
  assert SHARED_BYTES == 99 * 1024
  assert mma(1, 1024, 4096) == GemmTiles(16, 64, 1, 4, 4)     # 64 column blocks -> split K four ways
  assert mma(256, 1024, 151936) == GemmTiles(128, 128, 2, 4, 1, 3, 64)  # plenty of blocks for the big tile
  assert mma(2048, 3072, 1024, silu_mul=True) == GemmTiles(128, 128, 2, 4, 1, 3, 64)   # long K, x' pass
  assert mma(1024, 3072, 1024, silu_mul=True) == GemmTiles(64, 64, 2, 2, 1)   # 256 blocks, 4 stages of both halves
  assert mma(256, 1024, 4096) == GemmTiles(64, 64, 2, 2, 1, 0, 64)   # the largest tile that makes 256 blocks
  assert mma(64, 1024, 4096).bk == 32 and mma(256, 96, 4096).bk == 32   # 64-wide slices: measured rows, K
  assert mma(32, 3072, 1024) == GemmTiles(32, 64, 2, 2, 8)
  assert mma(256, 2048, 1024) == GemmTiles(64, 64, 2, 2, 4)    # long K at decode rows: split rather than thin tiles
  assert mma(128, 3072, 1024, silu_mul=True) == GemmTiles(64, 64, 2, 2, 4)
  # on Hopper (wgmma), from 128 rows: the measured tiles; below, and for long K below 256 rows, mma.sync's
  hopper = lambda rows, k, o, silu=False: choose_tiles(rows, k, o, HOPPER, silu)
  assert hopper(2048, 3072, 1024, True) == hopper(256, 1024, 151936) == GemmTiles.warpgroup(128, 128, ring=3)
  # from 4,096 rows four warpgroups over 256 rows, as many stages as fit (pipelined); not for the logits' wide outputs
  assert hopper(8192, 3072, 1024, True) == hopper(4096, 2048, 5120) == GemmTiles.warpgroup(256, 128)
  assert hopper(4096, 1024, 151936) == GemmTiles.warpgroup(128, 128, ring=3)
  assert choose_tiles(8192, 2048, 5120, HOPPER, packed=True) == GemmTiles.warpgroup(128, 128, ring=3)
  # blocks walk the columns in runs of the tuning table's row blocks where there is more than one row block
  assert gemm_plan(_shape("bf16_m300_wgmma_256x128_pipelined"), HOPPER, GemmTiles.warpgroup(256, 128))[0]["TV_RASTER"] == 8
  assert "TV_RASTER" not in gemm_plan(_shape("bf16_m200_wgmma_256x64_norm"), HOPPER, GemmTiles.warpgroup(256, 64))[0]
  assert hopper(256, 1024, 6144) == GemmTiles.warpgroup(256, 64) and hopper(256, 2048, 1024) == GemmTiles.warpgroup(128, 64, 4)
  assert hopper(128, 2048, 1024) == mma(128, 2048, 1024) and hopper(63, 1024, 4096) == mma(63, 1024, 4096)
  assert hopper(256, 1000, 4096) == mma(256, 1000, 4096)   # K not in whole 64-wide slices
  for rows, k, o in ((1, 96, 8), (300, 1024, 1024), (48, 4864, 896)):
    t = mma(rows, k, o)
    assert k % (32 * t.splits) == 0 and (t.splits == 1 or k // (32 * t.splits) >= 4)


def test_long_k_products_at_decode_batches_take_one_tall_row_block():
  """Long-K products at least long_k_tall_min_out wide from 64 to 256 rows on Hopper (Qwen3-30B-A3B's qkv and o): one
  wgmma row block as tall as the rows, K split while the grid gives fewer than half the SMs a block and the float32
  partials stay within the weights' bytes; narrower ones (Qwen3-0.6B's o and down), packed weights and other row counts
  keep their choice. A small weight with a long K (the router, 2,048 -> 128) splits K as a large one does: its few
  blocks would otherwise wait on each slice in turn."""
  hopper = lambda rows, k, o, packed=False: choose_tiles(rows, k, o, HOPPER, packed=packed)
  assert hopper(256, 2048, 5120) == GemmTiles.warpgroup(256, 64) and hopper(100, 2048, 5120) == GemmTiles.warpgroup(128, 64)
  assert [hopper(rows, 4096, 2048) for rows in (64, 128, 256)] == [GemmTiles.warpgroup(bm, 64, 4) for bm in (64, 128, 256)]
  assert hopper(256, 4096, 4096) == GemmTiles.warpgroup(256, 64, 2)   # 64 blocks; split in four the partials would pass the weights
  assert hopper(256, 2048, 1024) == GemmTiles.warpgroup(128, 64, 4) and hopper(32, 2048, 5120) == choose_tiles(32, 2048, 5120, MMA)
  assert hopper(300, 2048, 5120) == GemmTiles.warpgroup(128, 64, 2) and hopper(256, 2048, 5120, packed=True).bm == 128
  router = {(rows, target.kind): choose_tiles(rows, 2048, 128, target) for rows in (16, 64, 256) for target in (HOPPER, MMA)}
  assert router[256, HOPPER.kind] == GemmTiles.warpgroup(128, 64, 4)
  assert router[16, MMA.kind].splits == router[64, MMA.kind].splits == 8
  assert all(2048 // (t.bk * t.splits) >= tuning_for(HOPPER.kind).gemm.min_ktiles_per_split for t in router.values())


def test_stage_rings_in_dynamic_shared_memory():
  big = GemmTiles(128, 128, 2, 4, 1)
  assert (big.stages(MMA), big.stages(MMA, silu_mul=True), GemmTiles(64, 128, 2, 2, 1).stages(MMA, silu_mul=True)) == (4, 3, 4)
  assert big.shared_bytes(MMA) > 48 * 1024 and big.min_blocks(MMA) == 2   # two 256-thread blocks an SM, <= 128 registers
  for name in CASES:
    defines, launches = gemm_plan(_shape(name), HOPPER, CASES[name][-1])
    gemm = next(launch for launch in launches if launch.kernel == "tv_gemm")
    assert gemm.shared_bytes == defines["TV_SMEM_BYTES"] and all(x.shared_bytes == 0 for x in launches if x is not gemm)
  for rows in (1, 17, 100, 300, 2048, 4096):
    for o, k, silu in ((4096, 1024, False), (1024, 3072, True), (151936, 1024, False)):
      shape = LinearShape("bfloat16", rows, k, o, False, None if silu else 1e-6, silu, silu, False)
      defines, launches = gemm_plan(shape, MMA)
      deep_big = defines["TV_BK"] == 64 and defines["TV_BM"] == 128   # 3 stages of 36 KB, 2 blocks an SM
      assert 3 <= defines["TV_STAGES"] <= 4 and max(x.shared_bytes for x in launches) <= (111104 if deep_big else SHARED_BYTES)
  with pytest.raises(ValueError, match="bytes of shared memory"):   # 9 stages of both SwiGLU halves: 271 KB
    gemm_plan(LinearShape("bfloat16", 64, 1024, 64, False, None, True, False, False), MMA, GemmTiles(128, 128, 2, 4, 1, 9))


def test_64_wide_k_slices():
  big, big3 = GemmTiles(128, 128, 2, 4, 1, bk=64), GemmTiles(128, 128, 2, 4, 1, ring=3, bk=64)
  assert (big.stage_bytes(), big.stages(MMA), big.min_blocks(MMA)) == (36864, 2, 2)   # 144-byte rows: 2 stages in 99 KB
  assert (big3.stages(MMA), big3.shared_bytes(MMA), big3.min_blocks(MMA)) == (3, 111104, 2)   # 2 x (108.5 + 1) KB in 228 KB
  assert GemmTiles(64, 64, 2, 2, 1, bk=64).stages(MMA) == 4 and GemmTiles(64, 128, 2, 2, 1, bk=64).min_blocks(MMA) == 2
  plain = LinearShape("bfloat16", 256, 1024, 4096, False, None, False, False, False)
  assert gemm_plan(plain, MMA, big3)[0]["TV_BK"] == 64 and gemm_plan(plain, MMA, GemmTiles(64, 64, 2, 2, 1))[0]["TV_BK"] == 32
  shape = LinearShape("bfloat16", 64, 96, 64, False, None, False, False, False)
  with pytest.raises(ValueError, match="64-wide slices"): gemm_plan(shape, MMA, GemmTiles(64, 64, 2, 2, 1, bk=64))
  with pytest.raises(ValueError, match="2 runs of 64-wide"):
    gemm_plan(LinearShape("bfloat16", 64, 192, 64, False, None, False, False, False), MMA, GemmTiles(64, 64, 2, 2, 2, bk=64))
  with pytest.raises(ValueError, match="32 or 64"): gemm_plan(shape, MMA, GemmTiles(64, 64, 2, 2, 1, bk=48))
  with pytest.raises(ValueError, match="at least 2"):   # SwiGLU's two halves in the loop: one 55 KB stage
    gemm_plan(LinearShape("bfloat16", 64, 1024, 64, False, None, True, False, False), MMA, big)
  assert "multiple of 64" in unsupported_reason("bfloat16", 4, 96, 8, MMA, bk=64)
  assert unsupported_reason("bfloat16", 4, 96, 8, MMA) is None


def test_emulated_dynamic_shared_memory(emu):
  out = np.full(4 * DYNAMIC_NT, 7.0, np.float32)
  emu.launch("dynamic_ok", 0, [out], order="random")
  fresh, shifted = out.reshape(2, 2, DYNAMIC_NT)[:, 0], out.reshape(2, 2, DYNAMIC_NT)[:, 1]
  assert np.isnan(fresh).all()   # every block starts from poisoned memory, not the previous block's
  assert (shifted == np.arange(2 * DYNAMIC_NT).reshape(2, DYNAMIC_NT)[:, np.r_[1:DYNAMIC_NT, 0]]).all()
  with pytest.raises(EmulatorError):
    emu.launch("dynamic_overrun", 0, [out])


def test_prologue_runs_once_for_wide_products():
  kernels = lambda name: [launch.kernel for launch in gemm_plan(_shape(name), HOPPER, CASES[name][-1])[1]]
  assert kernels("bf16_m130_norm_xprime") == ["tv_gemm_xprime", "tv_gemm"]
  assert kernels("f16_m140_silu_residual_xprime_split2") == ["tv_gemm_xprime", "tv_gemm", "tv_gemm_reduce"]
  assert kernels("bf16_m130_norm_xprime_bk64") == ["tv_gemm_xprime", "tv_gemm"]
  assert kernels("bf16_m130_norm_logits")[0] == "tv_gemm"   # two column blocks: the prologue stays in the loop
  assert kernels("f16_m33_silu_residual")[0] == "tv_gemm"   # one column block: likewise


def test_shapes_the_kernel_refuses():
  assert "float16 and bfloat16" in unsupported_reason("float32", 4, 64, 8, HOPPER)
  assert "multiple of 32" in unsupported_reason("bfloat16", 4, 72, 8, HOPPER)
  # tensor cores (mma.sync, cp.async): CUDA sm_80 and newer only
  for target in (DeviceTarget.nominal("cuda", arch="sm_75"), DeviceTarget.nominal("metal")):
    assert "sm_80 or newer" in unsupported_reason("bfloat16", 4, 64, 8, target)


def test_kernel_choice_by_rows_dialect_and_dtype():
  def shape(dtype: str, rows: int) -> LinearShape: return LinearShape(dtype, rows, 1024, 4096, False, None, False, False, False)
  metal, turing = DeviceTarget.nominal("metal"), DeviceTarget.nominal("cuda", arch="sm_75")
  assert tuning_for(HOPPER.kind).linear.skinny_max_rows == 4
  assert pick_kernel(HOPPER, shape("bfloat16", 4)) == "skinny"
  assert pick_kernel(HOPPER, shape("bfloat16", 5)) == "gemm"
  assert pick_kernel(HOPPER, shape("bfloat16", 3000)) == "gemm"
  assert pick_kernel(metal, shape("bfloat16", 5)) == "skinny"      # no tensor-core kernel in the Metal dialect
  assert pick_kernel(turing, shape("bfloat16", 5)) == "skinny"     # nor on CUDA GPUs without mma.sync
  assert pick_kernel(HOPPER, shape("float32", 16)) == "skinny"     # nor for float32
  assert pick_kernel(HOPPER, shape("float32", 17)) is None
  assert pick_kernel(metal, shape("float16", 17)) is None
  # the logits (151,936 wide) stream their weight once up to 16 rows on Hopper: a verification's five, a decode of 5-16 sequences
  logits = lambda rows: LinearShape("bfloat16", rows, 1024, 151936, False, EPS, False, False, True)
  assert pick_kernel(HOPPER, logits(16)) == "skinny_tc" and pick_kernel(HOPPER, logits(17)) == "gemm"   # (its sums on tensor cores)


def test_wgmma_tiles_and_target():
  wide = GemmTiles.warpgroup(128, 128, ring=3)
  assert (wide.wm, wide.wn, wide.threads, wide.stage_bytes()) == (8, 1, 256, 32768)   # unpadded 128-byte rows
  assert (wide.shared_bytes(HOPPER), wide.min_blocks(HOPPER)) == (3 * 32768 + 512 + 1024, 2)   # + the alignment slack
  # 227 KB limit
  assert GemmTiles.warpgroup(128, 256).stages(HOPPER) == 4 and GemmTiles.warpgroup(128, 256).min_blocks(HOPPER) == 1
  assert gemm_plan(_shape("f16_m130_wgmma_128x128_norm"), HOPPER, CASES["f16_m130_wgmma_128x128_norm"][-1])[0]["TV_WGMMA"] == 128
  shape = _shape("bf16_m70_wgmma_64x64_residual")
  for bad in (GemmTiles(128, 128, 8, 1, 1, bk=32, wgmma=True), GemmTiles(96, 64, 6, 1, 1, bk=64, wgmma=True),
              GemmTiles(64, 96, 4, 1, 1, bk=64, wgmma=True), GemmTiles(64, 64, 2, 2, 1, bk=64, wgmma=True)):
    with pytest.raises(ValueError, match="wgmma takes"): gemm_plan(shape, HOPPER, bad)
  cuda_target = lambda arch: DeviceTarget.nominal("cuda", arch=arch).cuda_target
  assert (cuda_target("sm_90"), cuda_target("sm_89"), cuda_target("sm_100")) == ("sm_90a", "sm_89", "sm_100")
  assert HOPPER.wgmma and not any(DeviceTarget.nominal("cuda", arch=a).wgmma for a in ("sm_80", "sm_89", "sm_100"))


# packed (quantized) weights: name -> (dtype, rows, K, NOUT, weight codes, group, norm, silu_mul, residual, tiles or None)
PACKED = {
  "int8_bf16_m33_norm_channel": ("bfloat16", 33, 256, 72, "int8", 256, True, False, False, None),
  "int4_f16_m70_g32_silu_residual_bk64": ("float16", 70, 128, 64, "int4", 32, False, True, True, GemmTiles(64, 64, 2, 2, 1, bk=64)),
  # 32-wide slices of int4: one 16-byte chunk of codes a row; K split with its reduce
  "int4_bf16_m40_g128_residual_split2_bk32": ("bfloat16", 40, 512, 130, "int4", 128, False, False, True, GemmTiles(32, 64, 2, 2, 2)),
  "fp8_bf16_m130_g64_wgmma_128x128": ("bfloat16", 130, 320, 136, "fp8", 64, False, False, False, GemmTiles.warpgroup(128, 128)),
  "fp8_bf16_m48_g16_silu": ("bfloat16", 48, 256, 40, "fp8", 16, False, True, False, None),   # NVFP4's form: blocks of 16
  "int8_bf16_m65_g128_wgmma_norm_xprime": ("bfloat16", 65, 384, 330, "int8", 128, True, False, False, GemmTiles.warpgroup(64, 64)),
  # four warpgroups over 256 rows (a 256-row decode batch's column block dequantized once), the last row block partial
  "int4_bf16_m260_g64_wgmma_256x64_norm": ("bfloat16", 260, 256, 72, "int4", 64, True, False, False, GemmTiles.warpgroup(256, 64)),
  # tall tiles with fewer 16-byte chunks of codes a slice than threads: 8-byte pieces (int8 over 512 threads, int4
  # over 256), 4-byte ones (int4 groups of 32 over 512 threads: the narrowest scale group a piece sits in)
  "int8_bf16_m200_g64_wgmma_256x64": ("bfloat16", 200, 192, 72, "int8", 64, False, False, True, GemmTiles.warpgroup(256, 64)),
  "int4_bf16_m130_g128_wgmma_128x64_norm": ("bfloat16", 130, 256, 136, "int4", 128, True, False, False,
                                             GemmTiles.warpgroup(128, 64)),
  "int4_f16_m250_g32_wgmma_256x64_split2": ("float16", 250, 256, 72, "int4", 32, False, False, True,
                                            GemmTiles.warpgroup(256, 64, 2)),
  # a longer K through a ring of five stages (four slices of copies ahead, the two w tiles in turn over ten slices)
  "int8_bf16_m100_g128_wgmma_64x64_ring5": ("bfloat16", 100, 640, 136, "int8", 128, False, False, True,
                                            GemmTiles.warpgroup(64, 64, ring=5)),
  # the planner's packed tiles at decode batches (short_k_tiles: 64x64, K split in two where the weight is large
  # enough, then 64x64 or 128x64)
  "int4_bf16_m48_g64_norm_planned": ("bfloat16", 48, 256, 72, "int4", 64, True, False, False, None),
  "int4_bf16_m48_g64_norm_wgmma_split2": ("bfloat16", 48, 256, 72, "int4", 64, True, False, False, GemmTiles.warpgroup(64, 64, 2)),
  "int8_bf16_m100_channel_planned": ("bfloat16", 100, 256, 136, "int8", 256, False, False, True, None),
  # groups of 16 (GGUF Q6_K, and Q4_K_M's mixed q/k/v): one scale a 16-byte chunk of int8 codes
  "int8_bf16_m40_g16_planned": ("bfloat16", 40, 256, 72, "int8", 16, False, False, True, None),
  "int8_f16_m20_g16_bk32": ("float16", 20, 192, 40, "int8", 16, True, False, False, GemmTiles(32, 64, 2, 2, 1)),
  # a packed LM head (GGUF's output.weight) at a decode batch: the final norm, float32 logits
  "int8_bf16_m24_g16_logits": ("bfloat16", 24, 256, 136, "int8", 16, True, False, False, None, True),
}


def _packed_shape(name: str) -> LinearShape:
  dtype, m, k, o, weight, group, norm, silu, res, _, *logits = PACKED[name]
  return LinearShape(dtype, m, k, o, False, EPS if norm else None, silu, res, bool(logits), weight, group)


@pytest.fixture(scope="module")
def emu_packed() -> EmulatedKernels:
  find_compiler()
  return EmulatedKernels("cuda", [Spec(name, "gemm_tc", *gemm_plan(_packed_shape(name), HOPPER, PACKED[name][9])) for name in PACKED])


@pytest.mark.parametrize("name", list(PACKED))
def test_packed_weight_gemm_matches_portable(emu_packed, name):
  """The codes staged in the ring and dequantized into the w tile, against the portable path on the same packed weight
  (integer codes with random zero points and offsets, or FP8): a wrong scale, shift, group or chunk shows."""
  from tinygrad import Tensor

  from tinyvllm.layers.linear import portable_linear
  shape, rng = _packed_shape(name), np.random.default_rng(len(name))
  qw = packed_weight(rng, shape.weight, shape.out_features, shape.in_features, shape.group)
  a = {key: v for key, v in linear_inputs(rng, shape).items() if key != "w"}
  bits = {key: to_bits(v, shape.dtype).reshape(-1) for key, v in a.items()}
  shifts = qw.shifts if qw.shifts is not None else qw.scales   # FP8: a placeholder the kernel never reads
  out_dtype = "float32" if shape.out_float32 else shape.dtype
  t = {key: Tensor(v) for key, v in a.items()}
  ref = portable_linear(t["x"], qw, norm=t.get("norm"), eps=EPS, silu_mul=shape.silu_mul, residual=t.get("residual"),
                        out_float32=shape.out_float32).numpy()
  for order, late in (("random", False), ("forward", True)):   # copies landing at their issue, then at their wait
    buffers = {**bits, "g": bits.get("norm"), "y": poisoned(shape.rows * shape.out_features, out_dtype),
               "w": qw.codes.numpy().reshape(-1), "wscale": qw.scales.numpy().reshape(-1), "wshift": shifts.numpy().reshape(-1)}
    for i, launch in enumerate(emu_packed.specs[name].launches):
      for p in launch.params:
        if buffers.get(p.name) is None:
          buffers[p.name] = np.full(p.numel, np.nan, np.float32) if p.kind == "float" else poisoned(p.numel, shape.dtype)
      emu_packed.launch(name, i, [buffers[p.name] for p in launch.params], order, late_copies=late)
    got = from_bits(buffers["y"], out_dtype).reshape(shape.rows, shape.out_features)
    assert not np.isnan(got).any(), f"an output element was never written ({order}, late copies {late})"
    assert np.abs(got - ref).max() / np.abs(ref).max() < TOLERANCE[shape.dtype], f"{order}, late copies {late}"


def test_packed_weights_take_the_gemm_above_the_skinny_rows():
  """A packed product of more rows than the skinny kernel's goes to the tensor-core kernel, whose ring stages codes (and
  two w tiles); a group that splits a 16-byte chunk of codes is refused."""
  packed = lambda rows, weight="int4", group=128: LinearShape("bfloat16", rows, 1024, 4096, False, None, False, False, False,
                                                              weight, group)
  assert pick_kernel(HOPPER, packed(4)) == "skinny" and pick_kernel(HOPPER, packed(5)) == "gemm"
  assert pick_kernel(HOPPER, packed(3000, "fp8", 1024)) == "gemm"
  assert pick_kernel(DeviceTarget.nominal("metal"), packed(17)) is None   # no tensor-core kernel there; the portable path runs
  for rows in (5, 64, 256, 8192):   # as many stages as the plain ring, in no more shared memory than its blocks an SM allow
    tiles = choose_tiles(rows, 1024, 4096, HOPPER, packed=True)
    plain, quantized = gemm_plan(packed(rows, "elem", 0), HOPPER, tiles)[0], gemm_plan(packed(rows, "int8", 1024), HOPPER)[0]
    assert quantized["TV_WQ"] == 1 and quantized["TV_STAGES"] == plain["TV_STAGES"]
    assert quantized["TV_SMEM_BYTES"] <= HOPPER.sm_shared_bytes // quantized["TV_MIN_BLOCKS"] - 1024
  with pytest.raises(ValueError, match="group 12"): gemm_plan(packed(64, "int8", 12), HOPPER)


def test_short_k_products_take_the_tallest_tile_that_fills_the_gpu():
  """qkv and gate_up at decode batches on Hopper (H200, µs): up to 64 rows a 64x64 wgmma tile with K split in two
  (plain bf16 gate_up at 64 rows 20.0 -> 15.2 against mma.sync's tile; packed weights from 17 rows), above that the
  tallest tile that still gives most SMs a block without padding its row blocks by more than a quarter (int4 qkv at 128
  rows 18.0 -> 15.1 in 64x64 tiles; gate_up at 256 rows 28.9 -> 27.1 in 256x64). Long K, prompt chunks and GPUs
  without wgmma keep their choice."""
  tiles = lambda rows, o=4096, packed=False: choose_tiles(rows, 1024, o, HOPPER, packed=packed)
  for packed in (False, True):
    assert tiles(64, packed=packed) == GemmTiles.warpgroup(64, 64, 2)
    assert tiles(128, packed=packed) == GemmTiles.warpgroup(64, 64)            # 128x64: 32 blocks on 132 SMs
    assert tiles(128, 6144, packed) == tiles(256, packed=packed) == GemmTiles.warpgroup(128, 64)
    assert tiles(192, 6144, packed) == tiles(256, 6144, packed) == GemmTiles.warpgroup(256, 64)
    assert tiles(300, 6144, packed) == GemmTiles.warpgroup(128, 64)            # 256x64 would pad 212 of 512 rows
    assert tiles(1024, packed=packed) == GemmTiles.warpgroup(128, 128, ring=3)
  assert tiles(16, packed=True) == tiles(16) == GemmTiles(16, 64, 1, 4, 4)    # one row block
  assert tiles(17, packed=True) == GemmTiles.warpgroup(64, 64, 2) and not tiles(17).wgmma
  packed = lambda rows, k=1024, o=4096, target=HOPPER: choose_tiles(rows, k, o, target, packed=True)
  assert packed(256, 2048, 1024) == choose_tiles(256, 2048, 1024, HOPPER) and packed(256, 1000) == choose_tiles(256, 1000, 4096, HOPPER)
  assert packed(64, target=MMA) == choose_tiles(64, 1024, 4096, MMA)
  assert packed(64, 960) == GemmTiles.warpgroup(64, 64)                        # K not in two whole 64-wide halves
