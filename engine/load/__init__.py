"""Reading checkpoints from disk: the GGUF container (safetensors is read by engine/checkpoint.py and
engine/loader.py until they move here)."""
