"""The trainer's loops: the synchronous and asynchronous RL loops, SFT, reward-model training, and what every step
shares (phases, evaluation, checkpoints, dynamic sampling, balanced data parallelism)."""
