"""The mixture of experts' grouped path for larger steps (tinyvllm/kernels/moe_grouped.py: csrc/neutral/moe_align.inc and
gemm_tc.inc's TV_MOE products, CUDA) run on the CPU through the C++ emulation: the routing and the alignment (pairs
sorted by expert, runs padded to the tile's rows) against a layout computed here from the portable route's ids; the
grouped products and the combine against layers/moe.py's experts_gathered on the same rounded inputs at 17, 64 and 300
tokens, with experts that get no token, one expert taking every token, tokens routed to every expert (k = E), Mixtral's
and Qwen3-MoE's proportions in small form, mma.sync and wgmma tiles, every output written (poisoned buffers); a row block
given another expert fails the comparison; the whole backend op (FusedBackend.moe with run_kernel on the emulator) against
portable_moe, each step taking the decode kernels or this path by its size; the plan at Qwen3-30B-A3B's shape."""
from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from tests.emulator.cases import from_bits, to_bits
from tests.emulator.emulator import EmulatedRunKernel, LazyKernels, Spec, emulate, poisoned
from tests.test_kernels_moe import (
  TOLERANCE,
  backend_inputs,
  expert_inputs,
  portable_reference,
  portable_route,
  reference_moe,
  relative_error,
  weight_bits,
)
from tinyvllm.kernels.gemm import GemmTiles
from tinyvllm.kernels.moe import LARGE_STEP, MoEShape, moe_shape
from tinyvllm.kernels.moe_grouped import GroupedPlan, grouped_plan, grouped_reason, padded_rows, takes_decode_step
from tinyvllm.kernels.tuning import tuning_for
from tinyvllm.platform.target import DeviceTarget

HOPPER, AMPERE = DeviceTarget.nominal("cuda"), DeviceTarget.nominal("cuda", arch="sm_80")
EPS = 1e-6
# name -> (dtype, tokens, hidden, intermediate, experts, k, norm_topk_prob, logits, tiles: None for the planner's)
# ("skewed": expert 1 scores highest for every token and the last third of the experts never make the top k)
CASES = {
  "bf16_n17_e16_k4": ("bfloat16", 17, 128, 64, 16, 4, True, "random", None),
  "f16_n64_skewed_16x64": ("float16", 64, 128, 64, 16, 4, False, "skewed", GemmTiles(16, 64, 1, 4, 1)),
  "bf16_n17_every_expert": ("bfloat16", 17, 64, 32, 8, 8, True, "random", GemmTiles(32, 64, 2, 2, 1, bk=32)),
  "bf16_n300_mixtral_64x64": ("bfloat16", 300, 128, 192, 8, 2, True, "random", GemmTiles(64, 64, 2, 2, 1, bk=64)),
  "f16_n300_skewed_wgmma128": ("float16", 300, 128, 64, 12, 4, True, "skewed", GemmTiles.warpgroup(128, 128, ring=3)),
  "bf16_n64_qwen3_e128_wgmma64": ("bfloat16", 64, 192, 128, 128, 8, True, "random", GemmTiles.warpgroup(64, 64, ring=2)),
  "bf16_n40_32x64_bk128": ("bfloat16", 40, 384, 128, 16, 4, True, "random", GemmTiles(32, 64, 2, 2, 1, 2, 128)),
}
QUICK = {"bf16_n17_e16_k4", "f16_n64_skewed_16x64"}


def case_shape(name: str) -> MoEShape:
  dtype, n, h, i, e, k, norm_topk, *_ = CASES[name]
  return MoEShape(dtype, n, h, i, e, k, norm_topk, EPS)


def case_plan(name: str) -> GroupedPlan: return grouped_plan(case_shape(name), HOPPER, CASES[name][-1])


@pytest.fixture(scope="module")
def emu() -> LazyKernels:
  specs = [Spec(f"{name}__{kernel.name}", kernel.algorithm, kernel.defines, kernel.launches)
           for name in CASES for kernel in case_plan(name).kernels]
  return emulate("cuda", specs, quick={s.name for s in specs if s.name.split("__")[0] in QUICK})


def reference_align(ids: np.ndarray, experts: int, bm: int, rows: int) -> np.ndarray:
  """moe_align.inc's layout for these ids, -7 (the test's fill) where the kernel writes nothing."""
  flat, at = ids.reshape(-1), 0
  align = np.full(rows + rows // bm + 1, -7, np.int32)
  for e in range(experts):
    pairs = np.flatnonzero(flat == e)
    padded = -(-len(pairs) // bm) * bm
    align[at:at + padded] = np.r_[pairs, np.full(padded - len(pairs), -1)]
    align[rows + at // bm:rows + (at + padded) // bm] = e
    at += padded
  align[-1] = at // bm
  return align


def run_routing(emu: LazyKernels, name: str, plan: GroupedPlan, logits: np.ndarray, order: str = "forward"):
  """tv_moe_topk, tv_moe_count, tv_moe_align: (ids [N, k], weights [N, k], align)."""
  shape, spec = plan.shape, f"{name}__routing"
  ids, weights = np.full(shape.pairs, -7, np.int32), np.full(shape.pairs, np.nan, np.float32)
  emu.launch(spec, 0, [ids, weights, np.ascontiguousarray(logits, np.float32).reshape(-1)], order)
  counts = np.full(shape.experts, -7, np.int32)
  emu.launch(spec, 1, [counts, ids], order)
  np.testing.assert_array_equal(counts, np.bincount(ids, minlength=shape.experts))
  align = np.full(plan.rows + plan.rows // plan.tiles.bm + 1, -7, np.int32)
  emu.launch(spec, 2, [align, ids, counts], order)
  return ids.reshape(shape.tokens, shape.top_k), weights.reshape(shape.tokens, shape.top_k), align


def run_products(emu: LazyKernels, name: str, plan: GroupedPlan, a: dict[str, np.ndarray], align: np.ndarray, weights: np.ndarray,
                 order: str = "forward") -> tuple[np.ndarray, np.ndarray]:
  """x', gate_up with its SwiGLU, down and the combine on poisoned outputs: (out [N, H], down's float32 rows [P, H])."""
  s, dt = plan.shape, plan.shape.dtype
  bits = lambda key: to_bits(a[key], dt).reshape(-1)
  xn = poisoned(s.tokens * s.hidden, dt)
  emu.launch(f"{name}__gate_up", 0, [xn, bits("x"), bits("norm")], order)
  act = poisoned(plan.rows * s.intermediate, dt)
  emu.launch(f"{name}__gate_up", 1, [act, xn, weight_bits(a, "gate_up", s), align], order)
  down = np.full(s.pairs * s.hidden, np.nan, np.float32)
  emu.launch(f"{name}__down", 0, [down, act, weight_bits(a, "down", s), align], order)
  out = poisoned(s.tokens * s.hidden, dt)
  emu.launch(f"{name}__routing", 3, [out, down, np.ascontiguousarray(weights, np.float32).reshape(-1), bits("residual")], order)
  return from_bits(out, dt).reshape(s.tokens, s.hidden), down.reshape(s.pairs, s.hidden)


@pytest.mark.parametrize("name", list(CASES))
def test_grouped_path_matches_gathered(emu, name):
  plan, rng = case_plan(name), np.random.default_rng(len(name))
  shape = plan.shape
  logits = _logits(name, shape, rng)
  want_ids, want_w = portable_route(logits, shape.top_k, shape.norm_topk_prob)
  ids, weights, align = run_routing(emu, name, plan, logits, "random")
  np.testing.assert_array_equal(ids, want_ids)
  np.testing.assert_allclose(weights, want_w, rtol=2e-6, atol=1e-9)
  np.testing.assert_array_equal(align, reference_align(ids, shape.experts, plan.tiles.bm, plan.rows))
  if CASES[name][7] == "skewed":   # the cases it is meant for: an expert with every token, experts with none
    assert (ids == 1).any(1).all() and len(np.unique(ids)) <= shape.experts // 3 * 2
  a = expert_inputs(shape, rng, np.unique(ids))
  want = reference_moe(shape, a, ids, weights)
  out, down = run_products(emu, name, plan, a, align, weights, "random" if name in QUICK else "forward")
  assert not np.isnan(down).any() and not np.isnan(out).any(), "an output element was never written"
  assert relative_error(out, want, a["residual"]) < TOLERANCE[shape.dtype]


def _logits(name: str, shape: MoEShape, rng: np.random.Generator) -> np.ndarray:
  logits = rng.standard_normal((shape.tokens, shape.experts)).astype(np.float32)
  if CASES[name][7] == "skewed":
    logits[:, 1] += 8.0
    logits[:, shape.experts // 3 * 2:] -= 30.0
  return logits


def test_a_row_block_with_another_expert_fails(emu):
  name = "bf16_n17_e16_k4"
  plan, rng = case_plan(name), np.random.default_rng(7)
  ids, weights, align = run_routing(emu, name, plan, _logits(name, plan.shape, rng))
  a = expert_inputs(plan.shape, rng, np.unique(ids))
  want = reference_moe(plan.shape, a, ids, weights)
  assert relative_error(run_products(emu, name, plan, a, align, weights)[0], want, a["residual"]) < TOLERANCE["bfloat16"]
  wrong = align.copy()
  wrong[plan.rows] = (align[plan.rows] + 1) % plan.shape.experts   # row block 0 multiplies the next expert's weights
  assert relative_error(run_products(emu, name, plan, a, wrong, weights)[0], want, a["residual"]) > 1e-2


def test_plan_at_qwen3_30b_a3b():
  """Decode batches take small row blocks (one a used expert, its weights read once), prompt chunks Hopper's 128x128
  wgmma tile; the padded rows' bound and the buffers at 8,192 tokens; where the path does not run."""
  qwen = lambda n: MoEShape("bfloat16", n, 2048, 768, 128, 8, True, EPS)
  decode = grouped_plan(qwen(256), HOPPER)
  assert (decode.tiles.bm, decode.tiles.bn, decode.tiles.bk, decode.tiles.wgmma) == (32, 128, 64, False)
  assert decode.rows == padded_rows(qwen(256), 32) == (2048 + 128 * 31) // 32 * 32
  prompt = grouped_plan(qwen(8192), HOPPER)
  assert prompt.tiles == GemmTiles.warpgroup(128, 128, ring=3) and prompt.rows == 65536 + 128 * 127
  gate_up, down = prompt.gate_up.launches[1], prompt.down.launches[0]
  assert gate_up.grid == (1536 // 128, prompt.rows // 128, 1) and down.grid == (2048 // 128, prompt.rows // 128, 1)
  assert gate_up.params[0].numel == prompt.rows * 768 and down.params[0].numel == 65536 * 2048   # [M, I] bf16, [P, H] float32
  assert [step.kernel for step, _ in prompt.steps] == ["tv_moe_topk", "tv_moe_count", "tv_moe_align", "tv_gemm", "tv_gemm",
                                                       "tv_moe_combine"]
  assert not grouped_plan(qwen(8192), AMPERE).tiles.wgmma
  assert "sm_80" in grouped_reason(qwen(64), DeviceTarget.nominal("cuda", arch="sm_75"))
  assert "dtype" in grouped_reason(replace(qwen(64), dtype="float32"), HOPPER)
  assert "multiple of 32" in grouped_reason(replace(qwen(64), intermediate=100), HOPPER)


# ---- the backend op: decode kernels up to their bound, the grouped path above it
# name -> (dtype, tokens, hidden, intermediate, experts, k, norm_topk_prob) (float16: tinygrad's CPU backend here compiles no
# bfloat16 arithmetic)
BACKEND = {"f16_n5_decode": ("float16", 5, 64, 32, 16, 4, True), "f16_n16": ("float16", 16, 64, 32, 16, 4, True),
           "f16_n17": ("float16", 17, 64, 32, 16, 4, True),
           "f16_n64_every_expert": ("float16", 64, 64, 32, 4, 4, False), "f16_n300_wgmma": ("float16", 300, 128, 64, 8, 4, True)}


def test_backend_moe_picks_decode_kernels_or_grouped_path(monkeypatch):
  """FusedBackend.moe with every launch (the router products too) on the emulator against portable_moe: 5 tokens on
  the decode kernels, 16 (past Hopper's table's decode_kernel_max_tokens) and 17 and more (past the decode kernels'
  bound) on the grouped path (the 128x128 wgmma tile at 150 pairs an expert)."""
  import tinyvllm.kernels.linear as linear
  import tinyvllm.kernels.moe as moe_module
  import tinyvllm.kernels.moe_grouped as grouped
  from tinyvllm.kernels.fused import FusedBackend
  fake = EmulatedRunKernel("cuda", order="random")
  for module in (moe_module, grouped, linear): monkeypatch.setattr(module, "run_kernel", fake)
  backend = FusedBackend(replace(HOPPER, device="CPU"), log=pytest.fail)
  cases = {name: backend_inputs(name, BACKEND) for name in BACKEND}
  for _, moe, t in cases.values(): backend.moe(t["x"], moe, norm=t["norm"], eps=EPS, residual=t["residual"])   # collect
  fake.build()
  for name, (a, moe, t) in cases.items():
    got = backend.moe(t["x"], moe, norm=t["norm"], eps=EPS, residual=t["residual"]).float().numpy()
    want = portable_reference(a, moe.top_k, moe.norm_topk_prob)
    assert relative_error(got, want, a["residual"]) < TOLERANCE["float16"], name
  assert backend.calls["moe"] == 2 and backend.calls["moe-grouped"] == 2 * (len(BACKEND) - 1)
  assert "portable-moe" not in backend.calls
  assert fake.launches.count("tv_moe_align") == len(BACKEND) - 1 and fake.launches.count("tv_moe_route") == 1
  assert moe_shape(cases["f16_n17"][2]["x"], cases["f16_n17"][1], EPS)[1] == LARGE_STEP
  assert moe_shape(cases["f16_n16"][2]["x"], cases["f16_n16"][1], EPS)[1] is None


def test_decode_steps_past_the_tables_bound_take_the_grouped_path():
  """16-bit experts past the tuning table's decode_kernel_max_tokens (Hopper's: 5, where the grouped GEMM measured
  faster) take the grouped path; packed experts, other kinds' tables (16: the decode kernels' own bound) and devices
  without the grouped GEMM keep the decode kernels."""
  qwen = lambda n, **kw: replace(MoEShape("bfloat16", n, 2048, 768, 128, 8, True, EPS), **kw)
  assert tuning_for(HOPPER.kind).moe.decode_kernel_max_tokens == 5
  assert [takes_decode_step(qwen(n), HOPPER) for n in (1, 5, 6, 16)] == [False, False, True, True]
  assert not takes_decode_step(qwen(16, weights=(("int4", 128), ("int4", 128))), HOPPER)
  assert not takes_decode_step(qwen(16), AMPERE) and takes_decode_step(qwen(17), AMPERE)
  assert not takes_decode_step(qwen(16), DeviceTarget.nominal("cuda", arch="sm_75"))
