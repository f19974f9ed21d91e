"""The FP8 E4M3 KV cache (`--kv-cache-dtype fp8`): the encoding against torch's float8_e4m3fn (a reference no one here
wrote), the engine with it on the CPU (portable path), and its sizing. The kernels' FP8 paths are checked in
test_kernels_emulated.py / test_kernels_qkv_rope.py (the _kv8 cases) and on the GPU by bench/check_kernels.py."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from tinygrad import Tensor, dtypes

from tests.emulator.cases import e4m3_codes_to_f32, f32_to_e4m3_codes
from tinyvllm import LLM, SamplingParams
from tinyvllm.config import ConfigError, EngineConfig
from tinyvllm.layers.fp8 import decode_e4m3, encode_e4m3

EDGES = [0.0, -0.0, 448.0, -448.0, 449.0, 464.0, 465.0, 480.0, 1e9, np.inf, -np.inf, 2.0 ** -6, 2.0 ** -7, 2.0 ** -9,
         2.0 ** -10, 3 * 2.0 ** -10, 2.0 ** -10 * 1.0001, 1e-30, 0.0625 + 2.0 ** -8, 1.0 + 1 / 16, 1.0 + 3 / 16]


def _values() -> np.ndarray:
  rng = np.random.default_rng(0)
  scales = (1e-4, 1e-3, 1e-2, 0.1, 1.0, 10.0, 100.0, 1000.0)
  return np.concatenate([*(rng.standard_normal(4000) * s for s in scales), EDGES]).astype(np.float32)


def _torch_codes(x: np.ndarray) -> np.ndarray: return torch.tensor(x).to(torch.float8_e4m3fn).view(torch.uint8).numpy()


def test_encoders_match_torch():
  x = _values()
  want = _torch_codes(x)
  np.testing.assert_array_equal(encode_e4m3(Tensor(x)).numpy(), want)
  np.testing.assert_array_equal(f32_to_e4m3_codes(x), want)
  # saturation and NaN: what torch gives for out-of-range values and what the kernels' satfinite conversion gives
  assert f32_to_e4m3_codes(np.array([1e9, -np.inf, np.nan], np.float32)).tolist() == [0x7E, 0xFE, 0x7F]


def test_decoders_match_torch():
  codes = np.arange(256, dtype=np.uint8)
  want = torch.tensor(codes).view(torch.float8_e4m3fn).float().numpy()
  finite = ~np.isnan(want)
  assert finite.sum() == 254   # 0x7f and 0xff are the two NaNs
  for got in (decode_e4m3(Tensor(codes), dtypes.float32).numpy(), e4m3_codes_to_f32(codes)):
    np.testing.assert_array_equal(got[finite], want[finite])
  # every code round-trips through the encoder
  np.testing.assert_array_equal(f32_to_e4m3_codes(want[finite]), codes[finite])


def test_bad_kv_cache_dtype_is_a_clear_error():
  with pytest.raises(ConfigError, match="kv_cache_dtype must be one of auto, fp8, fp8_e4m3, got 'int4'"):
    EngineConfig(model="x", kv_cache_dtype="int4")


def test_fp8_cache_holds_a_byte_a_value(stories_dir):
  sizes = {}
  for kind in ("auto", "fp8"):
    llm = LLM(str(stories_dir), kv_cache_dtype=kind, kv_cache_memory=0.01, cuda_graph_sizes=[])
    k_cache = llm.engine.kv_cache.layers[0][0]
    sizes[kind] = (llm.engine.allocator.num_blocks, k_cache.dtype, llm.engine.kv_cache.nbytes)
  assert sizes["fp8"][1] == dtypes.uint8 and sizes["auto"][1] == dtypes.float32   # float32 compute on the CPU
  assert sizes["fp8"][0] // 4 == sizes["auto"][0]                                 # 1 byte a value against 4
  budget = int(0.01 * 2**30)
  assert budget - sizes["fp8"][2] < sizes["fp8"][2] / sizes["fp8"][0] and sizes["fp8"][2] <= budget


@pytest.mark.slow
def test_stories_greedy_with_fp8_cache(stories_dir):
  """stories260K with its K/V rounded to E4M3: the same greedy text as the float32 reference for the first 64 tokens
  (measured: the rounding flips no argmax there), alone and inside a batch that pages, chunks and preempts."""
  reference = json.loads((stories_dir / "reference_greedy.json").read_text())
  rng = np.random.default_rng(5)
  others = [[1, *rng.integers(3, 512, n).tolist()] for n in (40, 3, 90, 130)]
  params = lambda n: SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
  alone = LLM(str(stories_dir), kv_cache_dtype="fp8", max_num_seqs=1, num_gpu_blocks=64)
  solo = [alone.generate([p], params(32), use_tqdm=False)[0].outputs[0].token_ids for p in others]
  ref = alone.generate([reference["prompt_ids"]], params(64), use_tqdm=False)[0].outputs[0].token_ids
  assert ref == reference["greedy_ids"][:64]
  batched = LLM(str(stories_dir), kv_cache_dtype="fp8", num_gpu_blocks=20, max_num_batched_tokens=64, max_num_seqs=8,
                long_prefill_token_threshold=16)
  outs = batched.generate([reference["prompt_ids"], *others], [params(64)] + [params(32)] * len(others), use_tqdm=False)
  assert batched.engine.scheduler.num_preemptions > 0
  assert outs[0].outputs[0].token_ids == ref
  assert [o.outputs[0].token_ids for o in outs[1:]] == solo
  assert batched.engine.allocator.num_used_blocks == 0
