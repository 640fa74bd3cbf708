"""Writing output directories so that a reader never sees half of one."""

from __future__ import annotations

import contextlib
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path


def check_output_dir(out: Path, overwrite: bool) -> None:
    """A non-empty `out` is a FileExistsError unless `overwrite`."""
    if out.exists() and any(out.iterdir()) and not overwrite:
        raise FileExistsError(f"{out} exists and is not empty (pass --overwrite to replace it)")


@contextlib.contextmanager
def atomic_output_dir(out: str | Path, overwrite: bool = False) -> Iterator[Path]:
    """Yield a temporary sibling of `out`; rename it to `out` only if the block succeeds.

    On any error (or interrupt) the temporary directory is removed and `out` is untouched.
    A non-empty `out` is a FileExistsError unless `overwrite`.
    """
    out = Path(out)
    check_output_dir(out, overwrite)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    tmp.chmod(0o755)  # mkdtemp makes it private; outputs are meant to be shared
    try:
        yield tmp
        if out.exists():
            shutil.rmtree(out)
        tmp.rename(out)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
