"""tinyvllm: a small, fast, correct LLM inference engine on tinygrad, in the spirit of vLLM."""
from tinyvllm.engine.llm import LLM
from tinyvllm.engine.llm_engine import LLMEngine
from tinyvllm.outputs import CompletionOutput, RequestOutput
from tinyvllm.sampling_params import SamplingParams

__all__ = ["LLM", "CompletionOutput", "LLMEngine", "RequestOutput", "SamplingParams"]
__version__ = "0.1.0"
