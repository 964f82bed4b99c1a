"""Text in and out: tokenizers built from a checkpoint's metadata (GGUF's `tokenizer.ggml.*`); the safetensors
tokenizer, chat templates, reasoning and tool-call parsing live in engine/ until they move here."""
