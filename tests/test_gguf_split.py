"""GGUF models split into several files (llama.cpp's gguf-split; large hub models come so): written by llama.cpp's own
writer (the gguf package, split_max_tensors), opened by their first file, they give the logits HF transformers gives
reading the same model as one file; a split passed out of turn, a missing or misnamed split are named."""
from __future__ import annotations

import shutil

import numpy as np
import pytest

from tests.gguf_files import write_tiny_llama
from tinyvllm import LLM
from tinyvllm.config import ConfigError
from tinyvllm.model.gguf.reader import GGUFFile

gguf = pytest.importorskip("gguf", reason="the gguf package (test extra) writes the test files")
MIX = {"attn_q": "Q4_K", "attn_k": "Q4_K", "attn_v": "Q6_K", "attn_output": "Q4_K", "ffn_gate": "Q4_K", "ffn_up": "Q8_0",
       "ffn_down": "Q6_K"}
PROMPT = [int(x) for x in np.random.default_rng(5).integers(0, 256, 20)]


def write_split(folder, max_tensors: int = 6) -> list:
  """The tiny model cut every `max_tensors` tensors: its files, first to last."""
  folder.mkdir(parents=True, exist_ok=True)
  write_tiny_llama(folder / "tiny.gguf", MIX, "F16", "Q6_K", split_max_tensors=max_tensors)
  return sorted(folder.glob("tiny-*-of-*.gguf"))


def test_split_model_matches_hf_on_the_whole_file(tmp_path, capfd):
  import torch
  from transformers import AutoModelForCausalLM
  (tmp_path / "whole").mkdir()
  whole = write_tiny_llama(tmp_path / "whole" / "tiny.gguf", MIX, "F16", "Q6_K")
  splits = write_split(tmp_path / "split")
  assert [p.name for p in splits] == [f"tiny-{i:05d}-of-{len(splits):05d}.gguf" for i in range(1, len(splits) + 1)]
  assert len(splits) >= 4 and not (tmp_path / "split" / "tiny.gguf").exists()
  f, one = GGUFFile(splits[0]), GGUFFile(whole)
  assert len(f.splits) == len(splits) and f.tensors.keys() == one.tensors.keys()
  assert {i.split for i in f.tensors.values()} == set(range(len(splits)))   # every file holds some
  for name in one.tensors: np.testing.assert_array_equal(f.raw(name), one.raw(name))
  hf = AutoModelForCausalLM.from_pretrained(str(whole.parent), gguf_file=whole.name, dtype=torch.float32)
  with torch.no_grad(): ref = hf(torch.tensor([PROMPT])).logits[0, -1].numpy()
  logits = LLM(str(splits[0]), device="CPU", max_num_seqs=2, num_gpu_blocks=32, max_model_len=128).engine.compute_logits(PROMPT)
  assert float(np.abs(logits - ref).max() / np.abs(ref).max()) < 1e-4
  assert f"gguf: {splits[0].name} (and its {len(splits) - 1} other splits) holds" in capfd.readouterr().err


def test_a_later_split_names_the_first(tmp_path):
  splits = write_split(tmp_path)
  with pytest.raises(ConfigError, match=rf"split 2 of {len(splits)}; pass the model's first split \({splits[0].name}\)"):
    LLM(str(splits[1]), device="CPU")


def test_a_missing_split_is_named(tmp_path):
  splits = write_split(tmp_path)
  splits[2].unlink()
  with pytest.raises(ConfigError, match=rf"split 3 of {len(splits)} \({splits[2].name}\) is missing"): GGUFFile(splits[0])


def test_a_renamed_first_split_is_refused(tmp_path):
  splits = write_split(tmp_path)
  renamed = shutil.copy(splits[0], tmp_path / "model.gguf")
  with pytest.raises(ConfigError, match=rf"does not end in -00001-of-{len(splits):05d}\.gguf"): GGUFFile(renamed)


def test_a_split_in_the_wrong_place_is_named(tmp_path):
  splits = write_split(tmp_path)
  shutil.copy(splits[1], splits[2])
  with pytest.raises(ConfigError, match=rf"split.no / split.count are \(1, {len(splits)}\), expected \(2, {len(splits)}\)"):
    GGUFFile(splits[0])
