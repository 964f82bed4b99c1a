"""Text in and out: `tokenizer.py` (from tokenizer.json), `gguf_tokenizer.py` (from GGUF's `tokenizer.ggml.*`),
`chat_template/` (Jinja templates in a sandbox), `reasoning.py` (thinking split from the answer) and
`tool_calls.py` (tool calls parsed from the text)."""
