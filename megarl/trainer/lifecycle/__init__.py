"""A run's life cycle: pre-flight checks, the model folder, the stages' data, the worker groups (roles) and their
turns on the GPUs, run checkpoints, and `megarl train` itself (run.py)."""
