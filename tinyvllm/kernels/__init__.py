"""Hand-written attention kernels (CUDA and Metal, from one dialect-neutral source in kernels/) and their adapter.

  plan.py              launch plans: compile-time constants, grids, buffers (pure Python)
  sources.py           kernel source text: #defines + dialect prelude + algorithm
  tinygrad_program.py  the only module using tinygrad internals (PROGRAM, ProgramInfo, compilers)
  fused.py             the cuda/metal backend: fused decode (+ split-K reduce), prefill/mixed, KV write, and the two below
  linear.py            decode-batch matrix products with RMSNorm / SwiGLU / residual fused in (kernels/linear.inc)
  qkv_rope.py          QK-norm + RoPE + KV write in one kernel (kernels/qkv_rope.inc)
  portable.py          the portable backend (tinygrad ops), the reference and the fallback
  selection.py         --attention-backend auto|portable|cuda|metal
  emulator.py          builds and runs the same kernel text on the CPU (C++ shims in kernels/emu) for tests
  cases.py             random paged batches (holes, shared blocks, mixed decode/prefill) for checks
See docs/kernels.md.
"""
from tinyvllm.kernels.selection import BACKEND_CHOICES, native_dialect, select_attention_backend

__all__ = ["BACKEND_CHOICES", "native_dialect", "select_attention_backend"]
