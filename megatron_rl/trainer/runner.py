"""`RLTrainer`: owns the roles, the engine, the data and the checkpoints of one run, its steps
and its loop (`fit`: value pretraining, the PPO steps, evaluation, checkpoints, stop requests).

Ranks: one model replica per data-parallel rank (its TP x PP ranks); its vLLM engines (one
per pipeline stage by default, vLLM TP = Megatron TP) split each rollout's prompts and share
the samples (`rollout/replica.py`). Each DP rank draws its own slice of every rollout's
prompts, scores its own samples, and the batches meet in the gradient all-reduce; whitening
and loss normalisation use DP-global statistics.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import time
from contextlib import contextmanager
from pathlib import Path

import torch
import yaml

from megatron_rl.config import (
    ConfigError,
    TrainConfig,
    rollout_layout,
    scheduled_optim,
    to_dict,
    validate_config,
)
from megatron_rl.data import PromptStream, load_prompts
from megatron_rl.data.batch import TrainingBatch, mini_batches
from megatron_rl.models.hf_export import save_hf_pretrained
from megatron_rl.models.source import ModelSource
from megatron_rl.parallel import distributed
from megatron_rl.parallel.collectives import (
    any_model_parallel_rank,
    any_rank,
    balance_over_data_parallel,
    data_parallel_min,
    reduce_over_ranks,
)
from megatron_rl.parallel.placement import Placement
from megatron_rl.preemption import (
    STOP,
    StepAborted,
    grace_warning,
    plain_torchrun_warning,
)
from megatron_rl.rewards.pool import ModelParallelScoringPool
from megatron_rl.rollout.rating import request_seed
from megatron_rl.rollout.replica import ReplicaEngine
from megatron_rl.rollout.shm import ShmRecord
from megatron_rl.rollout.vllm_engine import ENGINE_MEMORY
from megatron_rl.sync.weight_sync import sync_weights
from megatron_rl.trainer.checkpoint import (
    HF_EXPORTS,
    CheckpointManager,
    CorruptCheckpoint,
    clear_previous_run,
    load_roles,
    previous_run_files,
    rng_state,
    save_hf_export,
    save_roles,
    set_rng_state,
)
from megatron_rl.trainer.disaggregated import EngineRanks
from megatron_rl.trainer.experience import (
    make_experience,
    micro_batching,
)
from megatron_rl.trainer.memory_timeline import MemoryTimeline
from megatron_rl.trainer.metrics import LoggerConfig, MetricsLogger
from megatron_rl.trainer.rounds import (
    STAGES,
    DataParallelShard,
    agent_engine,
    agent_spec,
    build_engine,
    build_env_pool,
    build_evaluator,
    generate_round,
    prompt_tools,
    sampling_config,
)
from megatron_rl.trainer.updates import mean_metrics, nonfinite_streak, optimizer_steps
from megatron_rl.trainer.value_pretrain import run_value_pretraining
from megatron_rl.trainer.watchdog import Watchdog, default_store
from megatron_rl.workers.critic import Critic
from megatron_rl.workers.policy import Actor, ReferencePolicy
from megatron_rl.workers.spec import RoleModel

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


class RLTrainer:
    def __init__(self, config: TrainConfig, roles: tuple[Placement, object] | None = None):
        """`roles`: (placement, the job's store) when this rank is a trainer of a
        disaggregated placement (`parallel.placement.initialize_role` made the trainers'
        default group); None: colocated, every rank trains and generates."""
        # transformers is heavy: loaded once a run is being built, not at import
        from transformers import AutoTokenizer

        world_size = roles[0].world_size if roles else int(os.environ.get("WORLD_SIZE", 1))
        validate_config(config, world_size)  # before any process group or model
        leftovers = previous_run_files(config.trainer.output_dir)
        if leftovers and not (config.trainer.resume or config.trainer.overwrite):
            shown = ", ".join(str(p) for p in leftovers[:3]) + (" ..." * (len(leftovers) > 3))
            raise ConfigError(
                f"trainer.output_dir {config.trainer.output_dir} holds an earlier run ({shown}) "
                "and trainer.resume is false: set trainer.overwrite=true to replace it, "
                "trainer.resume=true to continue it, or choose another output_dir"
            )
        self.config = config
        c, t = config, config.trainer
        layout = c.parallel
        policy_source = ModelSource(c.model.path)
        arch = policy_source.architecture()
        self.ctx = distributed.initialize(
            layout, arch=arch, seed=t.seed, deterministic=t.deterministic
        )
        self.watchdog = Watchdog(
            timeout_s=t.step_timeout_s,
            rank=self.ctx.rank,
            world_size=self.ctx.world_size,
            store=default_store(),
        )
        self.tokenizer = AutoTokenizer.from_pretrained(policy_source.hf_dir)
        self.pad_token_id = self.tokenizer.pad_token_id or 0
        self.prompts = PromptStream(
            load_prompts(c.data, self.tokenizer, prompt_tools(c)), seed=t.seed
        )
        # Before the models: a reward that cannot be imported or built fails in seconds.
        self.pool = ModelParallelScoringPool(c.rewards.reward_fns, c.rewards.pool)
        # Multi-turn rollouts: the tool format checked against the tokenizer, and the
        # environment's workers started, before the models too.
        self.agent = agent_spec(c, self.tokenizer) if c.rollout.multi_turn.enable else None
        self.env_pool = None
        if self.agent is not None:  # colocated only (config/validate.py)
            vllm_tp = rollout_layout(c, self.ctx.world_size).vllm_tensor_parallel_size
            self.env_pool = build_env_pool(c, self.ctx.rank, vllm_tp)
        if t.overwrite and self.ctx.rank == 0:  # only once the run's inputs proved usable
            clear_previous_run(t.output_dir)
        torch.distributed.barrier()
        temperature = c.rollout.temperature
        model = RoleModel(
            arch=arch,
            layout=layout,
            model_path=c.model.path,
            precision=c.model.precision,
            recompute=c.model.recompute,
            moe=c.model.moe,
            use_remove_padding=c.model.use_remove_padding,
        )
        self.actor = Actor(
            model,
            optim=scheduled_optim(c, "actor"),
            temperature=temperature,
            router_replay=c.actor.router_replay,
        )
        self.reference = (
            # forward only: model.recompute is the trained roles'
            ReferencePolicy(dataclasses.replace(model, recompute=None), temperature=temperature)
            if c.use_reference
            else None
        )
        self.critic = None
        if c.use_critic:
            critic_path = c.model.critic_path or c.model.path
            critic_arch = ModelSource(critic_path).architecture()
            self.critic = Critic(
                dataclasses.replace(model, arch=critic_arch, model_path=critic_path),
                optim=scheduled_optim(c, "critic"),
            )
        r = c.rollout
        if r.truncated and c.algorithm.rollout_correction.rollout_is is None and self.ctx.rank == 0:
            print(
                f"warning: rollout.top_p={r.top_p} / top_k={r.top_k} sample from a truncated "
                "distribution while the trainer's policy is the full tempered one: an "
                "off-policy gap (logged as logprob_gap_*, rollout_corr/*) that "
                "algorithm.rollout_correction.rollout_is would reweight",
                flush=True,
            )
        self.shm = ShmRecord(t.output_dir, self.ctx.rank)
        stale = self.shm.remove_stale()
        if stale:
            print(f"removed {len(stale)} shared-memory file(s) a killed run left: {stale}")
        self.engine = self.engine_ranks = None
        self.pushed_eval = None
        """With engine ranks: the eval sums they made right after the last push."""
        if roles:  # the engines are other ranks (`trainer/engine_worker.py`)
            self.engine_ranks = EngineRanks(
                roles[0], roles[1], self.ctx, c.async_.max_staleness,
                c.rollout.vllm_tensor_parallel_size or 1,
            )  # fmt: skip
        else:
            engines = rollout_layout(c, self.ctx.world_size)
            # The engine sizes its KV cache from the device memory free now: what the config
            # offloads leaves first (a sync, a resume or a save reads the chunks: they come
            # back).
            self.offload_for_rollout()
            engine = build_engine(
                c, policy_source, engines.vllm_tensor_parallel_size, "WORLD_SIZE" in os.environ
            )
            if self.agent is not None:
                engine = agent_engine(
                    engine, self.agent, self.env_pool, self.tokenizer, self.ctx.rank,
                    engines.vllm_tensor_parallel_size,
                )  # fmt: skip
            # One generation per model replica, split over its engines (`rollout/replica.py`).
            self.engine = ReplicaEngine.around(engine, engines, self.ctx.rank)
        if policy_source.is_megatron:
            self.send_weights()
        self.shm.write()
        self.sampling = sampling_config(c)
        self.evaluator = build_evaluator(
            c, self.engine, self.pool, self.tokenizer, self.ctx.dp_rank, self.dp_size,
            self.ctx.device,
        )  # fmt: skip
        sizes = (
            "tensor_model_parallel_size",
            "pipeline_model_parallel_size",
            "virtual_pipeline_model_parallel_size",
        )
        self.checkpoints = CheckpointManager(
            output_dir=t.output_dir,
            rank=self.ctx.rank,
            world_size=self.ctx.world_size,
            keep_last=t.keep_last,
            layout={k: getattr(layout, k) for k in sizes},
        )
        self.logger = MetricsLogger(
            output_dir=t.output_dir,
            total_steps=t.total_steps,
            enabled=self.ctx.rank == 0,
            settings=LoggerConfig(
                loggers=t.logger,
                project=t.project_name,
                run_name=t.experiment_name,
                config=to_dict(c),
                step_offset=c.critic.pretrain_steps if c.use_critic else 0,
            ),
        )
        self.memory = MemoryTimeline(
            Path(t.output_dir) / MEMORY_TIMELINE if self.ctx.rank == 0 else None,
            lambda: "+".join(sorted(self.engine.awake)) or "asleep" if self.engine else "apart",
        )
        self.step = 0
        self.value_pretrain_step = 0
        self.nonfinite_in_a_row = 0
        self.saved_progress: int | None = None
        """The progress (value-pretraining + PPO steps) of the last save or resume."""
        STOP.install()  # again: `megatron_rl.cli.train` installs it first thing
        # a request one rank sees reaches all (engine ranks too: the job's store)
        STOP.share_through(roles[1] if roles else default_store(), self.ctx.rank)
        warning = plain_torchrun_warning()
        if warning and self.ctx.rank == 0:
            print(warning, flush=True)
        if t.resume:
            self.resume_from_newest()
        self.offload_for_rollout()  # the first rollout runs as every later one

    # ------------------------------------------------------------------ set-up helpers

    def stop_requested_anywhere(self) -> bool:
        """A stop request (`megatron_rl.preemption`) reached some rank: asked at step
        boundaries (inside a step: `abort_point`)."""
        return any_rank(STOP.requested)

    def stop_requested_in_replica(self) -> bool:
        """A stop request reached some rank of this model replica (the ranks that run one
        rollout in lockstep): asked between the rollout's chunks."""
        return any_model_parallel_rank(STOP.requested)

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
        return self.critic is None or self.value_pretrain_step >= self.config.critic.pretrain_steps

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
        """Value pretraining to its end (`trainer/value_pretrain.py`); nothing when it is done.
        False when a stop request ended it early (saved first)."""
        return self.value_pretrain_done or run_value_pretraining(self)

    def fit_ppo(self) -> bool:
        """PPO steps to `trainer.total_steps` (evaluations first at step 0); False when a stop
        request ended them early."""
        t = self.config.trainer
        total, interval = t.total_steps, t.save_interval
        if self.evaluator and self.step == 0:
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
        rank (dynamic filtering can come back short), and the rollout metrics. Made here
        (colocated) or by the engine ranks (disaggregated), the same groups either way."""
        if self.engine_ranks is not None:
            data = self.prompts.state_dict()
            if stage == "train":  # generated ahead as async.max_staleness allows
                total = self.config.trainer.total_steps
                answer = self.engine_ranks.round(step, total, data)
            else:  # value pretraining: its policy is frozen, nothing to run ahead of
                answer = self.engine_ranks.generate(stage, step, data)
            groups, metrics, data, aborted, version = answer
            self.abort_point(aborted or "rollout", aborted is not None)
            self.prompts.load_state_dict(data)  # the draws the engines made
            if stage == "train":
                metrics = {**metrics, "rollout/staleness": self.staleness(step, version)}
        else:
            aborted = None
            try:
                rollout = generate_round(
                    self.config, stage, step,
                    DataParallelShard(self.prompts, self.ctx.dp_rank, self.dp_size),
                    self.engine, self.pool, self.tokenizer,
                    should_stop=self.stop_requested_in_replica,
                    stop_generation=lambda: STOP.requested,
                )  # fmt: skip
            except StepAborted as e:  # this replica; the others see the request at their check
                aborted = e.phase
            self.abort_point(aborted or "rollout", aborted is not None)
            groups, metrics = rollout.groups, dict(rollout.metrics)
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
        """Role `name` (actor, critic, reference) moves what its config asks to host memory:
        `param_offload` (the reference's: actor.ref_param_offload), `grad_offload`,
        `optimizer_offload`. The parameters come back with the role's next use of its
        chunks, the rest with its next update. Called after each role's last use before
        the rollout: the reference after the experience, the critic after its update, the
        actor after the weight sync (gradients and optimizer after its update)."""
        role = {"actor": self.actor, "critic": self.critic, "reference": self.reference}[name]
        if role is None:
            return
        if name == "reference":
            if self.config.actor.ref_param_offload:
                role.offload_params()
            return
        cfg = getattr(self.config, name)
        role.offload(cfg.grad_offload, cfg.optimizer_offload, params and cfg.param_offload)

    def offload_trained_roles(self) -> None:
        """After the updates: the actor keeps its parameters for the weight sync."""
        self.offload("actor", params=False)
        self.offload("critic")

    def offload_for_rollout(self) -> None:
        for name in ("actor", "critic", "reference"):
            self.offload(name)

    def offloaded_param_gib(self) -> float:
        """What `param_offload` keeps in host memory now (the next rollout runs without it)."""
        roles = (self.actor, self.critic, self.reference)
        return sum(r.offloaded_param_bytes for r in roles if r is not None) / 2**30

    def wake_engine(self, tags: tuple[str, ...] = ("weights", "kv_cache"), why: str = "") -> None:
        """Wake the engine's `tags`, once PyTorch's allocator has given its cached blocks
        back (`memory_timeline.release_cached_blocks` says why), recorded as hand-off
        `wake_<tags>` (`why`: a prefix naming the occasion). Nothing when the engines are
        other ranks."""
        if self.engine is None:
            return
        self.memory.release_cached_blocks(f"{why}wake_{'+'.join(tags)}")
        self.engine.wake_up(tags)

    def sleep_engine(self, level: int) -> None:
        """The colocated engine frees its KV cache (level 1 also moves its weights to host
        memory, level 2 drops them) while Megatron needs the device."""
        if self.engine is not None:
            self.engine.sleep(level=level)

    def send_weights(self, evaluate: bool = False) -> None:
        """The actor's current weights into the engines: the colocated one in place
        (`sync_weights`), or pushed to the engine ranks as policy version `step`, which with
        `evaluate` evaluate with them at once (`evaluate` then uses their sums: pushed
        later, the weights would be those of a later step)."""
        if self.engine_ranks is None:
            sync_weights(self.actor, self.engine)
            return
        self.pushed_eval = self.engine_ranks.push(
            self.actor, self.step, self.step if evaluate else None
        )

    def staleness(self, step: int, version: int) -> float:
        """How many updates older than the policy PPO step `step` trains (version `step`)
        the one that generated its rollout is; never more than async.max_staleness."""
        lag, bound = step - version, self.config.async_.max_staleness
        if not 0 <= lag <= bound:  # the engines' admission rule makes this a bug, never data
            raise RuntimeError(
                f"step {step + 1} got a rollout of policy version {version}: staleness {lag} "
                f"outside [0, async.max_staleness={bound}]"
            )
        return float(lag)

    def eval_due(self, step: int) -> bool:
        """Whether the run evaluates after PPO step `step`."""
        t = self.config.trainer
        return bool(self.evaluator) and (
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
        moving = moving and self.engine is not None
        awake = tuple(t for t in ENGINE_MEMORY if t in self.engine.awake) if moving else ()
        if awake:
            self.engine.sleep(level=1)
        try:
            yield
        finally:
            if moving:
                self.offload_for_rollout()
            if awake:
                self.wake_engine(awake, why="save_")

    def minibatch_plan(self) -> tuple[int, int]:
        a = self.config.actor
        per_rank = a.ppo_mini_batch_size // self.dp_size
        return per_rank, per_rank // a.micro_batch_size

    def update_generator(self, stage: str, step: int) -> torch.Generator:
        return torch.Generator().manual_seed(
            request_seed(self.config.trainer.seed, STAGES[stage], step, 7)
        )

    def balanced(self, batch: TrainingBatch) -> tuple[TrainingBatch, dict[str, float]]:
        c = self.config
        on = c.trainer.balance_batch
        if on is None:
            on = c.actor.use_dynamic_bsz
        return balance_over_data_parallel(batch) if on else (batch, {})

    def update(self, batch, step: int) -> dict[str, float]:
        """PPO epochs over shuffled mini-batches: actor (and critic) updates."""
        c = self.config
        self.abort_point("train")  # before the first mini-batch's gradients
        batch, balance_metrics = self.balanced(batch)
        per_rank, nmb = self.minibatch_plan()
        actor_split, critic_split = micro_batching(c.actor, nmb), micro_batching(c.critic, nmb)
        g = self.update_generator("train", step)
        roles = [(self.actor, c.actor.loss, actor_split)]
        if self.critic is not None:
            roles.append((self.critic, c.critic.loss, critic_split))
        epochs = c.actor.ppo_epochs
        batches = (mb for _ in range(epochs) for mb in mini_batches(batch, per_rank, g))
        count = epochs * (len(batch) // per_rank)
        records, rewind_metrics = optimizer_steps(self, roles, batches, count)
        actor_records, critic_records = records[0], records[1] if self.critic is not None else []
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

    def train_step(self) -> dict[str, float]:
        """One PPO/GRPO/... step: rollout; the engine sleeps (KV cache freed, weights dropped)
        while Megatron computes the experience and trains; it wakes its weights for the sync,
        then its KV cache for the next rollout. What the config offloads (`offload`) leaves
        after each role's last use and is back for the next experience; PyTorch's cached
        blocks go before each wake-up (`wake_engine`)."""
        c, step = self.config, self.step
        t0 = time.perf_counter()
        with self.phase("rollout"):
            groups, metrics = self.generate_and_score("train", step)
        if not groups:  # dynamic filtering found nothing informative within its cap
            self.step += 1
            if self.engine_ranks is not None:  # the same weights, but the next version:
                self.send_weights(evaluate=self.eval_due(self.step))  # the engines count
            metrics["actor/skipped_update"] = 1.0
            metrics.update(self.memory.end_step(self.step, "train"))
            return reduce_over_ranks(metrics)
        t1 = time.perf_counter()
        self.sleep_engine(level=2)  # its weights come back with the sync below
        with self.phase("experience"):
            batch, exp_metrics = make_experience(
                groups,
                self.actor,
                self.critic,
                self.reference,
                c,
                self.pad_token_id,
                before_forward=lambda role: self.abort_point(f"experience/{role}"),
            )
        self.offload("reference")  # unused until the next experience
        t2 = time.perf_counter()
        metrics.update(exp_metrics)
        with self.phase("train"):
            metrics.update(self.update(batch, step))
        t3 = time.perf_counter()
        self.wake_engine(("weights",))
        self.step += 1  # the weights sent are policy version `step`
        with self.phase("sync"):
            self.send_weights(evaluate=self.eval_due(self.step))
        self.offload("actor")  # its parameters: unused until the next experience
        self.wake_engine(("kv_cache",))
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
        metrics["memory/params_offloaded_gib"] = self.offloaded_param_gib()
        metrics.update(self.memory.end_step(self.step, "train"))
        return reduce_over_ranks(metrics)

    @in_phase("eval")
    def evaluate(self) -> dict[str, float]:
        """Every eval set at this step (`Evaluator`), one row per set in eval.jsonl."""
        if self.engine_ranks is not None:  # sampled and scored there, summed here
            sums, self.pushed_eval = self.pushed_eval, None  # made right after a push
            metrics, rows = self.evaluator.summarize(
                sums if sums is not None else self.engine_ranks.evaluate(self.step)
            )
        else:
            metrics, rows = self.evaluator.evaluate(self.step)
        self.logger.log_eval(self.step, rows)
        return metrics

    # ------------------------------------------------------------------ checkpoints

    @in_phase("save")
    def save(self) -> None:
        c = self.config
        sources = {"actor": c.model.path, "critic": c.model.critic_path or c.model.path}

        def write_roles(out):
            save_roles(out, self.trained_roles, sources, self.checkpoints.layout)

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

    @in_phase("save_hf")
    def save_hf(self) -> Path:
        """The actor as a Hugging Face model in output_dir/hf/step_N (`trainer.save_hf_interval`)."""
        out = Path(self.config.trainer.output_dir) / HF_EXPORTS / f"step_{self.step:06d}"
        meta_dir = ModelSource(self.config.model.path).hf_dir
        with self.roles_resident():
            save_hf_export(
                out,
                lambda tmp: save_hf_pretrained(
                    self.actor.chunks, self.actor.arch, "actor", meta_dir, tmp
                ),
            )
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
                    load_roles(path, self.trained_roles)
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

    @property
    def trained_roles(self) -> dict:
        return {"actor": self.actor, "critic": self.critic}

    def resume(self, path, rng: dict | None, trainer_state: dict) -> None:
        """Continue from `path`, whose roles `load_roles` has loaded."""
        if rng is not None:
            set_rng_state(rng)
        self.prompts.load_state_dict(trainer_state["data"])
        self.step = trainer_state["step"]
        self.value_pretrain_step = trainer_state["value_pretrain_step"]
        self.nonfinite_in_a_row = trainer_state["nonfinite_in_a_row"]
        self.saved_progress = self.value_pretrain_step + self.step
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
        """`failed`: an exception is on its way out; the engine ranks are then not told to
        shut down (mid-exchange, the protocol's state is unknown and a wait could hang): the
        launcher ends them when this rank exits with the error."""
        self.logger.close()
        self.pool.close()
        if self.env_pool is not None:
            self.env_pool.close()
        if self.engine_ranks is not None:
            if not failed:
                self.engine_ranks.shutdown()
        else:
            self.engine.shutdown()  # its process groups first, then ours
        self.shm.clean_up()
        distributed.destroy()
