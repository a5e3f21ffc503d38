"""Role workers: Megatron actor, critic, ref and reward-model compute, and the rollout worker."""
