"""Quantized checkpoints for the tests, written from the formats' published descriptions (independently of
tinyvllm's readers), beside the float weights they stand for: each writer quantizes a float HF model's linears, saves
the packed checkpoint, and returns the dequantized float32 weights, which HF transformers then runs as the reference.

- GPTQ (AutoGPTQ's Hugging Face layout): qweight int32 [in * bits / 32, out], 32 / bits input rows per word, the first
  in the lowest bits; qzeros int32 [groups, out * bits / 32] the same along the output, each zero point stored minus
  one (checkpoint_format "gptq"); scales float16 [groups, out]; g_idx int32 [in].
- AWQ (AutoAWQ GEMM): qweight int32 [in, out / 8] and qzeros int32 [groups, out / 8], eight output columns a word in
  the order 0, 2, 4, 6, 1, 3, 5, 7 (nibble i holds column ORDER[i]); scales float16 [groups, out]; w = (q - z) * s.
- FP8 (Qwen's FP8 releases): weight float8_e4m3fn [out, in]; weight_scale_inv float32 per [rows, cols] block
  (weight_block_size), or weight_scale per tensor.
- compressed-tensors (llm-compressor): pack-quantized weight_packed int32 [out, in * bits / 32] along the input, each
  code stored as q + 2^(bits - 1), weight_shape [2], asymmetric weight_zero_point int32 [out * bits / 32, groups]
  packed the same way along the output; int-quantized int8 weight (and zero points); float-quantized float8_e4m3fn
  weight; weight_scale per tensor [1], channel [out, 1], group [out, groups] or block; actorder's weight_g_idx [in];
  w = (q - zero_point) * scale. Linears named in `ignore` stay float.

- NVFP4 (ModelOpt's `modelopt_fp4` export, compressed-tensors' nvfp4-pack-quantized): E2M1 codes two a byte (the even
  column in the low nibble; bit 3 the sign, bits 0-2 index 0, 0.5, 1, 1.5, 2, 3, 4, 6) as uint8 [out, in / 2]
  (`weight` / `weight_packed`), float8_e4m3fn `weight_scale` [out, in / 16] a block of 16 columns, and a float32 global
  scale per tensor: ModelOpt's `weight_scale_2` (w = e2m1 * weight_scale * weight_scale_2, the global amax / (6 *
  448)), compressed-tensors' `weight_global_scale` (its inverse: w = e2m1 * (weight_scale / weight_global_scale)).

A mixture-of-experts model (Qwen3-MoE, Mixtral) is written as save_pretrained writes it, and as the published
quantized MoE checkpoints are: each expert's gate / up / down (Mixtral's w1 / w3 / w2) a linear of its own under its
per-expert name, quantized like any other; the router (mlp.gate) float. transformers 5 holds the experts fused
(experts.gate_up_proj [E, 2I, H], each expert's gate rows then its up rows; experts.down_proj [E, H, I]), so their
dequantized weights are returned fused, under those names.
"""
from __future__ import annotations

import fnmatch
import json
import re
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import save_file

LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj",
           "mlp.down_proj")
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
EXPERT_LINEARS = re.compile(r"\.experts\.\d+\.(gate_proj|up_proj|down_proj|w1|w3|w2)$")
# model_type -> the sparse block's name in the checkpoint, and its experts' gate, up, down projections
MOE_NAMES = {"qwen3_moe": ("mlp", ("gate_proj", "up_proj", "down_proj")), "mixtral": ("block_sparse_moe", ("w1", "w3", "w2"))}


def checkpoint_tensors(hf_model) -> tuple[Iterator[tuple[str, torch.Tensor]], dict[str, list[list[str]]]]:
  """hf_model's tensors under the names save_pretrained writes, and for each fused expert parameter the checkpoint
  weights of each expert whose rows it stacks (filled as the tensors are read; {} for a dense model)."""
  state = hf_model.state_dict()
  if hf_model.config.model_type not in MOE_NAMES: return iter(state.items()), {}
  block, (gate, up, down) = MOE_NAMES[hf_model.config.model_type]
  fused: dict[str, list[list[str]]] = {}
  def tensors() -> Iterator[tuple[str, torch.Tensor]]:
    for name, t in state.items():
      name = re.sub(r"^(model\.layers\.\d+)\.mlp\.(gate\.|experts\.)", rf"\1.{block}.\2", name)
      if not name.endswith(("experts.gate_up_proj", "experts.down_proj")):
        yield name, t
        continue
      experts, inter = name.removesuffix("gate_up_proj").removesuffix("down_proj"), t.shape[1] // 2
      parts = [(gate, slice(0, inter)), (up, slice(inter, None))] if name.endswith("gate_up_proj") else [(down, slice(None))]
      fused[re.sub(rf"\.{block}\.", ".mlp.", name)] = [[f"{experts}{e}.{p}.weight" for p, _ in parts] for e in range(t.shape[0])]
      for e in range(t.shape[0]):
        for p, rows in parts: yield f"{experts}{e}.{p}.weight", t[e, rows].clone()
  return tensors(), fused


def pack_words(fields: np.ndarray, bits: int) -> np.ndarray:
  """[..., n] small unsigned ints -> int32 [..., n * bits / 32], consecutive fields from the lowest bits up."""
  per = 32 // bits
  grouped = fields.astype(np.uint64).reshape(*fields.shape[:-1], -1, per)
  words = (grouped << (bits * np.arange(per, dtype=np.uint64))).sum(axis=-1)
  return words.astype(np.uint32).view(np.int32)


def asym_quantize(w: np.ndarray, bits: int, groups_of: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
  """Min/max round-to-nearest per (row, group): codes [out, in], zero points and float16 scales [out, groups], and the
  dequantized weight computed from the stored (float16) scales."""
  out, groups = w.shape[0], int(groups_of.max()) + 1
  top = 2 ** bits - 1
  scales, zeros = np.zeros((out, groups), np.float16), np.zeros((out, groups), np.int64)
  for g in range(groups):
    cols = w[:, groups_of == g]
    lo, hi = np.minimum(cols.min(axis=1), 0), np.maximum(cols.max(axis=1), 0)
    scales[:, g] = ((hi - lo) / top).astype(np.float16)
    zeros[:, g] = np.clip(np.round(-lo / scales[:, g].astype(np.float32)), 0, top)
  s, z = scales.astype(np.float32)[:, groups_of], zeros[:, groups_of]
  codes = np.clip(np.round(w / s) + z, 0, top).astype(np.int64)
  return codes, zeros, scales, ((codes - z) * s).astype(np.float32)


def gptq_tensors(w: np.ndarray, bits: int, group: int, order: np.ndarray) -> tuple[dict, np.ndarray]:
  """`order`: the columns in the order GPTQ quantized them (act-order: by the input's Hessian diagonal, so
  projections of the same input, q/k/v or gate/up, share it); groups are runs of that order."""
  cols = w.shape[1]
  group = cols if group == -1 else group
  g_idx = np.empty(cols, np.int32)
  g_idx[order] = np.arange(cols) // group
  codes, zeros, scales, deq = asym_quantize(w, bits, g_idx)
  tensors = {"qweight": pack_words(codes.T.reshape(-1, 32 // bits, codes.shape[0]).transpose(0, 2, 1), bits)[..., 0],
             "qzeros": pack_words(zeros.T - 1, bits), "scales": scales.T.copy(), "g_idx": g_idx}
  return tensors, deq


def awq_tensors(w: np.ndarray, group: int) -> tuple[dict, np.ndarray]:
  g_idx = np.arange(w.shape[1]) // group
  codes, zeros, scales, deq = asym_quantize(w, 4, g_idx)
  def pack(a: np.ndarray) -> np.ndarray:   # [rows, out] -> [rows, out / 8], column ORDER[i] in nibble i
    chunks = a.reshape(a.shape[0], -1, 8)[:, :, list(AWQ_ORDER)]
    return pack_words(chunks.reshape(a.shape[0], -1), 4)
  return {"qweight": pack(codes.T), "qzeros": pack(zeros.T), "scales": scales.T.copy()}, deq


def fp8_tensors(w: np.ndarray, block: tuple[int, int] | None) -> tuple[dict, np.ndarray]:
  rows, cols = (w.shape if block is None else block)
  out, cin = w.shape
  r, c = -(-out // rows), -(-cin // cols)
  scale = np.zeros((r, c), np.float32)
  for i in range(r):
    for j in range(c): scale[i, j] = np.abs(w[i * rows:(i + 1) * rows, j * cols:(j + 1) * cols]).max() / 448.0
  full = np.repeat(np.repeat(scale, rows, 0), cols, 1)[:out, :cin]
  codes = torch.from_numpy(w / full).to(torch.float8_e4m3fn)
  deq = (codes.float().numpy() * full).astype(np.float32)
  scales = {"weight_scale_inv": torch.from_numpy(scale)} if block else {"weight_scale": torch.tensor(scale[0, 0])}
  return {"weight": codes, **scales}, deq


def modelopt_tensors(w: np.ndarray, options: dict) -> tuple[dict, np.ndarray]:
  """ModelOpt's FP8 export of one linear: scales per tensor (with a static input_scale), per row, or per 128 x 128
  block as [out / 128, 1, in / 128, 1]."""
  algo, cols = options["algo"], w.shape[1]
  packed, deq = fp8_tensors(w, {"FP8": None, "FP8_PER_CHANNEL_PER_TOKEN": (1, cols), "FP8_PB_WO": (128, 128)}[algo])
  scale = packed.pop("weight_scale", None) if algo == "FP8" else packed.pop("weight_scale_inv")
  if algo == "FP8_PER_CHANNEL_PER_TOKEN": scale = scale.reshape(-1)
  if algo == "FP8_PB_WO": scale = scale.reshape(scale.shape[0], 1, scale.shape[1], 1)
  tensors = {"weight": packed["weight"], "weight_scale": scale}
  if algo == "FP8": tensors["input_scale"] = torch.tensor(0.05)
  return tensors, deq


KV_SCALES = (0.05, 0.02)   # (k_scale, v_scale) a checkpoint's kv_scales=True carries in every layer


def kv_scale_tensors(prefix: str, method: str, scales: tuple[float, float]) -> dict[str, torch.Tensor]:
  """The KV cache's static scales a checkpoint carries: ModelOpt's k_scale / v_scale on k_proj / v_proj;
  compressed-tensors' kv_cache_scheme puts them on the attention module; AutoFP8's static FP8 exports an output_scale
  on k_proj / v_proj (and every linear's input_scale)."""
  value = torch.tensor(scales[0] if prefix.endswith("k_proj") else scales[1])
  if method == "modelopt": return {f"{prefix}.{prefix[-6]}_scale": value}
  if method == "compressed-tensors": return {f"{prefix.rsplit('.', 1)[0]}.{prefix[-6]}_scale": value}
  return {f"{prefix}.output_scale": value}


E2M1 = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], np.float32)


def nvfp4_tensors(w: np.ndarray, options: dict) -> tuple[dict, np.ndarray]:
  """One linear in NVFP4: each block of 16 columns scaled so that its largest magnitude lands on 6, the block scale
  rounded to E4M3 under the tensor's global scale, each value rounded to the nearest E2M1 magnitude."""
  out, cols = w.shape
  blocks = w.reshape(out, cols // 16, 16)
  global_scale = np.float32(np.abs(w).max() / (6 * 448))   # ModelOpt's multiplier (compressed-tensors stores 1 / it)
  block = torch.from_numpy(np.abs(blocks).max(axis=-1) / 6 / global_scale).to(torch.float8_e4m3fn)
  divides = options.get("method") == "compressed-tensors"
  block_f = block.float().numpy()
  stored_global = np.float32(1 / global_scale) if divides else global_scale
  full = (block_f / stored_global if divides else block_f * stored_global)[..., None]   # each block's scale
  scaled = np.divide(blocks, full, out=np.zeros_like(blocks), where=full > 0)
  codes = (_nearest(np.abs(scaled), E2M1) | (np.signbit(scaled) << 3)).reshape(out, cols).astype(np.uint8)
  deq = (np.where(codes >> 3, -1, 1) * E2M1[codes & 7]).reshape(out, cols // 16, 16) * full
  names = ("weight_packed", "weight_global_scale") if divides else ("weight", "weight_scale_2")
  tensors = {names[0]: (codes[:, 1::2] << 4) | codes[:, 0::2], "weight_scale": block,
             names[1]: torch.tensor([stored_global] if divides else stored_global)}
  if options.get("activations"):
    tensors["input_global_scale" if divides else "input_scale"] = torch.tensor([2.5] if divides else 0.4)
  return tensors, deq.reshape(out, cols).astype(np.float32)


# bitsandbytes' 4-bit levels: NF4 (QLoRA's normal-float quantiles) and FP4 (its E2M1 grid over 12), as bitsandbytes
# tabulates them; the checkpoint carries its table (quant_map), which the reader uses
NF4 = [-1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453, -0.28444138169288635, -0.18477343022823334,
       -0.09105003625154495, 0.0, 0.07958029955625534, 0.16093020141124725, 0.24611230194568634, 0.33791524171829224,
       0.44070982933044434, 0.5626170039176941, 0.7229568362236023, 1.0]
FP4 = [v / 12 for v in (0, 0.0625, 8, 12, 4, 6, 2, 3, -0.0, -0.0625, -8, -12, -4, -6, -2, -3)]


def _nearest(values: np.ndarray, levels: np.ndarray) -> np.ndarray:
  return np.abs(values[..., None] - levels).argmin(axis=-1).astype(np.uint8)


def bnb_tensors(w: np.ndarray, options: dict) -> tuple[dict, np.ndarray]:
  """bitsandbytes' serialization of one linear: LLM.int8 (int8 rows and their SCB), or 4-bit codes of the flattened
  weight in blocks of 64, two a byte with the first high, a scale a block (double quantization: 8-bit codes into a
  nested map, a nested scale per 256 of them, plus their mean), the quant state as JSON bytes."""
  out, cols = w.shape
  if options["bits"] == 8:
    scb = np.abs(w).max(axis=1).astype(np.float32)
    q = np.round(w * 127 / scb[:, None]).astype(np.int8)
    return {"weight": q, "SCB": scb, "weight_format": np.array(0, np.uint8)}, (q * (scb / 127)[:, None]).astype(np.float32)
  levels = np.array(NF4 if options["kind"] == "nf4" else FP4, np.float32)
  blocks = w.reshape(-1, 64)
  absmax = np.abs(blocks).max(axis=1).astype(np.float32)
  codes = _nearest(blocks / absmax[:, None], levels).reshape(-1)
  state = {"quant_type": options["kind"], "blocksize": 64, "dtype": "float32", "shape": [out, cols]}
  tensors = {"weight.quant_map": levels}
  if options.get("nested"):
    nested_map = np.linspace(-1, 1, 256, dtype=np.float32)
    offset, blocks_n = np.float32(absmax.mean()), absmax.size
    shifted = np.pad(absmax - offset, (0, -blocks_n % 256)).reshape(-1, 256)   # (the last nested block partial)
    nested = np.abs(shifted).max(axis=1).astype(np.float32)
    acodes = _nearest(shifted / nested[:, None], nested_map).reshape(-1)[:blocks_n]
    absmax = (nested_map[acodes] * np.repeat(nested, 256)[:blocks_n] + offset).astype(np.float32)
    state.update(nested_blocksize=256, nested_dtype="float32", nested_offset=float(offset))
    tensors.update({"weight.absmax": acodes, "weight.nested_absmax": nested, "weight.nested_quant_map": nested_map})
  else: tensors["weight.absmax"] = absmax
  tensors["weight"] = ((codes[0::2] << 4) | codes[1::2]).astype(np.uint8).reshape(-1, 1)
  tensors[f"weight.quant_state.bitsandbytes__{options['kind']}"] = np.frombuffer(json.dumps(state).encode(), np.uint8).copy()
  return tensors, (levels[codes] * np.repeat(absmax, 64)).reshape(out, cols).astype(np.float32)


def sym_quantize(w: np.ndarray, bits: int, groups_of: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
  """Symmetric round-to-nearest per (row, group): signed codes [out, in], float16 scales [out, groups], and the
  dequantized weight from the stored scales."""
  top, groups = 2 ** (bits - 1) - 1, int(groups_of.max()) + 1
  scales = np.stack([np.abs(w[:, groups_of == g]).max(axis=1) / top for g in range(groups)], axis=1).astype(np.float16)
  s = scales.astype(np.float32)[:, groups_of]
  codes = np.clip(np.round(w / s), -top - 1, top).astype(np.int64)
  return codes, scales, (codes * s).astype(np.float32)


def compressed_tensors(w: np.ndarray, options: dict, order: np.ndarray) -> tuple[dict, np.ndarray]:
  """`order`: the columns in the order the quantizer took them (actorder "group": its groups are runs of that order)."""
  fmt, strategy, out, cols = options["format"], options["strategy"], *w.shape
  if fmt == "float-quantized":
    block = {"block": options.get("block"), "channel": (1, cols), "group": (1, options.get("group_size"))}.get(strategy)
    packed, deq = fp8_tensors(w, block)
    scale = packed.pop("weight_scale_inv", None) if strategy != "tensor" else packed.pop("weight_scale").reshape(1)
    return {"weight": packed["weight"], "weight_scale": scale}, deq
  bits, group = options["bits"], cols if strategy == "channel" else options["group_size"]
  groups_of = np.empty(cols, np.int64)
  groups_of[order] = np.arange(cols) // group
  offset = 2 ** (bits - 1)
  if options.get("symmetric", True):
    q, scales, deq = sym_quantize(w, bits, groups_of)
    zero = None
  else:
    codes, zeros, scales, deq = asym_quantize(w, bits, groups_of)
    q, zero = codes - offset, zeros - offset
  tensors = {"weight_scale": torch.from_numpy(scales)}
  if fmt == "int-quantized":
    tensors["weight"] = torch.from_numpy(q.astype(np.int8))
    if zero is not None: tensors["weight_zero_point"] = torch.from_numpy(zero.astype(np.int8))
  else:
    tensors["weight_packed"] = pack_words(q + offset, bits)
    tensors["weight_shape"] = torch.tensor([out, cols], dtype=torch.int64)
    if zero is not None: tensors["weight_zero_point"] = pack_words((zero + offset).T, bits).T.copy()
  if options.get("actorder"): tensors["weight_g_idx"] = groups_of.astype(np.int32)
  return tensors, deq


def write_quantized(hf_model, folder: Path, method: str, seed: int = 0, **options) -> dict[str, np.ndarray]:
  """Save hf_model's folder (config.json, float tensors) with its linears in `method`'s layout; returns the
  dequantized float32 weights by name, to load into the reference."""
  rng, (state, fused) = np.random.default_rng(seed), checkpoint_tensors(hf_model)
  tensors, dequantized, orders = {}, {}, {}
  for name, t in state:
    if name == "lm_head.weight" and hf_model.config.tie_word_embeddings: continue   # the embedding table itself
    prefix = name.removesuffix(".weight")
    # compressed-tensors' ignore list (regular expressions); HF's modules_to_not_convert (parts of the names)
    left_float = (any(re.match(p, prefix) for p in options.get("ignore", ()))
                  or any(k in prefix for k in options.get("not_converted", ()))
                  or any(fnmatch.fnmatch(prefix, p) for p in options.get("exclude", ())))   # ModelOpt's wildcards
    quantized_head = prefix == "lm_head" and options.get("lm_head")   # (GPTQ's lm_head true; compressed-tensors not ignoring it)
    if not (name.endswith(".weight") and (prefix.endswith(LINEARS) or EXPERT_LINEARS.search(prefix) or quantized_head)) or left_float:
      tensors[name] = t.contiguous()
      continue
    w = t.float().numpy()
    # act-order: one column order for the projections of the same input (q/k/v, gate/up), as the quantizer's Hessian gives
    role = prefix.rsplit(".", 1)[0] + (".in" if prefix.endswith(("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj", "w1", "w3"))
                                       else prefix)
    if role not in orders:
      shuffled = options.get("desc_act") or options.get("actorder")
      orders[role] = rng.permutation(w.shape[1]) if shuffled else np.arange(w.shape[1])
    if options.get("algo") == "NVFP4" or options.get("format") == "nvfp4-pack-quantized":
      packed, deq = nvfp4_tensors(w, {**options, "method": method})
    elif method == "gptq": packed, deq = gptq_tensors(w, options["bits"], options["group_size"], orders[role])
    elif method == "awq": packed, deq = awq_tensors(w, options["group_size"])
    elif method == "compressed-tensors": packed, deq = compressed_tensors(w, options, orders[role])
    elif method == "modelopt": packed, deq = modelopt_tensors(w, options)
    elif method == "bitsandbytes": packed, deq = bnb_tensors(w, options)
    elif method == "fbgemm_fp8":   # E4M3 rows, each with its float32 scale [out, 1]
      packed, deq = fp8_tensors(w, (1, w.shape[1]))
      packed["weight_scale"] = packed.pop("weight_scale_inv")
    else: packed, deq = fp8_tensors(w, options.get("weight_block_size"))
    dequantized[name] = deq
    for suffix, a in packed.items():
      tensors[f"{prefix}.{suffix}"] = a if isinstance(a, torch.Tensor) else torch.from_numpy(np.ascontiguousarray(a))
    if options.get("kv_scales") and method == "fp8": tensors[f"{prefix}.input_scale"] = torch.tensor(0.05)   # (AutoFP8's static)
    if options.get("kv_scales") and prefix.endswith(("k_proj", "v_proj")):
      tensors.update(kv_scale_tensors(prefix, method, KV_SCALES if options["kv_scales"] is True else options["kv_scales"]))
  for name, experts in fused.items():   # the experts' dequantized weights, fused as the HF model holds them
    if all(n in dequantized for names in experts for n in names):
      dequantized[name] = np.stack([np.concatenate([dequantized.pop(n) for n in names]) for names in experts])
  hf_model.config.save_pretrained(folder)
  config = json.loads((folder / "config.json").read_text())
  if method == "modelopt" and options.get("hf_quant_config"):   # ModelOpt's own file beside config.json, not in it
    kv = "FP8" if options.get("kv_scales") else None
    quant = {"quant_algo": options["algo"], "kv_cache_quant_algo": kv, "exclude_modules": ["lm_head", *options.get("exclude", ())],
             **({"group_size": 16} if options["algo"] == "NVFP4" else {})}
    (folder / "hf_quant_config.json").write_text(json.dumps({"producer": {"name": "modelopt", "version": "0.29.0"},
                                                             "quantization": quant}))
  else: config["quantization_config"] = quantization_config(method, options)
  if options.get("not_converted"):
    key = "llm_int8_skip_modules" if method == "bitsandbytes" else "modules_to_not_convert"
    config["quantization_config"][key] = list(options["not_converted"])
  (folder / "config.json").write_text(json.dumps(config))
  save_file(tensors, str(folder / "model.safetensors"))
  return dequantized


def quantization_config(method: str, options: dict) -> dict:
  if method == "gptq":
    return {"quant_method": "gptq", "bits": options["bits"], "group_size": options["group_size"], "sym": False,
            "desc_act": options.get("desc_act", False), "checkpoint_format": "gptq", "lm_head": bool(options.get("lm_head"))}
  if method == "awq": return {"quant_method": "awq", "bits": 4, "group_size": options["group_size"], "zero_point": True, "version": "gemm"}
  if method == "compressed-tensors" and options["format"] == "nvfp4-pack-quantized":
    fp4 = {"num_bits": 4, "type": "float", "strategy": "tensor_group", "group_size": 16, "symmetric": True}
    return {"quant_method": "compressed-tensors", "format": "nvfp4-pack-quantized", "quantization_status": "compressed",
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": {**fp4, "dynamic": False}, "output_activations": None,
                                          "input_activations": {**fp4, "dynamic": "local"} if options.get("activations") else None}},
            "ignore": ["lm_head", *(f"re:{p}" for p in options.get("ignore", ()))], "kv_cache_scheme": None}
  if method == "compressed-tensors":
    weights = {"num_bits": options.get("bits", 8), "type": "float" if options["format"] == "float-quantized" else "int",
               "symmetric": options.get("symmetric", True), "strategy": options["strategy"], "group_size": options.get("group_size"),
               "block_structure": list(options["block"]) if options.get("block") else None, "dynamic": False,
               "actorder": "group" if options.get("actorder") else None}
    activations = {"num_bits": 8, "type": weights["type"], "strategy": "token", "dynamic": True, "symmetric": True}
    return {"quant_method": "compressed-tensors", "format": options["format"], "quantization_status": "compressed",
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights, "output_activations": None,
                                          "input_activations": activations if options.get("activations") else None}},
            "ignore": [*([] if options.get("lm_head") else ["lm_head"]), *(f"re:{p}" for p in options.get("ignore", ()))],
            "kv_cache_scheme": {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False, "symmetric": True}
            if options.get("kv_scales") else None, "sparsity_config": {}}
  if method == "fbgemm_fp8": return {"quant_method": "fbgemm_fp8", "activation_scale_ub": 1200.0}
  if method == "bitsandbytes":
    four = options["bits"] == 4
    return {"quant_method": "bitsandbytes", "load_in_4bit": four, "load_in_8bit": not four, "llm_int8_threshold": 6.0,
            "llm_int8_has_fp16_weight": False, "bnb_4bit_quant_type": options.get("kind", "fp4"), "bnb_4bit_quant_storage": "uint8",
            "bnb_4bit_use_double_quant": bool(options.get("nested")), "bnb_4bit_compute_dtype": "float32"}
  if method == "modelopt":
    kv = {"type": "float", "num_bits": 8, "dynamic": False} if options.get("kv_scales") else None
    return {"quant_method": "modelopt", "quant_algo": options["algo"], "ignore": ["lm_head", *options.get("exclude", ())],
            "kv_cache_scheme": kv, **({"group_size": 16} if options["algo"] == "NVFP4" else {})}
  block = options.get("weight_block_size")
  return {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "static" if options.get("kv_scales") else "dynamic",
          **({"weight_block_size": list(block)} if block else {})}


def load_dequantized(hf_model, dequantized: dict[str, np.ndarray]):
  """hf_model with the dequantized float32 weights in place of its linears' (the reference)."""
  with torch.no_grad():
    for name, w in dequantized.items(): hf_model.get_parameter(name).copy_(torch.from_numpy(w))
  return hf_model
