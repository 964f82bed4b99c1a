"""What a model's layers compute with, shared by the model files and the expert cache (both import it, it imports
neither): `moe.py` (routing functions, the `ExpertProvider` contract, the resident provider and the slow
reference), `experts.py` (one MoE layer's expert compute over slots: native, Triton or torch paths) and
`kv_cache.py` (the sequence state: KV for attention layers, conv/SSM state for recurrent ones, snapshots for
prefix reuse)."""
