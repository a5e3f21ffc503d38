"""Checkpoint conversion between Hugging Face folders and Megatron distributed checkpoints (`megarl convert`)."""
