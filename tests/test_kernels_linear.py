"""The decode-batch matrix-product kernel (csrc/neutral/linear.inc), CUDA and Metal dialect, run on the CPU through the C++
emulation and compared with the portable form (tinyvllm/layers/linear.py, tinygrad ops) on the same rounded inputs:
plain, with bias, with the RMSNorm / SwiGLU prologue, with the residual epilogue, float32 logits; K with and without a
tail past the last full vector round, output counts not a multiple of the columns per block, every output written; each
in the planner's layout and in others (a column or eight a block; K's steps shared by three or two warps, so that some
warps take fewer steps or only the tail)."""
from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from tests.emulator.cases import from_bits, linear_inputs, packed_weight, portable_linear_reference, to_bits
from tests.emulator.emulator import LazyKernels, Spec, emulate, poisoned
from tinyvllm.kernels.linear import (
  LinearShape,
  SkinnyLayout,
  linear_plan,
  pick_kernel,
  skinny_layout,
  tensor_core_layout,
  tensor_core_reason,
  unsupported_reason,
)
from tinyvllm.kernels.tuning import tuning_for
from tinyvllm.platform.target import DeviceTarget

TOLERANCE = {"float32": 2e-5, "float16": 3e-3, "bfloat16": 2e-2}
EPS = 1e-5
# name -> (dtype, rows, K, NOUT, bias, norm, silu_mul, residual, out_float32)
CASES = {
  "f32_tail_bias": ("float32", 1, 72, 10, True, False, False, False, False),
  "f32_norm": ("float32", 3, 256, 33, False, True, False, False, False),
  "bf16_silu_residual": ("bfloat16", 5, 160, 17, False, False, True, True, False),
  "f32_norm_residual_logits": ("float32", 8, 128, 9, False, True, False, True, True),
  "f16_bias_residual": ("float16", 2, 64, 16, True, False, False, True, False),
  "bf16_norm_logits": ("bfloat16", 4, 264, 40, False, True, False, False, True),
  "bf16_16rows_norm": ("bfloat16", 16, 128, 23, True, True, False, False, False),
}


def _shape(name: str) -> LinearShape:
  dtype, m, k, o, bias, norm, silu, res, f32 = CASES[name]
  return LinearShape(dtype, m, k, o, bias, EPS if norm else None, silu, res, f32)


LAYOUTS = {"planned": None, "r1k3": SkinnyLayout(1, 3), "r8k2": SkinnyLayout(8, 2), "r4k1": SkinnyLayout(4, 1)}


def _specs(cases: dict, shape_of) -> list[Spec]:
  return [Spec(f"{name}__{layout}", "linear", (p := linear_plan(shape_of(name), LAYOUTS[layout])).defines, (p.launch,))
          for name in cases for layout in LAYOUTS]


@pytest.fixture(scope="module")
def emu(dialect: str) -> LazyKernels:
  return emulate(dialect, _specs(CASES, _shape))


def _inputs(name: str) -> dict[str, np.ndarray]: return linear_inputs(np.random.default_rng(len(name)), _shape(name))


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("name", list(CASES))
def test_linear_matches_portable(emu, name, layout):
  shape, a = _shape(name), _inputs(name)
  assert unsupported_reason(shape) is None
  out = np.full(shape.rows * shape.out_features, np.nan, np.float32) if shape.out_float32 else \
    poisoned(shape.rows * shape.out_features, shape.dtype)
  args = [out] + [to_bits(a[key], shape.dtype).reshape(-1) for key in ("x", "w", "bias", "norm", "residual") if key in a]
  emu.launch(f"{name}__{layout}", 0, args)
  got = (out if shape.out_float32 else from_bits(out, shape.dtype)).reshape(shape.rows, shape.out_features)
  ref = portable_linear_reference(a, shape)
  assert not np.isnan(got).any(), "an output element was never written"
  assert np.abs(got - ref).max() / np.abs(ref).max() < TOLERANCE[shape.dtype]


# the sums on tensor cores (csrc/cuda/linear_tc.inc, CUDA): name -> (rows, K, NOUT, bias, norm, residual, out_float32,
# SwiGLU prologue)
TENSOR_CORE = {
  "tc_2rows_norm_logits": (2, 128, 40, False, True, False, True),        # 40 columns: a short last block
  "tc_5rows_norm_logits": (5, 320, 37, False, True, False, True),        # 5 steps: a warp each
  "tc_8rows_bias_residual": (8, 256, 33, True, False, True, False),      # no norm: x as the one term, bfloat16 out
  "tc_12rows_norm_logits": (12, 512, 20, False, True, False, True),      # two n tiles, the second half used
  "tc_3rows_norm_logits": (3, 512, 20, False, True, False, True),        # the same product's first three rows
  "tc_16rows_norm_residual": (16, 1024, 16, False, True, True, False),   # two full n tiles, 16 steps over 8 warps
  "tc_4rows_silu_residual": (4, 192, 40, False, False, True, False, True),   # x' = silu(gate) * up: three terms
  "tc_9rows_silu_logits": (9, 256, 17, True, False, False, True, True),
}


def _tc_shape(name: str) -> LinearShape:
  m, k, o, bias, norm, res, f32, *silu = TENSOR_CORE[name]
  return LinearShape("bfloat16", m, k, o, bias, EPS if norm else None, bool(silu), res, f32)


@pytest.fixture(scope="module")
def emu_tc() -> LazyKernels:
  specs = []
  for name in TENSOR_CORE:
    for tag, layout in TC_LAYOUTS.items():
      plan = linear_plan(_tc_shape(name), layout or (tensor_core_layout(_tc_shape(name)) if tag == "tc" else None))
      specs.append(Spec(f"{name}__{tag}", "linear_tc" if tag != "fma" else "linear", plan.defines, (plan.launch,)))
  return emulate("cuda", specs)


# the planned layout, K's steps over three warps (some take fewer, or none), on one warp (rounds of four steps, the last
# short where K's steps are not a multiple of four), and the FMA form
TC_LAYOUTS = {"tc": None, "tc_k3": SkinnyLayout(16, 3, tensor_cores=True), "tc_k1": SkinnyLayout(16, 1, tensor_cores=True),
              "fma": None}


def _run(emu, spec: str, shape: LinearShape, a: dict[str, np.ndarray]) -> np.ndarray:
  out = np.full(shape.rows * shape.out_features, np.nan, np.float32) if shape.out_float32 else \
    poisoned(shape.rows * shape.out_features, shape.dtype)
  args = [out] + [to_bits(a[key], shape.dtype).reshape(-1) for key in ("x", "w", "bias", "norm", "residual") if key in a]
  emu.launch(spec, 0, args)
  return (out if shape.out_float32 else from_bits(out, shape.dtype)).reshape(shape.rows, shape.out_features)


@pytest.mark.parametrize("layout", ["tc", "tc_k3", "tc_k1"])
@pytest.mark.parametrize("name", list(TENSOR_CORE))
def test_tensor_core_sums_match_the_fma_form(emu_tc, name, layout):
  """The same products as the FMA form (x * g split exactly into two bfloat16 terms, silu(gate) * up into three):
  float32 outputs agree to float32 rounding of the sums, bfloat16 ones to a rounding step; both match the portable
  form."""
  shape = _tc_shape(name)
  a = linear_inputs(np.random.default_rng(len(name)), shape)
  tc, fma = _run(emu_tc, f"{name}__{layout}", shape, a), _run(emu_tc, f"{name}__fma", shape, a)
  assert not np.isnan(tc).any(), "an output element was never written"
  scale = np.abs(fma).max()
  assert np.abs(tc - fma).max() / scale < (1e-6 if shape.out_float32 else 1e-2)
  ref = portable_linear_reference(a, shape)
  assert np.abs(tc - ref).max() / np.abs(ref).max() < TOLERANCE["bfloat16"]


def test_tensor_core_rows_same_bits_at_every_row_count(emu_tc):
  """A row's sums take the same order whatever the row count (the layout depends on K, an mma's output on its own row
  and column): the first three rows of a 12-row product are the 3-row product's bits, so a verification's logits equal
  a decode step's."""
  wide, narrow = _tc_shape("tc_12rows_norm_logits"), _tc_shape("tc_3rows_norm_logits")
  a = linear_inputs(np.random.default_rng(7), wide)
  few = _run(emu_tc, "tc_3rows_norm_logits__tc", narrow, {**a, "x": a["x"][:3]})
  many = _run(emu_tc, "tc_12rows_norm_logits__tc", wide, a)
  assert np.array_equal(few.view(np.uint32), many[:3].view(np.uint32))


def test_tensor_core_layout_and_choice():
  """16 columns a block, K's 64-column steps over as many warps as divide them (up to 8); wide outputs (the logits)
  take it from the tuning table's skinny_tc_min_rows where mma.sync and bfloat16 allow, the rest keep the FMA form."""
  logits = lambda k, rows, dtype="bfloat16": LinearShape(dtype, rows, k, 151936, False, EPS, False, False, True)
  assert tensor_core_layout(logits(1024, 5)) == SkinnyLayout(16, 8, tensor_cores=True)
  assert tensor_core_layout(logits(2048, 8)) == tensor_core_layout(logits(4096, 8)) == SkinnyLayout(16, 8, tensor_cores=True)
  assert tensor_core_layout(logits(128, 2)) == SkinnyLayout(16, 2, tensor_cores=True)
  assert tensor_core_layout(logits(320, 2)) == SkinnyLayout(16, 5, tensor_cores=True)
  plan = linear_plan(logits(1024, 5), tensor_core_layout(logits(1024, 5)))
  assert plan.launch.grid == (9496, 1, 1) and plan.launch.threads == 256 and plan.defines["TV_TC"] == 1
  hopper = DeviceTarget.nominal("cuda")
  min_rows = tuning_for(hopper.kind).linear.skinny_tc_min_rows
  assert min_rows == 1   # (one row fills an eighth of the mma's columns, and still streams faster: the numbers in linear.py)
  assert pick_kernel(hopper, logits(1024, 1)) == pick_kernel(hopper, logits(1024, 16)) == "skinny_tc"
  assert pick_kernel(hopper, logits(1024, 17)) == "gemm"
  assert pick_kernel(DeviceTarget.nominal("cuda", "sm_86"), logits(1024, 5)) == "skinny"   # not measured there: off
  assert pick_kernel(hopper, logits(1024, 5, "float16")) == "skinny"          # x * g is split exactly for bfloat16 only
  assert pick_kernel(hopper, logits(1000, 5)) == "skinny"                      # K not a multiple of 64
  assert pick_kernel(DeviceTarget.nominal("metal"), logits(1024, 5)) == "skinny"
  narrow = LinearShape("bfloat16", 4, 1024, 3072, False, EPS, False, False, False)
  assert pick_kernel(hopper, narrow) == "skinny"
  assert tensor_core_reason(LinearShape("bfloat16", 4, 1024, 151936, False, None, True, False, True), hopper) is None
  assert "int8" in tensor_core_reason(replace(logits(1024, 4), weight="int8", group=1024), hopper)


def test_layout_spreads_long_rows_over_warps():
  """K's steps shared evenly by up to 8 warps: Llama-3.2-1B's down (K 8,192: 32 bf16 steps) and a K of 2,048 (8) over 8,
  a K of 3,072 (12) over 6, a K of 1,024 (4) over 4; packed codes count their 16-byte spans (int4: 32 columns a lane)
  and take 4 columns a block, as do 3 rows and more."""
  shape = lambda k, rows=1, **kw: LinearShape("bfloat16", rows, k, 2048, False, None, False, False, False, **kw)
  assert skinny_layout(shape(8192)) == skinny_layout(shape(2048)) == SkinnyLayout(2, 8)
  assert skinny_layout(shape(3072)) == SkinnyLayout(2, 6) and skinny_layout(shape(1024)) == SkinnyLayout(2, 4)
  assert skinny_layout(shape(264)) == SkinnyLayout(2, 2)   # a step and a tail of one vector: a warp each
  assert skinny_layout(shape(776)) == SkinnyLayout(2, 4) and skinny_layout(shape(1280)) == SkinnyLayout(2, 5)   # 4, 5 steps
  assert skinny_layout(shape(2048, weight="int4", group=128)) == SkinnyLayout(4, 2)
  assert skinny_layout(shape(2048, rows=3)) == SkinnyLayout(4, 8)
  # from three rows, wide outputs split K only as far as a full grid and four steps a warp need (their cross-warp sums
  # cost): Qwen3-0.6B's logits one warp a block, Qwen3-30B-A3B's (K 2,048: 8 steps) two; at one row as before
  logits = lambda k, rows: LinearShape("bfloat16", rows, k, 151936, False, EPS, False, False, True)
  assert skinny_layout(logits(1024, 5)) == SkinnyLayout(4, 1) and skinny_layout(logits(2048, 8)) == SkinnyLayout(4, 2)
  assert skinny_layout(logits(1024, 1)) == SkinnyLayout(2, 4)
  plan = linear_plan(shape(8192))
  assert plan.launch.grid == (1024, 1, 1) and plan.launch.threads == 256 and plan.defines["TV_KSPLIT"] == 8
  # int4 codes behind SwiGLU at one or two rows: at most 4 warps (Llama-3.2-1B's down: 8 steps of 32-column spans);
  # int8 and FP8 codes, and three rows, as before
  down = lambda weight, rows=1: LinearShape("bfloat16", rows, 8192, 2048, False, None, True, True, False, weight,
                                            128 if weight == "int4" else 8192)
  assert skinny_layout(down("int4")) == skinny_layout(down("int4", 2)) == SkinnyLayout(4, 4)
  assert skinny_layout(down("int8")) == skinny_layout(down("fp8")) == skinny_layout(down("int4", 3)) == SkinnyLayout(4, 8)
  # int8 codes outside SwiGLU at one or two rows: 2 columns a block, as 16-bit weights (K 2,048: 4 steps of 16 codes)
  qkv = lambda weight, rows=1: LinearShape("bfloat16", rows, 2048, 3072, False, EPS, False, False, False, weight, 2048)
  assert skinny_layout(qkv("int8")) == skinny_layout(qkv("int8", 2)) == SkinnyLayout(2, 4)
  assert skinny_layout(qkv("int8", 3)) == skinny_layout(qkv("fp8")) == SkinnyLayout(4, 4)
  # ... but 4 for wide outputs (Llama-3.2-1B's gate_up: 16,384)
  gate_up = LinearShape("bfloat16", 1, 2048, 16384, False, EPS, False, False, False, "int8", 2048)
  assert skinny_layout(gate_up) == SkinnyLayout(4, 4)


def test_shapes_the_kernel_refuses():
  base = LinearShape("bfloat16", 4, 64, 8, False, None, False, False, False)
  assert unsupported_reason(base) is None
  assert "rows" in unsupported_reason(LinearShape("bfloat16", 17, 64, 8, False, None, False, False, False))
  assert "multiple of 8" in unsupported_reason(LinearShape("bfloat16", 4, 60, 8, False, None, False, False, False))
  assert "together" in unsupported_reason(LinearShape("bfloat16", 4, 64, 8, False, 1e-6, True, False, False))


# packed (quantized) weights: name -> (dtype, rows, K, NOUT, weight codes, group, norm, silu_mul, residual)
PACKED = {
  "int8_f32_g32_norm": ("float32", 3, 128, 10, "int8", 32, True, False, False),
  "int4_bf16_g64_silu_residual": ("bfloat16", 4, 192, 17, "int4", 64, False, True, True),
  "int4_f16_channel": ("float16", 1, 256, 24, "int4", 256, False, False, False),
  "fp8_bf16_g128_norm": ("bfloat16", 2, 256, 9, "fp8", 128, True, False, False),
  "fp8_bf16_g16_silu": ("bfloat16", 1, 512, 11, "fp8", 16, False, True, False),   # NVFP4's form: E4M3 codes, blocks of 16
  "int8_bf16_16rows_tail": ("bfloat16", 16, 264, 12, "int8", 8, False, False, True),
  "int4_f32_g16_halfwords": ("float32", 2, 96, 7, "int4", 16, False, False, False),   # 4-element vectors: half a word
  # 16-byte code spans a lane (TV_WSPAN): whole steps of 32 lanes, and whole steps with a tail
  "int8_bf16_k1024_span_steps": ("bfloat16", 2, 1024, 12, "int8", 128, True, False, False),
  "int4_f32_k1024_span_steps": ("float32", 2, 1024, 9, "int4", 128, True, False, False),   # int4's biased codes in float32
  "int4_bf16_k1536_span_steps_tail": ("bfloat16", 3, 1536, 9, "int4", 128, False, True, False),
  # a packed LM head (GGUF's output.weight): the final norm in the prologue, float32 logits
  "int8_bf16_g16_logits": ("bfloat16", 2, 256, 40, "int8", 16, True, False, False, True),
}


def _packed_shape(name: str) -> LinearShape:
  dtype, m, k, o, weight, group, norm, silu, res, *logits = PACKED[name]
  return LinearShape(dtype, m, k, o, False, EPS if norm else None, silu, res, bool(logits), weight, group)


@pytest.fixture(scope="module")
def emu_packed(dialect: str) -> LazyKernels:
  return emulate(dialect, _specs(PACKED, _packed_shape))


def _packed_weight(name: str, rng: np.random.Generator):
  _, _, k, o, weight, group, *_ = PACKED[name]
  return packed_weight(rng, weight, o, k, group)


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("name", list(PACKED))
def test_packed_weight_linear_matches_portable(emu_packed, name, layout):
  from tinygrad import Tensor

  from tinyvllm.layers.linear import portable_linear
  shape, rng = _packed_shape(name), np.random.default_rng(len(name))
  assert unsupported_reason(shape) is None
  qw = _packed_weight(name, rng)
  a = {key: v for key, v in linear_inputs(rng, shape).items() if key != "w"}
  out_dtype = "float32" if shape.out_float32 else shape.dtype
  out = poisoned(shape.rows * shape.out_features, out_dtype)
  shifts = qw.shifts if qw.shifts is not None else qw.scales   # FP8: a placeholder the kernel never reads
  weights = [qw.codes.numpy().reshape(-1), qw.scales.numpy().reshape(-1), shifts.numpy().reshape(-1)]
  extras = [to_bits(a[key], shape.dtype).reshape(-1) for key in ("norm", "residual") if key in a]
  emu_packed.launch(f"{name}__{layout}", 0, [out, to_bits(a["x"], shape.dtype).reshape(-1), *weights, *extras])
  got = from_bits(out, out_dtype).reshape(shape.rows, shape.out_features)
  t = {key: Tensor(v) for key, v in a.items()}
  ref = portable_linear(t["x"], qw, norm=t.get("norm"), eps=EPS, silu_mul=shape.silu_mul, residual=t.get("residual"),
                        out_float32=shape.out_float32).numpy()
  assert not np.isnan(got).any(), "an output element was never written"
  assert np.abs(got - ref).max() / np.abs(ref).max() < TOLERANCE[shape.dtype]


def test_packed_weights_the_kernel_refuses():
  packed = lambda k, weight, group: LinearShape("bfloat16", 2, k, 8, False, None, False, False, False, weight, group)
  assert unsupported_reason(packed(128, "int4", 32)) is None
  assert "group 12" in unsupported_reason(packed(96, "int8", 12))          # not a multiple of the 8-element vector
  assert "group 64" in unsupported_reason(packed(96, "int4", 64))          # does not divide K
  assert "nf4 weights" in unsupported_reason(packed(128, "nf4", 32))
