"""`RLTrainer`: the loop of one run (`fit`: value pretraining, the PPO steps, evaluation,
checkpoints, stop requests) over the parts `trainer/build.py` assembled: the roles, the
rollout service, the data, the checkpoints and the logs.

Ranks: one model replica per data-parallel rank (its TP x PP ranks). Each DP rank gets its
own share of every rollout's prompts from the rollout service (`rollout/service/`: engines
in these ranks or on engine ranks of their own, the same groups either way), and the batches
meet in the gradient all-reduce; whitening and loss normalisation use DP-global statistics.
"""

from __future__ import annotations

import functools
import time
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from pathlib import Path

import torch
import yaml

from megatron_rl.config import TrainConfig, to_dict
from megatron_rl.data import PromptStream
from megatron_rl.data.batch import mini_batches
from megatron_rl.models.hf_export import save_hf_pretrained
from megatron_rl.models.peft_export import PEFT_ADAPTER, save_peft_adapter
from megatron_rl.models.source import ModelSource
from megatron_rl.parallel import distributed
from megatron_rl.parallel.collectives import (
    any_rank,
    data_parallel_min,
    reduce_over_ranks,
)
from megatron_rl.preemption import STOP, StepAborted, grace_warning
from megatron_rl.rollout.service import (
    STAGES,
    RolloutProgress,
    RolloutService,
    save_progress,
)
from megatron_rl.rollout.types import ENGINE_MEMORY, request_seed
from megatron_rl.trainer.checkpoint import (
    HF_EXPORTS,
    CheckpointManager,
    CorruptCheckpoint,
    load_roles,
    rng_state,
    save_hf_export,
    save_roles,
    set_rng_state,
)
from megatron_rl.trainer.experience import make_experience, micro_batching
from megatron_rl.trainer.memory_timeline import MemoryTimeline
from megatron_rl.trainer.metrics import MetricsLogger
from megatron_rl.trainer.offload import Roles
from megatron_rl.trainer.updates import (
    MiniBatchPlan,
    UpdateControl,
    balanced,
    mean_metrics,
    nonfinite_streak,
    optimizer_steps,
)
from megatron_rl.trainer.value_pretrain import (
    STAGE as VALUE_PRETRAIN,
)
from megatron_rl.trainer.value_pretrain import (
    pretrain_update,
    unsettled_warning,
)
from megatron_rl.trainer.watchdog import Watchdog
from megatron_rl.workers.own_layout import OnOwnLayout

MEMORY_TIMELINE = "memory_timeline.jsonl"


def in_phase(name: str):
    """Run an RLTrainer method as the watchdog's phase `name`."""

    def wrap(method):
        @functools.wraps(method)
        def run(self, *args, **kwargs):
            with self.watchdog.phase(name):
                return method(self, *args, **kwargs)

        return run

    return wrap


@dataclass
class RunParts:
    """What a run is made of (`trainer/build.py` makes them)."""

    config: TrainConfig
    ctx: object
    """The distributed context (`parallel.distributed.initialize`)."""
    watchdog: Watchdog
    tokenizer: object
    prompts: PromptStream
    roles: Roles
    rollout: RolloutService
    checkpoints: CheckpointManager
    logger: MetricsLogger
    memory: MemoryTimeline


class RLTrainer:
    def __init__(self, parts: RunParts):
        """A run at its start (`trainer/build.py` makes the parts, then resumes it)."""
        p = parts
        self.config, self.ctx, self.watchdog = p.config, p.ctx, p.watchdog
        self.tokenizer, self.prompts, self.roles = p.tokenizer, p.prompts, p.roles
        self.rollout: RolloutService = p.rollout
        self.checkpoints, self.logger, self.memory = p.checkpoints, p.logger, p.memory
        self.pad_token_id = self.tokenizer.pad_token_id or 0
        self.step = 0
        self.value_pretrain_step = 0
        self.nonfinite_in_a_row = 0
        self.saved_progress: int | None = None
        """The progress (value-pretraining + PPO steps) of the last save or resume."""
        self.step_rollout: dict[int, RolloutProgress] = {}
        """What this rank keeps of the step's rollout if a stop ends the step (by replica:
        `Rollout.progress`), saved with the step's start so the resume generates no token
        twice; empty between steps."""

    # ------------------------------------------------------------------ stop requests

    def stop_requested_anywhere(self) -> bool:
        """A stop request (`megatron_rl.preemption`) reached some rank: asked at step
        boundaries (inside a step: `abort_point`)."""
        return any_rank(STOP.requested)

    def abort_point(self, phase: str, aborted: bool = False) -> None:
        """Raise `StepAborted(phase)` on every rank when some rank saw a stop request (or
        `aborted`): a world collective, so every rank must reach each abort point of a step
        in the same order. Once an optimizer update ran, only where the trainer can rewind it
        (`trainer/updates.py`, `optimizer_steps`)."""
        if any_rank(aborted or STOP.requested):
            raise StepAborted(phase)

    def abortable_step(self, stage: str, step_fn):
        """`step_fn()`, or None when a stop request aborted it: the data position and RNG
        state of the step's start are put back and saved (unless that state is the newest
        checkpoint already), so the resumed run redoes the step exactly."""
        data, rng = self.prompts.state_dict(), rng_state()
        started = time.time()
        try:
            return step_fn()
        except StepAborted as e:
            self.prompts.load_state_dict(data)
            set_rng_state(rng)
            self.save_after_abort(stage, e.phase, started)
            return None
        finally:
            self.step_rollout = {}

    def save_after_abort(self, stage: str, phase: str, started: float) -> None:
        progress = self.value_pretrain_step + self.step
        step = self.value_pretrain_step if stage == "value_pretrain" else self.step
        if self.ctx.rank == 0:
            since = STOP.since
            seen = f"{time.time() - since:.1f} s after the request, " if since else ""
            print(
                f"stop ({STOP.reason or 'requested on another rank'}): {stage} step {step + 1} "
                f"aborted in {phase}, {seen}{time.time() - started:.1f} s into the step; "
                f"its start (step {step}) is what resumes",
                flush=True,
            )
        if self.saved_progress == progress:
            if self.ctx.rank == 0:
                print(f"step {step} is the newest checkpoint already: nothing to save", flush=True)
            # the rollout's progress joins it (each file whole: temp, then rename)
            self.keep_rollout(self.checkpoints.path(progress))
            torch.distributed.barrier()
        else:
            self.save()
        since = STOP.since  # None on a rank the request did not reach yet
        if since is not None and self.ctx.rank == 0:
            late = grace_warning("this stop", time.time() - since, self.config.trainer.stop_grace_s)
            if late:
                print(late, flush=True)

    @contextmanager
    def phase(self, name: str):
        """A phase of a step: named to the watchdog, its peak memory recorded."""
        with self.watchdog.phase(name), self.memory.phase(name):
            yield

    @property
    def dp_size(self) -> int:
        return self.ctx.dp_size

    @property
    def value_pretrain_done(self) -> bool:
        return (
            self.roles.critic is None
            or self.value_pretrain_step >= self.config.critic.pretrain_steps
        )

    # ------------------------------------------------------------------ the run

    def fit(self) -> bool:
        """The whole run: value pretraining (when a critic has steps of it left), the
        evaluation before training, then PPO steps to `trainer.total_steps`, with evaluations,
        checkpoints and Hugging Face exports at their intervals. A stop request
        (`megatron_rl.preemption`) ends it after the step it arrived in, once that step is
        saved. Returns False when a stop request ended it early, True when it ran to the end.
        """
        if self.stop_requested_anywhere():
            # asked before the first step (e.g. the scheduler's signal came while loading):
            # the checkpoint resumed from is still the newest; nothing to save
            if self.ctx.rank == 0:
                reason = STOP.reason or "on another rank"
                print(f"stop requested before the first step ({reason}): exiting", flush=True)
            return False
        if not self.fit_value_pretraining():
            return False
        return self.fit_ppo()

    def fit_value_pretraining(self) -> bool:
        """Value pretraining (`trainer/value_pretrain.py`) until done: a checkpoint every
        `trainer.save_interval` steps and at the end; nothing when it is done already. False
        when a stop request ended it early (saved first)."""
        if self.value_pretrain_done:
            return True
        c = self.config
        interval, total = c.trainer.save_interval, c.critic.pretrain_steps
        threshold = c.critic.pretrain_ev_threshold
        evs = []
        while not self.value_pretrain_done:
            with self.watchdog.watch(f"value_pretrain step {self.value_pretrain_step + 1}"):
                metrics = self.abortable_step(VALUE_PRETRAIN, self.value_pretrain_step_once)
                if metrics is None:  # a stop request: the step's start is saved
                    return False
                evs.append(metrics.get("critic/vf_explained_var"))
                self.logger.log(self.value_pretrain_step, metrics, VALUE_PRETRAIN, total)
                ev = metrics.get("critic/vf_explained_var", -1e9)
                if threshold is not None and ev >= threshold:
                    self.value_pretrain_step = total  # converged
                if self.stop_requested_anywhere():
                    self.save()
                    return False
                if interval and self.value_pretrain_step % interval == 0:
                    if not self.value_pretrain_done:
                        self.save()
        warning = unsettled_warning(evs, c.critic.pretrain_ev_warn_below)
        if warning and self.logger.enabled:
            print(warning, flush=True)
        self.save()  # the pretrained critic: PPO (or a later run) starts from it
        return True

    def fit_ppo(self) -> bool:
        """PPO steps to `trainer.total_steps` (evaluations first at step 0); False when a stop
        request ended them early."""
        t = self.config.trainer
        total, interval = t.total_steps, t.save_interval
        if self.rollout.evaluates and self.step == 0:
            with self.watchdog.watch("the evaluation before training"):
                self.logger.log(0, self.evaluate(), "eval")
        while self.step < total:
            with self.watchdog.watch(f"train step {self.step + 1}"):  # trainer.step_timeout_s
                # rollout -> experience -> PPO epochs -> weight sync; None: aborted and saved
                metrics = self.abortable_step("train", self.train_step)
                if metrics is None:
                    return False
                step = self.step
                if self.eval_due(step):
                    metrics.update(self.evaluate())
                self.logger.log(step, metrics)
                stop = self.stop_requested_anywhere()
                if stop or step == total or (interval and step % interval == 0):
                    self.save()  # first: on pre-emption the checkpoint is what must be complete
                if t.save_hf_interval and (step == total or step % t.save_hf_interval == 0):
                    self.save_hf()  # a step the resumed run will not redo
                if stop:
                    return False
        return True

    # ------------------------------------------------------------------ the steps

    def generate_and_score(self, stage: str, step: int):
        """This DP rank's rated groups for one step, trimmed to the same count on every DP
        rank (dynamic filtering can come back short), and the rollout metrics; a stop
        request that aborted the rollout on some rank aborts the step on all."""
        rollout = self.rollout.generate(stage, step, self.prompts)
        self.step_rollout = rollout.progress
        self.abort_point(rollout.aborted or "rollout", rollout.aborted is not None)
        groups, metrics = rollout.groups, rollout.metrics
        groups = groups[: data_parallel_min(len(groups))]
        samples = [s for g in groups for s in g]
        if samples:
            # host-side statistics of this rank's samples (reduce_over_ranks takes floats)
            rewards = torch.tensor([s.reward for s in samples], device="cpu")
            lengths = torch.tensor(
                [s.sample.response_length for s in samples], dtype=torch.float, device="cpu"
            )
            metrics.update(
                {
                    "rollout/reward/std": rewards.std().item() if len(rewards) > 1 else 0.0,
                    "rollout/accuracy": (rewards > 0).float().mean().item(),
                    "rollout/response_length/max": lengths.max().item(),
                    "rollout/response_length/clip_ratio": sum(
                        s.sample.finish_reason == "length" for s in samples
                    )
                    / len(samples),
                }
            )
        return groups, metrics

    def offload(self, name: str, params: bool = True) -> None:
        self.roles.offload(self.config, name, params)

    def offload_trained_roles(self) -> None:
        """After the updates: the actor keeps its parameters for the weight sync."""
        self.offload("actor", params=False)
        self.offload("critic")

    def send_weights(self, evaluate: bool = False, changed: bool = True) -> None:
        """The actor's current weights to the engines as policy version `step`; `evaluate`:
        the evaluation of this step follows (`RolloutService.push_weights`)."""
        self.rollout.push_weights(self.roles.actor, self.step, evaluate, changed)

    def eval_due(self, step: int) -> bool:
        """Whether the run evaluates after PPO step `step`."""
        t = self.config.trainer
        return self.rollout.evaluates and (
            step == t.total_steps or bool(t.eval_interval and step % t.eval_interval == 0)
        )

    @contextmanager
    def roles_resident(self):
        """For a save: the parameters come back to the device (reading a role's chunks
        brings them) and leave again after. With parameter offload the engine sleeps
        meanwhile (level 1: its weights wait in host memory), so they have the room they
        have in training, not just what generation leaves. An engine already asleep (a step
        aborted after the rollout) is left so, and only what was awake wakes again."""
        c = self.config
        moving = c.actor.param_offload or c.actor.ref_param_offload or c.critic.param_offload
        awake = self.rollout.awake if moving else ()
        if awake:
            self.rollout.sleep(level=1)
        try:
            yield
        finally:
            if moving:
                self.roles.offload_for_rollout(c)
            if awake:
                self.rollout.wake_up(awake, why="save_")

    def mini_batch_plan(self, stage: str, step: int) -> MiniBatchPlan:
        c = self.config
        per_rank = c.actor.ppo_mini_batch_size // self.dp_size
        balance = c.trainer.balance_batch
        return MiniBatchPlan(
            per_rank=per_rank,
            micro_batches=per_rank // c.actor.micro_batch_size,
            generator=torch.Generator().manual_seed(
                request_seed(c.trainer.seed, STAGES[stage], step, 7)
            ),
            balance=c.actor.use_dynamic_bsz if balance is None else balance,
        )

    def update_control(self) -> UpdateControl:
        return UpdateControl(
            abort_point=self.abort_point,
            rewindable=self.config.trainer.rewindable_update,
            verbose=self.ctx.rank == 0,
        )

    def update(self, batch, step: int) -> dict[str, float]:
        """PPO epochs over shuffled mini-batches: actor (and critic) updates."""
        c, actor, critic = self.config, self.roles.actor, self.roles.critic
        self.abort_point("train")  # before the first mini-batch's gradients
        plan = self.mini_batch_plan("train", step)
        batch, balance_metrics = balanced(batch, plan)
        roles = [(actor, c.actor.loss, micro_batching(c.actor, plan.micro_batches))]
        if critic is not None:
            roles.append((critic, c.critic.loss, micro_batching(c.critic, plan.micro_batches)))
        epochs = c.actor.ppo_epochs
        batches = (
            mb for _ in range(epochs) for mb in mini_batches(batch, plan.per_rank, plan.generator)
        )
        count = epochs * (len(batch) // plan.per_rank)
        records, rewind_metrics = optimizer_steps(roles, batches, count, self.update_control())
        actor_records, critic_records = records[0], records[1] if critic is not None else []
        self.nonfinite_in_a_row = nonfinite_streak(
            self.nonfinite_in_a_row,
            actor_records + critic_records,
            c.trainer.max_nonfinite_in_a_row,
        )
        self.offload_trained_roles()
        metrics = mean_metrics(actor_records, "actor/")
        metrics.update(mean_metrics(critic_records, "critic/"))
        metrics["actor/num_updates"] = float(len(actor_records))
        metrics.update(balance_metrics)
        metrics.update(rewind_metrics)
        return metrics

    def value_pretrain_step_once(self) -> dict[str, float]:
        """One value-pretraining step: rollout of the frozen policy, then the critic's
        update (`pretrain_update`); the step's metrics reduced over ranks."""
        step = self.value_pretrain_step
        with self.phase("rollout"):
            groups, metrics = self.generate_and_score(VALUE_PRETRAIN, step)
        if not groups:
            self.value_pretrain_step += 1
            metrics.update(self.memory.end_step(self.value_pretrain_step, VALUE_PRETRAIN))
            return reduce_over_ranks({**metrics, "actor/skipped_update": 1.0})
        self.abort_point("train")  # before the critic's values and gradients
        self.rollout.sleep(level=1)  # the policy is frozen: its weights wait in host memory
        with self.phase("train"):
            update, records = pretrain_update(
                self.roles.critic, groups, self.config, self.pad_token_id,
                self.mini_batch_plan(VALUE_PRETRAIN, step), self.update_control(),
            )  # fmt: skip
            self.nonfinite_in_a_row = nonfinite_streak(
                self.nonfinite_in_a_row, records, self.config.trainer.max_nonfinite_in_a_row
            )
            self.offload_trained_roles()
            metrics.update(update)
        self.rollout.wake_up(ENGINE_MEMORY)
        self.value_pretrain_step += 1
        metrics["memory/params_offloaded_gib"] = self.roles.offloaded_param_gib()
        metrics.update(self.memory.end_step(self.value_pretrain_step, VALUE_PRETRAIN))
        return reduce_over_ranks(metrics)

    def train_step(self) -> dict[str, float]:
        """One PPO/GRPO/... step: rollout; the engine sleeps (KV cache freed, weights dropped)
        while Megatron computes the experience and trains; it wakes its weights for the sync,
        then its KV cache for the next rollout. What the config offloads (`offload`) leaves
        after each role's last use and is back for the next experience; PyTorch's cached
        blocks go before each wake-up (`LocalRollout.wake_up`); with the engines on ranks of
        their own, sleep and wake-up are nothing."""
        c, step = self.config, self.step
        t0 = time.perf_counter()
        with self.phase("rollout"):
            groups, metrics = self.generate_and_score("train", step)
        if not groups:  # dynamic filtering found nothing informative within its cap
            self.step += 1
            # the same weights, but the next version: engines apart count versions
            self.send_weights(evaluate=self.eval_due(self.step), changed=False)
            metrics["actor/skipped_update"] = 1.0
            metrics.update(self.memory.end_step(self.step, "train"))
            return reduce_over_ranks(metrics)
        t1 = time.perf_counter()
        # its weights come back with the sync below; a LoRA actor's frozen ones stay (level
        # 1: in host memory), its sync sends what the adapters change (`sync/lora_sync.py`)
        self.rollout.sleep(level=1 if c.actor.lora.enabled else 2)
        with self.phase("experience"):
            batch, exp_metrics = make_experience(
                groups,
                self.roles.actor,
                self.roles.critic,
                self.roles.reference,
                c,
                self.pad_token_id,
                before_forward=lambda role: self.abort_point(f"experience/{role}"),
                teacher=self.roles.teacher,
            )
        self.offload("reference")  # unused until the next experience
        self.offload("teacher")
        t2 = time.perf_counter()
        metrics.update(exp_metrics)
        with self.phase("train"):
            metrics.update(self.update(batch, step))
        t3 = time.perf_counter()
        self.rollout.wake_up(("weights",))
        self.step += 1  # the weights sent are policy version `step`
        with self.phase("sync"):
            self.send_weights(evaluate=self.eval_due(self.step))
        self.offload("actor")  # its parameters: unused until the next experience
        self.rollout.wake_up(("kv_cache",))
        t4 = time.perf_counter()
        tokens = float(
            batch.response_mask.sum()
            + sum(len(s.sample.prompt_token_ids) for g in groups for s in g)
        )
        metrics.update(
            {
                "timing/rollout_s": t1 - t0,
                "timing/experience_s": t2 - t1,
                "timing/train_s": t3 - t2,
                "timing/sync_s": t4 - t3,
                "timing/step_s": t4 - t0,
                "perf/tokens_per_s": tokens / (t4 - t0),
            }
        )
        metrics["memory/params_offloaded_gib"] = self.roles.offloaded_param_gib()
        metrics.update(self.memory.end_step(self.step, "train"))
        return reduce_over_ranks(metrics)

    @in_phase("eval")
    def evaluate(self) -> dict[str, float]:
        """Every eval set at this step (`Evaluator`), one row per set in eval.jsonl; with
        `teacher.evaluate`, the teacher's too (`evaluate_teacher`)."""
        metrics, rows = self.rollout.evaluate(self.step)
        self.logger.log_eval(self.step, rows)
        if self.config.teacher.evaluate:
            metrics.update(self.evaluate_teacher())
        return metrics

    def evaluate_teacher(self) -> dict[str, float]:
        """The teacher's weights into the engine, every eval set with this step's request
        seeds (the student's: the two are compared on the same draws), then the actor's
        weights back. Metrics as `eval/teacher/...`; eval.jsonl rows with "policy": "teacher"."""
        teacher = self.roles.teacher
        # on a layout of its own, its weights are read with its groups active
        own = teacher.weights() if isinstance(teacher, OnOwnLayout) else nullcontext(teacher)
        with own as weights:
            self.rollout.push_weights(weights, self.step)
        self.offload("teacher")
        metrics, rows = self.rollout.evaluate(self.step)
        self.logger.log_eval(self.step, [{**row, "policy": "teacher"} for row in rows])
        self.send_weights()
        return {k.replace("eval/", "eval/teacher/", 1): v for k, v in metrics.items()}

    # ------------------------------------------------------------------ checkpoints

    @in_phase("save")
    def save(self) -> None:
        c = self.config
        sources = {"actor": c.model.path, "critic": c.model.critic_path or c.model.path}

        def write_roles(out):
            save_roles(out, self.roles.trained, sources, self.checkpoints.layout)
            self.keep_rollout(out)

        trainer_state = {
            "step": self.step,
            "value_pretrain_step": self.value_pretrain_step,
            "nonfinite_in_a_row": self.nonfinite_in_a_row,
            "data": self.prompts.state_dict(),
        }
        config_yaml = yaml.safe_dump(to_dict(self.config), sort_keys=False)
        # Checkpoints are numbered by progress over both stages, so the newest sorts last.
        progress = self.value_pretrain_step + self.step
        started = time.perf_counter()
        with self.roles_resident():
            path = self.checkpoints.save(
                progress, write_roles, rng_state(), trainer_state, config_yaml
            )
        self.saved_progress = progress
        if self.ctx.rank == 0:
            # the save time: what a scheduler's signal lead time must leave room for
            seconds = time.perf_counter() - started
            print(f"saved checkpoint {path} in {seconds:.1f} s", flush=True)
            slow = grace_warning("this save", seconds, c.trainer.stop_grace_s)
            if slow:
                print(slow, flush=True)

    def keep_rollout(self, checkpoint: Path) -> None:
        """Write what this rank keeps of an aborted step's rollout into `checkpoint` (the
        save's temp directory, or the complete checkpoint of the step's start)."""
        kept = {r: p for r, p in self.step_rollout.items() if p.chunks}
        if not kept:
            return
        save_progress(checkpoint, kept)
        name = checkpoint.name.removeprefix(".").removesuffix(".tmp")
        for replica, p in sorted(kept.items()):
            print(
                f"kept {p.tokens} generated tokens of {p.stage} step {p.step + 1}'s rollout "
                f"(replica {replica}: {len(p.chunks)} chunk(s), {p.unfinished} response(s) "
                f"unfinished) with {name}",
                flush=True,
            )

    @in_phase("save_hf")
    def save_hf(self) -> Path:
        """The actor as a Hugging Face model in output_dir/hf/step_N (`trainer.save_hf_interval`);
        a LoRA actor's merged, with its adapters beside it as a PEFT adapter of the base
        (`step_N/adapter`)."""
        out = Path(self.config.trainer.output_dir) / HF_EXPORTS / f"step_{self.step:06d}"
        meta_dir = ModelSource(self.config.model.path).hf_dir
        actor = self.roles.actor

        def write(tmp: Path) -> None:
            save_hf_pretrained(actor.chunks, actor.arch, "actor", meta_dir, tmp)
            if actor.lora is not None:
                adapter = tmp / PEFT_ADAPTER
                if self.ctx.rank == 0:
                    adapter.mkdir()
                torch.distributed.barrier()
                save_peft_adapter(
                    actor.chunks, actor.arch, actor.lora, adapter, self.config.model.path
                )

        with self.roles_resident():
            save_hf_export(out, write)
        if self.ctx.rank == 0:
            print(f"saved Hugging Face model {out}", flush=True)
        return out

    def resume_from_newest(self) -> None:
        """Resume from `latest`; a checkpoint some rank cannot read is named by that rank,
        moved aside, and the previous complete one is tried (all ranks agree on each)."""
        path = self.checkpoints.latest()
        while path is not None:
            error = None
            try:
                rng, trainer_state = self.checkpoints.load(path)
            except CorruptCheckpoint as e:
                error = e
                print(f"warning: {e}", flush=True)
            if not any_rank(error is not None):
                try:
                    load_roles(path, self.roles.trained)
                except CorruptCheckpoint as e:
                    error = e
                    print(f"warning: {e}", flush=True)
            if not any_rank(error is not None):
                return self.resume(path, rng, trainer_state)
            previous = self.checkpoints.previous(path)
            torch.distributed.barrier()
            if self.ctx.rank == 0:
                aside = self.checkpoints.set_aside(path)
                print(
                    f"warning: checkpoint {path} is unreadable (moved to {aside.name}); "
                    f"resuming from {previous or 'nothing: a fresh start'}",
                    flush=True,
                )
            torch.distributed.barrier()
            path = previous

    def resume(self, path, rng: dict | None, trainer_state: dict) -> None:
        """Continue from `path`, whose roles `load_roles` has loaded."""
        if rng is not None:
            set_rng_state(rng)
        self.prompts.load_state_dict(trainer_state["data"])
        self.step = trainer_state["step"]
        self.value_pretrain_step = trainer_state["value_pretrain_step"]
        self.nonfinite_in_a_row = trainer_state["nonfinite_in_a_row"]
        self.saved_progress = self.value_pretrain_step + self.step
        self.rollout.resume_progress(path)
        self.send_weights()  # the engines started from the HF weights
        position = (1, self.step) if self.value_pretrain_done else (0, self.value_pretrain_step)
        dropped = self.logger.rewind(position)
        if self.ctx.rank == 0:
            print(
                f"resumed from {path} (step {self.step}); {dropped} metrics row(s) of the "
                "steps it redoes dropped",
                flush=True,
            )

    def close(self, failed: bool = False) -> None:
        """`failed`: an exception is on its way out (`RolloutService.close`)."""
        self.logger.close()
        self.rollout.close(failed)
        distributed.destroy()
