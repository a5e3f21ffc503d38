"""Rollout: the engine interface and its backends (`hf` embedded on CPU, `sglang` on GPU clusters)."""
