"""Peers on the same device and shape (random weights): HF transformers `generate()` and tinygrad's own `tinygrad.llm`.

Both are imported only here, when asked for; transformers and torch are test/bench references, not dependencies.
"""
from __future__ import annotations

import sys
import time
import types
from dataclasses import dataclass
from typing import Any

from tinyvllm.model.presets import PRESETS


@dataclass
class PeerResult:
  name: str
  batch: int
  prompt_len: int
  new_tokens: int
  seconds: float          # decode phase (after the first token)

  @property
  def tok_s(self) -> float: return self.batch * (self.new_tokens - 1) / self.seconds

  def line(self) -> str:
    return f"{self.name:>24}: batch {self.batch:>4}, prompt {self.prompt_len}, {self.new_tokens} new: {self.tok_s:9.1f} tok/s"


def hf_generate(preset: str, batch: int, prompt_len: int = 128, new_tokens: int = 256) -> PeerResult:
  """HF eager generate() on CUDA in bf16; decode time = total - time of a 1-token generate (the prefill)."""
  import torch
  from transformers import AutoConfig, AutoModelForCausalLM
  raw = dict(PRESETS[preset])
  config = AutoConfig.for_model(raw.pop("architectures")[0].replace("ForCausalLM", "").lower(), **raw)
  with torch.device("cuda"): model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).eval()
  ids = torch.randint(0, 10000, (batch, prompt_len), device="cuda")
  mask = torch.ones_like(ids)

  def gen(n: int) -> float:
    torch.cuda.synchronize()
    start = time.perf_counter()
    with torch.no_grad():
      model.generate(ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0)
    torch.cuda.synchronize()
    return time.perf_counter() - start
  gen(2)
  first, total = gen(1), gen(new_tokens)
  return PeerResult("HF transformers generate", batch, prompt_len, new_tokens, total - first)


def _stub_tinygrad_llm_kernels() -> None:
  """The tinygrad 0.14.0 wheel's llm/model.py imports a subpackage the wheel does not ship (benchmarks reference)."""
  from tinygrad import nn
  amd = types.ModuleType("tinygrad.llm.kernels.amd")
  amd.Linear = nn.Linear  # type: ignore[attr-defined]
  amd.amd_custom_kernels_supported = lambda device: False  # type: ignore[attr-defined]

  def unavailable(*args: Any, **kwargs: Any): raise RuntimeError("AMD kernels are not in the tinygrad 0.14.0 wheel")
  amd.gated_delta_prefill = amd.flash_attention = unavailable  # type: ignore[attr-defined]
  sys.modules.setdefault("tinygrad.llm.kernels", types.ModuleType("tinygrad.llm.kernels"))
  sys.modules.setdefault("tinygrad.llm.kernels.amd", amd)


def tinygrad_llm(preset: str, prompt_len: int = 128, new_tokens: int = 256, max_context: int = 4096) -> PeerResult:
  """tinygrad.llm's Transformer at batch 1 (its only batch size), random fp16 weights in the preset's shape."""
  _stub_tinygrad_llm_kernels()
  from tinygrad import Tensor, dtypes, nn
  from tinygrad.llm.model import Transformer, TransformerConfig
  raw = PRESETS[preset]
  head_dim = raw.get("head_dim", raw["hidden_size"] // raw["num_attention_heads"])
  config = TransformerConfig(
    num_blocks=raw["num_hidden_layers"], dim=raw["hidden_size"], hidden_dim=raw["intermediate_size"],
    n_heads=raw["num_attention_heads"], n_kv_heads=raw["num_key_value_heads"], norm_eps=raw["rms_norm_eps"],
    vocab_size=raw["vocab_size"], head_dim=head_dim, rope_theta=raw["rope_theta"], rope_dim=head_dim, v_head_dim=head_dim,
    max_context=max_context, qk_norm=head_dim if "Qwen3" in raw["architectures"][0] else 0)
  model = Transformer(config)
  for p in nn.state.get_parameters(model): p.replace((Tensor.randn(*p.shape, dtype=dtypes.float32) * 0.02).cast(dtypes.half))
  Tensor.realize(*nn.state.get_parameters(model))
  prompt = list(range(1, prompt_len + 1))

  def decode_seconds(n: int) -> float:
    """From the first generated token to the n-th (the prefill is before the first)."""
    model._cached_tokens = []
    first = 0.0
    for count, _ in enumerate(model.generate(list(prompt)), start=1):
      if count == 1: first = time.perf_counter()
      if count == n: break
    return time.perf_counter() - first
  decode_seconds(8)
  return PeerResult("tinygrad.llm", 1, prompt_len, new_tokens, decode_seconds(new_tokens))
