"""The packed-weight (quantized) products on the GPU, as part of bench/check_kernels.py: the decode kernel
(csrc/neutral/linear.inc with TV_WQ, 1-4 rows) and the tensor-core kernel (csrc/cuda/gemm_tc.inc with TV_WQ: decode
batches and prompt chunks, wgmma and mma.sync tiles, split K) against the portable path (tinygrad ops dequantizing the
same packed weight on the same device) for int8, int4 and FP8 codes, integer codes with arbitrary zero points (GPTQ /
AWQ / GGUF-like; act-order ones sorted by group, their input gathered), with the RMSNorm and SwiGLU prologues and the
residual; bf16 activations, Qwen3-0.6B's widths. Returns records for $OUT/kernels.json; raises AssertionError."""
from __future__ import annotations

import numpy as np

TOL = 2.5e-2   # bf16 outputs: max |kernel - portable| / max |portable|


def _weight(kind: str, out: int, cols: int, group: int, device: str, rng: np.random.Generator):
  from tinygrad import Tensor, dtypes

  from tinyvllm.layers.quantized import quantize_rtn
  from tinyvllm.model.quantization.unpacked import UnpackedWeight, upload
  if kind in ("int8", "int4", "fp8"):
    w = Tensor(rng.standard_normal((out, cols)).astype(np.float32) * 0.05, device=device).cast(dtypes.bfloat16)
    return quantize_rtn(w, kind, group)
  bits = 4   # "asym4": GPTQ/AWQ-style codes with zero points; "act4" the same with act-order groups (g_idx)
  groups = (out, cols // group)
  g_idx = rng.permutation(np.arange(cols) // group).astype(np.int32) if kind == "act4" else None
  u = UnpackedWeight(rng.integers(0, 16, (out, cols)).astype(np.uint8), (rng.random(groups) * 0.01).astype(np.float16),
                     rng.integers(0, 16, groups).astype(np.uint8), g_idx, group, bits)
  return upload(u, "gptq", "int", dtypes.bfloat16, device)


def check_quant(target, device: str) -> list[dict]:
  from tinygrad import Tensor, dtypes

  from tinyvllm.kernels.linear import fused_linear, linear_shape, pick_kernel
  from tinyvllm.layers.linear import portable_linear
  from tinyvllm.layers.quantized import permute_input
  rng, records = np.random.default_rng(0), []
  # (weight kind, rows, in, out, group, prologue): Qwen3-0.6B's qkv (1024 -> 4096), down (3072 -> 1024, SwiGLU in)
  cases = [("int8", 1, 1024, 4096, 1024, "norm"), ("int4", 4, 1024, 4096, 128, "norm"), ("fp8", 16, 1024, 4096, 1024, "norm"),
           ("asym4", 2, 3072, 1024, 128, "silu"), ("int4", 1, 3072, 1024, 128, "silu"), ("int8", 8, 1024, 1024, 1024, "residual"),
           # the tensor-core kernel: decode batches (mma.sync, wgmma 64x64, split K) and a prompt chunk (wgmma 128x128)
           ("int8", 64, 1024, 4096, 1024, "norm"), ("int4", 256, 1024, 6144, 128, "norm"), ("asym4", 256, 3072, 1024, 128, "silu"),
           ("fp8", 256, 2048, 1024, 2048, "residual"), ("int4", 2048, 1024, 4096, 128, "norm"), ("fp8", 2048, 3072, 1024, 3072, "silu"),
           # GGUF's packed forms (tinyvllm/model/gguf): Q4_K's int4 groups of 32, Q6_K's int8 groups of 16, Q8_0's int8 groups of 32
           ("int4", 1, 1024, 4096, 32, "norm"), ("int8", 3, 3072, 1024, 16, "silu"), ("int8", 1, 1024, 1024, 32, "residual"),
           ("int4", 64, 1024, 6144, 32, "norm"), ("int8", 256, 3072, 1024, 16, "silu"), ("int8", 512, 1024, 4096, 32, "norm"),
           # FP8 in blocks of 128 x 128 (Qwen's FP8 releases, ModelOpt's FP8_PB_WO): E4M3 codes in groups of 128 a row
           ("fp8", 1, 1024, 4096, 128, "norm"), ("fp8", 2, 3072, 1024, 128, "silu"), ("fp8", 256, 1024, 4096, 128, "norm"),
           # NVFP4 checkpoints (modelopt_fp4, compressed-tensors nvfp4-pack-quantized): E4M3 codes in groups of 16
           ("fp8", 1, 1024, 4096, 16, "norm"), ("fp8", 2, 3072, 1024, 16, "silu"), ("fp8", 256, 1024, 4096, 16, "norm"),
           # act-order (columns sorted by group, the input gathered into that order, as the portable path does too)
           ("act4", 1, 1024, 4096, 128, "norm"), ("act4", 2, 3072, 1024, 128, "silu"), ("act4", 256, 1024, 4096, 128, "norm")]
  for kind, rows, cols, out, group, prologue in cases:
    w = _weight(kind, out, cols, group, device, rng)
    bf16 = lambda a: Tensor(a.astype(np.float32), device=device).cast(dtypes.bfloat16)
    x = bf16(rng.standard_normal((rows, 2 * cols if prologue == "silu" else cols)))
    extra = {"norm": {"norm": bf16(1 + 0.3 * rng.standard_normal(cols))}, "silu": {"silu_mul": True},
             "residual": {"residual": bf16(rng.standard_normal((rows, out)))}}[prologue]
    xp, extra_p = permute_input(w, x, extra)   # (an act-order weight's column order; others as they are)
    shape = linear_shape(xp, w, None, extra_p.get("norm"), 1e-6, prologue == "silu", extra.get("residual"), False)
    kernel = pick_kernel(target, shape)
    got = fused_linear(target, xp, w, **extra_p)
    assert got is not None, f"{kind} {rows}x{cols}->{out}: the kernel did not take the shape"
    ref = portable_linear(x, w, **extra).float().numpy()
    err = float(np.abs(got.float().numpy() - ref).max() / np.abs(ref).max())
    records.append({"weight": kind, "rows": rows, "in": cols, "out": out, "group": group, "prologue": prologue, "kernel": kernel,
                    "rel_err": err})
    assert err < TOL, f"{kind} {rows}x{cols}->{out} ({prologue}): relative error {err:.3g}"
  return records
