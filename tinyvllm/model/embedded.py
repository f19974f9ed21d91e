"""The model shipped inside the package: karpathy's stories260K from llama2.c (MIT), a 260K-parameter story writer,
converted to a HuggingFace folder by scripts/convert_stories260k.py. The command line runs it when no --model is
given, so that a fresh install works with neither a model download nor the network."""
from __future__ import annotations

from importlib import resources
from pathlib import Path

EMBEDDED_MODEL = "stories260K"


def embedded_model_path() -> Path:
  """The shipped folder (config.json, model.safetensors, tokenizer files, LICENSE), wherever the package is installed."""
  return Path(str(resources.files("tinyvllm") / "assets" / EMBEDDED_MODEL))
