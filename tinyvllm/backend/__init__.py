"""The compute-backend interface, below both the model and the kernels: the attention metadata (metadata.py), a
decoder layer's weights (weights.py), the sampler's packed-parameter contract (sampling.py), and the ops and
capability record every backend implements (interface.py). The portable backend lives in tinyvllm/layers, the
hand-written CUDA/Metal one in tinyvllm/kernels."""
from tinyvllm.backend.interface import BackendCapabilities, ComputeBackend, KVCaches
from tinyvllm.backend.metadata import AttentionMetadata
from tinyvllm.backend.sampling import SamplerVariant
from tinyvllm.backend.weights import DecoderLayerWeights

__all__ = ["AttentionMetadata", "BackendCapabilities", "ComputeBackend", "DecoderLayerWeights", "KVCaches", "SamplerVariant"]
