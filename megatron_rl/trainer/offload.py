"""Moving the roles' state to host memory between their uses (`actor.param_offload`,
`grad_offload`, `optimizer_offload`; the reference's `actor.ref_param_offload`; the critic's
own; the teacher's `teacher.param_offload`), so the rollout engine and the other roles have
the device."""

from __future__ import annotations

from dataclasses import dataclass

from megatron_rl.config import TrainConfig


@dataclass
class Roles:
    """The run's Megatron roles; `reference`, `critic` and `teacher` are None when the run
    has none (no KL term / no critic / no distillation)."""

    actor: object
    reference: object | None
    critic: object | None
    teacher: object | None = None

    @property
    def trained(self) -> dict:
        """The roles a checkpoint holds, by name."""
        return {"actor": self.actor, "critic": self.critic}

    def offload(self, config: TrainConfig, name: str, params: bool = True) -> None:
        """Role `name` (actor, critic, reference, teacher) moves what its config asks to host memory.
        The parameters come back with the role's next use of its chunks, the rest with its
        next update. Called after each role's last use before the rollout: the reference
        after the experience, the critic after its update, the actor after the weight sync
        (gradients and optimizer after its update)."""
        role = getattr(self, name)
        if role is None:
            return
        if name in ("reference", "teacher"):  # frozen: parameters only
            wanted = {
                "reference": config.actor.ref_param_offload,
                "teacher": config.teacher.param_offload,
            }
            if wanted[name]:
                role.offload_params()
            return
        section = config.actor if name == "actor" else config.critic
        role.offload(
            section.grad_offload, section.optimizer_offload, params and section.param_offload
        )

    def offload_for_rollout(self, config: TrainConfig) -> None:
        for name in ("actor", "critic", "reference", "teacher"):
            self.offload(config, name)

    def offloaded_param_gib(self) -> float:
        """What `param_offload` keeps in host memory now (the next rollout runs without it)."""
        roles = (self.actor, self.critic, self.reference, self.teacher)
        return sum(r.offloaded_param_bytes for r in roles if r is not None) / 2**30
