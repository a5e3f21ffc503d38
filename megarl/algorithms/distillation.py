"""On-policy distillation: a frozen teacher scores the student's own samples, token by token.

The student (the actor) samples responses as in any RL step; the teacher (the `teacher` role: a frozen model with
the same tokenizer) gives the log-prob of every sampled token. A token's log pi_student(y_t) - log pi_teacher(y_t)
is a one-sample estimate of the reverse KL, KL(student || teacher), at that position, and its negation is the
token's distillation advantage (Agarwal et al. 2024, "On-Policy Distillation of Language Models: Learning from
Self-Generated Mistakes"; Thinking Machines, "On-Policy Distillation", 2025). Mixed with the verifier's reward:

    advantage_t = reward_coef * A_reward_t + coef * (log pi_teacher(y_t) - log pi_student(y_t))   on response tokens

A_reward is the configured estimator's advantage (algorithm.advantage.estimator) from the token rewards; reward_coef
= 0 is pure distillation (the reward is still computed and logged). What it leaves out: no discounting or
credit to earlier tokens (each token's term is its own, as in both references: the policy gradient then
minimizes the per-token reverse KL), no normalization of the distillation term (its scale is the log-ratio's).
Tokens outside the response mask (prompt, padding, an agent episode's observation tokens) get 0.

The student's log-prob is the actor's old log-prob (the policy that sampled, before this step's update); both are
taken at the rollout temperature, so a teacher identical to the student gives exactly 0.

Shapes: B samples, S token positions.
"""

from __future__ import annotations

import torch


def distillation_advantages(
    reward_advantages_BS: torch.Tensor,
    student_logprobs_BS: torch.Tensor,
    teacher_logprobs_BS: torch.Tensor,
    response_mask_BS: torch.Tensor,
    coef: float,
    reward_coef: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(advantages_BS, reverse_kl_BS): the mix in the module doc, and each response token's reverse-KL sample
    log pi_student - log pi_teacher (both 0 outside the response mask)."""
    mask = response_mask_BS.to(torch.float32)
    reverse_kl = (student_logprobs_BS.float() - teacher_logprobs_BS.float()) * mask
    advantages = (reward_coef * reward_advantages_BS.float() - coef * reverse_kl) * mask
    return advantages, reverse_kl


def distillation_metrics(
    reverse_kl_BS: torch.Tensor, teacher_logprobs_BS: torch.Tensor, response_mask_BS: torch.Tensor
) -> dict[str, float]:
    """distill/reverse_kl: mean over response tokens of log pi_student - log pi_teacher (0 when the student matches
    the teacher on its own samples); distill/reverse_kl_per_sample: the same summed over each response, averaged over
    samples; distill/teacher_logprob: the teacher's mean log-prob of the student's tokens."""
    mask = response_mask_BS.to(torch.float32)
    num_tokens = mask.sum().clamp(min=1)
    per_sample = (reverse_kl_BS * mask).sum(dim=1)
    return {
        "distill/reverse_kl": ((reverse_kl_BS * mask).sum() / num_tokens).item(),
        "distill/reverse_kl_per_sample": per_sample.mean().item() if len(per_sample) else 0.0,
        "distill/teacher_logprob": ((teacher_logprobs_BS.float() * mask).sum() / num_tokens).item(),
    }
