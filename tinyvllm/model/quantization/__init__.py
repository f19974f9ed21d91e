"""Weight quantization at load: which format a checkpoint or --quantization asks for (config.py), reading GPTQ, AWQ
and FP8 checkpoints (checkpoint_formats.py) into the unpacked form that becomes the packed one of
tinyvllm/backend/quantized.py (unpacked.py), and the linears' source that the model loader reads (source.py)."""
