"""On-policy distillation's signal: a teacher's per-token log-probs of the tokens the student
sampled (Agarwal et al. 2024, "On-Policy Distillation of Language Models" (GKD); Thinking
Machines 2025, "On-Policy Distillation"; slime's `--opd-kl-coef`).

The student minimises the reverse KL to the teacher on its own samples. Its one-sample
estimate at token t is log pi_student(y_t) - log pi_teacher(y_t); as a per-token reward with
no discounting (each token is scored for itself, the published recipe) it enters the
policy-gradient loss as an advantage term:

    A'_t = A_t - kl_coef * (log pi_student(y_t) - log pi_teacher(y_t))     on policy tokens

added after the estimator (and its whitening), so it composes with any of them; with the
`on_policy_distill` estimator A_t = 0 and the teacher is the only signal. pi_student is the
policy that sampled (the old log-probs). Environment tokens of multi-turn rollouts and
padding are outside the response mask and get no signal.
"""

from __future__ import annotations

import torch


def teacher_reverse_kl(
    student_logprobs: torch.Tensor, teacher_logprobs: torch.Tensor, response_mask: torch.Tensor
) -> torch.Tensor:
    """[B, T] log pi_student - log pi_teacher on policy tokens, 0 elsewhere (fp32)."""
    if student_logprobs.shape != teacher_logprobs.shape:
        raise ValueError(
            f"student log-probs {tuple(student_logprobs.shape)} and teacher log-probs "
            f"{tuple(teacher_logprobs.shape)} differ in shape"
        )
    kl = student_logprobs.float() - teacher_logprobs.float()
    return torch.where(response_mask.bool(), kl, 0.0)


def add_distillation(
    advantages: torch.Tensor, reverse_kl: torch.Tensor, kl_coef: float
) -> torch.Tensor:
    """[B, T] advantages with the teacher's per-token signal -kl_coef * reverse_kl added
    (`reverse_kl` is 0 off the response mask, so padding and environment tokens keep theirs)."""
    return advantages - kl_coef * reverse_kl.to(advantages.dtype)
