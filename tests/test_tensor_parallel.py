"""Tensor parallelism over 2 and 4 tinygrad CPU devices (CPU:0 .. CPU:3 on one machine): the same greedy tokens as HF
transformers and as stories260K's reference, for tiny random Qwen3 (QK-norm, GQA: with 4 devices its 2 KV heads are
replicated), Llama (biases, tied embeddings, a vocabulary 4 does not divide) and Qwen3-MoE models; the split weights
and the collectives checked against numpy; what cannot be split refused by name."""
from __future__ import annotations

import numpy as np
import pytest
from tinygrad import Tensor

from tests.hf_models import assert_same_greedy, hf_greedy, make_model
from tinyvllm import LLM, SamplingParams
from tinyvllm.config import ConfigError
from tinyvllm.layers.tensor_parallel import TensorParallelGroup, group_devices
from tinyvllm.model.sharding import _qkv_parts, local_config
from tinyvllm.model_config import ModelConfig

PROMPTS = [[5, 9, 17, 3], [44, 2, 91, 7, 120, 33, 8, 19, 250, 11, 6], [77], [13, 13, 200, 31, 64, 5, 1]]
NEW_TOKENS = 12
GREEDY = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)

MODELS = {
  "qwen3": ("qwen3", {}),
  "llama": ("llama", {"attention_bias": True, "mlp_bias": True, "tie_word_embeddings": True, "vocab_size": 322}),
  "qwen3_moe": ("qwen3_moe", {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32, "norm_topk_prob": True}),
}


@pytest.fixture(scope="module")
def tiny_models(tmp_path_factory):
  """name -> (folder, HF's greedy continuation and scores of each prompt), each tiny random model saved when first asked for."""
  made: dict = {}
  def get(name: str):
    if name not in made:
      kind, overrides = MODELS[name]
      folder = tmp_path_factory.mktemp(name)
      model = make_model(kind, folder, **overrides)
      made[name] = folder, [hf_greedy(model, p, NEW_TOKENS) for p in PROMPTS]
    return made[name]
  return get


def generate(folder, tp: int, prompts=PROMPTS) -> list[list[int]]:
  llm = LLM(str(folder), tensor_parallel_size=tp, num_gpu_blocks=48, max_num_seqs=8)
  outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
  assert llm.engine.allocator.num_free_blocks == llm.engine.allocator.num_blocks
  return [o.outputs[0].token_ids for o in outs]


@pytest.mark.slow
@pytest.mark.parametrize(("name", "tp"), [("qwen3", 2), ("qwen3", 4), ("llama", 2), ("llama", 4), ("qwen3_moe", 2)])
def test_tensor_parallel_greedy_equals_hf(tiny_models, name, tp):
  folder, refs = tiny_models(name)
  for ours, (ref, scores) in zip(generate(folder, tp), refs, strict=True): assert_same_greedy(ours, ref, scores)


@pytest.mark.slow
@pytest.mark.parametrize("tp", [2, 4])
def test_stories260k_tensor_parallel_gives_the_reference(stories_dir, reference, tp):
  llm = LLM(str(stories_dir), tensor_parallel_size=tp, num_gpu_blocks=64)
  out = llm.generate({"prompt_token_ids": reference["prompt_ids"]}, SamplingParams(temperature=0, max_tokens=32), use_tqdm=False)[0]
  assert out.outputs[0].token_ids == reference["greedy_ids"][:32]


def test_qkv_split_gives_each_device_its_heads_and_replicates_kv_heads():
  cfg = ModelConfig.from_dict({"architectures": ["Qwen3ForCausalLM"], "hidden_size": 8, "intermediate_size": 8,
                               "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 2,
                               "vocab_size": 16})
  rows = np.arange((4 + 2 * 2) * 2, dtype=np.float32)   # q heads 0-3 (rows 0-7), k heads 0-1 (8-11), v heads 0-1 (12-15)
  parts = [p.numpy().tolist() for p in _qkv_parts(Tensor(rows), cfg, 4)]
  # device i: q head i, k and v head i // 2 (each KV head on two devices)
  assert parts == [[0, 1, 8, 9, 12, 13], [2, 3, 8, 9, 12, 13], [4, 5, 10, 11, 14, 15], [6, 7, 10, 11, 14, 15]]
  parts = [p.numpy().tolist() for p in _qkv_parts(Tensor(rows), cfg, 2)]
  assert parts == [[0, 1, 2, 3, 8, 9, 12, 13], [4, 5, 6, 7, 10, 11, 14, 15]]
  local = local_config(cfg, 4)
  assert (local.num_heads, local.num_kv_heads, local.intermediate_size) == (1, 1, 2)


def test_collectives_on_local_views():
  group = TensorParallelGroup(group_devices("CPU", 2))
  x, w = np.random.default_rng(0).standard_normal((3, 8), np.float32), np.random.default_rng(1).standard_normal((8, 5), np.float32)
  xl = group.local([Tensor(x[:, :4]), Tensor(x[:, 4:])])
  wl = group.local([Tensor(w[:4]), Tensor(w[4:])])
  np.testing.assert_allclose(group.all_reduce(xl @ wl).to("CPU").numpy(), x @ w, rtol=1e-5, atol=1e-5)
  np.testing.assert_array_equal(group.gather_columns(xl).numpy(), x)
  assert group_devices("CUDA:2", 2) == ("CUDA:2", "CUDA:3")


@pytest.mark.parametrize("size", [2, 4])
def test_placed_columns_all_reduced_are_the_gather_bit_for_bit(size: int):
  """The peer kernel's gather (PeerAllReduce.gather_columns): each device's shard placed among zeros, all-reduced, then
  the first device's copy: the shards side by side, the same values (infinities included)."""
  group = TensorParallelGroup(group_devices("CPU", size))
  x = np.random.default_rng(size).standard_normal((3, 5 * size)).astype(np.float32)
  x[0, 1], x[1, -1] = np.inf, -np.inf
  xl = group.local([Tensor(x[:, 5 * i:5 * (i + 1)]) for i in range(size)])
  placed = group.place_columns(xl)
  assert placed.shape == (3, 5 * size)
  gathered = group.first_of(group.all_reduce(placed))
  assert not isinstance(gathered.device, tuple)   # one device's buffer
  np.testing.assert_array_equal(gathered.numpy(), x)


@pytest.mark.parametrize(("kwargs", "words"), [
  ({"tensor_parallel_size": 3}, "tensor_parallel_size 3 does not divide the model's num_attention_heads (8)"),
  ({"tensor_parallel_size": 2, "preemption_mode": "swap"}, "tensor parallelism with --preemption-mode swap is not supported"),
])
def test_what_cannot_be_split_is_refused_by_name(stories_dir, kwargs, words):
  with pytest.raises(ConfigError, match=words.replace("(", r"\(").replace(")", r"\)")): LLM(str(stories_dir), **kwargs)
