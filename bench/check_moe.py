"""The mixture-of-experts kernels on the GPU, as part of bench/check_kernels.py: FusedBackend.moe against portable_moe at
Qwen3-30B-A3B's shape (hidden 2,048, experts' intermediate 768, 128 experts, top 8 renormalised), bf16 weights made on
the device: the decode kernels (the router product, routing and grouping, the grouped skinny products, the combine:
tinyvllm/kernels/moe.py) at 1, 4 and 16 tokens, and the grouped tensor-core path (tinyvllm/kernels/moe_grouped.py:
x', router product, routing and alignment, the grouped gate_up and down GEMMs, the combine) at 64, 256, 2,048 and 8,192
tokens (and at the decode steps the tuning table hands it, `moe.decode_kernel_max_tokens`: 16 on Hopper), with other
tiles than the planner's timed beside it at 256, 2,048 and 8,192 (the tuning table's `moe` section); then packed experts
(bench/check_moe_packed.py).

The decode kernels' reference is portable_moe on float32 copies of the same bf16 values (both route on float32 logits;
the bf16 portable path rounds the normed activations to bf16 before the router, so a near-tie between two experts may
still go the other way there: its error is printed too, for information). The grouped path routes on float32 logits of
its bf16 x' (as the portable path does), so its reference is the float32 portable path on the bf16 x', where a token may
still route otherwise only if its k-th and (k+1)-th experts tie within the logits' rounding (TIE; counted and printed);
a token's result depends on that token alone, so above 256 tokens it is computed for 256 of them, spread over the step.
Errors are max |kernel - reference| / max |reference - residual| (the experts' part). Then both paths are timed under
TinyJit over LAYERS layers of their own weights (so the experts come from HBM, not L2), with the expert bytes each layer
reads and, on the grouped path, the TFLOP/s of the pairs' products. Returns records for $OUT/kernels.json; raises
AssertionError."""
from __future__ import annotations

import time

import numpy as np

HIDDEN, INTER, EXPERTS, TOP_K = 2048, 768, 128, 8
TOL = 2.5e-2
TIE = 1e-3   # a token of the grouped path may route otherwise than the reference only where its k-th and (k+1)-th
             # experts' probabilities are this close (relative): float32 logits from products summed in other orders
LAYERS = 4
EPS = 1e-6
DIRECT_TOKENS = 4   # steps up to this many tokens time both decode plans
DIRECT_COLUMNS = ((2, 2), (2, 4), (4, 2), (4, 4), (8, 4), (4, 8), (2, 8))   # the direct plan's (gate_up, down) columns a
                                                                           # warp timed beside the planner's (4, 8)


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


def _time(fn, layers: list, device: str, iters: int, warmup: int = 3) -> float:
  """us per layer of fn(layer) over every layer in one TinyJit call (`warmup` replays first)."""
  from tinygrad import Device, Tensor, TinyJit
  jit = TinyJit(lambda: Tensor.stack(*[fn(moe) for moe in layers]).realize())
  for _ in range(warmup): jit()
  Device[device].synchronize()
  t = time.perf_counter()
  for _ in range(iters): jit()
  Device[device].synchronize()
  return (time.perf_counter() - t) / iters / len(layers) * 1e6


def _check_tokens(target, device: str, n: int, layers: list, reference_layer, iters: int) -> dict:
  """The decode kernels at n tokens (called directly: where the tuning table hands such a step to the grouped GEMM,
  they still run elsewhere, on other kinds and Metal)."""
  from tinyvllm.kernels.moe import moe_shape, run_moe
  from tinyvllm.layers.moe import portable_moe
  x, norm, residual = _inputs(n, device)
  shape, reason = moe_shape(x, layers[0], EPS)
  assert reason is None, f"{n} tokens: the decode kernels refuse the step: {reason}"
  kernels = lambda moe: run_moe(target, shape, x, moe, norm, residual)
  got = kernels(layers[0]).float().numpy()
  want = portable_moe(x.float(), reference_layer, norm=norm.float(), eps=EPS, residual=residual.float()).numpy()
  bf16 = portable_moe(x, layers[0], norm=norm, eps=EPS, residual=residual).float().numpy()
  scale = np.abs(want - residual.float().numpy()).max()
  rec = {"name": f"moe_qwen3_30b_a3b_n{n}", "tokens": n, "rel_err": float(np.abs(got - want).max() / scale),
         "rel_err_vs_bf16_portable": float(np.abs(got - bf16).max() / scale), "nan": bool(np.isnan(got).any())}
  rec["fused_us_per_layer"] = _time(kernels, layers, device, iters)
  rec["portable_us_per_layer"] = _time(lambda moe: portable_moe(x, moe, norm=norm, eps=EPS, residual=residual), layers, device, iters)
  rec["weight_bytes_per_layer"] = int(np.mean([_experts_read(x, norm, moe) for moe in layers]))
  rec["fused_GBps"] = rec["weight_bytes_per_layer"] / rec["fused_us_per_layer"] / 1e3
  rec["ok"] = rec["rel_err"] < TOL and not rec["nan"]
  if n <= DIRECT_TOKENS:
    rec.update(_plans(target, x, norm, residual, layers, device, iters))
    rec["ok"] = rec["ok"] and rec["plans_same_bits"]
  print(f"{'ok  ' if rec['ok'] else 'FAIL'} moe Qwen3-30B-A3B shape, {n:>2} tokens: max rel err {rec['rel_err']:.2e} vs float32 "
        f"portable ({rec['rel_err_vs_bf16_portable']:.2e} vs bf16 portable, its own routing); fused {rec['fused_us_per_layer']:.1f} "
        f"us/layer ({rec['fused_GBps']:.0f} GB/s of expert weights), portable {rec['portable_us_per_layer']:.1f} us/layer", flush=True)
  return rec


def _plans(target, x, norm, residual, layers: list, device: str, iters: int) -> dict:
  """The direct and the grouped decode plans (kernels/moe.py) side by side: the same bits, and each one's time; the
  direct plan also with other columns a warp (gate_up's, down's) than the planner's."""
  from tinygrad import dtypes

  from tinyvllm.kernels.moe import moe_shape, run_moe
  shape = moe_shape(x, layers[0], EPS)[0]
  run = lambda moe, direct, columns=None: run_moe(target, shape, x, moe, norm, residual, direct=direct, direct_columns=columns)
  bits = lambda t: t.bitcast(dtypes.uint16).numpy()
  grouped = bits(run(layers[0], False))
  same = bool((bits(run(layers[0], True)) == grouped).all())
  us = {plan: _time(lambda moe, direct=direct: run(moe, direct), layers, device, iters)
        for plan, direct in (("direct", True), ("grouped", False))}
  columns = {}
  for up, down in DIRECT_COLUMNS:
    columns[f"up {up}, down {down}"] = _time(lambda moe, c=(up, down): run(moe, True, c), layers, device, iters)
    same = same and bool((bits(run(layers[0], True, (up, down))) == grouped).all())
  print(f"{'ok  ' if same else 'FAIL'} moe plans, {shape.tokens} tokens: direct {us['direct']:.1f} us/layer, grouped "
        f"{us['grouped']:.1f}; the same bits: {same}; direct with columns a warp: "
        + ", ".join(f"{name} {t:.1f}" for name, t in columns.items()), flush=True)
  return {"plans_us_per_layer": us, "plans_same_bits": same, "direct_columns_us_per_layer": columns}


def _explored(n: int) -> list:
  """Tiles timed beside the planner's at a decode batch (on an H200, 256 tokens: the planner's 32x128 with 64-wide K
  slices 386-393 us a layer, 32x64 395-401, 16x64 447, 64x64 464, wgmma 64x64 431-435, 32x64 with 32-wide slices 561,
  with 128-wide ones 455; at 2,048 and 8,192 tokens wgmma 128x128 902-923 and 2,681-2,761 us against 1,134 and 3,782
  for wgmma 64x128, 3,360 for mma.sync 128x128 at 8,192)."""
  from tinyvllm.kernels.gemm import GemmTiles
  if n == 256: return [GemmTiles(32, 64, 2, 2, 1, 0, 64)]
  # prompt chunks: wgmma's deeper rings (one block an SM) and 256-wide tiles
  return [GemmTiles.warpgroup(bm, bn, ring=ring) for bm, bn, ring in ((128, 128, 4), (128, 256, 3), (128, 256, 4), (256, 128, 0))] \
    if n >= 2048 else []


def _tiles_name(tiles) -> str:
  name = lambda t: f"{t.bm}x{t.bn}x{t.bk}{' wgmma' if t.wgmma else ''}{f' ring {t.ring}' if t.ring else ''}"
  return " / ".join(name(t) for t in tiles) if isinstance(tiles, tuple) else name(tiles)


def _compile_grouped(target, device: str, shapes: list, layer) -> None:
  """Every grouped specialisation the large cases use, compiled in parallel (NVRTC drops the GIL)."""
  from tinygrad import Tensor, dtypes

  from tinyvllm.kernels.moe_grouped import grouped_reason, run_grouped
  from tinyvllm.kernels.tinygrad_program import collecting_sources, compile_parallel
  with collecting_sources() as pending:
    for shape, tiles in shapes:
      if grouped_reason(shape, target) is not None: continue
      t = lambda *s: Tensor.empty(*s, dtype=dtypes.bfloat16, device=device)
      run_grouped(target, shape, t(shape.tokens, HIDDEN), layer, t(HIDDEN), t(shape.tokens, HIDDEN), tiles)
  t0 = time.perf_counter()
  print(f"compiled {compile_parallel(pending)} grouped MoE sources in {time.perf_counter() - t0:.1f} s", flush=True)


def _launch_times(fn) -> list[tuple[str, float]]:
  """(kernel, us) of each launch of fn() run eagerly under tinygrad's DEBUG=2 (after a run that compiled it; small
  kernels come out inflated)."""
  import contextlib
  import io

  from gpu_profile import ANSI, LINE
  from tinygrad.helpers import Context
  fn().realize()
  buf = io.StringIO()
  with contextlib.redirect_stdout(buf), Context(DEBUG=2): fn().realize()
  return [(m.group(1), round(float(m.group(2)) * (1.0 if m.group(3) == "us" else 1e3), 1))
          for m in LINE.finditer(ANSI.sub("", buf.getvalue()))]


def _reference(x, norm, residual, reference_layer) -> tuple[np.ndarray, np.ndarray]:
  """portable_moe's result in float32 on the bf16 x' (the portable RMSNorm in bf16, rounded as the grouped path's x'
  pass rounds it, so both route on the same x'), and each token's relative gap between its k-th and (k+1)-th expert
  probabilities (a routing may differ only where that is within the logits' rounding)."""
  from tinyvllm.layers.moe import experts_dense, route
  from tinyvllm.layers.norm import rms_norm
  xn = rms_norm(x, norm, EPS).float()
  weights, ids = route(xn, reference_layer)
  want = (residual.float() + experts_dense(xn, reference_layer, weights, ids)).numpy()
  probs = -np.sort(-xn.linear(reference_layer.router.T).softmax(-1).numpy(), axis=-1)
  return want, (probs[:, TOP_K - 1] - probs[:, TOP_K]) / probs[:, TOP_K - 1]


def _check_large(target, device: str, n: int, layers: list, reference_layer, iters: int) -> list[dict]:
  """The grouped path at n tokens against the float32 portable path (on 256 of the tokens above that), timed against
  the bf16 portable path; other tiles timed beside the planner's."""
  from tinyvllm.kernels.fused import FusedBackend
  from tinyvllm.kernels.moe import moe_shape
  from tinyvllm.kernels.moe_grouped import grouped_plan, run_grouped
  from tinyvllm.layers.moe import portable_moe
  x, norm, residual = _inputs(n, device)
  backend = FusedBackend(target)
  got = backend.moe(x, layers[0], norm=norm, eps=EPS, residual=residual).float().numpy()
  assert dict(backend.calls) == {"moe-grouped": 1}, f"{n} tokens did not take the grouped path: {dict(backend.calls)}"
  rows = np.linspace(0, n - 1, min(n, 256)).round().astype(np.int32)
  want, gaps = _reference(x[rows.tolist()].contiguous(), norm, residual[rows.tolist()].contiguous(), reference_layer)
  scale = np.abs(want - residual.float().numpy()[rows]).max()
  shape = moe_shape(x, layers[0], EPS)[0]
  plan = grouped_plan(shape, target)
  weight_bytes = int(np.mean([_experts_read(x, norm, moe) for moe in layers]))
  records = []
  for tiles in [None, *[t for t in _explored(n) if t not in (plan.tiles, (plan.tiles, plan.down_tiles))]]:
    out = got if tiles is None else run_grouped(target, shape, x, layers[0], norm, residual, tiles).float().numpy()
    used = tiles or (plan.tiles, plan.down_tiles)
    token_err = np.abs(out[rows] - want).max(1) / scale
    off = token_err >= TOL   # tokens routed otherwise: only where two experts tie within the logits' rounding
    rec = {"name": f"moe_grouped_qwen3_30b_a3b_n{n}" + ("" if tiles is None else "_explore"), "tokens": n, "pairs": shape.pairs,
           "tiles": _tiles_name(used), "planner": tiles is None,
           "rel_err": float(token_err[~off].max(initial=0.0)), "checked_tokens": len(rows), "tokens_off": int(off.sum()),
           "tokens_off_gaps": [float(g) for g in gaps[off]], "nan": bool(np.isnan(out).any())}
    rec["fused_us_per_layer"] = _time(lambda moe, tiles=tiles: run_grouped(target, shape, x, moe, norm, residual, tiles), layers,
                                      device, iters)
    rec["fused_GBps"] = weight_bytes / rec["fused_us_per_layer"] / 1e3
    rec["fused_TFLOPs"] = 2 * shape.pairs * 3 * HIDDEN * INTER / rec["fused_us_per_layer"] / 1e6
    rec["ok"] = not rec["nan"] and off.sum() <= max(1, len(rows) // 100) and bool((gaps[off] < TIE).all())
    records.append(rec)
  main = records[0]
  main["weight_bytes_per_layer"] = weight_bytes
  main["launches_us"] = _launch_times(lambda: run_grouped(target, shape, x, layers[1], norm, residual))
  print(f"     launches (eager, us): {main['launches_us']}", flush=True)
  slow = n >= 2048   # the portable path's dense form: 16 times the products, in chunks of tokens
  main["portable_us_per_layer"] = _time(lambda moe: portable_moe(x, moe, norm=norm, eps=EPS, residual=residual),
                                        layers[:2] if slow else layers, device, 2 if slow else iters, warmup=2)
  for rec in records:
    portable = f", portable {main['portable_us_per_layer']:.1f} us/layer" if rec is main else ""
    planner = "(planner)" if rec["planner"] else ""
    print(f"{'ok  ' if rec['ok'] else 'FAIL'} moe grouped, {n:>4} tokens, tiles {rec['tiles']:<28}{planner:9} "
          f"max rel err {rec['rel_err']:.2e} ({rec['tokens_off']} of {len(rows)} tokens routed otherwise, relative gaps "
          f"{rec['tokens_off_gaps']}); {rec['fused_us_per_layer']:8.1f} us/layer ({rec['fused_GBps']:5.0f} GB/s of expert "
          f"weights, {rec['fused_TFLOPs']:5.1f} TFLOP/s){portable}", flush=True)
  return records


def check_moe(target, device: str, tokens=(1, 2, 4, 16), large_tokens=(64, 256, 2048, 8192), iters: int = 20) -> list[dict]:
  from tinyvllm.kernels.moe import MoEShape
  from tinyvllm.kernels.moe_grouped import takes_decode_step
  layers = [_layer(device, seed) for seed in range(LAYERS)]
  reference_layer = _float32(layers[0])
  records = [_check_tokens(target, device, n, layers, reference_layer, iters) for n in tokens]
  shape = lambda n: MoEShape("bfloat16", n, HIDDEN, INTER, EXPERTS, TOP_K, True, EPS)
  # decode steps the tuning table hands to the grouped GEMM (moe.decode_kernel_max_tokens) are checked there too
  large_tokens = (*[n for n in tokens if takes_decode_step(shape(n), target)], *large_tokens)
  _compile_grouped(target, device, [(shape(n), tiles) for n in large_tokens for tiles in [None, *_explored(n)]], layers[0])
  for n in large_tokens: records += _check_large(target, device, n, layers, reference_layer, iters)
  from check_moe_packed import check_moe_packed
  records += check_moe_packed(target, device, layers, iters)
  for rec in records: assert rec["ok"], f"{rec['name']}: relative error {rec['rel_err']:.3g} (NaN: {rec['nan']})"
  return records
