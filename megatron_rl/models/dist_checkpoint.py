"""A role's model (and optimizer state) as a megatron-core distributed checkpoint: the one
on-disk format of converted checkpoints (`checkpoints_convert.hf_to_megatron`) and of the
trainer's, loadable at any TP/PP/DP layout (megatron's sharded tensors reshard on load) and
exportable with `checkpoints_convert.megatron_to_hf`.

    <dir>/megatron_rl.json   role, architecture, the layout it was saved at
    <dir>/model/             torch_dist files: the model's sharded tensors, and the
                             optimizer's (Adam moments, step) keyed by the same parameters;
                             none for an optimizer that has not stepped (a policy frozen
                             through value pretraining), which loads back as unstepped
    <dir>/hf_meta/           the Hugging Face source's config, generation config, tokenizer

Every rank calls `save_role` / `load_role` (they are collectives).
"""

from __future__ import annotations

import contextlib
import json
import queue
import re
import shutil
from pathlib import Path

import torch

from megatron_rl.models.architecture import ModelArchitecture
from megatron_rl.models.lora import is_adapted

METADATA = "megatron_rl.json"
MODEL_SUBDIR = "model"
HF_META_SUBDIR = "hf_meta"
HF_SIDE_FILES = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
)
FORMAT = "megatron-core dist_checkpointing (torch_dist)"


def copy_side_files(src: Path, dst: Path) -> None:
    """The Hugging Face files besides the weights (config, tokenizer), as they are."""
    dst.mkdir(parents=True, exist_ok=True)
    for name in HF_SIDE_FILES:
        if (Path(src) / name).exists():
            shutil.copy2(Path(src) / name, dst / name)


def write_metadata(out_dir: Path, role: str, arch: ModelArchitecture, **extra) -> None:
    meta = {"format": FORMAT, "role": role, "arch": arch.to_dict(), **extra}
    (Path(out_dir) / METADATA).write_text(json.dumps(meta, indent=2))


def read_metadata(ckpt_dir: Path) -> tuple[dict, ModelArchitecture]:
    """(metadata, architecture); FileNotFoundError naming the file when it is absent."""
    path = Path(ckpt_dir) / METADATA
    if not path.exists():
        raise FileNotFoundError(
            f"{path} not found: {ckpt_dir} is not a megatron_rl checkpoint (written by "
            "checkpoints_convert.hf_to_megatron, or a role directory of a training checkpoint)"
        )
    meta = json.loads(path.read_text())
    return meta, ModelArchitecture(**meta["arch"])


def _modules(chunks: list) -> list:
    """The GPTModels inside megatron DDP wrappers (or the chunks themselves)."""
    return [getattr(c, "module", c) for c in chunks]


def _trained_only(module) -> dict:
    """The module's sharded state of its trained parameters alone: a LoRA model's adapters
    (and a critic's value head), not the frozen base, which the run's model.path holds."""
    trained = {id(p) for p in module.parameters() if p.requires_grad}
    return {
        key: value
        for key, value in module.sharded_state_dict().items()
        if id(getattr(value, "data", None)) in trained
    }


def _sharded_state(chunks: list, optimizer, is_loading: bool) -> dict:
    state_of = _trained_only if is_adapted(chunks) else (lambda m: m.sharded_state_dict())
    model = {f"chunk{i}": state_of(m) for i, m in enumerate(_modules(chunks))}
    state = {"model": model}
    if optimizer is not None:
        # Keyed by the parameters' global names, so Adam's moments reshard like the weights.
        state["optimizer"] = optimizer.sharded_state_dict(
            model, is_loading=is_loading, metadata=OPTIMIZER_METADATA
        )
    return state


OPTIMIZER_METADATA = {"distrib_optim_sharding_type": "fully_reshardable"}
"""The distributed optimizer's checkpoint format: its moments per parameter, like the
non-distributed optimizer's, so a checkpoint reshards in TP, PP and DP alike (Megatron-LM's
`--dist-ckpt-optim-fully-reshardable`). megatron-core 0.16's default,
'fully_sharded_model_space', fails at save ("ShardedTensor.flattened_range is not
supported", tests/test_gpu.py on an H200, bench/gpu.md); 'dp_reshardable' saves without
gathering on DP rank 0 but reshards in DP only."""


def _use_in_process_writer_queue() -> None:
    """megatron's torch_dist writer passes its write results through a queue that, by
    default, lives in a spawn-method Manager process it starts at the first save. Our saves
    are synchronous (megatron's `execute_sync`: the results are put and taken in this
    process), so a plain in-process queue serves. Why not the Manager: a first save 2.4-4.4 s
    longer (the Manager imports the main module and, to unpickle the first results, torch:
    2-core CPU), and a helper process that SLURM's `scancel` would signal with the rest of
    the job, breaking the very save the signal asks for (as tests/trainer/
    test_train_distributed.py's SIGTERM test once found). An asynchronous save would put its
    results in a forked copy of this queue and fail on the empty one ("results_queue should
    not be empty"), never silently."""

    # why: megatron-core takes seconds to import: loaded on first use
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    if filesystem_async._results_queue is None:
        filesystem_async._results_queue = queue.Queue()


def inner_optimizers(optimizer) -> list:
    """The torch optimizers inside megatron's (one, or one per chained optimizer); a torch
    optimizer is its own."""
    subs = getattr(optimizer, "chained_optimizers", [optimizer])
    return [getattr(o, "optimizer", o) for o in subs]


def has_stepped(optimizer) -> bool:
    """Whether the optimizer holds state, which torch's Adam creates at its first step."""
    return any(len(inner.state) > 0 for inner in inner_optimizers(optimizer))


def reset_to_unstepped(optimizer) -> None:
    """No Adam state, and master weights (bf16 training) copied from the model's: the
    optimizer as built, around the model's current weights."""
    for inner in inner_optimizers(optimizer):
        inner.state.clear()
    optimizer.reload_model_params()


def _torch_adam_distributed(optimizer) -> list:
    """The distributed optimizers in `optimizer` that step with torch's Adam (neither Apex
    nor Transformer Engine installed), whose `step` megatron-core 0.16 mishandles."""
    # why: megatron-core takes seconds to import: loaded on first use
    from megatron.core.optimizer import distrib_optimizer

    if distrib_optimizer.HAVE_APEX_OR_TE:
        return []
    subs = getattr(optimizer, "chained_optimizers", [optimizer])
    return [s for s in subs if isinstance(s, distrib_optimizer.DistributedOptimizer)]


def _seed_unstepped_state(optimizer) -> None:
    """Zero Adam moments and step 0 in each unstepped torch-Adam distributed optimizer, as
    torch's Adam makes them at its first step; the load then overwrites them. Why:
    megatron-core 0.16's `DistributedOptimizer.state_dict()` (called by its
    `sharded_state_dict` when loading too) reads `step` from every parameter's state and
    asserts there is one (distrib_optimizer.py l.642; tests/test_gpu.py on an H200)."""
    for sub in _torch_adam_distributed(optimizer):
        inner = sub.optimizer
        if len(inner.state) > 0:
            continue
        sub.init_state_fn(inner, sub.config)
        for group in inner.param_groups:
            # torch's Adam keeps `step` on the parameter's device only when capturable or fused
            on_param = group.get("capturable") or group.get("fused")
            for p in group["params"]:
                device = p.device if on_param else torch.device("cpu")
                inner.state[p]["step"] = torch.zeros((), dtype=torch.float32, device=device)


@contextlib.contextmanager
def _step_kept_apart(optimizer):
    """While megatron-core 0.16 loads a torch-Adam distributed optimizer's 'fully_reshardable'
    state, hide each parameter's `step` from its copy. Why: the checkpoint holds no per-
    parameter `step` (it travels in the param groups, which `load_state_dict` has just put
    back into the state), yet `_set_main_param_and_optimizer_states` copies every key of the
    state from the checkpoint's tensors: a KeyError 'step' (distrib_optimizer.py l.940, seen
    on an H200). With Transformer Engine's FusedAdam the state has no `step` at all."""
    patched = _torch_adam_distributed(optimizer)
    for sub in patched:
        original = sub._set_main_param_and_optimizer_states

        def set_states(model_param, tensors, sub=sub, original=original):
            group, order = sub.model_param_group_index_map[model_param]
            state = sub.optimizer.state[sub.optimizer.param_groups[group]["params"][order]]
            step = state.pop("step", None)
            try:
                original(model_param, tensors)
            finally:
                if step is not None:
                    state["step"] = step

        sub._set_main_param_and_optimizer_states = set_states
    try:
        yield
    finally:
        for sub in patched:
            del sub._set_main_param_and_optimizer_states  # the class's method again


def _unshare_steps(optimizer) -> None:
    """One `step` tensor per parameter again. Why: megatron-core 0.16's torch-Adam
    `DistributedOptimizer.load_state_dict` puts one tensor in every parameter's state
    (distrib_optimizer.py l.821-825) and torch keeps it as given; torch's foreach Adam then
    adds 1 to it once per parameter, so the bias corrections of every later step are wrong
    (the resumed step differed from the uninterrupted one, tests/test_gpu.py on an H200)."""
    for sub in _torch_adam_distributed(optimizer):
        for state in sub.optimizer.state.values():
            if "step" in state:
                state["step"] = state["step"].clone()


OPTIMIZER_KEY = re.compile(r"^(chained_\d+\.)?optimizer\.")
"""A checkpoint key of optimizer state, not of the model."""


def _holds_optimizer_state(model_dir: Path) -> bool:
    """Whether a checkpoint holds optimizer tensors (keyed `optimizer.…`, or `chained_<i>.
    optimizer.…` for a MoE model's chained dense and expert optimizers, beside `chunk<i>.…`)."""
    # why: megatron-core takes seconds to import: loaded on first use
    from megatron.core import dist_checkpointing

    keys = dist_checkpointing.load_tensors_metadata(str(model_dir))
    return any(OPTIMIZER_KEY.match(key) for key in keys)


def save_role(chunks: list, optimizer, ckpt_dir: Path) -> None:
    """Write this rank's shards of the model (and optimizer) under `ckpt_dir/model`. An
    optimizer that has not stepped has no state to write: the model alone is saved (megatron
    would write its param groups, and its load would then look for Adam moments that were
    never created)."""
    # why: megatron-core takes seconds to import: loaded on first use
    from megatron.core import dist_checkpointing

    _use_in_process_writer_queue()
    model_dir = Path(ckpt_dir) / MODEL_SUBDIR
    if torch.distributed.get_rank() == 0:
        model_dir.mkdir(parents=True)
    torch.distributed.barrier()
    # Every rank steps together, so every rank makes the same choice (save is a collective).
    if optimizer is not None and not has_stepped(optimizer):
        optimizer = None
    dist_checkpointing.save(_sharded_state(chunks, optimizer, False), str(model_dir))


def load_role(chunks: list, optimizer, ckpt_dir: Path, skip: tuple[str, ...] = ()) -> None:
    """Load the model (and, given an optimizer, its state) at this run's layout. Parameters
    named in `skip` keep their values (a critic started from a policy: its value head). A
    checkpoint without optimizer state (saved before the optimizer's first step) leaves the
    optimizer unstepped, as it was saved. On failure the optimizer is as it was before: the
    Adam moments megatron creates to load into do not linger without the step count torch's
    Adam needs with them (its next step would fail with KeyError 'step')."""
    if skip and optimizer is not None:
        raise ValueError("load_role: skip is for model-only loads (no optimizer state)")
    model_dir = Path(ckpt_dir) / MODEL_SUBDIR
    unstepped = optimizer is not None and not has_stepped(optimizer)
    try:
        _load(chunks, optimizer, model_dir, skip)
    except BaseException:
        if unstepped:  # megatron created Adam moments to load into: drop them
            reset_to_unstepped(optimizer)
        raise


def _load_trained(module, state: dict, model_dir: Path) -> None:
    result = module.load_state_dict(state, strict=False)
    trained = {n for n, p in module.named_parameters() if p.requires_grad}
    missing = trained & set(result.missing_keys)
    if missing or result.unexpected_keys:
        raise ValueError(
            f"{model_dir.parent}: the adapters checkpoint leaves {sorted(missing)} unset and "
            f"{result.unexpected_keys} unused"
        )


def _load(chunks: list, optimizer, model_dir: Path, skip: tuple[str, ...]) -> None:
    # why: megatron-core takes seconds to import: loaded on first use
    from megatron.core import dist_checkpointing

    has_state = optimizer is not None and _holds_optimizer_state(model_dir)
    saved_optimizer = optimizer if has_state else None
    if saved_optimizer is not None:
        _seed_unstepped_state(saved_optimizer)
    sharded = _sharded_state(chunks, saved_optimizer, True)
    for chunk_state in sharded["model"].values():
        for name in skip:
            chunk_state.pop(name, None)
    state = dist_checkpointing.load(sharded, str(model_dir))
    adapters_only = is_adapted(chunks)
    for i, module in enumerate(_modules(chunks)):
        if adapters_only:  # the frozen base is the run's model.path, loaded already
            _load_trained(module, state["model"][f"chunk{i}"], model_dir)
            continue
        result = module.load_state_dict(state["model"][f"chunk{i}"], strict=not skip)
        if skip and (result.unexpected_keys or set(result.missing_keys) - set(skip)):
            raise ValueError(
                f"{model_dir.parent}: loading chunk {i} left {result.missing_keys} unset and "
                f"{result.unexpected_keys} unused (only {list(skip)} may be skipped)"
            )
    if saved_optimizer is not None:
        with _step_kept_apart(saved_optimizer):
            saved_optimizer.load_state_dict(state["optimizer"])
        _unshare_steps(saved_optimizer)
    elif optimizer is not None:  # saved before its first step: it stays unstepped
        reset_to_unstepped(optimizer)
