"""Packed (quantized) experts on the mixture-of-experts kernels, run on the CPU through the C++ emulation: the whole
backend op (FusedBackend.moe, every launch on the emulator, the router product too) with int8, int4 and FP8 experts
(their rows stacked, as the loader quantizes them) against portable_moe on the same packed weights in float32: the
direct plan (1-4 tokens) and the grouped skinny products (5-16 tokens) in both dialects, and the grouped tensor-core
GEMM (17 and more) on CUDA; scale groups per channel and of 32 and 64 columns (a lane's step a span of 16 bytes of
codes), and of 8 and 16 (a vector of activations a step); gate_up and down in different forms (a GGUF Q4_K_M layer's
int4 and int8 codes; packed gate_up beside a float16 down); a scale changed in the kernels' copy alone fails the
comparison."""
from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
from tinygrad import Tensor, dtypes

from tests.emulator.cases import round_to
from tests.emulator.emulator import EmulatedRunKernel
from tests.test_kernels_moe import TOLERANCE, relative_error
from tinyvllm.backend.weights import MoEWeights
from tinyvllm.kernels.moe import MoEShape
from tinyvllm.layers.moe import portable_moe
from tinyvllm.layers.quantized import quantize_rtn
from tinyvllm.platform.target import DeviceTarget

EPS = 1e-6
TARGETS = {"cuda": DeviceTarget.nominal("cuda"), "metal": DeviceTarget.nominal("metal")}
# name -> (tokens, hidden, intermediate, experts, k, format, group: 0 for one scale a row; or, for down's own: its format
# and group after)
CASES = {
  "q4_k_m_n2": (2, 128, 64, 8, 2, "int4", 32, "int8", 16),   # a GGUF Q4_K_M layer: Q4_K gate/up, Q6_K down
  "q4_k_m_n24": (24, 128, 64, 8, 2, "int4", 32, "int8", 16),
  "int4_up_bf16_down_n5": (5, 128, 64, 8, 2, "int4", 32, "elem", 0),
  "int8_n1": (1, 128, 64, 8, 2, "int8", 0),
  "int4_g32_n3": (3, 128, 64, 16, 4, "int4", 32),
  "fp8_n12": (12, 64, 32, 16, 4, "fp8", 0),
  "int4_g64_n16": (16, 128, 64, 8, 2, "int4", 64),
  "int4_g16_n2": (2, 128, 64, 8, 2, "int4", 16),         # groups narrower than a span of codes: a vector a step
  "int8_g8_n9": (9, 64, 32, 8, 4, "int8", 8),
  "int8_g32_n20": (20, 128, 64, 8, 2, "int8", 32),       # the grouped GEMM (CUDA)
  "int4_g32_n64": (64, 128, 64, 16, 4, "int4", 32),
  "fp8_n40": (40, 64, 32, 8, 8, "fp8", 0),               # every token routed to every expert
}
GEMM_TOKENS = 17   # from here the grouped tensor-core path (CUDA)


def packed_layer(name: str) -> tuple[MoEWeights, MoEWeights, dict[str, Tensor], dict[str, Tensor]]:
  """(the layer as the kernels take it: float16 router, packed experts; the same in float32 for the reference; the op's
  float16 tensors; their float32 values)."""
  n, h, i, e, k, fmt, group, *down_form = CASES[name]
  down_fmt, down_group = down_form or (fmt, group)
  rng = np.random.default_rng(len(name))
  r = lambda *s, scale=1.0, offset=0.0: round_to(offset + rng.standard_normal(s).astype(np.float32) * scale, "float16")
  gate_up, down = r(e * 2 * i, h, scale=h ** -0.5), r(e * h, i, scale=i ** -0.5)
  q_up = quantize_rtn(Tensor(gate_up).cast(dtypes.float16), fmt, group or h)
  q_down = (quantize_rtn(Tensor(down).cast(dtypes.float16), down_fmt, down_group or i) if down_fmt != "elem"
            else Tensor(down).cast(dtypes.float16).reshape(e, h, i).contiguous().realize())
  router = r(e, h, scale=2 * h ** -0.5)
  half = MoEWeights(Tensor(router).cast(dtypes.float16).contiguous().realize(), q_up, q_down, k, True)
  as_float32 = lambda w: w.float() if isinstance(w, Tensor) else replace(w, dtype=dtypes.float32)
  full = MoEWeights(Tensor(router), as_float32(q_up), as_float32(q_down), k, True)
  values = {"x": r(n, h), "norm": r(h, scale=0.3, offset=1), "residual": r(n, h)}
  return (half, full, {key: Tensor(v).cast(dtypes.float16).contiguous().realize() for key, v in values.items()},
          {key: Tensor(v) for key, v in values.items()})


def backend_on_emulator(dialect: str, monkeypatch):
  import tinyvllm.kernels.linear as linear
  import tinyvllm.kernels.moe as moe_module
  import tinyvllm.kernels.moe_grouped as grouped
  from tinyvllm.kernels.fused import FusedBackend
  fake = EmulatedRunKernel(dialect, order="random")
  for module in (moe_module, grouped, linear): monkeypatch.setattr(module, "run_kernel", fake)
  return FusedBackend(replace(TARGETS[dialect], device="CPU"), log=pytest.fail), fake


def run_cases(backend, fake, names: list[str], edit=None) -> dict[str, float]:
  """Each case's error against portable_moe on the float32 packed weights (`edit` changes the kernels' layer first)."""
  layers = {name: packed_layer(name) for name in names}
  if edit is not None: layers = {name: (edit(half), full, t, v) for name, (half, full, t, v) in layers.items()}
  for half, _, t, _ in layers.values(): backend.moe(t["x"], half, norm=t["norm"], eps=EPS, residual=t["residual"])   # collect
  fake.build()
  errors = {}
  for name, (half, full, t, v) in layers.items():
    got = backend.moe(t["x"], half, norm=t["norm"], eps=EPS, residual=t["residual"]).float().numpy()
    want = portable_moe(v["x"], full, norm=v["norm"], eps=EPS, residual=v["residual"]).numpy()
    errors[name] = relative_error(got, want, v["residual"].numpy())
  return errors


@pytest.mark.parametrize("dialect", ["cuda", "metal"])
def test_decode_kernels_take_packed_experts(dialect, monkeypatch):
  backend, fake = backend_on_emulator(dialect, monkeypatch)
  names = [name for name, case in CASES.items() if case[0] < GEMM_TOKENS]
  errors = run_cases(backend, fake, names)
  assert all(err < TOLERANCE["float16"] for err in errors.values()), errors
  assert backend.calls["moe"] == 2 * len(names) and "portable-moe" not in backend.calls
  assert "tv_moe_up" in fake.launches and "tv_moe_linear" in fake.launches   # both plans


def test_grouped_gemm_takes_packed_experts(monkeypatch):
  backend, fake = backend_on_emulator("cuda", monkeypatch)
  names = [name for name, case in CASES.items() if case[0] >= GEMM_TOKENS]
  errors = run_cases(backend, fake, names)
  assert all(err < TOLERANCE["float16"] for err in errors.values()), errors
  assert backend.calls["moe-grouped"] == 2 * len(names) and "portable-moe" not in backend.calls


@pytest.mark.parametrize("tokens", [3, 20])
def test_a_wrong_scale_fails(tokens, monkeypatch):
  """The last expert's gate_up scales doubled in the kernels' weights only: the comparison catches it (so the kernels
  read the scales of each expert's own rows)."""
  backend, fake = backend_on_emulator("cuda", monkeypatch)
  name = "int4_g32_n3" if tokens < GEMM_TOKENS else "int8_g32_n20"
  _, _, i, e, *_ = CASES[name]
  def edit(layer: MoEWeights) -> MoEWeights:
    scales = layer.gate_up_proj.scales.numpy()
    scales[(e - 1) * 2 * i:] *= 2
    return replace(layer, gate_up_proj=replace(layer.gate_up_proj, scales=Tensor(scales)), top_k=e)   # every expert used
  assert run_cases(backend, fake, [name], edit)[name] > 0.05


def test_a_lane_takes_a_span_of_codes_where_the_group_allows():
  """16 bytes of codes a lane's step (32 int4 or 16 int8 / FP8 columns) where K and the scale group are whole spans,
  else a vector of activations; a batch (TV_SB steps) holds as many columns of x' as the 16-bit weights' batch of 16
  vectors, half as many where the codes come a vector a step; packed products take 4 columns a warp in the grouped plan
  (Qwen3-30B-A3B's shape: (columns a warp, steps a batch, span) of gate_up and of down)."""
  from tinyvllm.kernels.moe import moe_plan
  def layout(n: int, fmt: str, groups: tuple[int, int]) -> list[tuple]:
    plan = moe_plan(MoEShape("bfloat16", n, 2048, 768, 128, 8, True, EPS, ((fmt, groups[0]), (fmt, groups[1]))))
    return [(k.defines["TV_RPW"], k.defines["TV_SB"], k.defines.get("TV_WSPAN")) for k in (plan.gate_up, plan.down)]
  assert layout(1, "elem", (0, 0)) == [(8, 2, None), (4, 4, None)]   # the direct plan's columns
  assert layout(1, "int4", (128, 128)) == [(8, 1, 32), (4, 1, 32)]
  assert layout(1, "fp8", (2048, 768)) == [(8, 1, 16), (4, 2, 16)]
  assert layout(16, "elem", (0, 0)) == [(4, 4, None), (8, 2, None)]
  assert layout(16, "int8", (2048, 768)) == [(4, 2, 16), (4, 2, 16)]
  assert layout(16, "fp8", (2048, 768)) == [(4, 1, 16), (4, 1, 16)]   # (the E4M3 conversion's registers: one step a batch)
  assert layout(16, "int4", (16, 16)) == [(4, 2, None), (4, 2, None)]   # groups narrower than a span
