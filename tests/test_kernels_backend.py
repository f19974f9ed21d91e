"""Attention-backend selection, the fused backend's visible fallback, launch plans, and (where nvcc is installed) the
CUDA sources through the real CUDA compiler. CPU only: nothing here loads NVRTC or Metal."""
from __future__ import annotations

import re
import shutil
import subprocess
import sys

import numpy as np
import pytest

from tinyvllm.cli.args import add_engine_args, engine_kwargs
from tinyvllm.config import ConfigError, EngineConfig
from tinyvllm.kernels import native_dialect, select_attention_backend
from tinyvllm.kernels.cases import make_case, metadata_tensors, portable_attention
from tinyvllm.kernels.fused import FusedBackend
from tinyvllm.kernels.gemm import gemm_plan
from tinyvllm.kernels.linear import LinearShape
from tinyvllm.kernels.plan import (
  DECODE_RING_LIMIT,
  SHARED_LIMITS,
  AttentionShape,
  decode_plan,
  decode_ring_bytes,
  default_decode_stages,
  prefill_plan,
  unsupported_reason,
  write_plan,
  write_unsupported_reason,
)
from tinyvllm.kernels.portable import PortableBackend
from tinyvllm.kernels.sources import kernel_source
from tinyvllm.layers.attention import paged_attention, write_kv


def test_native_dialect():
  assert native_dialect("CUDA") == "cuda" and native_dialect("CUDA:PTX") == "cuda" and native_dialect("cuda:1") == "cuda"
  assert native_dialect("METAL") == "metal"
  assert native_dialect("CPU") is None and native_dialect("CPU:LLVM") is None and native_dialect("AMD") is None


def test_cpu_selects_portable():
  for requested in ("auto", "portable"):
    backend = select_attention_backend(requested, "CPU")
    assert isinstance(backend, PortableBackend) and backend.name == "portable"
    assert backend.attention is paged_attention and backend.write_kv is write_kv
  assert "no hand-written kernels for CPU" in select_attention_backend("auto", "CPU").describe()
  assert "requested" in select_attention_backend("portable", "CPU").describe()


@pytest.mark.parametrize("requested", ["cuda", "metal"])
def test_requesting_kernels_on_cpu_is_a_clear_error(requested):
  with pytest.raises(ConfigError, match=f"--attention-backend {requested} needs a {requested.upper()} device.*CPU"):
    select_attention_backend(requested, "CPU")


def test_cuda_on_metal_is_an_error():
  with pytest.raises(ConfigError, match="needs a CUDA device"):
    select_attention_backend("cuda", "METAL", probe=False)


def test_config_and_cli():
  assert EngineConfig(model="m").attention_backend == "auto"
  with pytest.raises(ConfigError, match="attention_backend must be one of"):
    EngineConfig(model="m", attention_backend="triton")
  import argparse
  p = argparse.ArgumentParser()
  add_engine_args(p)
  assert engine_kwargs(p.parse_args(["--model", "m", "--attention-backend", "portable"]))["attention_backend"] == "portable"
  assert engine_kwargs(p.parse_args(["--model", "m"]))["attention_backend"] == "auto"
  with pytest.raises(SystemExit):
    p.parse_args(["--model", "m", "--attention-backend", "triton"])


def test_cpu_never_imports_gpu_compilers():
  code = ("import sys; from tinyvllm.kernels import select_attention_backend; select_attention_backend('auto', 'CPU'); "
          "bad = [m for m in sys.modules if m.endswith(('compiler_cuda', 'ops_metal', 'ops_cuda', 'tinyvllm.kernels.fused'))]; "
          "assert not bad, bad")
  subprocess.run([sys.executable, "-c", code], check=True)


def test_engine_on_cpu_uses_portable_and_refuses_cuda(stories_dir):
  from tinyvllm import LLM
  with pytest.raises(ConfigError, match="needs a CUDA device"):
    LLM(str(stories_dir), attention_backend="cuda", num_gpu_blocks=16)
  llm = LLM(str(stories_dir), num_gpu_blocks=16, max_num_seqs=2)
  assert llm.engine.attention_backend.name == "portable"
  assert llm.engine.model.attention_fn is paged_attention and llm.engine.model.write_kv_fn is write_kv


def test_fused_backend_falls_back_visibly_for_unsupported_shapes():
  """head_dim 12 (3 float32 vectors a row: not a power of two) is not taken: the portable path runs, and says so once."""
  messages = []
  backend = FusedBackend("cuda", "CPU", log=messages.append)
  case = make_case(np.random.default_rng(0), [(20, 1), (5, 1)], heads=4, kv_heads=2, head_dim=12)
  from tinygrad import Tensor
  meta = metadata_tensors(case)
  q, kc, vc = (Tensor(np.ascontiguousarray(x)) for x in (case.q, case.k_cache, case.v_cache))
  out = backend.attention(q, kc, vc, meta).numpy()
  np.testing.assert_allclose(out, portable_attention(case), atol=1e-6)
  backend.attention(q, kc, vc, meta)
  assert len(messages) == 1 and "head_dim 12" in messages[0] and "portable" in messages[0]
  assert backend.calls["portable-attention"] == 2


def test_unsupported_reasons():
  shape = lambda **kw: AttentionShape(**{"dtype": "bfloat16", "head_dim": 128, "num_heads": 16, "num_kv_heads": 8,
                                         "block_size": 16, "num_seqs": 8, "num_tokens": 8, "query_len": 1,
                                         "context_len": 1024, "num_slots": 4096, **kw})
  assert unsupported_reason(shape()) is None
  assert unsupported_reason(shape(head_dim=8, dtype="float32", num_heads=8, num_kv_heads=4)) is None   # stories260K
  assert unsupported_reason(shape(head_dim=96)) is not None            # 12 vectors a row
  assert unsupported_reason(shape(head_dim=4)) is not None             # under one 16-byte vector of bf16
  assert unsupported_reason(shape(dtype="int8")) is not None
  assert unsupported_reason(shape(num_heads=12)) is not None           # not a multiple of the KV heads
  assert write_unsupported_reason("bfloat16", 1024) is None and write_unsupported_reason("bfloat16", 12) is not None


@pytest.mark.parametrize("dialect", ["cuda", "metal"])
def test_plans(dialect):
  for dtype, kv_fp8 in (("float32", False), ("float16", False), ("bfloat16", False), ("float16", True), ("bfloat16", True)):
    for head_dim in (8, 16, 32, 64, 128, 256):
      for group in (1, 2, 4, 7, 8, 16):
        for seqs, tq, ctx in ((1, 1, 16), (8, 1, 1024), (256, 1, 4096), (4, 64, 2048)):
          s = AttentionShape(dtype, head_dim, 2 * group, 2, 16, seqs, seqs * tq, tq, ctx, 1 << 16, kv_fp8)
          if unsupported_reason(s, dialect) is not None: continue
          d = decode_plan(s)
          assert d.tile % 32 == 0 and d.chunk % d.tile == 0 and d.splits * d.chunk >= ctx > (d.splits - 1) * d.chunk
          assert d.lpk * d.nvl == d.vpr and d.kpp * d.lpk == 128 and d.shared_bytes <= SHARED_LIMITS[dialect]
          assert d.vpr * d.vec == head_dim and d.kpp * d.unroll == d.tile and d.defines["TV_KVEC"] == d.vec
          assert d.vec == (16 if kv_fp8 and head_dim % 16 == 0 and group <= 2 else 16 // (4 if dtype == "float32" else 2))
          assert seqs * 2 * (d.splits - 1) < 512   # split only while the blocks are too few
          p = prefill_plan(s, dialect)
          assert p.shared_bytes <= SHARED_LIMITS[dialect] and p.tokens >= 1 and p.tokens * p.q_tiles >= tq
          if (stages := default_decode_stages(s, dialect)):   # the staged decode: FP8 on CUDA, 16-byte rows, ring in budget
            staged = decode_plan(s, stages=stages)
            assert dialect == "cuda" and kv_fp8 and head_dim % 16 == 0 and staged.algorithm == "decode_staged"
            assert staged.launches[0].shared_bytes == 2 * 2 * staged.tile * head_dim <= DECODE_RING_LIMIT
          else:
            assert dialect == "metal" or not kv_fp8 or head_dim % 16 or decode_ring_bytes(s, d.tile, 2) > DECODE_RING_LIMIT
  w = write_plan("bfloat16", 1024, 64, 4096)
  assert w.launches[0].grid == (64, 1, 1) and w.threads == 128
  with pytest.raises(ValueError, match="16 bytes"):   # FP8 rows of 8 codes cannot be copied in 16-byte pieces
    decode_plan(AttentionShape("float16", 8, 4, 2, 16, 2, 2, 1, 64, 1024, True), stages=2)
  with pytest.raises(ValueError, match="2 or more"):
    decode_plan(AttentionShape("bfloat16", 128, 4, 2, 16, 2, 2, 1, 64, 1024, True), stages=1)


SPECIMENS = {   # name -> (algorithm, plan): what the models of interest compile
  "decode_qwen3_b1": ("decode", decode_plan(AttentionShape("bfloat16", 128, 16, 8, 16, 1, 1, 1, 1024, 1 << 16))),
  "decode_qwen3_b256": ("decode", decode_plan(AttentionShape("bfloat16", 128, 16, 8, 16, 256, 256, 1, 1024, 1 << 16))),
  "decode_llama1b_f16": ("decode", decode_plan(AttentionShape("float16", 64, 32, 8, 16, 32, 32, 1, 2048, 1 << 16))),
  "decode_stories_f32": ("decode", decode_plan(AttentionShape("float32", 8, 8, 4, 16, 8, 8, 1, 512, 4096))),
  "decode_qwen3_b1_kv8": ("decode", decode_plan(AttentionShape("bfloat16", 128, 16, 8, 16, 1, 1, 1, 1024, 1 << 16, True))),
  "decode_qwen3_b256_kv8": ("decode", decode_plan(AttentionShape("bfloat16", 128, 16, 8, 16, 256, 256, 1, 1024, 1 << 16, True))),
  "decode_qwen3_b256_staged": ("decode_staged", decode_plan(AttentionShape("bfloat16", 128, 16, 8, 16, 256, 256, 1, 1024, 1 << 16),
                                                          stages=2)),
  "decode_qwen3_b256_kv8_staged": ("decode_staged", decode_plan(AttentionShape("bfloat16", 128, 16, 8, 16, 256, 256, 1, 1024,
                                                                               1 << 16, True), stages=2)),
  "prefill_qwen3": ("prefill_tc", prefill_plan(AttentionShape("bfloat16", 128, 16, 8, 16, 4, 1024, 512, 2048, 1 << 16))),
  "prefill_qwen3_kv8": ("prefill_tc", prefill_plan(AttentionShape("bfloat16", 128, 16, 8, 16, 4, 1024, 512, 2048, 1 << 16,
                                                                  True))),
  "prefill_qwen3_fma": ("prefill", prefill_plan(AttentionShape("bfloat16", 128, 16, 8, 16, 4, 1024, 512, 2048, 1 << 16),
                                                tensor_cores=False)),
  "prefill_stories_f32": ("prefill", prefill_plan(AttentionShape("float32", 8, 8, 4, 16, 4, 64, 32, 512, 4096))),
  "kv_write_bf16": ("kv_write", write_plan("bfloat16", 1024, 256, 1 << 16)),
}
# Qwen3-0.6B's projections as an H100 plans them (wgmma from 128 rows), compiled for sm_90a as NVRTC does there
GEMM_SPECIMENS = {f"gemm_{name}_{rows}": LinearShape("bfloat16", rows, k, o, False, 1e-6 if norm else None, silu, silu, o > 100000)
                  for rows in (64, 256, 8192) for name, k, o, norm, silu in
                  (("qkv", 1024, 4096, True, False), ("down", 3072, 1024, False, True), ("logits", 1024, 151936, True, False))
                  if not (name == "logits" and rows > 256)}


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not installed (the CUDA compile check needs it)")
def test_cuda_sources_compile_with_nvcc(tmp_path):
  """The CUDA dialect through the real CUDA compiler (sm_90; the matmuls for sm_90a, with wgmma): no errors, no
  register spills, shared memory in budget."""
  sources = {name: (kernel_source("cuda", algo, plan.defines), "-arch=sm_90") for name, (algo, plan) in SPECIMENS.items()}
  sources |= {name: (kernel_source("cuda", "gemm_tc", gemm_plan(shape, wgmma=True)[0]), "-gencode=arch=compute_90a,code=sm_90a")
              for name, shape in GEMM_SPECIMENS.items()}
  assert sum("#define TV_WGMMA" in src for src, _ in sources.values()) >= 5
  procs = {}
  for name, (source, arch) in sources.items():
    path = tmp_path / f"{name}.cu"
    path.write_text(source)
    procs[name] = subprocess.Popen(["nvcc", arch, "-cubin", "-o", str(tmp_path / f"{name}.cubin"), "-Xptxas", "-v",
                                    str(path)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
  for name, proc in procs.items():
    out = proc.communicate(timeout=300)[0]
    assert proc.returncode == 0, f"{name}:\n{out}"
    assert "error" not in out.lower(), out
    spills = [int(x) for x in re.findall(r"(\d+) bytes spill stores", out)]
    assert spills and max(spills) <= 32, f"{name} spills: {out}"


@pytest.mark.parametrize("dialect", ["cuda", "metal"])
@pytest.mark.parametrize("kv_fp8", [False, True])
def test_fused_backend_builds_every_attention_graph(dialect, kv_fp8):
  """The backend's wiring of the kernels (buffers, their sizes and order for each plan: decode with and without split-K,
  prefill, KV write) on the CPU: graphs are built with no binaries (collecting_sources
  records the sources instead of compiling), so a wrong buffer is caught here rather than on a GPU."""
  from tinygrad import Tensor, dtypes

  from tinyvllm.kernels.tinygrad_program import collecting_sources
  backend = FusedBackend(dialect, "CPU")
  rng = np.random.default_rng(4)
  shapes = {"decode-split": [(300, 1), (40, 1)], "decode": [(40, 1)] * 128, "prefill": [(50, 20), (9, 1)]}
  with collecting_sources() as pending:
    for seqs in shapes.values():
      case = make_case(rng, seqs, heads=4, kv_heads=2, head_dim=128, dtype="bfloat16", kv_fp8=kv_fp8)
      meta = metadata_tensors(case)
      kv_dtype = dtypes.uint8 if kv_fp8 else dtypes.bfloat16
      kc, vc = (Tensor.empty(*c.shape, dtype=kv_dtype) for c in (case.k_cache, case.v_cache))
      q = Tensor.empty(*case.q.shape, dtype=dtypes.bfloat16)
      backend.write_kv(kc, vc, q[:, :2], q[:, 2:], meta.slot_mapping)
      backend.attention(q, kc, vc, meta)
  assert dict(backend.calls) == {"write": 3, "decode-split": 1, "decode": 1, "prefill": 1}
  assert len(pending) == 6 and all(device == "CPU" for device, _ in pending)
