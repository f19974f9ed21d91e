"""The mixture-of-experts kernels on the GPU, as part of bench/check_kernels.py: FusedBackend.moe (the router product,
routing and grouping, the grouped gate_up and down products, the combine: tinyvllm/kernels/moe.py) against portable_moe
at Qwen3-30B-A3B's shape (hidden 2,048, experts' intermediate 768, 128 experts, top 8 renormalised) for 1, 4 and 16
tokens, bf16 weights made on the device.

The reference is portable_moe on float32 copies of the same bf16 values (both route on float32 logits; the bf16 portable
path rounds the normed activations to bf16 before the router, so a near-tie between two experts may still go the other
way there: its error is printed too, for information). Errors are
max |kernel - reference| / max |reference - residual| (the experts' part). Then both paths are timed under TinyJit over
LAYERS layers of their own weights (so the experts come from HBM, not L2), with the expert bytes each layer reads.
Returns records for $OUT/kernels.json; raises AssertionError."""
from __future__ import annotations

import time

import numpy as np

HIDDEN, INTER, EXPERTS, TOP_K = 2048, 768, 128, 8
TOL = 2.5e-2
LAYERS = 4
EPS = 1e-6


def _layer(device: str, seed: int):
  """A random sparse layer in bf16 on the device (router scaled for logits of about unit spread)."""
  from tinygrad import Tensor, dtypes

  from tinyvllm.backend.weights import MoEWeights
  Tensor.manual_seed(seed)
  w = lambda *s, scale: (Tensor.randn(*s, device=device) * scale).cast(dtypes.bfloat16).contiguous().realize()
  return MoEWeights(w(EXPERTS, HIDDEN, scale=HIDDEN ** -0.5), w(EXPERTS, 2 * INTER, HIDDEN, scale=HIDDEN ** -0.5),
                    w(EXPERTS, HIDDEN, INTER, scale=INTER ** -0.5), TOP_K, True)


def _float32(moe):
  from dataclasses import replace
  return replace(moe, router=moe.router.float().contiguous().realize(), gate_up_proj=moe.gate_up_proj.float().contiguous().realize(),
                 down_proj=moe.down_proj.float().contiguous().realize())


def _inputs(tokens: int, device: str):
  from tinygrad import Tensor, dtypes
  Tensor.manual_seed(1000 + tokens)
  bf16 = lambda t: t.cast(dtypes.bfloat16).contiguous().realize()
  return (bf16(Tensor.randn(tokens, HIDDEN, device=device)), bf16(1 + 0.3 * Tensor.randn(HIDDEN, device=device)),
          bf16(Tensor.randn(tokens, HIDDEN, device=device)))


def _experts_read(x, norm, moe) -> int:
  """Bytes of expert weights (and the router) one layer reads for this step on the kernel path: each used expert once."""
  from tinyvllm.layers.moe import route
  from tinyvllm.layers.norm import rms_norm
  ids = route(rms_norm(x.float(), norm.float(), EPS), _float32(moe))[1].numpy()
  return len(np.unique(ids)) * 3 * HIDDEN * INTER * 2 + EXPERTS * HIDDEN * 2


def _time(fn, layers: list, device: str, iters: int) -> float:
  """us per layer of fn(layer) over every layer in one TinyJit call (3 warm-up replays)."""
  from tinygrad import Device, Tensor, TinyJit
  jit = TinyJit(lambda: Tensor.stack(*[fn(moe) for moe in layers]).realize())
  for _ in range(3): jit()
  Device[device].synchronize()
  t = time.perf_counter()
  for _ in range(iters): jit()
  Device[device].synchronize()
  return (time.perf_counter() - t) / iters / len(layers) * 1e6


def _check_tokens(target, device: str, n: int, layers: list, reference_layer, iters: int) -> dict:
  from tinyvllm.kernels.fused import FusedBackend
  from tinyvllm.layers.moe import portable_moe
  x, norm, residual = _inputs(n, device)
  backend = FusedBackend(target)
  got = backend.moe(x, layers[0], norm=norm, eps=EPS, residual=residual).float().numpy()
  assert dict(backend.calls) == {"moe": 1}, f"{n} tokens did not take the kernel path: {dict(backend.calls)}"
  want = portable_moe(x.float(), reference_layer, norm=norm.float(), eps=EPS, residual=residual.float()).numpy()
  bf16 = portable_moe(x, layers[0], norm=norm, eps=EPS, residual=residual).float().numpy()
  scale = np.abs(want - residual.float().numpy()).max()
  rec = {"name": f"moe_qwen3_30b_a3b_n{n}", "tokens": n, "rel_err": float(np.abs(got - want).max() / scale),
         "rel_err_vs_bf16_portable": float(np.abs(got - bf16).max() / scale), "nan": bool(np.isnan(got).any())}
  rec["fused_us_per_layer"] = _time(lambda moe: backend.moe(x, moe, norm=norm, eps=EPS, residual=residual), layers, device, iters)
  rec["portable_us_per_layer"] = _time(lambda moe: portable_moe(x, moe, norm=norm, eps=EPS, residual=residual), layers, device, iters)
  rec["weight_bytes_per_layer"] = int(np.mean([_experts_read(x, norm, moe) for moe in layers]))
  rec["fused_GBps"] = rec["weight_bytes_per_layer"] / rec["fused_us_per_layer"] / 1e3
  rec["calls"] = dict(backend.calls)
  rec["ok"] = rec["rel_err"] < TOL and not rec["nan"]
  print(f"{'ok  ' if rec['ok'] else 'FAIL'} moe Qwen3-30B-A3B shape, {n:>2} tokens: max rel err {rec['rel_err']:.2e} vs float32 "
        f"portable ({rec['rel_err_vs_bf16_portable']:.2e} vs bf16 portable, its own routing); fused {rec['fused_us_per_layer']:.1f} "
        f"us/layer ({rec['fused_GBps']:.0f} GB/s of expert weights), portable {rec['portable_us_per_layer']:.1f} us/layer", flush=True)
  return rec


def check_moe(target, device: str, tokens=(1, 4, 16), iters: int = 20) -> list[dict]:
  layers = [_layer(device, seed) for seed in range(LAYERS)]
  reference_layer = _float32(layers[0])
  records = [_check_tokens(target, device, n, layers, reference_layer, iters) for n in tokens]
  for rec in records: assert rec["ok"], f"{rec['name']}: relative error {rec['rel_err']:.3g} (NaN: {rec['nan']})"
  return records
