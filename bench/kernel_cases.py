"""The random paged-attention cases bench/check_kernels.py runs on the GPU (tests/emulator/cases.py builds them)."""
from __future__ import annotations

import numpy as np

CTXS = [1000, 4000, 100, 1, 2, 15, 16, 17]             # the first three start with shared blocks (share=2)
MIXED = [(600, 250), (1500, 1), (300, 100), (17, 1), (16, 16), (2, 2), (100, 1)]


FP8_CASES = [
  dict(name="decode_bf16_d128_g2_kv8", seqs=[(c, 1) for c in CTXS], heads=4, kv_heads=2, head_dim=128, dtype="bfloat16",
       share=2, kv_fp8=True),
  dict(name="decode_bf16_d128_g2_kv8_nosplit", seqs=[(c, 1) for c in CTXS], heads=4, kv_heads=2, head_dim=128,
       dtype="bfloat16", share=2, splits=1, kv_fp8=True),
  dict(name="decode_bf16_qwen3_b128_kv8", seqs=[(int(c), 1) for c in np.random.default_rng(6).integers(1, 1025, 128)],
       heads=16, kv_heads=8, head_dim=128, dtype="bfloat16", share=0, kv_fp8=True),
  dict(name="mixed_bf16_d128_g2_kv8", seqs=MIXED, heads=4, kv_heads=2, head_dim=128, dtype="bfloat16", share=2, kv_fp8=True),
  dict(name="mixed_f16_d64_g4_kv8", seqs=MIXED, heads=8, kv_heads=2, head_dim=64, dtype="float16", share=2, kv_fp8=True),
]


def case_list(quick: bool) -> list[dict]:
  cases = []
  for d in (64, 128):
    for g in (1, 2, 4, 8):
      cases.append(dict(name=f"decode_bf16_d{d}_g{g}", seqs=[(c, 1) for c in CTXS], heads=2 * g, kv_heads=2, head_dim=d,
                        dtype="bfloat16", share=2))
      if not quick or g == 2:
        cases.append(dict(name=f"mixed_bf16_d{d}_g{g}", seqs=MIXED, heads=2 * g, kv_heads=2, head_dim=d, dtype="bfloat16", share=2))
  cases += [
    dict(name="decode_bf16_d128_g2_nosplit", seqs=[(c, 1) for c in CTXS], heads=4, kv_heads=2, head_dim=128, dtype="bfloat16",
         share=2, splits=1),
    dict(name="decode_bf16_qwen3_b128", seqs=[(int(c), 1) for c in np.random.default_rng(5).integers(1, 1025, 128)], heads=16,
         kv_heads=8, head_dim=128, dtype="bfloat16", share=0),
    # Qwen3-30B-A3B's group of 8 at 64 sequences: the decode step on the tensor-core prefill kernel (as the engine plans it)
    dict(name="decode_bf16_qwen3_30b_b64", seqs=[(int(c), 1) for c in np.random.default_rng(7).integers(1, 1025, 64)],
         heads=32, kv_heads=4, head_dim=128, dtype="bfloat16", share=0),
    dict(name="prefill_bf16_qwen3_long", seqs=[(2048, 2048), (1000, 600), (300, 1)], heads=16, kv_heads=8, head_dim=128,
         dtype="bfloat16", share=0),
    dict(name="decode_f16_d128_g2", seqs=[(c, 1) for c in CTXS], heads=4, kv_heads=2, head_dim=128, dtype="float16", share=2),
    dict(name="mixed_f16_d64_g4", seqs=MIXED, heads=8, kv_heads=2, head_dim=64, dtype="float16", share=2),
    dict(name="decode_bf16_d64_g7", seqs=[(c, 1) for c in CTXS], heads=14, kv_heads=2, head_dim=64, dtype="bfloat16", share=2),
    dict(name="mixed_bf16_d64_g7", seqs=MIXED, heads=14, kv_heads=2, head_dim=64, dtype="bfloat16", share=2),
    dict(name="decode_f32_d8_g2_stories", seqs=[(c, 1) for c in (300, 512, 1, 2, 15, 16, 17, 100)], heads=8, kv_heads=4,
         head_dim=8, dtype="float32", share=2),
    dict(name="mixed_f32_d8_g2_stories", seqs=[(200, 200), (300, 40), (17, 1), (5, 5)], heads=8, kv_heads=4, head_dim=8,
         dtype="float32", share=1),
    *FP8_CASES,
  ]
  return cases


def build(spec: dict, seed: int):
  from tests.emulator.cases import make_case
  rng = np.random.default_rng(seed)
  return make_case(rng, spec["seqs"], heads=spec["heads"], kv_heads=spec["kv_heads"], head_dim=spec["head_dim"],
                   dtype=spec["dtype"], share=spec["share"], pad_seqs=1, kv_fp8=spec.get("kv_fp8", False))


def plan_for(case, target, splits=None):
  """(algorithm, plan) of the case's kernel on `target` (a DeviceTarget): the decode plan with `splits` forced, else the
  engine's choice (attention.attention_source)."""
  from tinyvllm.kernels.attention import attention_source
  from tinyvllm.kernels.plan import decode_plan
  plan = decode_plan(case.shape, target, splits=splits) if splits is not None else attention_source(case.shape, target)[0]
  return plan.algorithm, plan
