"""Mixture-of-experts GGUF files as llama.cpp writes them (tests/gguf_files.py: every layer's experts in 3-D
ffn_gate_exps / ffn_up_exps / ffn_down_exps tensors and the router in ffn_gate_inp): a qwen3moe file against HF
transformers reading the same file, a llama file with experts (llama.cpp's Mixtral) against HF's Mixtral on the weights
the gguf package dequantizes; the experts kept packed (a Q4_K_M mix's Q4_K gate/up beside its Q6_K down) or
dequantized (F16); the metadata errors."""
from __future__ import annotations

import numpy as np
import pytest

from tests.gguf_files import write_tiny_llama
from tinyvllm import LLM, SamplingParams
from tinyvllm.backend.quantized import QuantizedWeight
from tinyvllm.config import ConfigError

gguf = pytest.importorskip("gguf", reason="the gguf package (test extra) writes the test files")
PROMPT = [int(x) for x in np.random.default_rng(5).integers(0, 256, 20)]
ATTENTION = ("attn_q", "attn_k", "attn_v", "attn_output")
# name -> (attention's type, the experts' gate/up and down types)
CASES = {"q4_k_m": ("Q4_K", "Q4_K", "Q6_K"), "q8_0": ("Q8_0", "Q8_0", "Q8_0"), "f16-experts": ("Q8_0", "F16", "F16")}
EXPERTS, USED, INTER = 8, 2, 256   # (a K-quant block is 256 columns: the down product's K)


def moe_file(path, case: str, arch: str = "qwen3moe", **dims: int):
  attention, up, down = CASES[case]
  linears = {**dict.fromkeys(ATTENTION, attention), "ffn_gate": up, "ffn_up": up, "ffn_down": down}
  heads = {"heads": 2, "kv_heads": 1} if arch == "qwen3moe" else {}   # (HF reads a qwen3 file's head_dim as 128)
  return write_tiny_llama(path, linears, "F32", None, arch=arch, experts=(EXPERTS, USED, INTER), **heads, **dims)


def relative_error(ours: np.ndarray, ref: np.ndarray) -> float: return float(np.abs(ours - ref).max() / np.abs(ref).max())


def hf_qwen3moe(path):
  """HF transformers on the same file: llama.cpp renormalises the chosen experts' probabilities (its qwen3moe graph),
  and HF's GGUF mapping reads neither that nor the experts' size, so both are passed."""
  import torch
  from transformers import AutoModelForCausalLM
  return AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32, norm_topk_prob=True,
                                              moe_intermediate_size=INTER)


@pytest.mark.parametrize("case", list(CASES))
def test_qwen3moe_file_matches_hf_on_the_same_file(case, tmp_path, capfd):
  import torch
  path = moe_file(tmp_path / "moe.gguf", case)
  llm = LLM(str(path), device="CPU", max_num_seqs=2, num_gpu_blocks=32, max_model_len=128)
  moe = llm.engine.model.weights.layers[0].moe
  assert llm.engine.model_config.architecture == "Qwen3MoeForCausalLM" and moe.num_experts == EXPERTS and moe.top_k == USED
  packed = CASES[case][1] != "F16"
  assert isinstance(moe.gate_up_proj, QuantizedWeight) == isinstance(moe.down_proj, QuantizedWeight) == packed
  if packed: assert moe.gate_up_proj.shape == (EXPERTS * 2 * INTER, 256) and moe.down_proj.method == f"gguf {CASES[case][2]}"
  assert ("gguf: experts kept packed" in capfd.readouterr().err) == packed
  with torch.no_grad(): ref = hf_qwen3moe(path)(torch.tensor([PROMPT])).logits[0, -1].numpy()
  assert relative_error(llm.engine.compute_logits(PROMPT), ref) < 1e-4


@pytest.mark.slow
def test_qwen3moe_file_greedy_tokens_match_hf(tmp_path):
  from tests.hf_models import assert_same_greedy, hf_greedy
  path = moe_file(tmp_path / "moe.gguf", "q4_k_m")
  ref, ref_logits = hf_greedy(hf_qwen3moe(path), PROMPT, 32)
  llm = LLM(str(path), device="CPU", max_num_seqs=2, num_gpu_blocks=32, max_model_len=128)
  out = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=32, ignore_eos=True), use_tqdm=False)[0]
  assert_same_greedy(out.outputs[0].token_ids, ref, ref_logits)


def hf_mixtral_from_gguf(path):
  """HF's Mixtral on the file's weights as the gguf package dequantizes them, attn_q / attn_k rows un-permuted by HF's
  own GGUF processor (llama.cpp permutes a llama file's)."""
  import torch
  from transformers import MixtralConfig, MixtralForCausalLM
  from transformers.modeling_gguf_pytorch_utils import LlamaTensorProcessor
  reader = gguf.GGUFReader(str(path))
  w = {t.name: gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32) for t in reader.tensors}
  hidden, layers, vocab = w["token_embd.weight"].shape[1], 1 + max(int(n.split(".")[1]) for n in w if n.startswith("blk.")), \
    w["token_embd.weight"].shape[0]
  heads, kv_heads = 4, 2
  config = MixtralConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=INTER, num_hidden_layers=layers,
                         num_attention_heads=heads, num_key_value_heads=kv_heads, num_local_experts=EXPERTS,
                         num_experts_per_tok=USED, rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=True,
                         max_position_embeddings=512, head_dim=hidden // heads)
  unpermute = LlamaTensorProcessor()._reverse_permute_weights
  state = {"model.embed_tokens.weight": w["token_embd.weight"], "model.norm.weight": w["output_norm.weight"],
           "lm_head.weight": w["token_embd.weight"]}
  for i in range(layers):
    b, p = f"blk.{i}.", f"model.layers.{i}."
    state.update({p + "input_layernorm.weight": w[b + "attn_norm.weight"], p + "post_attention_layernorm.weight": w[b + "ffn_norm.weight"],
                  p + "self_attn.q_proj.weight": unpermute(w[b + "attn_q.weight"], heads, heads),
                  p + "self_attn.k_proj.weight": unpermute(w[b + "attn_k.weight"], heads, kv_heads),
                  p + "self_attn.v_proj.weight": w[b + "attn_v.weight"], p + "self_attn.o_proj.weight": w[b + "attn_output.weight"],
                  p + "mlp.gate.weight": w[b + "ffn_gate_inp.weight"],
                  p + "mlp.experts.gate_up_proj": np.concatenate([w[b + "ffn_gate_exps.weight"], w[b + "ffn_up_exps.weight"]], 1),
                  p + "mlp.experts.down_proj": w[b + "ffn_down_exps.weight"]})
  model = MixtralForCausalLM(config).eval()
  missing, unexpected = model.load_state_dict({k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in state.items()}, strict=False)
  assert not unexpected and all("rotary" in k for k in missing), (missing, unexpected)
  return model


def test_llama_file_with_experts_runs_as_mixtral(tmp_path):
  import torch
  path = moe_file(tmp_path / "mixtral.gguf", "q4_k_m", arch="llama")
  llm = LLM(str(path), device="CPU", max_num_seqs=2, num_gpu_blocks=32, max_model_len=128)
  cfg = llm.engine.model_config
  assert cfg.architecture == "MixtralForCausalLM" and cfg.moe.norm_topk_prob and cfg.moe.intermediate_size == INTER
  with torch.no_grad(): ref = hf_mixtral_from_gguf(path)(torch.tensor([PROMPT])).logits[0, -1].numpy()
  assert relative_error(llm.engine.compute_logits(PROMPT), ref) < 1e-4


@pytest.mark.parametrize("arch,drop,words", [
  ("qwen3moe", "expert_count", "qwen3moe.expert_count is missing"),
  ("qwen3moe", "expert_feed_forward_length", "qwen3moe.expert_feed_forward_length"),
  ("qwen2", None, "qwen2.expert_count = 8: experts in a qwen2 file are not supported"),
])
def test_bad_expert_metadata_is_named(arch, drop, words, tmp_path, monkeypatch):
  real = gguf.GGUFWriter.add_uint32
  monkeypatch.setattr(gguf.GGUFWriter, "add_uint32", lambda self, key, value: None if key.endswith(f".{drop}") else real(self, key, value))
  path = moe_file(tmp_path / "bad.gguf", "q8_0", arch=arch)
  with pytest.raises(ConfigError, match=words): LLM(str(path), device="CPU", num_gpu_blocks=8)
