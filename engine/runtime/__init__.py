"""Running a model: `generate.py` (the engine: load, the token loop, its immutable chunks), `sampling.py` and
`sampling_device.py` (host and device samplers, the same tokens)."""
