"""The KV cache's static scales a quantized checkpoint carries (ModelOpt's k_proj.k_scale / v_proj.v_scale,
compressed-tensors' kv_cache_scheme, AutoFP8's output_scale), applied under --kv-cache-dtype fp8 as vLLM applies them:
the cache holds e4m3(k / k_scale) and e4m3(v / v_scale). The reference is HF transformers on the dequantized weights
with its attention reading k and v so stored (an attention function registered with transformers that rounds them
through torch's float8_e4m3fn); without an FP8 cache the scales are not used and start-up says so."""
from __future__ import annotations

import pytest
import torch

from tests.hf_models import hf_logits, make_model
from tests.quant_checkpoints import load_dequantized, write_quantized
from tests.test_quantization import PROMPT, relative_error, startup_log
from tinyvllm import LLM
from tinyvllm.config import ConfigError

SCALES = (0.05, 0.02)   # k_scale, v_scale: unlike 1.0 they move e4m3's rounding, so a dropped scale shows in the logits
CASES = {  # model, checkpoint format, its options, the names its scales go by
  "modelopt-fp8-llama": ("llama", "modelopt", dict(algo="FP8", hf_quant_config=True), "k_scale, v_scale"),
  "ct-fp8-kv-scheme-qwen3": ("qwen3", "compressed-tensors", dict(format="float-quantized", bits=8, strategy="channel"),
                             "k_scale, v_scale"),
  "autofp8-static-qwen2": ("qwen2", "fp8", {}, "output_scale"),   # q/k/v biases scaled with their rows
}


def fp8_cache_reference(hf, scales: tuple[float, float]):
  """hf with its attention reading k and v as an FP8 cache holds them: e4m3(k / k_scale) * k_scale (the same for v)."""
  from transformers import AttentionInterface, AttentionMaskInterface
  from transformers.masking_utils import eager_mask
  from transformers.models.llama.modeling_llama import eager_attention_forward
  stored = lambda t, s: (t / s).to(torch.float8_e4m3fn).to(t.dtype) * s
  def attend(module, query, key, value, attention_mask, **kwargs):
    return eager_attention_forward(module, query, stored(key, scales[0]), stored(value, scales[1]), attention_mask, **kwargs)
  name = f"fp8_cache_{scales[0]}_{scales[1]}"
  AttentionInterface.register(name, attend)
  AttentionMaskInterface.register(name, eager_mask)   # (the causal mask eager attention takes)
  hf.set_attn_implementation(name)
  return hf


@pytest.mark.parametrize("case", list(CASES))
def test_an_fp8_cache_holds_k_and_v_over_their_scales(case, tmp_path, capfd):
  kind, method, options, name = CASES[case]
  hf = make_model(kind, tmp_path / "float")
  dequantized = write_quantized(hf, tmp_path / "q", method, kv_scales=SCALES, **options)
  llm = LLM(str(tmp_path / "q"), kv_cache_dtype="fp8", num_gpu_blocks=16, max_num_seqs=2)
  assert (f"the checkpoint's KV cache scales ({name}) are applied in {hf.config.num_hidden_layers} layers: the FP8 cache "
          "holds k / k_scale and v / v_scale") in capfd.readouterr().err
  ours = llm.engine.compute_logits(PROMPT)
  reference = load_dequantized(hf, dequantized)
  with_scales = hf_logits(fp8_cache_reference(reference, SCALES), PROMPT)[-1]
  without = hf_logits(fp8_cache_reference(reference, (1.0, 1.0)), PROMPT)[-1]
  assert relative_error(ours, with_scales) < 1e-4
  assert relative_error(ours, without) > 10 * max(relative_error(ours, with_scales), 1e-6)   # the scales were applied
  # without an FP8 cache the scales are not used: the model is the checkpoint's own
  err = startup_log(tmp_path / "q", capfd)
  assert f"the checkpoint's KV cache scales ({name}) are not used: the KV cache is not FP8 (--kv-cache-dtype fp8 applies them)" in err
  reference.set_attn_implementation("eager")
  plain = LLM(str(tmp_path / "q"), num_gpu_blocks=16, max_num_seqs=2).engine.compute_logits(PROMPT)
  assert relative_error(plain, hf_logits(reference, PROMPT)[-1]) < 1e-4


def test_a_bad_kv_scale_is_named(tmp_path):
  write_quantized(make_model("llama", tmp_path / "float"), tmp_path / "q", "modelopt", algo="FP8", kv_scales=(0.0, 0.02))
  with pytest.raises(ConfigError, match=r"KV cache scale model\.layers\.0\.self_attn\.k_proj\.k_scale is \[0\.0\], expected "
                                        "one finite positive value"):
    LLM(str(tmp_path / "q"), kv_cache_dtype="fp8", num_gpu_blocks=16)
