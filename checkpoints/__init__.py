"""Checkpoints: HF safetensors loading, deterministic random init, orbax save/restore."""
