"""The sampling kernel (tinyvllm/kernels/csrc/neutral/sample.inc) on the GPU, as part of bench/check_kernels.py: batches
of 1, 8 and 256 rows (each row over the blocks sample_splits gives it) over Qwen3's 151,936-token vocabulary (greedy,
temperature and padding rows mixed), the kernel against the portable sampler (tinygrad ops on the same device): the same
token in every row, except where the two draws' noisy values are within TIE of each other (log2 may round
differently), each checked against numpy's float64 evaluation of the same noise; and each path's time per call (TinyJit
replays). Returns a record a batch for $OUT/kernels.json; raises AssertionError."""
from __future__ import annotations

import time

import numpy as np

TIE = 1e-4


def _fmix32(h: np.ndarray) -> np.ndarray:
  h = h ^ (h >> np.uint32(16))
  h = h * np.uint32(0x85EBCA6B)
  h = h ^ (h >> np.uint32(13))
  h = h * np.uint32(0xC2B2AE35)
  return h ^ (h >> np.uint32(16))


def noisy_values(logits: np.ndarray, params: np.ndarray, seeds: np.ndarray) -> np.ndarray:
  """logits / T + Gumbel noise (float64) as both samplers define it; greedy rows unchanged."""
  with np.errstate(over="ignore"):
    key1 = _fmix32(_fmix32(seeds[:, 0] ^ np.uint32(0x3C6EF372)) ^ seeds[:, 1])[:, None]
    key2 = _fmix32(key1 ^ np.uint32(0x9E3779B9))
    h = _fmix32(_fmix32(np.arange(logits.shape[1], dtype=np.uint32)[None, :] ^ key1) + key2)
  u = ((h >> np.uint32(8)).astype(np.float64) + 0.5) / (1 << 24)
  greedy = params[:, :1] < 1e-5
  return np.where(greedy, logits, logits / np.where(greedy, 1.0, params[:, :1]) - np.log(-np.log(u)))


def check_sample(device: str, batches: tuple[int, ...] = (1, 8, 256), vocab: int = 151936) -> list[dict]:
  return [check_sample_rows(device, rows, vocab) for rows in batches]


def check_sample_rows(device: str, rows: int, vocab: int) -> dict:
  from tinygrad import Device, Tensor, TinyJit

  from tinyvllm.backend.sampling import NEUTRAL_PARAMS, SamplerVariant
  from tinyvllm.kernels.sample import fused_sample, sample_splits
  from tinyvllm.kernels.tinygrad_program import device_target
  from tinyvllm.layers.sampler import sample_packed
  target = device_target(device)
  rng = np.random.default_rng(21 + rows)
  logits = (rng.standard_normal((rows, vocab)) * 4).astype(np.float32)
  params = np.tile(np.array(NEUTRAL_PARAMS, np.float32), (rows, 1))
  params[:, 0] = np.where(rng.random(rows) < 0.25, 0.0, rng.uniform(0.3, 1.5, rows))
  seeds = np.stack([rng.integers(0, 2**32, rows), rng.integers(0, 5000, rows)], 1).astype(np.uint32)
  args = [Tensor(x, device=device).realize() for x in (logits, params.view(np.int32), seeds.view(np.int32))]
  variant = SamplerVariant(True, False, False)
  record: dict = {"rows": rows, "vocab": vocab, "splits": sample_splits(target, rows, vocab)}
  tokens = {}
  for name, fn in (("kernel", lambda: fused_sample(target, *args, variant).realize()),
                   ("portable", lambda: sample_packed(*args, variant).realize())):
    jit = TinyJit(fn)
    for _ in range(3): jit()
    Device[device].synchronize()
    t = time.perf_counter()
    for _ in range(20): out = jit()
    Device[device].synchronize()
    record[f"{name}_ms"] = round((time.perf_counter() - t) / 20 * 1e3, 4)
    tokens[name] = out.numpy()
  values = noisy_values(logits.astype(np.float64), params.astype(np.float64), seeds)
  best = values.max(1)
  differ = np.nonzero(tokens["kernel"] != tokens["portable"])[0]
  far = [int(r) for r in differ if best[r] - values[r, tokens["kernel"][r]] > TIE or best[r] - values[r, tokens["portable"][r]] > TIE]
  record.update(differ=len(differ), beyond_tie=far, ok=not far)
  assert not far, f"sampling kernel: rows {far[:8]} differ from the portable sampler beyond a near-tie"
  return record
