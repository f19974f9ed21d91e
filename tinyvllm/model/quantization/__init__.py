"""Weight quantization at load: which format a checkpoint or --quantization asks for (config.py), reading GPTQ, AWQ
and FP8 checkpoints into the packed form of tinyvllm/backend/quantized.py (checkpoint_formats.py), and the linears'
source that the model loader reads (source.py)."""
