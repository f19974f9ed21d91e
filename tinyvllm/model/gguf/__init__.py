"""GGUF model files (llama.cpp / ollama): reading them (reader.py, blocks.py), their config, weights and tokenizer."""
