"""What a step's rollout has generated, kept with the step's checkpoint when a stop request
ends the step, so that the resumed run generates no token twice.

A rollout is a sequence of engine calls (chunks, `rollout/rating.py`), each drawing its
prompts from the stream and sampling `n` responses of each. `RolloutProgress` holds every
chunk generated so far: its prompt rows and its responses, prompt-major; a chunk a stop cut
holds the responses as far as they got (`Sample.finish_reason == UNFINISHED`: tokens,
log-probs, policy-version segments so far, the request's random state; routed experts come
with the continuation, whose re-prefill routes the kept tokens again). After the resume the
step starts again from its saved start (same data position, same request seeds), and
`generate_samples_with_rating`, given the progress, takes each saved chunk in place of its
engine call: a finished chunk is used as it is, a cut one goes to the engine as `partial`,
which continues only the unfinished responses. Scoring is not generation: the saved
responses are scored again.

What equals an uninterrupted run: every response finished before the stop, token for token
(same prompts, same seeds), and every response the stop cut: its continuation gets back its
request's random state (`rollout/sampler_state.py`), so it draws what the uncut request
would have (up to kernel rounding between a prefill and a decode step; where vLLM's runner
cannot be hooked it draws from its own `continuation_seed` instead). A multi-turn
trajectory in flight is kept as it stood (`Sample.agent_state`: its environment's state,
whether the environment was answering) and goes on from there (`agent.run_in_flight`); on
the turn-by-turn loop (an engine that cannot be cut) its chunk is generated again.

Files: `<checkpoint>/rollout_progress/replica_00000.pt`, one per rollout replica (the
model replicas colocated, the engine replicas disaggregated), each written whole (temp file,
then rename). A resumed run with another number of replicas draws other shares and finds
files that do not match: it says so and generates the step anew.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch

from megatron_rl.preemption import StepAborted
from megatron_rl.rollout.types import UNFINISHED, Sample, SamplingConfig

PROGRESS_DIR = "rollout_progress"
FORMAT = 1


@dataclass
class GeneratedChunk:
    """One engine call of a rollout."""

    rows: list[int]
    """The prompt rows it drew (`PromptRecord.row`), in order."""
    samples: list[Sample]
    """Its `n` responses per prompt, prompt-major; those a stop cut are `UNFINISHED`."""

    @property
    def finished(self) -> bool:
        return all(s.finish_reason != UNFINISHED for s in self.samples)

    @property
    def tokens(self) -> int:
        return sum(len(s.token_ids) for s in self.samples)


@dataclass
class RolloutProgress:
    """Every chunk a rollout (`stage` step `step`, one replica's share) has generated."""

    stage: str
    step: int
    replicas: int
    """How many replicas shared the step's prompts (each saved its own share)."""
    sampling: SamplingConfig
    chunks: list[GeneratedChunk]
    version: int = 0
    """The policy version its first tokens came from (engines apart count versions: a
    resumed round reports it, so its staleness is the one it had)."""

    @property
    def tokens(self) -> int:
        """Response tokens generated (environment blocks of multi-turn samples included)."""
        return sum(c.tokens for c in self.chunks)

    @property
    def unfinished(self) -> int:
        return sum(s.finish_reason == UNFINISHED for c in self.chunks for s in c.samples)

    def saved_chunk(self, index: int, rows: list[int], sampling: SamplingConfig):
        """The saved chunk `index` for an engine call drawing `rows` with `sampling`, or
        None past the saved chunks; ValueError when the resumed run draws other prompts or
        samples otherwise (its config changed: the saved responses are not its own)."""
        if index >= len(self.chunks):
            return None
        saved = self.chunks[index]
        if saved.rows != rows or sampling != self.sampling:
            raise ValueError(
                f"the rollout progress saved for {self.stage} step {self.step + 1} does not "
                f"match this run: chunk {index} drew prompt rows {saved.rows[:8]} with "
                f"{self.sampling}, this run draws {rows[:8]} with {sampling} (the data or "
                f"rollout config changed): remove {PROGRESS_DIR}/ from the checkpoint to "
                "generate the step anew"
            )
        return saved


class RolloutStopped(StepAborted):
    """A stop request ended a rollout: `progress` is what it generated (complete chunks,
    and the chunk a stop cut where the engine could tell its responses)."""

    def __init__(self, phase: str, progress: RolloutProgress):
        super().__init__(phase)
        self.progress = progress


def save_progress(checkpoint: str | Path, progress: dict[int, RolloutProgress]) -> None:
    """Write each replica's progress into `checkpoint` (whole files: temp, then rename)."""
    out = Path(checkpoint) / PROGRESS_DIR
    for replica, p in progress.items():
        out.mkdir(exist_ok=True)
        final = out / f"replica_{replica:05d}.pt"
        tmp = final.with_name(f".{final.name}.tmp")
        record = {
            "format": FORMAT,
            "stage": p.stage,
            "step": p.step,
            "replicas": p.replicas,
            "version": p.version,
            "sampling": asdict(p.sampling),
            "chunks": [
                {"rows": c.rows, "samples": [asdict(s) for s in c.samples]} for c in p.chunks
            ],
        }
        torch.save(record, tmp)
        os.replace(tmp, final)


def load_progress(
    checkpoint: str | Path, replicas: list[int] | None = None
) -> dict[int, RolloutProgress]:
    """The progress of `replicas` (None: every replica) saved in `checkpoint`, by replica
    (none where none was saved)."""
    found = {}
    for path in sorted((Path(checkpoint) / PROGRESS_DIR).glob("replica_*.pt")):
        replica = int(path.stem.removeprefix("replica_"))
        if replicas is not None and replica not in replicas:
            continue
        record = torch.load(path, weights_only=False)
        if record.get("format") != FORMAT:
            raise ValueError(f"{path}: rollout progress format {record.get('format')}, "
                             f"this version reads {FORMAT}")  # fmt: skip
        sampling = record["sampling"]
        found[replica] = RolloutProgress(
            stage=record["stage"],
            step=record["step"],
            replicas=record["replicas"],
            sampling=SamplingConfig(
                **{**sampling, "stop_token_ids": tuple(sampling["stop_token_ids"])}
            ),
            chunks=[
                GeneratedChunk(c["rows"], [_sample(s) for s in c["samples"]])
                for c in record["chunks"]
            ],
            version=record["version"],
        )
    return found


def _sample(fields: dict) -> Sample:
    fields = dict(fields)
    fields["segments"] = [tuple(x) for x in fields["segments"]]
    fields["env_spans"] = [tuple(x) for x in fields["env_spans"]]
    fields["step_rewards"] = [tuple(x) for x in fields["step_rewards"]]
    routes = fields["routed_experts"]
    fields["routed_experts"] = None if routes is None else np.asarray(routes)
    return Sample(**fields)


def progress_for(
    saved: dict[int, RolloutProgress], stage: str, step: int, replica: int, replicas: int
) -> RolloutProgress | None:
    """Replica `replica`'s saved progress of `stage` step `step`, or None (none saved, or
    saved by a run of another number of replicas: said, and the step is generated anew)."""
    progress = saved.get(replica)
    if progress is None or (progress.stage, progress.step) != (stage, step):
        return None
    if progress.replicas != replicas:
        print(
            f"rollout progress of {stage} step {step + 1} was saved by {progress.replicas} "
            f"rollout replicas, this run has {replicas}: its {progress.tokens} tokens are "
            "generated anew",
            flush=True,
        )
        return None
    return progress
