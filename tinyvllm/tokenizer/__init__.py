"""Tokenizers on tiktoken for HuggingFace model folders: byte-level BPE (Qwen, GPT-2, Llama-3 HF), Llama-3's tiktoken
tokenizer.model, and SentencePiece-style BPE tokenizer.json (Llama 2, TinyLlama); chat templates; streaming decode."""
from tinyvllm.tokenizer.detokenizer import IncrementalDetokenizer
from tinyvllm.tokenizer.errors import TokenizerError
from tinyvllm.tokenizer.hf_style import HFStyleTokenizer
from tinyvllm.tokenizer.loader import load_tokenizer
from tinyvllm.tokenizer.tokenizer import Tokenizer

__all__ = ["HFStyleTokenizer", "IncrementalDetokenizer", "Tokenizer", "TokenizerError", "load_tokenizer"]
