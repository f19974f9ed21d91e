"""Attention-backend selection, the fused backend's visible fallback, launch plans, and (where nvcc is installed) the
CUDA sources through the real CUDA compiler. CPU only: nothing here loads NVRTC or Metal."""
from __future__ import annotations

import re
import shutil
import subprocess
import sys
from dataclasses import replace

import numpy as np
import pytest

from tests.emulator.cases import make_case, metadata_tensors, portable_attention
from tinyvllm.cli.args import add_engine_args, engine_kwargs
from tinyvllm.config import ConfigError, EngineConfig
from tinyvllm.kernels.all_reduce import all_reduce_plan
from tinyvllm.kernels.attention import attention_shape, attention_source
from tinyvllm.kernels.fused import FusedBackend, capabilities
from tinyvllm.kernels.gemm import gemm_plan
from tinyvllm.kernels.linear import LinearShape
from tinyvllm.kernels.moe import MoEShape, moe_plan
from tinyvllm.kernels.moe_grouped import grouped_plan
from tinyvllm.kernels.plan import (
  AttentionShape,
  decode_on_tensor_cores,
  decode_plan,
  decode_ring_bytes,
  default_decode_stages,
  prefill_plan,
  unsupported_reason,
  write_plan,
  write_unsupported_reason,
)
from tinyvllm.kernels.selection import BackendRequest, select_backend
from tinyvllm.kernels.sources import kernel_source
from tinyvllm.kernels.tuning import tuning_for
from tinyvllm.layers.portable import PortableBackend
from tinyvllm.platform.target import DeviceTarget, native_dialect

CUDA, METAL = DeviceTarget.nominal("cuda"), DeviceTarget.nominal("metal")
TARGETS = {"cuda": CUDA, "metal": METAL}
NO_TENSOR_CORES = DeviceTarget.nominal("cuda", arch="sm_75")   # the CUDA dialect on a GPU without mma.sync: FMA prefill
REQUEST = BackendRequest("float32", "auto", 64, 16)


def on_cpu(target: DeviceTarget) -> DeviceTarget:
  """The target's plans with CPU tensors: a FusedBackend whose graphs are built (never run) on the CPU."""
  return replace(target, device="CPU")


def test_native_dialect():
  assert native_dialect("CUDA") == "cuda" and native_dialect("CUDA:PTX") == "cuda" and native_dialect("cuda:1") == "cuda"
  assert native_dialect("METAL") == "metal"
  assert native_dialect("CPU") is None and native_dialect("CPU:LLVM") is None and native_dialect("AMD") is None


def test_cpu_selects_portable():
  for requested in ("auto", "portable"):
    backend = select_backend(requested, "CPU", REQUEST)
    assert isinstance(backend, PortableBackend) and backend.name == "portable" and not backend.builds_kernels
  assert "no hand-written kernels for CPU" in select_backend("auto", "CPU", REQUEST).describe()
  assert "requested" in select_backend("portable", "CPU", REQUEST).describe()


@pytest.mark.parametrize("requested", ["cuda", "metal"])
def test_requesting_kernels_on_cpu_is_a_clear_error(requested):
  with pytest.raises(ConfigError, match=f"--attention-backend {requested} needs a {requested.upper()} device.*CPU"):
    select_backend(requested, "CPU", REQUEST)


def test_cuda_on_metal_is_an_error():
  with pytest.raises(ConfigError, match="needs a CUDA device"):
    select_backend("cuda", "METAL", REQUEST, probe=False)


def test_unknown_backend_is_an_error():
  with pytest.raises(ConfigError, match="attention backend must be one of"):
    select_backend("triton", "CPU", REQUEST)


@pytest.mark.parametrize("target", [CUDA, METAL], ids=["cuda", "metal"])
def test_capabilities_of_nominal_targets(target):
  """The head sizes of the models of interest (64: Llama-3.2-1B, Qwen2.5; 128: Qwen3, Llama-3-8B) on both dialects, every
  dtype; FP8 caches with 16-bit activations."""
  caps = capabilities(target)
  assert {64, 128} <= set(caps.head_sizes) and caps.dtypes == ("float32", "float16", "bfloat16")
  assert caps.fp8_kv_cache_dtypes == ("float16", "bfloat16")
  assert caps.unsupported_reason("bfloat16", "fp8_e4m3", 128, 16) is None
  assert "head size 96" in caps.unsupported_reason("bfloat16", "auto", 96, 16)   # 12 vectors a row
  assert "FP8" in caps.unsupported_reason("float32", "fp8_e4m3", 64, 16)


def test_selection_on_cpu():
  """On the CPU: asking for the CUDA kernels is an error, auto gives the portable backend."""
  with pytest.raises(ConfigError, match="needs a CUDA device"):
    select_backend("cuda", "CPU", BackendRequest("bfloat16", "auto", 128, 16))
  backend = select_backend("auto", "CPU", BackendRequest("bfloat16", "fp8_e4m3", 128, 16))
  assert isinstance(backend, PortableBackend) and backend.name == "portable"


def test_a_gelu_model_is_not_given_kernels_that_fuse_silu_only(monkeypatch):
  """Gemma's GeGLU: the kernels' capability record has SiLU only, so auto falls back to portable and says why, and an
  explicit choice of the kernels is an error naming the activation (the device made to look like a CUDA one)."""
  gelu = BackendRequest("bfloat16", "auto", 128, 16, "gelu_pytorch_tanh")
  assert "activation gelu_pytorch_tanh" in capabilities(CUDA).unsupported_reason(*vars(gelu).values())
  assert PortableBackend.capabilities.unsupported_reason(*vars(gelu).values()) is None
  import tinyvllm.kernels.selection as selection
  import tinyvllm.kernels.tinygrad_program as tinygrad_program
  monkeypatch.setattr(selection, "native_dialect", lambda device: "cuda")
  monkeypatch.setattr(tinygrad_program, "device_target", lambda device: on_cpu(CUDA))
  assert isinstance(select_backend("auto", "CPU", replace(gelu, activation="silu"), probe=False), FusedBackend)
  backend = select_backend("auto", "CPU", gelu, probe=False)
  assert isinstance(backend, PortableBackend) and "activation gelu_pytorch_tanh" in backend.describe()
  with pytest.raises(ConfigError, match="cuda kernels do not take the MLP activation gelu_pytorch_tanh"):
    select_backend("cuda", "CPU", gelu, probe=False)


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
  code = ("import sys; from tinyvllm.kernels.selection import BackendRequest, select_backend; "
          "select_backend('auto', 'CPU', BackendRequest('float32', 'auto', 64, 16)); "
          "bad = [m for m in sys.modules if m.endswith(('compiler_cuda', 'ops_metal', 'ops_cuda', 'tinyvllm.kernels.fused'))]; "
          "assert not bad, bad")
  subprocess.run([sys.executable, "-c", code], check=True)


def test_engine_on_cpu_uses_portable_and_refuses_cuda(stories_dir):
  from tinyvllm import LLM
  with pytest.raises(ConfigError, match="needs a CUDA device"):
    LLM(str(stories_dir), attention_backend="cuda", num_gpu_blocks=16)
  llm = LLM(str(stories_dir), num_gpu_blocks=16, max_num_seqs=2)
  assert isinstance(llm.engine.model.backend, PortableBackend) and llm.engine.model.backend.name == "portable"


def test_fused_backend_falls_back_visibly_for_unsupported_shapes():
  """head_dim 12 (3 float32 vectors a row: not a power of two) is not taken: the portable path runs, and says so once."""
  messages = []
  backend = FusedBackend(on_cpu(CUDA), log=messages.append)
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
  for target in (CUDA, METAL):
    assert unsupported_reason(shape(), target) is None
    assert unsupported_reason(shape(head_dim=8, dtype="float32", num_heads=8, num_kv_heads=4), target) is None   # stories260K
    assert unsupported_reason(shape(head_dim=96), target) is not None            # 12 vectors a row
    assert unsupported_reason(shape(head_dim=4), target) is not None             # under one 16-byte vector of bf16
    assert unsupported_reason(shape(dtype="int8"), target) is not None
    assert unsupported_reason(shape(num_heads=12), target) is not None           # not a multiple of the KV heads
  assert write_unsupported_reason("bfloat16", 1024) is None and write_unsupported_reason("bfloat16", 12) is not None


@pytest.mark.parametrize("dialect", ["cuda", "metal"])
def test_plans(dialect):
  target = TARGETS[dialect]
  shared, ring_limit = target.static_shared_bytes, tuning_for(target.kind).attention.decode_ring_limit_bytes
  for dtype, kv_fp8 in (("float32", False), ("float16", False), ("bfloat16", False), ("float16", True), ("bfloat16", True)):
    for head_dim in (8, 16, 32, 64, 128, 256):
      for group in (1, 2, 4, 7, 8, 16):
        for seqs, tq, ctx in ((1, 1, 16), (8, 1, 1024), (256, 1, 4096), (4, 64, 2048)):
          s = AttentionShape(dtype, head_dim, 2 * group, 2, 16, seqs, seqs * tq, tq, ctx, 1 << 16, kv_fp8)
          if unsupported_reason(s, target) is not None: continue
          d = decode_plan(s, target, stages=0)
          assert d.tile % 32 == 0 and d.chunk % d.tile == 0 and d.splits * d.chunk >= ctx > (d.splits - 1) * d.chunk
          assert d.lpk * d.nvl == d.vpr and d.kpp * d.lpk == 128 and d.shared_bytes <= shared
          assert d.vpr * d.vec == head_dim and d.kpp * d.unroll == d.tile and d.defines["TV_KVEC"] == d.vec
          assert d.vec == (16 if kv_fp8 and head_dim % 16 == 0 and group <= 2 else 16 // (4 if dtype == "float32" else 2))
          assert seqs * 2 * (d.splits - 1) < 512   # split only while the blocks are too few
          p = prefill_plan(s, target)
          assert p.shared_bytes <= shared and p.tokens >= 1 and p.tokens * p.q_tiles >= tq
          stages = default_decode_stages(s, target)
          assert decode_plan(s, target).defines["TV_KV_STAGES"] == stages   # stages=None: the default policy
          if stages:   # the staged decode: FP8 on CUDA, 16-byte rows, ring in budget
            staged = decode_plan(s, target, stages=stages)
            assert dialect == "cuda" and kv_fp8 and head_dim % 16 == 0 and staged.algorithm == "decode_staged"
            assert staged.launches[0].shared_bytes == 2 * 2 * staged.tile * head_dim <= ring_limit
          else:
            assert dialect == "metal" or not kv_fp8 or head_dim % 16 or decode_ring_bytes(s, d.tile, 2) > ring_limit
  w = write_plan("bfloat16", 1024, 64, 4096)
  assert w.launches[0].grid == (64, 1, 1) and w.threads == 128
  with pytest.raises(ValueError, match="16 bytes"):   # FP8 rows of 8 codes cannot be copied in 16-byte pieces
    decode_plan(AttentionShape("float16", 8, 4, 2, 16, 2, 2, 1, 64, 1024, True), CUDA, stages=2)
  with pytest.raises(ValueError, match="2 or more"):
    decode_plan(AttentionShape("bfloat16", 128, 4, 2, 16, 2, 2, 1, 64, 1024, True), CUDA, stages=1)



def test_large_gqa_groups_decode_on_tensor_cores_where_the_table_says():
  """GQA groups of 4 and more (Qwen3-8B, Qwen3-30B-A3B) at 64 sequences x 4 KV heads: the tensor-core kernel, its warps
  over the keys, takes the decode step (an H100: 1.2-2.2x faster, docs/benchmarks.md section 5); not a group of 2, not
  a batch too small to fill the GPU without split-K, not FP8 caches, not without tensor cores (Metal, pre-Ampere)."""
  tuning = tuning_for(CUDA.kind).attention
  assert (tuning.tc_decode_min_group, tuning.tc_decode_min_blocks) == (4, 256)
  shape = lambda group, seqs, kv_fp8=False, tq=1: AttentionShape("bfloat16", 128, 4 * group, 4, 16, seqs, seqs * tq, tq,
                                                                 2048, 1 << 16, kv_fp8)
  assert decode_on_tensor_cores(shape(8, 64), CUDA) and decode_on_tensor_cores(shape(4, 64), CUDA)
  assert decode_on_tensor_cores(shape(16, 256), CUDA)
  assert not decode_on_tensor_cores(shape(2, 256), CUDA) and not decode_on_tensor_cores(shape(8, 63), CUDA)
  assert not decode_on_tensor_cores(shape(8, 256, kv_fp8=True), CUDA)
  assert not decode_on_tensor_cores(shape(8, 256), METAL) and not decode_on_tensor_cores(shape(8, 256), NO_TENSOR_CORES)
  assert not decode_on_tensor_cores(shape(8, 64, tq=2), CUDA)   # a prompt step is the prefill kernel's anyway
  plan, _ = attention_source(shape(8, 64), CUDA)
  assert plan.algorithm == "prefill_tc" and plan.defines["TV_KW"] == 4 and plan.rows == 16 and plan.tokens == 2


PACKED_EXPERTS = {"int4": (("int4", 128), ("int4", 128)), "fp8": (("fp8", 2048), ("fp8", 768)),   # gate_up's, down's
                  "q4_k_m": (("int4", 32), ("int8", 16))}   # (form, scale group); a GGUF Q4_K_M layer's Q4_K and Q6_K
# the decode specimens on the register path unless named _staged (stages=0); the prefill ones on an H100 (tensor cores)
decode = lambda shape, stages=0: decode_plan(shape, CUDA, stages=stages)
SPECIMENS = {   # name -> (algorithm, plan): what the models of interest compile
  "decode_qwen3_b1": ("decode", decode(AttentionShape("bfloat16", 128, 16, 8, 16, 1, 1, 1, 1024, 1 << 16))),
  "decode_qwen3_b256": ("decode", decode(AttentionShape("bfloat16", 128, 16, 8, 16, 256, 256, 1, 1024, 1 << 16))),
  "decode_llama1b_f16": ("decode", decode(AttentionShape("float16", 64, 32, 8, 16, 32, 32, 1, 2048, 1 << 16))),
  "decode_stories_f32": ("decode", decode(AttentionShape("float32", 8, 8, 4, 16, 8, 8, 1, 512, 4096))),
  "decode_qwen3_b1_kv8": ("decode", decode(AttentionShape("bfloat16", 128, 16, 8, 16, 1, 1, 1, 1024, 1 << 16, True))),
  "decode_qwen3_b256_kv8": ("decode", decode(AttentionShape("bfloat16", 128, 16, 8, 16, 256, 256, 1, 1024, 1 << 16, True))),
  "decode_qwen3_b256_staged": ("decode_staged", decode(AttentionShape("bfloat16", 128, 16, 8, 16, 256, 256, 1, 1024, 1 << 16),
                                                       stages=2)),
  "decode_qwen3_b256_kv8_staged": ("decode_staged", decode(AttentionShape("bfloat16", 128, 16, 8, 16, 256, 256, 1, 1024,
                                                                          1 << 16, True), stages=2)),
  "prefill_qwen3": ("prefill_tc", prefill_plan(AttentionShape("bfloat16", 128, 16, 8, 16, 4, 1024, 512, 2048, 1 << 16), CUDA)),
  "prefill_qwen3_kv8": ("prefill_tc", prefill_plan(AttentionShape("bfloat16", 128, 16, 8, 16, 4, 1024, 512, 2048, 1 << 16,
                                                                  True), CUDA)),
  "prefill_qwen3_fma": ("prefill", prefill_plan(AttentionShape("bfloat16", 128, 16, 8, 16, 4, 1024, 512, 2048, 1 << 16),
                                                NO_TENSOR_CORES)),
  "prefill_stories_f32": ("prefill", prefill_plan(AttentionShape("float32", 8, 8, 4, 16, 4, 64, 32, 512, 4096), CUDA)),
  "kv_write_bf16": ("kv_write", write_plan("bfloat16", 1024, 256, 1 << 16)),
  # the mixture of experts at Qwen3-30B-A3B's shape, 1 and 16 tokens: routing + combine, gate_up, down
  **{f"moe_{kernel.name}_n{n}": (kernel.algorithm, kernel) for n in (1, 16)
     for kernel in moe_plan(MoEShape("bfloat16", n, 2048, 768, 128, 8, True, 1e-6)).kernels},
  # its packed experts: int4 in groups of 128, FP8 per channel
  **{f"moe_{name}_{kernel.name}_n{n}": (kernel.algorithm, kernel) for n in (1, 16) for name, forms in PACKED_EXPERTS.items()
     for kernel in moe_plan(MoEShape("bfloat16", n, 2048, 768, 128, 8, True, 1e-6, forms)).kernels},
  # tensor parallelism's collectives at TP=4: a row-parallel product's all-reduce with the residual, the inputs' broadcast
  "all_reduce_residual": ("all_reduce", all_reduce_plan(4096, 4, "bfloat16", residual=True)),
  "all_reduce_broadcast": ("all_reduce", all_reduce_plan(1024, 4, "float32", broadcast=True)),
}
# Qwen3-0.6B's projections as an H100 plans them (wgmma from 128 rows), compiled for sm_90a as NVRTC does there
GEMM_SPECIMENS = {f"gemm_{name}_{rows}": LinearShape("bfloat16", rows, k, o, False, 1e-6 if norm else None, silu, silu, o > 100000)
                  for rows in (64, 256, 8192) for name, k, o, norm, silu in
                  (("qkv", 1024, 4096, True, False), ("down", 3072, 1024, False, True), ("logits", 1024, 151936, True, False))
                  if not (name == "logits" and rows > 256)}


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not installed (the CUDA compile check needs it)")
def test_cuda_sources_compile_with_nvcc(tmp_path):
  """The CUDA dialect through the real CUDA compiler (sm_90; the matmuls for sm_90a, with wgmma): no errors, no
  register spills, shared memory in budget."""
  sources = {name: (kernel_source("cuda", algo, plan.defines), "-arch=sm_90") for name, (algo, plan) in SPECIMENS.items()}
  sources |= {name: (kernel_source("cuda", "gemm_tc", gemm_plan(shape, CUDA)[0]), "-gencode=arch=compute_90a,code=sm_90a")
              for name, shape in GEMM_SPECIMENS.items()}
  sources |= {f"moe_grouped_{kernel.name}_n{n}": (kernel_source("cuda", kernel.algorithm, kernel.defines),
                                                 "-gencode=arch=compute_90a,code=sm_90a")
              for n in (256, 8192) for kernel in grouped_plan(MoEShape("bfloat16", n, 2048, 768, 128, 8, True, 1e-6), CUDA).kernels}
  sources |= {f"moe_grouped_{name}_{kernel.name}_n{n}": (kernel_source("cuda", kernel.algorithm, kernel.defines),
                                                        "-gencode=arch=compute_90a,code=sm_90a")
              for n in (256, 8192) for name, forms in PACKED_EXPERTS.items()
              for kernel in grouped_plan(MoEShape("bfloat16", n, 2048, 768, 128, 8, True, 1e-6, forms), CUDA).kernels}
  assert sum("#define TV_WGMMA" in src for src, _ in sources.values()) >= 7
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
  backend = FusedBackend(on_cpu(TARGETS[dialect]))
  rng = np.random.default_rng(4)
  shapes = {"decode-split": [(300, 1), (40, 1)], "decode": [(40, 1)] * 128, "prefill": [(50, 20), (9, 1)]}
  splits = {}
  with collecting_sources() as pending:
    for name, seqs in shapes.items():
      case = make_case(rng, seqs, heads=4, kv_heads=2, head_dim=128, dtype="bfloat16", kv_fp8=kv_fp8)
      meta = metadata_tensors(case)
      kv_dtype = dtypes.uint8 if kv_fp8 else dtypes.bfloat16
      kc, vc = (Tensor.empty(*c.shape, dtype=kv_dtype) for c in (case.k_cache, case.v_cache))
      q = Tensor.empty(*case.q.shape, dtype=dtypes.bfloat16)
      backend.write_kv(kc, vc, q[:, :2], q[:, 2:], meta.slot_mapping)
      backend.attention(q, kc, vc, meta)
      shape, reason = attention_shape(q, kc, vc, meta, backend.target)
      assert reason is None
      if shape.query_len == 1: splits[name] = decode_plan(shape, backend.target).splits
  assert dict(backend.calls) == {"write": 3, "decode": 2, "prefill": 1}
  assert splits["decode-split"] > 1 and splits["decode"] == 1   # the split-K decode (two launches) and the single one
  assert len(pending) == 6 and all(device == "CPU" for device, _ in pending)


@pytest.mark.parametrize("dtype, kv_cache_dtype, fused_takes", [("float32", "auto", True), ("float16", "fp8", True),
                                                                  ("float32", "fp8", False)])
def test_the_engine_asks_for_the_models_configuration_by_name(dtype, kv_cache_dtype, fused_takes, stories_dir, monkeypatch):
  """What the engine hands the selection is what the capability records speak of (dtype names, not tinygrad's)."""
  import tinyvllm.engine.core_setup as core_setup
  from tinyvllm import LLM
  asked = []

  def record(requested, device, request, options=None, probe=True):
    asked.append(request)
    return PortableBackend("recorded")
  monkeypatch.setattr(core_setup, "select_backend", record)
  LLM(str(stories_dir), dtype=dtype, kv_cache_dtype=kv_cache_dtype, num_gpu_blocks=8, max_model_len=64)
  assert asked == [BackendRequest(dtype, "auto" if kv_cache_dtype == "auto" else "fp8_e4m3", 8, 16)]
  reason = capabilities(DeviceTarget.nominal("cuda")).unsupported_reason(*vars(asked[0]).values())
  assert (reason is None) == fused_takes and (fused_takes or "FP8 KV cache with float32" in reason)
