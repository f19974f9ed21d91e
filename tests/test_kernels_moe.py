"""The mixture-of-experts kernels (csrc/neutral/moe.inc, tinyvllm/kernels/moe.py), CUDA and Metal dialect, run on the CPU
through the C++ emulation: the routing kernel against the portable route (softmax + top k in tinygrad ops) on random
logits, k = E and E not a multiple of 32 included, ties to the lowest id, and its grouping of the pairs by expert; the
grouped products and the combine against layers/moe.py's experts_gathered on the same rounded inputs (experts with no
pair, an expert with every token's pair, 1-16 tokens, k 1-8, up to 128 experts, Qwen3-30B-A3B's shape at one token),
every output written (poisoned buffers), in several thread orders; a wrong expert or weight fails the comparison; the
whole backend op (FusedBackend.moe with run_kernel on the emulator, router product included) against portable_moe, and
its portable path above the bound."""
from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
from tinygrad import Tensor, dtypes

from tests.emulator.cases import from_bits, round_to, to_bits
from tests.emulator.emulator import EmulatedRunKernel, LazyKernels, Spec, emulate, poisoned
from tinyvllm.backend.weights import MoEWeights
from tinyvllm.kernels.moe import (
  DIRECT_MAX_TOKENS,
  LARGE_STEP,
  MAX_PAIRS,
  MAX_TOKENS,
  MoEPlan,
  MoEShape,
  moe_plan,
  moe_shape,
  unsupported_reason,
)
from tinyvllm.layers.moe import experts_gathered, portable_moe, route
from tinyvllm.layers.norm import rms_norm
from tinyvllm.platform.target import DeviceTarget

TOLERANCE = {"float32": 2e-5, "float16": 3e-3, "bfloat16": 2e-2}   # max |kernel - reference| / max |reference - residual|
EPS = 1e-6
# routing: name -> (tokens, experts, k, norm_topk_prob)
ROUTES = {
  "r_qwen3_n1": (1, 128, 8, True),
  "r_qwen3_n16": (16, 128, 8, False),      # 128 pairs: the bound, 4 warps of tokens
  "r_every_expert": (3, 40, 40, True),     # k = E, E not a multiple of 32, two rounds' values a lane
  "r_e8_k2": (5, 8, 2, True),              # fewer experts than lanes
  "r_e250_k3": (7, 250, 3, False),
  "r_one_expert": (2, 1, 1, True),
}
# experts: name -> (dtype, tokens, hidden, intermediate, experts, k, norm_topk_prob, logits): "random", or "skewed" (one
# expert scores highest for every token and a third of them never make the top k)
EXPERTS = {
  "bf16_n1_e128_k8": ("bfloat16", 1, 256, 96, 128, 8, True, "random"),
  "f32_n4_e16_k4": ("float32", 4, 256, 96, 16, 4, False, "skewed"),
  "bf16_n16_e64_k8": ("bfloat16", 16, 256, 96, 64, 8, True, "skewed"),
  "f16_n7_e8_k2": ("float16", 7, 128, 64, 8, 2, True, "random"),
  "bf16_n9_e12_k1": ("bfloat16", 9, 264, 40, 12, 1, False, "skewed"),   # K tails: 264 = 256 + 8, 40 < one round of lanes
  "f32_n16_e4_k2": ("float32", 16, 128, 64, 4, 2, False, "random"),      # passes of 8 rows, the last ones partial
  "f32_n16_e128_k8": ("float32", 16, 64, 32, 128, 8, True, "random"),
  "bf16_qwen3_30b_n1": ("bfloat16", 1, 2048, 768, 128, 8, True, "random"),   # only the chosen experts' weights filled
}
QUICK = {"r_qwen3_n1", "r_every_expert", "bf16_n1_e128_k8", "f32_n4_e16_k4"}


def route_shape(name: str) -> MoEShape:
  n, e, k, norm_topk = ROUTES[name]
  return MoEShape("float32", n, 32, 16, e, k, norm_topk, EPS)


def expert_shape(name: str) -> MoEShape:
  dtype, n, h, i, e, k, norm_topk, _ = EXPERTS[name]
  return MoEShape(dtype, n, h, i, e, k, norm_topk, EPS)


def _specs(name: str, plan: MoEPlan) -> list[Spec]:
  prefix = "direct_" if plan.direct else ""
  return [Spec(f"{name}__{prefix}{kernel.name}", kernel.algorithm, kernel.defines, kernel.launches) for kernel in plan.kernels]


@pytest.fixture(scope="module")
def emu(dialect: str) -> LazyKernels:
  specs = [s for name in ROUTES for s in _specs(name, moe_plan(route_shape(name), direct=False))]
  specs += [s for name in EXPERTS for direct in (False, True) for s in _specs(name, moe_plan(expert_shape(name), direct=direct))]
  return emulate(dialect, specs, quick={s.name for s in specs if s.name.split("__")[0] in QUICK})


# ---- routing
def portable_route(logits: np.ndarray, k: int, norm_topk: bool) -> tuple[np.ndarray, np.ndarray]:
  """layers/moe.py's route on these logits (an identity router: the product gives them back exactly): (ids, weights)."""
  e = logits.shape[1]
  moe = MoEWeights(Tensor.eye(e).contiguous(), Tensor.zeros(e, 2, 1), Tensor.zeros(e, 1, 1), k, norm_topk)
  weights, ids = route(Tensor(np.ascontiguousarray(logits, np.float32)), moe)
  return ids.numpy(), weights.numpy()


def reference_groups(ids: np.ndarray, slots: int) -> np.ndarray:
  """moe.inc's groups layout for these ids: the pairs sorted by (expert, pair), then each used expert's slot."""
  flat = ids.reshape(-1)
  order = np.argsort(flat, kind="stable")
  used, start, count = np.unique(flat, return_index=True, return_counts=True)
  start = np.searchsorted(flat[order], used)
  pad = lambda a: np.concatenate([a, np.zeros(slots - len(used), np.int64)])
  return np.concatenate([order, pad(used), pad(start), pad(count)]).astype(np.int32)


def run_route(emu: LazyKernels, name: str, shape: MoEShape, logits: np.ndarray, order: str = "forward"):
  p = shape.pairs
  ids, weights, groups = np.full(p, -7, np.int32), np.full(p, np.nan, np.float32), np.full(p + 3 * shape.slots, -7, np.int32)
  emu.launch(f"{name}__routing", 0, [ids, weights, groups, np.ascontiguousarray(logits, np.float32).reshape(-1)], order)
  return ids.reshape(shape.tokens, shape.top_k), weights.reshape(shape.tokens, shape.top_k), groups


@pytest.mark.parametrize("name", list(ROUTES))
def test_route_matches_portable(emu, name):
  shape = route_shape(name)
  logits = np.random.default_rng(len(name)).standard_normal((shape.tokens, shape.experts)).astype(np.float32) * 3
  want_ids, want_w = portable_route(logits, shape.top_k, shape.norm_topk_prob)
  for order in ("forward", "reverse", "random"):
    ids, weights, groups = run_route(emu, name, shape, logits, order)
    np.testing.assert_array_equal(ids, want_ids)
    np.testing.assert_allclose(weights, want_w, rtol=2e-6, atol=1e-9)
    np.testing.assert_array_equal(groups, reference_groups(ids, shape.slots))


def test_route_ties_go_to_the_lowest_id(emu):
  """Equal logits: the lowest ids first, the same weights as the portable route's (which need not order ties alike)."""
  shape = route_shape("r_every_expert")
  logits = np.zeros((shape.tokens, shape.experts), np.float32)
  logits[1, ::3] = 1.0
  logits[2, 30:] = -np.inf   # probability 0: still chosen (k = E), lowest ids first
  ids, weights, groups = run_route(emu, "r_every_expert", shape, logits)
  assert (ids[0] == np.arange(40)).all() and (ids[1] == np.r_[0:40:3, [i for i in range(40) if i % 3]]).all()
  assert (ids[2] == np.arange(40)).all() and (weights[2, 30:] == 0).all()
  _, want_w = portable_route(logits, shape.top_k, shape.norm_topk_prob)
  np.testing.assert_allclose(weights, want_w, rtol=2e-6, atol=1e-9)
  np.testing.assert_array_equal(groups, reference_groups(ids, shape.slots))


def test_route_ids_stay_in_range_on_nan_logits(emu):
  """A NaN in the step (a diverged hidden state) must not send the products past the experts' weights."""
  shape = route_shape("r_e8_k2")
  logits = np.random.default_rng(3).standard_normal((shape.tokens, shape.experts)).astype(np.float32)
  logits[1] = np.nan
  ids, _, groups = run_route(emu, "r_e8_k2", shape, logits)
  assert ((ids >= 0) & (ids < shape.experts)).all() and (groups >= 0).all()
  np.testing.assert_array_equal(ids[[0, 2, 3, 4]], portable_route(logits[[0, 2, 3, 4]], shape.top_k, shape.norm_topk_prob)[0])


# ---- grouped products and the combine
def expert_logits(name: str, shape: MoEShape, rng: np.random.Generator) -> np.ndarray:
  logits = rng.standard_normal((shape.tokens, shape.experts)).astype(np.float32)
  if EXPERTS[name][-1] == "skewed":
    logits[:, 1] += 8.0                                # every token's pair
    logits[:, shape.experts // 3 * 2:] -= 30.0         # never chosen (while k <= 2E/3)
  return logits


def expert_inputs(shape: MoEShape, rng: np.random.Generator, used: np.ndarray) -> dict[str, np.ndarray]:
  """x, norm, residual and the experts' weights (`experts`: which, `gate_up` / `down`: theirs), rounded to the dtype.
  Every expert's for small shapes; for large ones (gate_up over 2^24 elements) only the `used` ones', the kernel's
  other experts zeros (calloc: never touched, so the full buffers cost little)."""
  n, h, i, e = shape.tokens, shape.hidden, shape.intermediate, shape.experts
  r = lambda *s, scale=1.0: round_to(rng.standard_normal(s).astype(np.float32) * scale, shape.dtype)
  experts = used if e * 2 * i * h > 1 << 24 else np.arange(e)
  return {"x": r(n, h), "norm": round_to(1 + 0.3 * rng.standard_normal(h).astype(np.float32), shape.dtype), "residual": r(n, h),
          "experts": experts, "gate_up": r(len(experts), 2 * i, h, scale=h ** -0.5), "down": r(len(experts), h, i, scale=i ** -0.5)}


def weight_bits(a: dict[str, np.ndarray], key: str, shape: MoEShape) -> np.ndarray:
  """The kernel's [E, rows, cols] buffer of `key`'s weights: the experts' own, zeros elsewhere."""
  rows, cols = a[key].shape[1:]
  bits = np.zeros((shape.experts, rows, cols), np.float32 if shape.dtype == "float32" else np.uint16)
  bits[a["experts"]] = to_bits(a[key], shape.dtype)
  return bits.reshape(-1)


def reference_moe(shape: MoEShape, a: dict[str, np.ndarray], ids: np.ndarray, weights: np.ndarray) -> np.ndarray:
  """residual + experts_gathered(rmsnorm(x)) in float32 tinygrad ops on the same rounded inputs, with these routes (only
  the used experts' weights handed over, ids renumbered among them)."""
  used, local = np.unique(ids, return_inverse=True)
  held = np.searchsorted(a["experts"], used)
  assert (a["experts"][held] == used).all()
  moe = MoEWeights(Tensor.zeros(len(used), shape.hidden), Tensor(a["gate_up"][held]), Tensor(a["down"][held]), shape.top_k,
                   shape.norm_topk_prob)
  xn = rms_norm(Tensor(a["x"]), Tensor(a["norm"]), shape.eps)
  y = experts_gathered(xn, moe, Tensor(weights), Tensor(local.reshape(ids.shape).astype(np.int32)))
  return (Tensor(a["residual"]) + y).numpy()


def run_experts(emu: LazyKernels, name: str, shape: MoEShape, a: dict[str, np.ndarray], groups: np.ndarray, weights: np.ndarray,
                order: str = "forward") -> tuple[np.ndarray, np.ndarray, np.ndarray]:
  """gate_up, down and the combine on poisoned outputs: (out [N, H] float32, down's float32 rows [P, H], gate_up's bits)."""
  p, h, i, dt = shape.pairs, shape.hidden, shape.intermediate, shape.dtype
  bits = lambda key: to_bits(a[key], dt).reshape(-1)
  gate_up = poisoned(p * 2 * i, dt)
  emu.launch(f"{name}__gate_up", 0, [gate_up, bits("x"), weight_bits(a, "gate_up", shape), groups, bits("norm")], order)
  assert not np.isnan(from_bits(gate_up, dt)).any(), "a gate_up element was never written"
  down = np.full(p * h, np.nan, np.float32)
  emu.launch(f"{name}__down", 0, [down, gate_up, weight_bits(a, "down", shape), groups], order)
  out = poisoned(shape.tokens * h, dt)
  emu.launch(f"{name}__routing", 1, [out, down, np.ascontiguousarray(weights, np.float32).reshape(-1), bits("residual")], order)
  return from_bits(out, dt).reshape(shape.tokens, h), down.reshape(p, h), gate_up


def run_direct(emu: LazyKernels, name: str, shape: MoEShape, a: dict[str, np.ndarray], logits: np.ndarray,
               order: str = "forward") -> dict[str, np.ndarray]:
  """The direct plan's two launches on poisoned outputs: out [N, H] and gate_up [P, 2I] as bits, ids and weights."""
  p, h, i, dt = shape.pairs, shape.hidden, shape.intermediate, shape.dtype
  bits = lambda key: to_bits(a[key], dt).reshape(-1)
  gate_up, ids, weights = poisoned(p * 2 * i, dt), np.full(p, -7, np.int32), np.full(p, np.nan, np.float32)
  emu.launch(f"{name}__direct_gate_up", 0, [gate_up, ids, weights, bits("x"), weight_bits(a, "gate_up", shape),
                                            np.ascontiguousarray(logits, np.float32).reshape(-1), bits("norm")], order)
  out = poisoned(shape.tokens * h, dt)
  emu.launch(f"{name}__direct_down", 0, [out, gate_up, weight_bits(a, "down", shape), ids, weights, bits("residual")], order)
  return {"out": out, "gate_up": gate_up, "ids": ids.reshape(shape.tokens, shape.top_k),
          "weights": weights.reshape(shape.tokens, shape.top_k)}


def relative_error(got: np.ndarray, want: np.ndarray, residual: np.ndarray) -> float:
  return float(np.abs(got - want).max() / np.abs(want - residual).max())


@pytest.mark.parametrize("name", list(EXPERTS))
def test_experts_match_gathered(emu, name):
  shape, rng = expert_shape(name), np.random.default_rng(len(name))
  assert unsupported_reason(shape) is None
  logits = expert_logits(name, shape, rng)
  ids, weights, groups = run_route(emu, name, shape, logits)
  want_ids, want_w = portable_route(logits, shape.top_k, shape.norm_topk_prob)
  np.testing.assert_array_equal(ids, want_ids)
  np.testing.assert_allclose(weights, want_w, rtol=2e-6, atol=1e-9)
  if EXPERTS[name][-1] == "skewed":   # the cases it is meant for: an expert with every token, experts with none
    assert (ids == 1).any(1).all() and len(np.unique(ids)) <= shape.experts // 3 * 2
  a = expert_inputs(shape, rng, np.unique(ids))
  want = reference_moe(shape, a, ids, weights)
  orders = ("forward",) if shape.hidden > 1024 else ("forward", "random")
  for order in orders:
    out, down, _ = run_experts(emu, name, shape, a, groups, weights, order)
    assert not np.isnan(out).any() and not np.isnan(down).any(), "an output element was never written"
    assert relative_error(out, want, a["residual"]) < TOLERANCE[shape.dtype]


@pytest.mark.parametrize("name", list(EXPERTS))
def test_direct_plan_equals_the_grouped_one(emu, name):
  """The direct plan (routing in tv_moe_up, the combine in tv_moe_down) writes the grouped plan's bits: the same ids and
  weights, gate_up rows and output (the same sums in the same order), every element written, in any block order; and
  so it matches the gathered reference as the grouped plan does."""
  shape, rng = expert_shape(name), np.random.default_rng(len(name))
  logits = expert_logits(name, shape, rng)
  ids, weights, groups = run_route(emu, name, shape, logits)
  a = expert_inputs(shape, rng, np.unique(ids))
  want = reference_moe(shape, a, ids, weights)
  grouped_out, _, gate_up = run_experts(emu, name, shape, a, groups, weights)
  grouped_out = to_bits(grouped_out, shape.dtype).reshape(-1)
  orders = ("forward",) if shape.hidden > 1024 else ("forward", "reverse", "random")
  for order in orders:
    got = run_direct(emu, name, shape, a, logits, order)
    np.testing.assert_array_equal(got["ids"], ids)
    np.testing.assert_array_equal(got["weights"], weights)
    np.testing.assert_array_equal(got["gate_up"], gate_up)
    np.testing.assert_array_equal(got["out"], grouped_out)
    out = from_bits(got["out"], shape.dtype).reshape(shape.tokens, shape.hidden)
    assert relative_error(out, want, a["residual"]) < TOLERANCE[shape.dtype]


def test_a_wrong_expert_or_weight_fails(emu):
  """The comparison catches a group reading another expert's weights, and a pair weighted with another's probability."""
  name = "f32_n4_e16_k4"
  shape, rng = expert_shape(name), np.random.default_rng(len(name))
  ids, weights, groups = run_route(emu, name, shape, expert_logits(name, shape, rng))
  a = expert_inputs(shape, rng, np.unique(ids))
  want = reference_moe(shape, a, ids, weights)
  assert relative_error(run_experts(emu, name, shape, a, groups, weights)[0], want, a["residual"]) < TOLERANCE["float32"]
  wrong_expert = groups.copy()
  wrong_expert[shape.pairs] = (groups[shape.pairs] + 1) % shape.experts    # slot 0 reads the next expert
  assert relative_error(run_experts(emu, name, shape, a, wrong_expert, weights)[0], want, a["residual"]) > 1e-2
  wrong_weight = weights.copy()
  wrong_weight[0, [0, 1]] = wrong_weight[0, [1, 0]]
  assert relative_error(run_experts(emu, name, shape, a, groups, wrong_weight)[0], want, a["residual"]) > 1e-2


def test_shapes_the_kernels_refuse():
  base = MoEShape("bfloat16", 16, 2048, 768, 128, 8, True, EPS)
  assert unsupported_reason(base) is None and base.pairs == MAX_PAIRS
  assert unsupported_reason(replace(base, tokens=17)) == LARGE_STEP
  assert unsupported_reason(replace(base, tokens=MAX_TOKENS, top_k=9)) == LARGE_STEP      # 144 pairs
  assert "top 9 of 8" in unsupported_reason(replace(base, tokens=1, experts=8, top_k=9))
  assert "multiple of 8" in unsupported_reason(replace(base, intermediate=100))
  assert "dtype" in unsupported_reason(replace(base, dtype="int8"))


def test_plan_of_qwen3_30b_at_one_token():
  """Grouped: each used expert one column of blocks, the 8 slots of a token's 8 experts; one routing block of a warp;
  passes of one row while the pairs spread over as many experts (passes of the average group's rows otherwise).
  Direct (the plan of up to four tokens): gate_up's blocks a (columns, pair), down's a (columns, token) of a warp a
  pair."""
  shape = MoEShape("bfloat16", 1, 2048, 768, 128, 8, True, EPS)
  plan = moe_plan(shape, direct=False)
  route, gate_up, down, combine = (launch for launch, _ in plan.steps)
  assert route.grid == (1, 1, 1) and route.threads == 32
  assert gate_up.grid == (1536 // 16, 8, 1) and down.grid == (2048 // 32, 8, 1)   # 4 columns a warp, 8 for down's K 768
  assert combine.grid == (2048 // 32, 1, 1)
  direct = moe_plan(shape)
  assert direct.direct and direct.routing is None
  up, down = (launch for launch, _ in direct.steps)
  assert (up.kernel, up.grid, up.threads) == ("tv_moe_up", (1536 // 32, 8, 1), 128)   # 8 columns a warp
  assert (down.kernel, down.grid, down.threads) == ("tv_moe_down", (2048 // 4, 1, 1), 256)   # 4 columns a block
  assert moe_plan(replace(shape, tokens=4)).direct and not moe_plan(replace(shape, tokens=5)).direct
  sixteen = moe_plan(MoEShape("bfloat16", 16, 2048, 768, 128, 8, True, EPS))
  assert sixteen.routing.launches[0].threads == 256 and sixteen.gate_up.launches[0].grid[1] == 128
  assert sixteen.gate_up.defines["TV_M"] == 1 and sixteen.down.defines["TV_SB"] == 2
  mixtral = moe_plan(MoEShape("bfloat16", 16, 4096, 14336, 8, 2, True, EPS))
  assert mixtral.gate_up.defines["TV_M"] == 4 and mixtral.gate_up.launches[0].grid[1] == 8


# ---- the backend op
# name -> (dtype, tokens, hidden, intermediate, experts, k, norm_topk_prob)
# (float16 rather than bfloat16: tinygrad's CPU backend here compiles no bfloat16 arithmetic; the kernels' bf16 is above)
BACKEND = {"f32_n1": ("float32", 1, 64, 32, 8, 2, True), "f16_n3": ("float16", 3, 128, 64, 16, 4, False),
           "f16_n16": ("float16", 16, 64, 32, 32, 8, True)}
TARGETS = {"cuda": DeviceTarget.nominal("cuda"), "metal": DeviceTarget.nominal("metal")}
TINY = {"float32": dtypes.float32, "float16": dtypes.float16}


def backend_inputs(name: str, cases: dict[str, tuple] = BACKEND) -> tuple[dict[str, np.ndarray], MoEWeights, dict[str, Tensor]]:
  """Rounded operands, the layer's weights in its dtype and the op's tensors (x, norm, residual) in it."""
  dtype, n, h, i, e, k, norm_topk = cases[name]
  rng = np.random.default_rng(len(name))
  r = lambda *s, scale=1.0, offset=0.0: round_to(offset + rng.standard_normal(s).astype(np.float32) * scale, dtype)
  a = {"x": r(n, h), "norm": r(h, scale=0.3, offset=1), "residual": r(n, h), "router": r(e, h, scale=2 * h ** -0.5),
       "gate_up": r(e, 2 * i, h, scale=h ** -0.5), "down": r(e, h, i, scale=i ** -0.5)}
  put = lambda key: Tensor(a[key]).cast(TINY[dtype]).contiguous().realize()
  moe = MoEWeights(put("router"), put("gate_up"), put("down"), k, norm_topk)
  return a, moe, {key: put(key) for key in ("x", "norm", "residual")}


def portable_reference(a: dict[str, np.ndarray], k: int, norm_topk: bool) -> np.ndarray:
  """portable_moe in float32 on the same rounded operands (the kernels' float32 logits route as its float32 ones)."""
  moe = MoEWeights(Tensor(a["router"]), Tensor(a["gate_up"]), Tensor(a["down"]), k, norm_topk)
  return portable_moe(Tensor(a["x"]), moe, norm=Tensor(a["norm"]), eps=EPS, residual=Tensor(a["residual"])).numpy()


def test_backend_moe_through_the_emulator(dialect, monkeypatch):
  """FusedBackend.moe with every launch (the router product too) on the emulator: the kernel path for decode-sized
  steps, against portable_moe; its outputs poisoned before each launch. On CUDA an sm_80 target, whose tuning table
  keeps steps of up to 16 tokens on these kernels (Hopper's hands 16-bit ones of 6 and more to the grouped GEMM:
  test_kernels_moe_grouped.py)."""
  import tinyvllm.kernels.linear as linear
  import tinyvllm.kernels.moe as moe_module
  from tinyvllm.kernels.fused import FusedBackend
  fake = EmulatedRunKernel(dialect, order="random")
  monkeypatch.setattr(moe_module, "run_kernel", fake)
  monkeypatch.setattr(linear, "run_kernel", fake)
  target = DeviceTarget.nominal("cuda", arch="sm_80") if dialect == "cuda" else TARGETS[dialect]
  backend = FusedBackend(replace(target, device="CPU"), log=pytest.fail)
  cases = {name: backend_inputs(name) for name in BACKEND}
  for _, moe, t in cases.values(): backend.moe(t["x"], moe, norm=t["norm"], eps=EPS, residual=t["residual"])   # collect
  fake.build()
  for name, (a, moe, t) in cases.items():
    got = backend.moe(t["x"], moe, norm=t["norm"], eps=EPS, residual=t["residual"]).float().numpy()
    want = portable_reference(a, moe.top_k, moe.norm_topk_prob)
    assert relative_error(got, want, a["residual"]) < TOLERANCE[BACKEND[name][0]], name
  assert backend.calls["moe"] == 2 * len(BACKEND) and "portable-moe" not in backend.calls
  direct = sum(BACKEND[name][1] <= DIRECT_MAX_TOKENS for name in BACKEND)   # steps of 1 and 3 tokens: the direct plan
  assert direct == 2 and fake.launches.count("tv_moe_up") == fake.launches.count("tv_moe_down") == direct
  grouped = len(BACKEND) - direct
  assert fake.launches.count("tv_moe_route") == grouped and fake.launches.count("tv_moe_linear") == 2 * grouped


def test_backend_moe_takes_large_steps_to_the_portable_path():
  """Above the bound (17 tokens, or 16 tokens of 9 experts each): portable_moe, said once; at it, the kernel path (its
  graph built on the CPU without compiling: collecting_sources)."""
  from tinyvllm.kernels.fused import FusedBackend
  from tinyvllm.kernels.tinygrad_program import collecting_sources
  messages = []
  backend = FusedBackend(replace(TARGETS["cuda"], device="CPU"), log=messages.append)
  rng = np.random.default_rng(0)
  h, i, e = 64, 32, 16
  w = lambda *s: Tensor(rng.standard_normal(s).astype(np.float32) * 0.2)
  layer = MoEWeights(w(e, h), w(e, 2 * i, h), w(e, h, i), 8, True)
  for n, k in ((17, 8), (16, 9), (32, 2)):
    x, residual, norm = w(n, h), w(n, h), w(h) + 1
    moe = replace(layer, top_k=k)
    assert moe_shape(x, moe, EPS)[1] == LARGE_STEP
    got = backend.moe(x, moe, norm=norm, eps=EPS, residual=residual).numpy()
    np.testing.assert_allclose(got, portable_moe(x, moe, norm=norm, eps=EPS, residual=residual).numpy(), rtol=1e-6, atol=1e-6)
  assert backend.calls["portable-moe"] == 3 and len(messages) == 1 and LARGE_STEP in messages[0] and "portable" in messages[0]
  with collecting_sources() as pending:
    x = w(16, h)
    assert moe_shape(x, layer, EPS)[1] is None
    backend.moe(x, layer, norm=w(h) + 1, eps=EPS, residual=w(16, h))
  assert backend.calls["moe"] == 1 and len(messages) == 1
  assert len(pending) == 4   # the router product (here the tensor-core GEMM: 16 rows on an H100), routing, gate_up, down
