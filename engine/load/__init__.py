"""Checkpoints into a model: `loader.py` (build on meta, fill from safetensors or GGUF, choose the expert store)
and `gguf.py` (the GGUF container mapped onto the same model classes, its tokenizer and template)."""
