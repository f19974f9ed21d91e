"""Quantized mixture-of-experts models (Qwen3-MoE, Mixtral) on the portable path, each sparse layer's experts loaded as
one stacked packed weight: int8 / int4 / fp8 quantized at load (experts_int8: the experts alone), and GPTQ, AWQ, FP8
(block-wise and per-tensor), compressed-tensors and NVFP4 checkpoints whose experts are quantized one linear each under HF's
per-expert names (written by tests/quant_checkpoints.py), against HF transformers run on the dequantized float32
weights (logits, 32 greedy tokens, batched equal to alone); and the clear errors of act-order experts and of an
expert's missing scales."""
from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest

from tests.hf_models import make_model
from tests.quant_checkpoints import load_dequantized, write_quantized
from tests.test_quantization import check_against, rtn
from tinyvllm import LLM, SamplingParams
from tinyvllm.backend.quantized import QuantizedWeight
from tinyvllm.backend.weights import MoEWeights
from tinyvllm.config import ConfigError

# hidden 256, experts' intermediate 128, the dense layer's 384: int4's group of 128 divides every projection's input
QWEN3_MOE_128 = dict(hidden_size=256, head_dim=32, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=128,
                     intermediate_size=384, num_hidden_layers=3, mlp_only_layers=[1], norm_topk_prob=True)
# small enough for the checkpoint formats' groups (32) and blocks (16 x 32) to tile every weight, experts' included
QWEN3_MOE = dict(head_dim=24, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, num_hidden_layers=3,
                 mlp_only_layers=[1], norm_topk_prob=True)
MIXTRAL = dict(num_local_experts=4, num_experts_per_tok=2, intermediate_size=64)
SHAPES = {"qwen3-moe-128": ("qwen3_moe", QWEN3_MOE_128), "qwen3-moe": ("qwen3_moe", QWEN3_MOE), "mixtral": ("mixtral", MIXTRAL)}

AT_LOAD = {"int8-qwen3-moe": ("qwen3-moe-128", "int8"), "int4-qwen3-moe": ("qwen3-moe-128", "int4"),
           "fp8-qwen3-moe": ("qwen3-moe-128", "fp8"), "int8-mixtral": ("mixtral", "int8")}
CHECKPOINTS = {
  "fp8-blocks-qwen3-moe": ("qwen3-moe", "fp8", dict(weight_block_size=(16, 32))),
  "fp8-tensor-qwen3-moe": ("qwen3-moe", "fp8", {}),   # a scale per expert's matrix, the stacked weight's rows each their own
  "gptq-4bit-g32-qwen3-moe": ("qwen3-moe", "gptq", dict(bits=4, group_size=32)),
  "awq-g32-qwen3-moe": ("qwen3-moe", "awq", dict(group_size=32)),
  "ct-w4a16-g32-qwen3-moe": ("qwen3-moe", "compressed-tensors", dict(format="pack-quantized", bits=4, strategy="group", group_size=32)),
  "modelopt-nvfp4-qwen3-moe": ("qwen3-moe", "modelopt", dict(algo="NVFP4", hf_quant_config=True)),   # (its experts: E4M3 codes)
  "gptq-8bit-channel-mixtral": ("mixtral", "gptq", dict(bits=8, group_size=-1)),
  "fp8-blocks-mixtral": ("mixtral", "fp8", dict(weight_block_size=(16, 32))),
}


def sparse_layer(llm: LLM) -> MoEWeights:
  moe = llm.engine.model.weights.layers[0].moe
  assert moe is not None
  return moe


def assert_packed_experts(moe: MoEWeights, method: str, bits: int, group: int | None = None) -> None:
  """Both projections one packed weight of every expert's rows stacked: (E * 2I, H) and (E * H, I)."""
  experts, inter, hidden = moe.num_experts, moe.intermediate, moe.hidden
  for w, shape in ((moe.gate_up_proj, (experts * 2 * inter, hidden)), (moe.down_proj, (experts * hidden, inter))):
    assert isinstance(w, QuantizedWeight) and w.method == method and w.bits == bits and w.shape == shape
    assert w.g_idx is None and w.perm is None
    if group is not None: assert w.group_size == min(group, shape[1])
  assert not isinstance(moe.router, QuantizedWeight)   # the router stays float


def round_to_nearest(hf, method: str) -> dict[str, np.ndarray]:
  """rtn() of every linear, each expert's matrices included: quantized per row (and group of 128 for int4), so the
  stacked experts' rows quantized at load are each expert's rows quantized alone."""
  group = lambda cols: 128 if method == "int4" else cols
  out = {}
  for name, p in hf.named_parameters():
    if not name.endswith(("_proj.weight", "experts.gate_up_proj", "experts.down_proj")): continue
    w = p.detach().numpy()
    rows = w.reshape(-1, w.shape[-1])
    out[name] = rtn(rows, method, group(w.shape[-1])).reshape(w.shape)
  return out


@pytest.mark.slow
@pytest.mark.parametrize("case", list(AT_LOAD))
def test_quantized_at_load_matches_hf_on_round_to_nearest_experts(case: str, tmp_path: Path):
  shape, method = AT_LOAD[case]
  kind, overrides = SHAPES[shape]
  hf = make_model(kind, tmp_path, **overrides)
  llm = LLM(str(tmp_path), quantization=method, max_num_seqs=2, num_gpu_blocks=32)
  assert_packed_experts(sparse_layer(llm), method, 4 if method == "int4" else 8, 128 if method == "int4" else None)
  check_against(load_dequantized(hf, round_to_nearest(hf, method)), llm)


def test_experts_int8_quantizes_the_experts_only(tmp_path: Path):
  """vLLM's experts_int8: each expert's rows int8 per channel at load; attention, the dense layer and the router float."""
  hf = make_model("qwen3_moe", tmp_path, **QWEN3_MOE_128)
  llm = LLM(str(tmp_path), quantization="experts_int8", max_num_seqs=2, num_gpu_blocks=32)
  assert_packed_experts(sparse_layer(llm), "experts_int8", 8)
  layers = llm.engine.model.weights.layers
  assert not any(isinstance(w, QuantizedWeight) for w in (layers[0].qkv_proj, layers[0].o_proj, layers[1].gate_up_proj))
  experts = {n: w for n, w in round_to_nearest(hf, "int8").items() if ".experts." in n}
  check_against(load_dequantized(hf, experts), llm)


def test_experts_int8_on_a_dense_model_is_refused(tmp_path: Path):
  make_model("qwen3", tmp_path)
  with pytest.raises(ConfigError, match=re.escape("--quantization experts_int8 quantizes a mixture of experts' experts, and "
                                                  "Qwen3ForCausalLM has none")):
    LLM(str(tmp_path), quantization="experts_int8", num_gpu_blocks=16)


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CHECKPOINTS))
def test_quantized_moe_checkpoint_matches_hf_on_its_dequantized_weights(case: str, tmp_path: Path):
  shape, method, options = CHECKPOINTS[case]
  kind, overrides = SHAPES[shape]
  hf = make_model(kind, tmp_path / "float", **overrides)
  dequantized = write_quantized(hf, tmp_path / "q", method, **options)
  assert any(name.endswith("experts.gate_up_proj") for name in dequantized)   # the experts were quantized too
  llm = LLM(str(tmp_path / "q"), max_num_seqs=2, num_gpu_blocks=32)
  loaded_as = "modelopt_fp4" if options.get("algo") == "NVFP4" else method
  assert_packed_experts(sparse_layer(llm), loaded_as, options.get("bits", 4 if method == "awq" else 8))
  check_against(load_dequantized(hf, dequantized), llm)


@pytest.mark.slow
def test_batched_equals_alone_with_quantized_experts(tmp_path: Path):
  """int4 experts: prompts of different lengths together (prefill: every expert; decode: the chosen ones) give what each
  gives alone."""
  make_model("qwen3_moe", tmp_path, **QWEN3_MOE_128)
  llm = LLM(str(tmp_path), quantization="int4", max_num_seqs=8, num_gpu_blocks=64)
  assert isinstance(sparse_layer(llm).gate_up_proj, QuantizedWeight)
  rng = np.random.default_rng(5)
  prompts = [[int(x) for x in rng.integers(0, 320, n)] for n in (3, 17)]
  params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
  together = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
  alone = [llm.generate([p], params, use_tqdm=False)[0].outputs[0].token_ids for p in prompts]
  assert together == alone


# ---- bad checkpoints: each a clear error naming what is wrong
def without(folder: Path, name: str) -> Path:
  """folder with the tensor `name` taken out of its checkpoint (through torch, which holds float8 tensors)."""
  from safetensors.torch import load_file, save_file
  tensors = load_file(str(folder / "model.safetensors"))
  del tensors[name]
  save_file(tensors, str(folder / "model.safetensors"))
  return folder


def gptq_moe(folder: Path, desc_act: bool) -> Path:
  write_quantized(make_model("qwen3_moe", folder / "float", **QWEN3_MOE), folder / "q", "gptq", bits=4, group_size=32, desc_act=desc_act)
  return folder / "q"


def test_act_order_experts_are_refused(tmp_path: Path):
  with pytest.raises(ConfigError, match=re.escape("model.layers.0.mlp.experts: act-order")):
    LLM(str(gptq_moe(tmp_path, desc_act=True)), num_gpu_blocks=16)


def test_an_experts_missing_scales_tensor_is_named(tmp_path: Path):
  name = "model.layers.2.mlp.experts.5.up_proj.scales"
  with pytest.raises(ConfigError, match=re.escape(f"GPTQ checkpoint is missing tensor {name}")):
    LLM(str(without(gptq_moe(tmp_path, desc_act=False), name)), num_gpu_blocks=16)


@pytest.mark.slow
def test_an_experts_missing_block_scales_tensor_is_named(tmp_path: Path):
  write_quantized(make_model("mixtral", tmp_path / "float", **MIXTRAL), tmp_path / "q", "fp8", weight_block_size=(16, 32))
  name = "model.layers.1.block_sparse_moe.experts.3.w2.weight_scale_inv"
  with pytest.raises(ConfigError, match=re.escape(f"FP8 checkpoint is missing tensor {name}")):
    LLM(str(without(tmp_path / "q", name)), num_gpu_blocks=16)


def test_start_up_counts_the_experts_as_quantized():
  """The weights line's unquantized size counts the packed experts at the compute dtype: the float model's bytes."""
  kwargs = dict(load_format="dummy", num_gpu_blocks=8, max_model_len=128)
  plain = LLM("qwen3-moe-tiny", **kwargs).engine.model.weights
  packed = LLM("qwen3-moe-tiny", quantization="int8", **kwargs).engine.model.weights
  assert packed.unquantized_bytes() == plain.nbytes() > packed.nbytes()
