#!/usr/bin/env python3
"""Convert karpathy's stories260K (llama2.c) into the HuggingFace Llama folder that tinyvllm ships as its default model.

  python scripts/convert_stories260k.py stories260K.bin tok512.model tinyvllm/assets/stories260K

stories260K.bin is llama2.c's legacy (version 0) export, as its export.py `legacy_export` writes it and run.c reads
it: seven int32 (dim, hidden_dim, n_layers, n_heads, n_kv_heads, vocab_size, seq_len; vocab_size negative when the
classifier is not the embedding), then float32 tensors, row-major [out, in]: token embedding, attention RMSNorm
weights, wq, wk, wv, wo, FFN RMSNorm weights, w1, w2, w3, the final RMSNorm, freq_cis real and imaginary parts
(unused: RoPE is recomputed with theta 10000), and the classifier when not shared. llama2.c rotates interleaved pairs
(x[2i], x[2i+1]) of each head; HF's Llama rotates halves, so wq and wk rows are permuted per head (llama2.c's
`permute_reverse` undone). tok512.model is the SentencePiece tokenizer: transformers converts it to tokenizer.json
(legacy Llama behaviour, BOS added). The folder gets a plain chat template (CHAT_TEMPLATE), a README and llama2.c's MIT
LICENSE. Needs numpy and safetensors, and for the tokenizer transformers, sentencepiece and protobuf (the test extra).
"""
from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from safetensors.numpy import save_file

ROPE_THETA = 10000.0
RMS_NORM_EPS = 1e-5   # llama2.c's RMSNorm
# The original has no chat template: a story model continues text. This one makes `chat` co-write a story: the turns
# are joined into one text (a space before each turn but replies, which continue the text as generated), and the
# model's reply continues it; add_generation_prompt adds nothing.
CHAT_TEMPLATE = ("{{ bos_token }}{% for message in messages %}{% if message['role'] == 'assistant' %}{{ message['content'] }}"
                 "{% else %}{% if not loop.first %} {% endif %}{{ message['content'] | trim }}{% endif %}{% endfor %}")
LICENSE = """MIT License

Copyright (c) 2023 Andrej

Permission is hereby granted, free of charge, to any person obtaining a copy
of this software and associated documentation files (the "Software"), to deal
in the Software without restriction, including without limitation the rights
to use, copy, modify, merge, publish, distribute, sublicense, and/or sell
copies of the Software, and to permit persons to whom the Software is
furnished to do so, subject to the following conditions:

The above copyright notice and this permission notice shall be included in all
copies or substantial portions of the Software.

THE SOFTWARE IS PROVIDED "AS IS", WITHOUT WARRANTY OF ANY KIND, EXPRESS OR
IMPLIED, INCLUDING BUT NOT LIMITED TO THE WARRANTIES OF MERCHANTABILITY,
FITNESS FOR A PARTICULAR PURPOSE AND NONINFRINGEMENT. IN NO EVENT SHALL THE
AUTHORS OR COPYRIGHT HOLDERS BE LIABLE FOR ANY CLAIM, DAMAGES OR OTHER
LIABILITY, WHETHER IN AN ACTION OF CONTRACT, TORT OR OTHERWISE, ARISING FROM,
OUT OF OR IN CONNECTION WITH THE SOFTWARE OR THE USE OR OTHER DEALINGS IN THE
SOFTWARE.
"""
README = """# stories260K

The default model of tinyvllm: `generate`, `chat` and `serve` run it when no `--model` is given.

A 260K-parameter Llama (5 layers, dim 64, 8 query heads sharing 4 key/value heads, a 512-token SentencePiece
vocabulary, 512 positions) that Andrej Karpathy trained on TinyStories with llama2.c
(https://github.com/karpathy/llama2.c, `doc/stories260K.md`; weights published at
https://huggingface.co/karpathy/tinyllamas/tree/main/stories260K). It writes short children's stories; greedy decoding
from BOS gives "Once upon a time, there was a little girl named Lily. She loved to play outside in the park. ...".

Converted from `stories260K.bin` and `tok512.model` by `scripts/convert_stories260k.py` in the tinyvllm repository:
float32 weights under HF Llama names, wq/wk rows permuted from llama2.c's interleaved RoPE pairs to HF's rotate-half
layout, the tokenizer converted by transformers. The original has no chat template; `tokenizer_config.json` carries a
plain one for co-writing a story: the turns are joined into one text and the model continues it.

License: MIT, Copyright (c) 2023 Andrej (llama2.c's LICENSE, in `LICENSE`).
"""


@dataclass(frozen=True)
class Header:
  dim: int
  hidden_dim: int
  n_layers: int
  n_heads: int
  n_kv_heads: int
  vocab_size: int   # negative: the classifier is stored after the other weights
  seq_len: int

  @property
  def vocab(self) -> int: return abs(self.vocab_size)

  @property
  def head_dim(self) -> int: return self.dim // self.n_heads


def read_checkpoint(path: Path) -> tuple[Header, dict[str, np.ndarray]]:
  """The header and llama2.c's tensors by their names in its model.py (per-layer ones stacked on a first axis)."""
  raw = path.read_bytes()
  h = Header(*np.frombuffer(raw, np.int32, 7).tolist())
  floats = np.frombuffer(raw, np.float32, offset=7 * 4)
  kv_dim, layers = h.n_kv_heads * h.head_dim, h.n_layers
  shapes = {"tok_embeddings": (h.vocab, h.dim), "attention_norm": (layers, h.dim), "wq": (layers, h.dim, h.dim),
            "wk": (layers, kv_dim, h.dim), "wv": (layers, kv_dim, h.dim), "wo": (layers, h.dim, h.dim),
            "ffn_norm": (layers, h.dim), "w1": (layers, h.hidden_dim, h.dim), "w2": (layers, h.dim, h.hidden_dim),
            "w3": (layers, h.hidden_dim, h.dim), "norm": (h.dim,), "freq_cis_real": (h.seq_len, h.head_dim // 2),
            "freq_cis_imag": (h.seq_len, h.head_dim // 2)}
  if h.vocab_size < 0: shapes["output"] = (h.vocab, h.dim)
  tensors, offset = {}, 0
  for name, shape in shapes.items():
    count = int(np.prod(shape))
    tensors[name], offset = floats[offset:offset + count].reshape(shape).copy(), offset + count
  if offset != floats.size: raise ValueError(f"{path}: {floats.size - offset} float32 values left after the weights the header names")
  return h, tensors


def to_rotate_half(w: np.ndarray, heads: int) -> np.ndarray:
  """Rows of a q/k projection from interleaved RoPE pairs (2i, 2i+1) to HF's halves (i, i + head_dim / 2), per head."""
  out, inp = w.shape
  return w.reshape(heads, out // heads // 2, 2, inp).transpose(0, 2, 1, 3).reshape(out, inp)


def hf_tensors(h: Header, t: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
  out = {"model.embed_tokens.weight": t["tok_embeddings"], "model.norm.weight": t["norm"]}
  for i in range(h.n_layers):
    p = f"model.layers.{i}."
    out |= {p + "input_layernorm.weight": t["attention_norm"][i], p + "post_attention_layernorm.weight": t["ffn_norm"][i],
            p + "self_attn.q_proj.weight": to_rotate_half(t["wq"][i], h.n_heads),
            p + "self_attn.k_proj.weight": to_rotate_half(t["wk"][i], h.n_kv_heads),
            p + "self_attn.v_proj.weight": t["wv"][i], p + "self_attn.o_proj.weight": t["wo"][i],
            p + "mlp.gate_proj.weight": t["w1"][i], p + "mlp.down_proj.weight": t["w2"][i], p + "mlp.up_proj.weight": t["w3"][i]}
  if "output" in t: out["lm_head.weight"] = t["output"]
  return {name: np.ascontiguousarray(x, dtype=np.float32) for name, x in out.items()}


def hf_config(h: Header) -> dict:
  return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": h.dim, "intermediate_size": h.hidden_dim,
          "num_hidden_layers": h.n_layers, "num_attention_heads": h.n_heads, "num_key_value_heads": h.n_kv_heads,
          "vocab_size": h.vocab, "max_position_embeddings": h.seq_len, "rms_norm_eps": RMS_NORM_EPS, "rope_theta": ROPE_THETA,
          "tie_word_embeddings": h.vocab_size > 0, "hidden_act": "silu", "bos_token_id": 1, "eos_token_id": 2,
          "torch_dtype": "float32", "attention_bias": False, "mlp_bias": False}


def write_tokenizer(tokenizer_model: Path, out: Path) -> None:
  """tokenizer.json and tokenizer_config.json through transformers' SentencePiece conversion, with the chat template."""
  from transformers import LlamaTokenizer
  with tempfile.TemporaryDirectory() as tmp:   # transformers finds the SentencePiece model by its file name
    shutil.copy(tokenizer_model, Path(tmp) / "tokenizer.model")
    tokenizer = LlamaTokenizer.from_pretrained(tmp, legacy=True, add_bos_token=True)
  tokenizer.save_pretrained(out)
  config_path = out / "tokenizer_config.json"
  config = json.loads(config_path.read_text())
  for name in ("is_local", "local_files_only"): config.pop(name, None)   # how this run loaded it, not the tokenizer's
  # transformers does not save `legacy`; without it, loading the folder it would drop tokenizer.json's "always" prefix
  # space for the "first" one, and text after a special token (the template's BOS) would lose its leading "▁"
  config = {**config, "legacy": True, "chat_template": CHAT_TEMPLATE}
  config_path.write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")
  (out / "chat_template.jinja").unlink(missing_ok=True)   # the template lives in tokenizer_config.json only


def convert(checkpoint: Path, tokenizer_model: Path, out: Path) -> None:
  header, tensors = read_checkpoint(checkpoint)
  out.mkdir(parents=True, exist_ok=True)
  save_file(hf_tensors(header, tensors), str(out / "model.safetensors"), metadata={"format": "pt"})
  (out / "config.json").write_text(json.dumps(hf_config(header), indent=2) + "\n")
  (out / "generation_config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": 2}, indent=2) + "\n")
  write_tokenizer(tokenizer_model, out)
  (out / "LICENSE").write_text(LICENSE)
  (out / "README.md").write_text(README)


def main(argv: list[str] | None = None) -> int:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("checkpoint", type=Path, help="llama2.c's stories260K.bin")
  p.add_argument("tokenizer", type=Path, help="its SentencePiece model, tok512.model")
  p.add_argument("out", type=Path, help="the folder to write (e.g. tinyvllm/assets/stories260K)")
  args = p.parse_args(argv)
  convert(args.checkpoint, args.tokenizer, args.out)
  print(f"wrote {', '.join(sorted(f.name for f in args.out.iterdir()))} to {args.out}", file=sys.stderr)
  return 0


if __name__ == "__main__":
  sys.exit(main())
