"""Prompt datasets: JSONL / JSON, Parquet or a directory saved with `Dataset.save_to_disk`,
loaded through Hugging Face `datasets`, templated by the actor's tokenizer and tokenised once.

Field names follow verl / OpenRLHF: `prompt_key` holds either a string (one user turn) or a
list of chat messages `{"role", "content"}`; `label_key` holds the reference answer that rule
rewards compare against. Prompts longer than `max_prompt_length` tokens are dropped and
counted (`filter_overlong_prompts`) or refused with the row named.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from megatron_rl.data.templates import Messages, render_prompt


@dataclass(frozen=True)
class PromptDataConfig:
    path: str
    """A .jsonl/.json file, a .parquet file, or a directory written by `save_to_disk`."""
    prompt_key: str = "prompt"
    label_key: str | None = "answer"
    """Column of reference answers; None when the rewards need no label (reward models)."""
    apply_chat_template: bool = True
    max_prompt_length: int = 1024
    """In tokens, after the chat template."""
    filter_overlong_prompts: bool = True
    """Drop (and count) longer prompts; False refuses them with the row named."""
    split: str = "train"
    """For a saved `DatasetDict`."""

    def __post_init__(self) -> None:
        if self.max_prompt_length < 1:
            raise ValueError(f"max_prompt_length must be >= 1, got {self.max_prompt_length}")


@dataclass
class PromptRecord:
    """One prompt, ready for the engine."""

    row: int
    """Row of the source dataset (0-based), for errors and logs."""
    prompt: str | Messages
    """As in the dataset: reward models re-template it with their own tokenizer."""
    prompt_text: str
    """Rendered with the actor's chat template (generation prompt included)."""
    prompt_token_ids: list[int]
    label: Any = None


@dataclass
class PromptDataset:
    records: list[PromptRecord]
    source: str
    num_dropped_overlong: int = 0
    metrics: dict[str, float] = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.records)

    def __getitem__(self, i: int) -> PromptRecord:
        return self.records[i]


def _json_rows(path: Path) -> list[Any] | None:
    """The rows of a .jsonl file (or a .json list), parsed the way a reference answer must be
    read: numbers stay the text they were written as ("007", "1e3", "0.10"); `datasets` would
    cast them (a column mixing 7 and "007" becomes [7, 7]). None for other formats. Raises
    ValueError naming the line of a row that is not UTF-8, not JSON or not an object."""
    numbers_as_text = {"parse_int": str, "parse_float": str}
    if path.suffix == ".json":
        try:
            rows = json.loads(path.read_bytes().decode("utf-8"), **numbers_as_text)
        except (UnicodeDecodeError, json.JSONDecodeError):
            return None  # `datasets` names the problem
        return rows if isinstance(rows, list) and all(isinstance(r, dict) for r in rows) else None
    if path.suffix != ".jsonl":
        return None
    rows = []
    with path.open("rb") as f:
        for lineno, raw in enumerate(f, 1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise ValueError(
                    f"{path}:{lineno}: not valid UTF-8 (byte {raw[e.start]:#04x} at column "
                    f"{e.start + 1})"
                ) from None
            if not line.strip():
                continue
            try:
                obj = json.loads(line, **numbers_as_text)
            except json.JSONDecodeError as e:
                raise ValueError(
                    f"{path}:{lineno}: not valid JSON ({e.msg} at column {e.colno})"
                ) from None
            if not isinstance(obj, dict):
                raise ValueError(
                    f"{path}:{lineno}: expected a JSON object per line, got {type(obj).__name__}"
                )
            rows.append(obj)
    return rows


def _has_rows(path: Path) -> bool:
    # `datasets` reports an empty file as a missing split; say what it is instead.
    if path.suffix == ".parquet":
        # why: only parquet prompt files need it
        import pyarrow.parquet as pq

        return pq.ParquetFile(path).metadata.num_rows > 0
    with path.open(encoding="utf-8", errors="replace") as f:
        return any(line.strip() not in ("", "[]") for line in f)


def load_table(config: PromptDataConfig):
    """The raw `datasets.Dataset` behind a config, with errors that name the file."""
    # why: `datasets` takes seconds to import: only loading a prompt table needs it
    import datasets

    path = Path(config.path)
    if not path.exists():
        raise FileNotFoundError(f"prompt data {path}: no such file or directory")
    datasets.disable_progress_bars()
    if path.is_dir():
        try:
            ds = datasets.load_from_disk(str(path))
        except Exception as e:
            raise ValueError(
                f"prompt data {path}: not a directory written by Dataset.save_to_disk ({e})"
            ) from e
        if isinstance(ds, datasets.DatasetDict):
            if config.split not in ds:
                raise ValueError(
                    f"prompt data {path}: no split {config.split!r}; it has {sorted(ds)}"
                )
            ds = ds[config.split]
        return ds
    builder = {".jsonl": "json", ".json": "json", ".parquet": "parquet"}.get(path.suffix)
    if builder is None:
        raise ValueError(
            f"prompt data {path}: unknown format {path.suffix!r}; expected .jsonl, .json, "
            ".parquet or a save_to_disk directory"
        )
    if path.stat().st_size == 0:
        raise ValueError(f"prompt data {path}: the file is empty")
    try:
        has_rows = _has_rows(path)
    except Exception as e:
        raise ValueError(f"prompt data {path}: cannot read it as {builder}: {e}") from e
    if not has_rows:
        raise ValueError(f"prompt data {path}: the dataset has no rows")
    try:
        return datasets.load_dataset(builder, data_files=str(path), split="train")
    except Exception as e:
        _json_rows(path)  # names the bad row by its line, where pyarrow's error does not
        raise ValueError(f"prompt data {path}: {e}") from e


def read_labels(config: PromptDataConfig, ds) -> list:
    """The reference answer of each row: as written in a JSON(L) file (numbers as text, so
    "007" stays "007" and 1e3 stays "1e3"; lists and objects as they are), as typed in a
    Parquet file or saved dataset; None everywhere without `label_key`."""
    if config.label_key is None:
        return [None] * len(ds)
    rows = _json_rows(Path(config.path)) if Path(config.path).is_file() else None
    if rows is None:
        return ds[config.label_key]
    if len(rows) != len(ds):  # never seen; refused rather than pairing labels with other rows
        raise ValueError(
            f"prompt data {config.path}: {len(rows)} JSON rows but `datasets` read {len(ds)}; "
            "cannot pair the labels with their prompts"
        )
    return [row.get(config.label_key) for row in rows]


def load_prompts(
    config: PromptDataConfig, tokenizer, chat_template_kwargs: dict | None = None
) -> PromptDataset:
    """Load, template, tokenise and length-filter every prompt of `config.path`;
    `chat_template_kwargs` (the tools of multi-turn rollouts) go to the chat template."""
    ds = load_table(config)
    source = config.path
    if len(ds) == 0:
        raise ValueError(f"prompt data {source}: the dataset has no rows")
    for key, what in ((config.prompt_key, "prompt_key"), (config.label_key, "label_key")):
        if key is not None and key not in ds.column_names:
            hint = (
                " (set label_key: null if the rewards need no label)" if what == "label_key" else ""
            )
            raise ValueError(
                f"prompt data {source}: no column {key!r} ({what}); columns are "
                f"{ds.column_names}{hint}"
            )
    prompts = ds[config.prompt_key]
    labels = read_labels(config, ds)
    texts = []
    for row, prompt in enumerate(prompts):
        where = f"prompt data {source} row {row}"
        if prompt is None or prompt == "" or prompt == []:
            raise ValueError(f"{where}: field {config.prompt_key!r} is missing or empty")
        texts.append(
            render_prompt(
                tokenizer, prompt, config.apply_chat_template, where, chat_template_kwargs
            )
        )
    # The template already wrote the special tokens; raw prompts get the tokenizer's own (BOS).
    ids = tokenizer(texts, add_special_tokens=not config.apply_chat_template)["input_ids"]
    records, dropped = [], 0
    for row, (prompt, text, tokens, label) in enumerate(
        zip(prompts, texts, ids, labels, strict=True)
    ):
        if len(tokens) > config.max_prompt_length:
            if not config.filter_overlong_prompts:
                raise ValueError(
                    f"prompt data {source} row {row}: {len(tokens)} tokens > max_prompt_length "
                    f"{config.max_prompt_length} (or set filter_overlong_prompts: true)"
                )
            dropped += 1
            continue
        records.append(PromptRecord(row, prompt, text, list(tokens), label))
    if not records:
        raise ValueError(
            f"prompt data {source}: all {len(prompts)} prompts are longer than "
            f"max_prompt_length {config.max_prompt_length} tokens"
        )
    metrics = {"data/num_prompts": float(len(records)), "data/dropped_overlong": float(dropped)}
    return PromptDataset(records, source, dropped, metrics)
