"""The hand-written CUDA and Metal kernels (sources in csrc/) and the backend that runs them.

  fused.py             FusedBackend: the compute-backend ops (tinyvllm/backend/interface.py) on the kernels below
  selection.py         choosing the backend at engine start (--attention-backend auto|portable|cuda|metal)
  attention.py         paged attention (decode with split-K, prefill/mixed) and the KV write
  linear.py, gemm.py   the products with RMSNorm / SwiGLU / bias / residual fused in: skinny rows, tensor-core GEMM
  qkv_rope.py          QK-norm + RoPE + KV write in one kernel
  sample.py            greedy / temperature sampling in one kernel
  decode_layer.py      every layer of a small decode step in one persistent kernel (CUDA, Hopper)
  plan.py              launch plans: compile-time constants, grids, buffers (pure functions of shape and target)
  tuning.py, tuning/   the planners' measured choices, as data per device kind
  sources.py           kernel source text: #defines + dialect prelude + algorithm files, from the package
  tinygrad_program.py  compiling and launching through tinygrad
See docs/kernels.md.
"""
