"""Files in and out, below every other room: `files.py` (regular files only, atomic writes that never clobber),
`checkpoint.py` (safetensors shards and their index, memory-mapped) and `validate.py` (a hostile config or header
refused with one typed line before a byte of it is used)."""
