"""The wide products (the logits: Qwen3-0.6B's and Qwen3-30B-A3B's LM heads with the final RMSNorm, float32 out) on the
GPU, as part of bench/check_kernels.py: the planner's kernel (on sm_90 the skinny product's sums on tensor cores,
csrc/cuda/linear_tc.inc) and the FMA form of the skinny product against a float32 product in tinygrad ops, at 1-16
rows; a row's logits are the same bits at every row count in the planner's kernel. bf16 weights and activations.
Returns records for $OUT/kernels.json; raises AssertionError."""
from __future__ import annotations

import numpy as np

TOL = 1e-4   # max |kernel - float32| / max |float32|: the same products, float32 sums in another order


def check_logits(target, device: str) -> list[dict]:
  from tinygrad import Tensor, dtypes

  from tinyvllm.kernels.linear import linear_shape, pick_kernel, run_linear
  from tinyvllm.layers.linear import portable_linear
  rng, records = np.random.default_rng(0), []
  for k, out in ((1024, 151936), (2048, 151936)):
    w = (Tensor.randn(out, k, device=device, dtype=dtypes.bfloat16) * 0.05).realize()
    g = Tensor((1 + 0.2 * rng.standard_normal(k)).astype(np.float32), device=device).cast(dtypes.bfloat16).realize()
    x_all = Tensor(rng.standard_normal((16, k)).astype(np.float32), device=device).cast(dtypes.bfloat16).realize()
    first_row = None
    for rows in (1, 2, 5, 8, 16):
      x = x_all[:rows].contiguous().realize()
      shape = linear_shape(x, w, None, g, 1e-6, False, None, True)
      planned = pick_kernel(target, shape)
      ref = portable_linear(x.float(), w.float(), norm=g.float(), eps=1e-6, out_float32=True).numpy()
      got = run_linear(target, shape, planned, x, w, norm=g).numpy()
      fma = run_linear(target, shape, "skinny", x, w, norm=g).numpy() if planned != "skinny" else got
      err, vs_fma = (float(np.abs(a - ref).max() / np.abs(ref).max()) for a in (got, fma))
      first_row = got[0] if first_row is None else first_row
      same_bits = bool(np.array_equal(got[0].view(np.uint32), first_row.view(np.uint32)))
      records.append({"in": k, "out": out, "rows": rows, "kernel": planned, "rel_err": err, "fma_rel_err": vs_fma,
                      "row0_same_bits_as_one_row": same_bits})
      assert err < TOL and vs_fma < TOL, f"logits {rows}x{k}->{out} ({planned}): relative error {err:.3g}, FMA form {vs_fma:.3g}"
      assert planned != "skinny_tc" or same_bits, f"logits {rows}x{k} ({planned}): row 0 differs from the one-row product"
  return records
