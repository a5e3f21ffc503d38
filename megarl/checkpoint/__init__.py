"""Checkpoint folders: the megarl model checkpoint format, atomic writes, Megatron distributed checkpoint I/O."""
