"""The fused qkv split + QK-norm + RoPE + KV-write kernel (csrc/neutral/qkv_rope.inc), CUDA and Metal dialect, run on the CPU
through the C++ emulation and compared with the portable form (tinyvllm/layers/portable.py: `qkv_rope_write`, the ops
the model runs on the CPU): float32 / float16 / bfloat16, with and without q/k norm, head_dim 8 to 256 (also half-heads
that are not a power-of-two number of vectors), GQA and MHA, several passes of the block over the heads; arbitrary
positions (cos/sin from rope_tables), padding tokens (slot -1) and an out-of-range slot that write nothing, q poisoned
with NaN first and fully written, cache rows outside slot_mapping untouched, V copied bit for bit."""
from __future__ import annotations

import re
import shutil
import subprocess
from dataclasses import replace

import numpy as np
import pytest
from tinygrad import Tensor, dtypes

from tests.emulator.cases import FP8, from_bits, round_to, to_bits
from tests.emulator.emulator import LazyKernels, Spec, emulate, poisoned
from tinyvllm.kernels.fused import FusedBackend
from tinyvllm.kernels.qkv_rope import QkvRopeShape, qkv_rope_plan, qkv_rope_shape, unsupported_reason
from tinyvllm.kernels.sources import kernel_source
from tinyvllm.layers.portable import qkv_rope_write
from tinyvllm.layers.rotary import rope_tables
from tinyvllm.platform.target import DeviceTarget

EPS = 1e-6
TG_DTYPES = {"float32": dtypes.float32, "float16": dtypes.float16, "bfloat16": dtypes.bfloat16}
# elementwise, against the float32 portable form on the same rounded inputs: the kernel rounds once, so at most about
# one unit in the last place of the storage type (2^-7 relative for bf16, 2^-10 for f16)
REL = {"float32": 1e-5, "float16": 2.0 ** -10, "bfloat16": 2.0 ** -7}
# against the portable form run in the storage type itself (HF's roundings after the norm, the weight and each product)
TOLERANCE = {"float32": 2e-5, "float16": 3e-3, "bfloat16": 2e-2}
# name -> (dtype, tokens N, heads H, kv heads KVH, head_dim D, qk norm)
CASES = {
  "f32_d8_stories": ("float32", 3, 8, 4, 8, False),            # stories260K: one lane a head
  "f32_d8_norm": ("float32", 5, 4, 2, 8, True),
  "f32_d24_norm": ("float32", 4, 4, 2, 24, True),              # 3 vectors a half-head: 4 lanes, one idle
  "f32_d128_norm_3pass": ("float32", 2, 32, 8, 128, True),     # 48 heads x 16 lanes: three passes of 256 threads
  "f32_d256_norm": ("float32", 2, 2, 1, 256, True),            # 32 lanes a head
  "f16_d64_norm_mha": ("float16", 4, 4, 4, 64, True),
  "f16_d128": ("float16", 3, 6, 2, 128, False),
  "bf16_d64_qwen2": ("bfloat16", 4, 14, 2, 64, False),         # Qwen2.5-0.5B: G = 7
  "bf16_d64_norm": ("bfloat16", 3, 8, 2, 64, True),
  "bf16_d96_norm": ("bfloat16", 2, 4, 2, 96, True),            # 6 vectors a half-head: 8 lanes, two idle
  "bf16_d128_norm_qwen3": ("bfloat16", 4, 16, 8, 128, True),   # Qwen3-0.6B: 32 heads x 8 lanes, one pass of 256
  "bf16_d128_norm_qwen3_kv8": ("bfloat16", 4, 16, 8, 128, True),   # FP8 E4M3 caches (names with _kv8)
  "f16_d64_kv8": ("float16", 3, 6, 2, 64, False),
}
FP8_CASES = [name for name in CASES if name.endswith("_kv8")]


def _shape(name: str) -> QkvRopeShape:
  dtype, n, h, kvh, d, norm = CASES[name]
  return QkvRopeShape(dtype, n, h, kvh, d, 3 * n + 2, norm, EPS, name.endswith("_kv8"))


@pytest.fixture(scope="module")
def emu(dialect: str) -> LazyKernels:
  return emulate(dialect, [Spec(name, "qkv_rope", (p := qkv_rope_plan(_shape(name))).defines, (p.launch,)) for name in CASES])


def _inputs(name: str) -> dict[str, np.ndarray]:
  sh = _shape(name)
  rng = np.random.default_rng(sum(map(ord, name)))
  n, d, row = sh.num_tokens, sh.head_dim, sh.num_kv_heads * sh.head_dim
  # per-head scales, so that the norm matters; values exactly representable in the storage type
  scale = np.exp(rng.uniform(-1.5, 1.5, (1, sh.num_heads + 2 * sh.num_kv_heads, 1)))
  qkv = (rng.standard_normal((n, sh.num_heads + 2 * sh.num_kv_heads, d)) * scale).reshape(n, -1)
  cos_t, sin_t = rope_tables(d, 4096, 1_000_000.0, None)
  positions = rng.integers(0, 4096, n)
  slots = rng.permutation(sh.num_slots)[:n].astype(np.int32)
  slots[1] = -1                                  # a padding token
  if n > 3: slots[3] = sh.num_slots              # out of range: skipped like -1
  a = {"qkv": qkv, "k_cache": rng.standard_normal((sh.num_slots, row)), "v_cache": rng.standard_normal((sh.num_slots, row))}
  if sh.qk_norm: a |= {"q_norm": 1 + 0.3 * rng.standard_normal(d), "k_norm": 1 + 0.3 * rng.standard_normal(d)}
  out = {k: round_to(v.astype(np.float32), FP8 if sh.kv_fp8 and k.endswith("_cache") else sh.dtype) for k, v in a.items()}
  return out | {"cos": cos_t[positions], "sin": sin_t[positions], "slot_mapping": slots}


def _run_kernel(emu: LazyKernels, name: str, a: dict[str, np.ndarray], order: str = "forward"):
  sh = _shape(name)
  q = poisoned(sh.num_tokens * sh.num_heads * sh.head_dim, sh.dtype)
  kv = FP8 if sh.kv_fp8 else sh.dtype
  kc, vc = to_bits(a["k_cache"], kv).reshape(-1).copy(), to_bits(a["v_cache"], kv).reshape(-1).copy()
  args = [q, kc, vc, to_bits(a["qkv"], sh.dtype).reshape(-1), np.ascontiguousarray(a["cos"], np.float32).reshape(-1),
          np.ascontiguousarray(a["sin"], np.float32).reshape(-1), a["slot_mapping"]]
  if sh.qk_norm: args += [to_bits(a["q_norm"], sh.dtype), to_bits(a["k_norm"], sh.dtype)]
  emu.launch(name, 0, args, order, seed=7)
  return (from_bits(q, sh.dtype).reshape(sh.num_tokens, sh.num_heads, sh.head_dim),
          from_bits(kc, kv).reshape(a["k_cache"].shape), from_bits(vc, kv).reshape(a["v_cache"].shape))


def _portable(a: dict[str, np.ndarray], dtype):
  t = {k: Tensor(np.ascontiguousarray(v)) for k, v in a.items()}
  cast = {k: t[k].cast(dtype).contiguous() for k in ("qkv", "k_cache", "v_cache", "q_norm", "k_norm") if k in t}
  q, kc, vc = qkv_rope_write(cast["qkv"], cast.get("q_norm"), cast.get("k_norm"), t["cos"], t["sin"], cast["k_cache"],
                             cast["v_cache"], t["slot_mapping"], EPS)
  return tuple(x.cast(dtypes.float32).numpy() for x in (q, kc, vc))


@pytest.mark.parametrize("name", [name for name in CASES if name not in FP8_CASES])
def test_qkv_rope_write_matches_portable(emu, name):
  sh, a = _shape(name), _inputs(name)
  assert unsupported_reason(sh) is None
  q, kc, vc = _run_kernel(emu, name, a)
  ref_q, ref_kc, ref_vc = _portable(a, dtypes.float32)     # float32 ops on the same rounded inputs
  assert not np.isnan(q).any(), "an element of q was never written"
  tol = lambda ref: REL[sh.dtype] * np.abs(ref) + 1e-6 * np.abs(ref).max()
  assert (np.abs(q - ref_q) <= tol(ref_q)).all(), np.abs(q - ref_q).max()
  assert (np.abs(kc - ref_kc) <= tol(ref_kc)).all(), np.abs(kc - ref_kc).max()
  # which cache rows changed: exactly the valid slots; V bit for bit; every other row untouched
  slots = a["slot_mapping"]
  valid = (slots >= 0) & (slots < sh.num_slots)
  written = slots[valid]
  untouched = np.setdiff1d(np.arange(sh.num_slots), written)
  assert len(untouched) > sh.num_slots - sh.num_tokens and valid.sum() >= sh.num_tokens - 2
  np.testing.assert_array_equal(kc[untouched], a["k_cache"][untouched])
  np.testing.assert_array_equal(vc[untouched], a["v_cache"][untouched])
  v_new = a["qkv"].reshape(sh.num_tokens, -1, sh.head_dim)[:, sh.num_heads + sh.num_kv_heads:].reshape(sh.num_tokens, -1)
  np.testing.assert_array_equal(vc[written], v_new[valid])
  np.testing.assert_array_equal(vc, ref_vc)
  assert not np.array_equal(kc[written], a["k_cache"][written])
  # the portable form in the storage type (what the model runs in that dtype; HF's intermediate roundings); not bf16:
  # tinygrad's CPU backend here has no __bf16 (clang: "not supported on this target")
  if sh.dtype == "bfloat16": return
  low_q, low_kc, _ = _portable(a, TG_DTYPES[sh.dtype])
  assert np.abs(q - low_q).max() / np.abs(low_q).max() < TOLERANCE[sh.dtype]
  assert np.abs(kc - low_kc).max() / np.abs(low_kc).max() < TOLERANCE[sh.dtype]


@pytest.mark.parametrize("name", FP8_CASES)
def test_qkv_rope_write_fp8_cache(emu, name):
  """FP8 caches: q as with 16-bit caches; k rounded to the activations' dtype, then to E4M3 (one E4M3 step at most off
  the float32 reference, whose k skips the first rounding); v exactly its E4M3 rounding; other rows untouched."""
  sh, a = _shape(name), _inputs(name)
  q, kc, vc = _run_kernel(emu, name, a)
  ref_q, ref_kc, _ = _portable(a, dtypes.float32)
  assert not np.isnan(q).any() and (np.abs(q - ref_q) <= REL[sh.dtype] * np.abs(ref_q) + 1e-6 * np.abs(ref_q).max()).all()
  slots = a["slot_mapping"]
  valid = (slots >= 0) & (slots < sh.num_slots)
  written, untouched = slots[valid], np.setdiff1d(np.arange(sh.num_slots), slots[valid])
  np.testing.assert_array_equal(kc[untouched], a["k_cache"][untouched])
  np.testing.assert_array_equal(vc[untouched], a["v_cache"][untouched])
  want_k = round_to(round_to(ref_kc[written], sh.dtype), FP8)
  assert (np.abs(kc[written] - want_k) <= 2.0 ** -3 * np.abs(want_k) + 2.0 ** -9).all()
  assert np.mean(kc[written] == want_k) > 0.99
  v_new = a["qkv"].reshape(sh.num_tokens, -1, sh.head_dim)[:, sh.num_heads + sh.num_kv_heads:].reshape(sh.num_tokens, -1)
  np.testing.assert_array_equal(vc[written], round_to(v_new[valid], FP8))


@pytest.mark.parametrize("name", ["bf16_d128_norm_qwen3", "f32_d24_norm", "bf16_d128_norm_qwen3_kv8"])
@pytest.mark.parametrize("order", ["reverse", "random"])
def test_thread_order_does_not_matter(emu, name, order):
  a = _inputs(name)
  for got, want in zip(_run_kernel(emu, name, a, order), _run_kernel(emu, name, a), strict=True):
    np.testing.assert_array_equal(got, want)


def test_plans():
  qwen3 = qkv_rope_plan(QkvRopeShape("bfloat16", 1, 16, 8, 128, 1 << 16, True, EPS))
  assert (qwen3.lanes_per_head, qwen3.threads, qwen3.passes, qwen3.launch.grid) == (8, 256, 1, (1, 1, 1))
  llama8b = qkv_rope_plan(QkvRopeShape("bfloat16", 256, 32, 8, 128, 1 << 16, False, EPS))
  assert (llama8b.threads, llama8b.passes, llama8b.launch.grid) == (192, 2, (256, 1, 1))
  assert "TV_QK_NORM" not in llama8b.defines and len(llama8b.launch.params) == 7
  stories = qkv_rope_plan(QkvRopeShape("float32", 8, 8, 4, 8, 4096, False, EPS))
  assert (stories.lanes_per_head, stories.threads, stories.passes) == (1, 32, 1)
  for dtype in ("float32", "float16", "bfloat16"):
    for d in (8, 16, 24, 32, 48, 64, 80, 96, 128, 160, 256):
      for h, kvh in ((1, 1), (8, 4), (14, 2), (32, 8), (64, 8)):
        s = QkvRopeShape(dtype, 4, h, kvh, d, 64, True, EPS)
        if unsupported_reason(s) is not None: continue
        p = qkv_rope_plan(s)
        units = h + 2 * kvh
        assert p.threads % 32 == 0 and p.threads <= 256 and 32 % p.lanes_per_head == 0
        assert p.lanes_per_head * s.vec >= d // 2 and p.passes * (p.threads // p.lanes_per_head) >= units


def test_shapes_the_kernel_refuses():
  base = dict(num_tokens=4, num_heads=16, num_kv_heads=8, num_slots=64, qk_norm=True, eps=EPS)
  assert unsupported_reason(QkvRopeShape("bfloat16", head_dim=128, **base)) is None
  assert unsupported_reason(QkvRopeShape("float32", head_dim=8, **base)) is None
  assert "half a head" in unsupported_reason(QkvRopeShape("bfloat16", head_dim=8, **base))   # 4 elements < one vector
  assert "half a head" in unsupported_reason(QkvRopeShape("float16", head_dim=72, **base))
  assert "> 256" in unsupported_reason(QkvRopeShape("float32", head_dim=512, **base))
  assert "dtype" in unsupported_reason(QkvRopeShape("float64", head_dim=128, **base))
  # from tensors: the adapter derives H and KVH from the rows and refuses mismatches
  n, d = 3, 16
  qkv = Tensor.zeros(n, (4 + 2 * 2) * d).contiguous()
  cache, cs = Tensor.zeros(10, 2 * d).contiguous(), Tensor.zeros(n, d // 2).contiguous()
  slots = Tensor([0, 1, -1], dtype=dtypes.int32)
  shape, reason = qkv_rope_shape(qkv, None, None, cs, cs, cache, cache, slots, EPS)
  assert reason is None and shape is not None and (shape.num_heads, shape.num_kv_heads, shape.head_dim) == (4, 2, d)
  assert "q_norm" in qkv_rope_shape(qkv, Tensor.ones(d), None, cs, cs, cache, cache, slots, EPS)[1]
  assert "differs" in qkv_rope_shape(qkv.cast(dtypes.float16), None, None, cs, cs, cache, cache, slots, EPS)[1]
  assert "int32" in qkv_rope_shape(qkv, None, None, cs, cs, cache, cache, slots.cast(dtypes.int64), EPS)[1]


def test_fused_backend_falls_back_visibly():
  """A shape the kernel does not take (float64 here) runs the portable ops (and the backend's KV write), logged once."""
  messages: list[str] = []
  backend = FusedBackend(replace(DeviceTarget.nominal("cuda"), device="CPU"), log=messages.append)
  rng = np.random.default_rng(3)
  n, h, kvh, d = 3, 4, 2, 16
  cos_t, sin_t = rope_tables(d, 64, 10000.0, None)
  pos = np.array([5, 0, 63])
  args = [rng.standard_normal((n, (h + 2 * kvh) * d)), 1 + rng.standard_normal(d) * 0.1, 1 + rng.standard_normal(d) * 0.1,
          cos_t[pos], sin_t[pos], rng.standard_normal((8, kvh * d)), rng.standard_normal((8, kvh * d)),
          np.array([7, -1, 2], np.int32)]
  tensors = lambda: [Tensor(np.ascontiguousarray(x)) for x in args]
  for _ in range(2):
    got = [x.numpy() for x in backend.qkv_rope_write(*tensors(), EPS)]
    want = [x.numpy() for x in qkv_rope_write(*tensors(), EPS)]
    for g, w in zip(got, want, strict=True): np.testing.assert_allclose(g, w, rtol=1e-12, atol=1e-12)
  assert len(messages) == 2 and "qkv-rope" in messages[0] and "double" in messages[0] and "kv-write" in messages[1]
  assert backend.calls["portable-qkv-rope"] == 2 and backend.calls["portable-kv-write"] == 2
  assert got[0].shape == (n, h, d) and np.array_equal(got[1][1], args[5][1]) and not np.array_equal(got[1][7], args[5][7])


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not installed (the CUDA compile check needs it)")
def test_cuda_source_compiles_with_nvcc(tmp_path):
  """The CUDA dialect through the real CUDA compiler (sm_90), Qwen3-0.6B shape at batch 1 and 256: no errors, no spills."""
  for n in (1, 256):
    path = tmp_path / f"qkv_rope_{n}.cu"
    path.write_text(kernel_source("cuda", "qkv_rope", qkv_rope_plan(QkvRopeShape("bfloat16", n, 16, 8, 128, 1 << 16, True, EPS)).defines))
    run = subprocess.run(["nvcc", "-arch=sm_90", "-cubin", "-o", str(path.with_suffix(".cubin")), "-Xptxas", "-v", str(path)],
                         capture_output=True, text=True, timeout=300)
    out = run.stdout + run.stderr
    assert run.returncode == 0 and "error" not in out.lower(), out
    assert re.findall(r"(\d+) bytes spill stores", out) == ["0"], out
