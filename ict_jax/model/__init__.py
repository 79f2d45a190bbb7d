"""Qwen2 in flax.nnx and its weights: config and presets, the model, HF safetensors, GGUF, loading by path.
docs/models.md."""
