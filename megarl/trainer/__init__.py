"""The trainer, in four rooms: `loops/` (the RL, SFT and reward-model loops and their steps), `rollout_side/` (the
controller's side of rollout and weight sync), `observability/` (metrics, progress, timing, plots) and `lifecycle/`
(`megarl train`: pre-flight, roles, stage data, run checkpoints). `config.py` holds the loops' config sections."""
