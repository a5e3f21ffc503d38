"""The trainer: the RL / SFT / reward-model loops, run checkpoints, metrics and plots."""
