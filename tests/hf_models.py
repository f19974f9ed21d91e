"""Tiny random HF models saved as real model folders by transformers (the reference implementation)."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

BASE = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            vocab_size=320, max_position_embeddings=256, initializer_range=0.3, bos_token_id=None, eos_token_id=None,
            pad_token_id=None)


def make_model(kind: str, folder: Path, seed: int = 0, dtype: torch.dtype = torch.float32, shard_size: str | None = None,
               **overrides):
  """Save a random `kind` (qwen3 | qwen2 | llama | mistral | gemma | qwen3_moe | mixtral) model to folder; returns the HF
  model (float32, eval mode)."""
  import transformers as tf
  classes = {"qwen3": (tf.Qwen3Config, tf.Qwen3ForCausalLM), "qwen2": (tf.Qwen2Config, tf.Qwen2ForCausalLM),
             "llama": (tf.LlamaConfig, tf.LlamaForCausalLM), "mistral": (tf.MistralConfig, tf.MistralForCausalLM),
             "gemma": (tf.GemmaConfig, tf.GemmaForCausalLM), "qwen3_moe": (tf.Qwen3MoeConfig, tf.Qwen3MoeForCausalLM),
             "mixtral": (tf.MixtralConfig, tf.MixtralForCausalLM)}
  config_cls, model_cls = classes[kind]
  torch.manual_seed(seed)
  model = model_cls(config_cls(**{**BASE, **overrides})).eval()
  with torch.no_grad():  # norms away from 1 so that a missing or misplaced norm cannot pass
    for name, p in model.named_parameters():
      if "norm" in name: p.copy_(1 + 0.3 * torch.randn_like(p))
      elif name.endswith("bias"): p.copy_(0.3 * torch.randn_like(p))
  model.to(dtype).save_pretrained(folder, **({"max_shard_size": shard_size} if shard_size else {}))
  return model_cls.from_pretrained(folder, dtype=torch.float32).eval()  # as a user would load the saved folder


def hf_logits(model, ids: list[int]) -> np.ndarray:
  with torch.no_grad(): return model(torch.tensor([ids])).logits[0].float().numpy()


def hf_greedy(model, ids: list[int], new_tokens: int) -> tuple[list[int], np.ndarray]:
  """HF's greedy continuation and the logits it chose each token from ([new_tokens, vocab])."""
  with torch.no_grad():
    out = model.generate(torch.tensor([ids]), max_new_tokens=new_tokens, do_sample=False, output_scores=True,
                         return_dict_in_generate=True, attention_mask=torch.ones(1, len(ids), dtype=torch.long))
  return out.sequences[0, len(ids):].tolist(), torch.stack(out.scores)[:, 0].numpy()


def assert_same_greedy(ours: list[int], ref: list[int], ref_logits: np.ndarray, tie: float = 1e-4) -> None:
  """Token-for-token equal, except that a divergence is accepted where the reference's top two logits nearly tie."""
  for i, (a, b) in enumerate(zip(ours, ref, strict=False)):
    if a != b:
      top2 = np.sort(ref_logits[i])[-2:]
      assert top2[1] - top2[0] < tie, f"greedy tokens differ at {i}: {a} != {b} (top-2 gap {top2[1] - top2[0]:.3g})"
      return
  assert len(ours) == len(ref), f"{len(ours)} tokens != {len(ref)}"
