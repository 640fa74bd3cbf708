"""`procutil.exit_now`: a finished process ends with its code, its atexit handlers run and
its output flushed, without the interpreter's finalisation."""

import subprocess
import sys
import textwrap


def test_exit_now_runs_atexit_flushes_and_skips_finalisation(tmp_path):
    marker = tmp_path / "atexit.txt"
    script = textwrap.dedent(
        f"""
        import atexit, sys
        from megatron_rl.procutil import exit_now

        class Finalised:
            def __del__(self):  # runs at the interpreter's finalisation, not after exit_now
                print("finalised", flush=True)

        kept = Finalised()
        atexit.register(lambda: open({str(marker)!r}, "w").write("ran"))
        sys.stdout.write("buffered, no newline")  # a pipe: block-buffered until flushed
        sys.stderr.write("err too")
        exit_now(3)
        print("never")
        """
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert done.returncode == 3, done.stderr
    assert done.stdout == "buffered, no newline"
    assert done.stderr == "err too"
    assert marker.read_text() == "ran"


def test_without_exit_now_the_same_script_is_finalised():
    """The control: the finaliser above does run when the process exits the usual way."""
    script = textwrap.dedent(
        """
        class Finalised:
            def __del__(self):
                print("finalised", flush=True)

        kept = Finalised()
        """
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert done.returncode == 0 and done.stdout == "finalised\n", done
