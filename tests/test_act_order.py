"""GPTQ act-order weights (desc_act: each input column's group in g_idx) loaded with their columns sorted by group, as
vLLM's act-order kernels take them: the product reads its input in that order (layers/quantized.py's permute_input), so
the fused kernels see a plain grouped weight. Checked against the products of the weight as the checkpoint gives it,
computed in numpy; the whole-model check against HF is tests/test_quantization.py's act-order checkpoints."""
from __future__ import annotations

import numpy as np
import pytest
from tinygrad import Tensor, dtypes

from tests.emulator.cases import from_bits, to_bits
from tests.emulator.emulator import Spec, emulate, poisoned
from tinyvllm.kernels.linear import LinearShape, linear_plan
from tinyvllm.layers.linear import portable_linear
from tinyvllm.layers.quantized import permute_input
from tinyvllm.layers.scatter import gather_columns
from tinyvllm.model.quantization.unpacked import UnpackedWeight, sorted_by_group, upload

EPS = 1e-5
OUT, K, GROUP = 24, 128, 32


def act_order_weight(rng: np.random.Generator, k: int = K, sizes: list[int] | None = None) -> UnpackedWeight:
  """int4 codes with zero points and float16 scales; the groups' columns scattered over the input (g_idx)."""
  sizes = sizes or [GROUP] * (k // GROUP)
  g_idx = rng.permutation(np.repeat(np.arange(len(sizes)), sizes)).astype(np.int32)
  return UnpackedWeight(rng.integers(0, 16, (OUT, k)).astype(np.uint8),
                        ((rng.random((OUT, k // GROUP)) + 0.5) / 40).astype(np.float16),
                        rng.integers(6, 11, (OUT, k // GROUP)).astype(np.uint8), g_idx, GROUP, 4)


def dequantized(w: UnpackedWeight) -> np.ndarray:
  """The weight [out, in] as the checkpoint means it: column c takes its group g_idx[c]'s scale and zero point."""
  group = w.g_idx if w.g_idx is not None else np.arange(w.codes.shape[1]) // w.group_size
  return (w.codes.astype(np.float32) - w.zeros[:, group].astype(np.float32)) * w.scales[:, group].astype(np.float32)


def rms_norm(x: np.ndarray, g: np.ndarray) -> np.ndarray:
  return x / np.sqrt((x * x).mean(axis=-1, keepdims=True) + EPS) * g


def silu(x: np.ndarray) -> np.ndarray: return x / (1 + np.exp(-x))


def test_gather_columns_takes_the_named_columns():
  x = np.random.default_rng(0).standard_normal((5, 40)).astype(np.float32)
  index = np.array([3, 39, 0, 3, 17, 40, -1], dtype=np.int32)   # repeats; past either end: zeros
  got = gather_columns(Tensor(x), Tensor(index)).numpy()
  want = np.where((index >= 0) & (index < 40), x[:, np.clip(index, 0, 39)], 0)
  np.testing.assert_array_equal(got, want)
  with pytest.raises(ValueError, match="1-D int32"): gather_columns(Tensor(x), Tensor(index.astype(np.int64)))


def test_columns_sorted_by_group_where_every_group_is_whole():
  rng = np.random.default_rng(1)
  w = act_order_weight(rng)
  ordered, perm = sorted_by_group(w)
  assert ordered.g_idx is None and sorted(perm) == list(range(K))
  np.testing.assert_array_equal(dequantized(ordered), dequantized(w)[:, perm])   # group runs: column j's group is j // 32
  uneven = act_order_weight(rng, sizes=[40, 24, 32, 32])   # a group of 40: no run of 32 holds it, g_idx stays
  kept, none = sorted_by_group(uneven)
  assert kept is uneven and none is None
  packed = upload(w, "gptq", "int", dtypes.float32, "CPU")
  assert packed.perm is not None and packed.g_idx is None and "act-order" in packed.describe()
  assert upload(uneven, "gptq", "int", dtypes.float32, "CPU").g_idx is not None


@pytest.mark.parametrize("prologue", ["norm", "silu_mul"])
def test_sorted_weight_products_equal_the_checkpoints(prologue):
  """The portable product and the skinny kernel (emulated, float32) on the sorted weight and the permuted input equal
  the product of the weight in the checkpoint's order, with the RMSNorm or the SwiGLU prologue."""
  rng = np.random.default_rng(2)
  w, rows = act_order_weight(rng), 3
  x = rng.standard_normal((rows, 2 * K if prologue == "silu_mul" else K)).astype(np.float32)
  g = (1 + 0.3 * rng.standard_normal(K)).astype(np.float32)
  xp = rms_norm(x, g) if prologue == "norm" else silu(x[:, :K]) * x[:, K:]
  want = xp @ dequantized(w).T
  packed = upload(w, "gptq", "int", dtypes.float32, "CPU")
  fused = {"norm": Tensor(g)} if prologue == "norm" else {"silu_mul": True}
  portable = portable_linear(Tensor(x), packed, eps=EPS, **fused).numpy()
  np.testing.assert_allclose(portable, want, rtol=2e-5, atol=2e-5 * np.abs(want).max())
  ordered_x, ordered = permute_input(packed, Tensor(x), fused)
  shape = LinearShape("float32", rows, K, OUT, False, EPS if prologue == "norm" else None, prologue == "silu_mul", False,
                      False, "int4", GROUP)
  plan = linear_plan(shape)
  emu = emulate("cuda", [Spec("act_order", "linear", plan.defines, (plan.launch,))])
  out = poisoned(rows * OUT, "float32")
  args = [out, to_bits(ordered_x.numpy(), "float32").reshape(-1), packed.codes.numpy().reshape(-1),
          packed.scales.numpy().reshape(-1), packed.shifts.numpy().reshape(-1)]
  if prologue == "norm": args.append(to_bits(ordered["norm"].numpy(), "float32"))
  emu.launch("act_order", 0, args)
  np.testing.assert_allclose(from_bits(out, "float32").reshape(rows, OUT), want, rtol=2e-5, atol=2e-5 * np.abs(want).max())


@pytest.mark.parametrize("taken", [True, False])
def test_fused_backend_hands_the_kernel_the_gathered_input(monkeypatch, taken):
  """The kernels get x and the norm's weight in the sorted order; where no kernel takes the product, the portable
  linear gets them as the caller gave them (it gathers them itself) and the result is the checkpoint's product."""
  from dataclasses import replace

  from tinyvllm.kernels import fused as fused_module
  from tinyvllm.kernels.fused import FusedBackend
  from tinyvllm.platform.target import DeviceTarget
  rng = np.random.default_rng(3)
  w = act_order_weight(rng)
  packed = upload(w, "gptq", "int", dtypes.float32, "CPU")
  x, g = rng.standard_normal((2, K)).astype(np.float32), (1 + 0.3 * rng.standard_normal(K)).astype(np.float32)
  seen: dict = {}
  def kernel(target, xs, weight, bias, **fused):
    seen.update(x=xs.numpy(), norm=fused["norm"].numpy())
    return Tensor.zeros(2, OUT).contiguous() if taken else None
  monkeypatch.setattr(fused_module, "fused_linear", kernel)
  backend = FusedBackend(replace(DeviceTarget.nominal("cuda"), device="CPU"), log=lambda message: None)
  y = backend.linear(Tensor(x), packed, norm=Tensor(g), eps=EPS).numpy()
  perm = packed.perm.numpy()
  np.testing.assert_array_equal(seen["x"], x[:, perm])
  np.testing.assert_array_equal(seen["norm"], g[perm])
  want = np.zeros((2, OUT)) if taken else rms_norm(x, g) @ dequantized(w).T
  np.testing.assert_allclose(y, want, rtol=2e-5, atol=2e-5 * max(1.0, np.abs(want).max()))
