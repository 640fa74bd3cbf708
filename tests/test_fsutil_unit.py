"""Output directories appear whole or not at all."""

import pytest

from megatron_rl.fsutil import atomic_output_dir


def test_success_renames_and_failure_leaves_nothing(tmp_path):
    out = tmp_path / "ckpt"
    with atomic_output_dir(out) as tmp:
        (tmp / "a.txt").write_text("1")
        assert not out.exists()  # readers see nothing until the block ends
    assert (out / "a.txt").read_text() == "1" and oct(out.stat().st_mode)[-3:] == "755"

    with pytest.raises(RuntimeError), atomic_output_dir(out, overwrite=True) as tmp:
        (tmp / "b.txt").write_text("2")
        raise RuntimeError("disk full")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]  # no temp dir left
    assert sorted(p.name for p in out.iterdir()) == ["a.txt"]  # the old output untouched


def test_existing_output_needs_overwrite(tmp_path):
    out = tmp_path / "ckpt"
    out.mkdir()
    (out / "x").write_text("")
    with pytest.raises(FileExistsError, match="ckpt exists and is not empty"):
        with atomic_output_dir(out):
            pass
    with atomic_output_dir(out, overwrite=True) as tmp:
        (tmp / "y").write_text("")
    assert [p.name for p in out.iterdir()] == ["y"]
