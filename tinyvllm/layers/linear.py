"""The model's matrix products with their neighbouring small ops, as one call: [residual +] op(x) @ w.T [+ bias], where
op is an RMSNorm, the SwiGLU product silu(x1) * x2, the GeGLU product gelu_tanh(x1) * x2 (Gemma), or nothing. This is
the portable form (tinygrad ops, HF's order of operations); the CUDA/Metal backend runs decode-sized ones as one fused
kernel (tinyvllm/kernels/linear.py), SwiGLU only."""
from __future__ import annotations

from collections.abc import Callable

from tinygrad import Tensor, dtypes

from tinyvllm.backend.quantized import QuantizedWeight
from tinyvllm.layers.norm import rms_norm
from tinyvllm.layers.quantized import dequantize, permute_input

LinearFn = Callable[..., Tensor]


def portable_linear(x: Tensor, w: Tensor | QuantizedWeight, bias: Tensor | None = None, *, norm: Tensor | None = None,
                    eps: float = 1e-6, silu_mul: bool = False, gelu_mul: bool = False, residual: Tensor | None = None,
                    out_float32: bool = False) -> Tensor:
  """A quantized weight is dequantized inside the graph, in x's dtype (tinygrad fuses it into the product); an act-order
  one's input taken in its column order."""
  if isinstance(w, QuantizedWeight):
    x, reordered = permute_input(w, x, {"norm": norm, "silu_mul": silu_mul, "gelu_mul": gelu_mul})
    w, norm = dequantize(w, x.dtype), reordered["norm"]
  if norm is not None: x = rms_norm(x, norm, eps)
  if silu_mul or gelu_mul:
    half = x.shape[-1] // 2
    gate = x[:, :half]
    # computed once: fused into the product's reduction, tinygrad would recompute it for every output column (on the
    # CPU that made stories260K's down product of 8 rows take 0.28 ms instead of ~0.02); tinygrad's gelu is the tanh
    # form (HF's gelu_pytorch_tanh)
    x = ((gate.silu() if silu_mul else gate.gelu()) * x[:, half:]).contiguous()
  if out_float32: y = x.matmul(w.T, dtype=dtypes.float32).cast(dtypes.float32) + (0 if bias is None else bias.float())
  else: y = x.linear(w.T, bias)
  return y if residual is None else residual + y
