"""Tensor parallelism's row-parallel product that all-reduces its own outputs (csrc/neutral/linear.inc with TV_AR, over
csrc/cuda/peer.inc), run on the CPU through the C++ emulation, each device's launch on a thread of its own: every
device gets the same bits as its product (the plain skinny kernel, same layout) followed by the all-reduce kernel
(each device's products rounded to the dtype, added in the devices' order in float32, rounded, the residual added).
Launches of it and of the all-reduce kernel alternate on the same buffers (one launch count for the group, every
reducer moving its counters), grids of one to 32 reducers, packed weight shards (int4, FP8), and what the planner
refuses. The emulator runs a grid's
blocks one after the other in index order, so the reducers (the last blocks) find their words pushed; on the GPU they
run beside the product blocks, which never wait."""
from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from tests.emulator.cases import from_bits, linear_inputs, packed_weight, to_bits
from tests.emulator.emulator import LazyKernels, Spec, emulate, poisoned
from tests.test_kernels_all_reduce import Devices, _expected, _name, _partials, on_every_device
from tinyvllm.kernels import all_reduce as ar
from tinyvllm.kernels.linear import LinearShape, all_reduce_reason, linear_plan

# name -> (dtype, rows, K, NOUT, silu_mul, residual, devices): down's SwiGLU prologue, o's plain product; a word of
# two 16-bit columns or one float32; grids of several blocks
CASES = {
  "bf16_residual_2": ("bfloat16", 1, 256, 64, False, True, 2),
  "f32_silu_residual_2": ("float32", 2, 72, 24, True, True, 2),
  "f16_plain_4": ("float16", 3, 128, 40, False, False, 4),
  # several reducers, each owning a run of columns of every row
  "bf16_wide_2": ("bfloat16", 2, 256, 600, False, True, 2),
  "f16_wide_4": ("float16", 1, 128, 520, False, False, 4),
  # 32 reducers (one launch counter each), two rounds of vectors each
  "bf16_many_2": ("bfloat16", 1, 64, 8448, False, True, 2),
  # three devices: a reducer's threads past 3 x (32 // 3) idle
  "bf16_three_3": ("bfloat16", 2, 128, 64, False, True, 3),
  # packed weight shards (tensor parallelism with quantized weights): int4 in groups of 32 behind SwiGLU, FP8 per channel
  "bf16_int4_g32_silu_2": ("bfloat16", 1, 256, 64, True, True, 2, "int4", 32),
  "f16_fp8_4": ("float16", 2, 128, 40, False, False, 4, "fp8", 128),
}
BETWEEN = (4096, "bfloat16")   # an all-reduce kernel launch between the products (2 devices)


def _shape(name: str, world: int | None = None) -> LinearShape:
  dtype, m, k, o, silu, residual, devices, *packed = CASES[name]
  form = dict(zip(("weight", "group"), packed, strict=True)) if packed else {}
  return LinearShape(dtype, m, k, o, False, None, silu, residual, False, all_reduce=devices if world is None else world, **form)


def _operands(rng: np.random.Generator, name: str) -> dict[str, np.ndarray]:
  """A device's x, residual and weight shard: in the activations' dtype, or packed (its codes, scales and shifts)."""
  shape = _shape(name)
  a = linear_inputs(rng, shape)
  if shape.weight == "elem": return a
  w = packed_weight(rng, shape.weight, shape.out_features, shape.in_features, shape.group)
  shifts = w.shifts if w.shifts is not None else w.scales   # (FP8 has none: its scales stand in, never read)
  return {**a, "w": None, "codes": w.codes.numpy().reshape(-1), "scales": w.scales.numpy().reshape(-1),
          "shifts": shifts.numpy().reshape(-1)}


def _weight_args(a: dict[str, np.ndarray], dtype: str) -> list[np.ndarray]:
  return [to_bits(a["w"], dtype).reshape(-1)] if a["w"] is not None else [a["codes"], a["scales"], a["shifts"]]


@pytest.fixture(scope="module")
def emu() -> LazyKernels:
  specs = []
  for name in CASES:
    fused, plain = linear_plan(_shape(name)), linear_plan(replace(_shape(name, 0), residual=False))
    specs += [Spec(f"{name}__ar", "linear_all_reduce", fused.defines, (fused.launch,)),
              Spec(f"{name}__plain", "linear", plain.defines, (plain.launch,))]
  numel, dtype = BETWEEN
  plan = ar.all_reduce_plan(numel, 2, dtype)
  specs.append(Spec(_name(numel, 2, dtype), "all_reduce", plan.defines, plan.launches))
  return emulate("cuda", specs)


def _want(emu: LazyKernels, name: str, operands: list[dict[str, np.ndarray]], residual: np.ndarray | None) -> np.ndarray:
  """Each device's product on the plain kernel (what the all-reduce kernel would add up), added up as it does."""
  shape = _shape(name)
  partials = []
  for a in operands:
    out = poisoned(shape.rows * shape.out_features, shape.dtype)
    emu.launch(f"{name}__plain", 0, [out, to_bits(a["x"], shape.dtype).reshape(-1), *_weight_args(a, shape.dtype)])
    partials.append(from_bits(out, shape.dtype))
  want = _expected(partials, shape.dtype)
  return want if residual is None else to_bits(residual.reshape(-1) + from_bits(want, shape.dtype), shape.dtype)


def _product_args(name: str, a: dict[str, np.ndarray], residual: np.ndarray | None, table: np.ndarray, out: np.ndarray) -> list:
  shape = _shape(name)
  extra = [] if residual is None else [to_bits(residual, shape.dtype).reshape(-1)]
  return [out, to_bits(a["x"], shape.dtype).reshape(-1), *_weight_args(a, shape.dtype), *extra, table]


@pytest.mark.parametrize("name", list(CASES))
def test_every_device_gets_its_product_then_the_all_reduce(emu, name):
  shape = _shape(name)
  world, m, o = shape.all_reduce, shape.rows, shape.out_features
  devices, rng = Devices(world), np.random.default_rng(len(name))
  for launch in range(2):   # the LL slots alternate; the arrivals counter starts again at 0
    operands = [_operands(rng, name) for _ in range(world)]   # each device's x and weight shard
    residual = operands[0].get("residual")   # replicated, as the hidden states are
    want, outs = _want(emu, name, operands, residual), [poisoned(m * o, shape.dtype) for _ in range(world)]

    def run(rank: int, operands=operands, outs=outs, residual=residual, launch=launch) -> None:
      emu.launch(f"{name}__ar", 0, _product_args(name, operands[rank], residual, devices.tables[rank], outs[rank]),
                 order=("forward", "reverse")[(rank + launch) % 2])
    on_every_device(world, run)
    for rank, out in enumerate(outs): assert np.array_equal(out, want), f"launch {launch}, device {rank}"
  # every launch counted by every counter (each reducer moves its own)
  assert all((s[ar.MAX_BLOCKS * world:] == 2).all() for s in devices.signals)


def test_products_and_all_reduce_launches_alternate(emu):
  """Product, all-reduce kernel, product, all-reduce kernel on the same buffers: the launch count is the group's."""
  name = "bf16_residual_2"
  shape, devices, rng = _shape(name), Devices(2), np.random.default_rng(11)
  numel, dtype = BETWEEN
  for _ in range(2):
    operands, sums = [linear_inputs(rng, shape) for _ in range(2)], _partials(rng, numel, 2, dtype)
    residual = operands[0]["residual"]
    outs, reduced = [poisoned(shape.rows * shape.out_features, shape.dtype) for _ in range(2)], [poisoned(numel, dtype) for _ in range(2)]

    def run(rank: int, operands=operands, sums=sums, outs=outs, reduced=reduced, residual=residual) -> None:
      emu.launch(f"{name}__ar", 0, _product_args(name, operands[rank], residual, devices.tables[rank], outs[rank]))
      emu.launch(_name(numel, 2, dtype), 0, [reduced[rank], to_bits(sums[rank], dtype), devices.tables[rank]])
    on_every_device(2, run)
    want = _want(emu, name, operands, residual)
    assert all(np.array_equal(out, want) for out in outs)
    assert all(np.array_equal(r, _expected(sums, dtype)) for r in reduced)


def test_refusals():
  shape = lambda **kw: LinearShape(**{"dtype": "bfloat16", "rows": 1, "in_features": 256, "out_features": 4096, "bias": False,
                                      "norm_eps": None, "silu_mul": False, "residual": True, "out_float32": False,
                                      "all_reduce": 2, **kw})
  assert all_reduce_reason(shape()) is None
  assert "bias" in all_reduce_reason(shape(bias=True))
  assert "norm" in all_reduce_reason(shape(norm_eps=1e-6))
  assert "16-byte vectors" in all_reduce_reason(shape(out_features=4092))
  assert "decode rows" in all_reduce_reason(shape(rows=8))
  assert "devices" in all_reduce_reason(shape(all_reduce=9))


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("world", [2, 3, 4, 8])
def test_reducer_plan_covers_every_column_once(dtype, world):
  """Over decode shapes: reducers own whole runs of vectors and of product blocks' columns (a product block reads its
  reducer's launch counter), at most one counter each, and a round's threads (vector, device) fit the block."""
  checked = 0
  for rows, k, o in ((1, 2048, 4096), (2, 6144, 4096), (4, 1024, 4096), (1, 64, 8448), (1, 256, 40), (4, 3072, 896)):
    shape = LinearShape(dtype, rows, k, o, False, None, False, True, False, all_reduce=world)
    if all_reduce_reason(shape) is not None: continue
    checked += 1
    d = linear_plan(shape).defines
    vec, cols, reducers = 16 // (4 if dtype == "float32" else 2), d["TV_RCOLS"], d["TV_REDUCERS"]
    assert cols % vec == 0 and cols % d["TV_RPW"] == 0
    assert (reducers - 1) * cols < o <= reducers * cols and reducers <= ar.MAX_BLOCKS
    # one round of (vector, device) threads covers a reducer's vectors, unless the counters cap the reducers
    assert cols // vec * rows <= d["TV_NT"] // world or reducers == ar.MAX_BLOCKS
    assert linear_plan(shape).launch.grid[0] == d["TV_BLOCKS"] + reducers
  assert checked == 6
