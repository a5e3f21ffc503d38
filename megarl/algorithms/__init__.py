"""RL algorithm math as pure tensor functions behind registries: advantage estimators (advantages.py), KL estimators
(kl.py), loss aggregation (aggregation.py), policy and value losses (policy_loss.py, value_loss.py), off-policy
corrections (off_policy.py), DAPO tricks (dapo.py), and the loss objects handed to workers (losses.py).

Nothing here touches torch.distributed, Megatron or Ray. This package file imports nothing, so that the config loader
can import megarl.algorithms.config without torch.
"""
