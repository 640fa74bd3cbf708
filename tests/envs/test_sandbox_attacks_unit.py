"""Hostile code against the sandbox's kernel layers, each attack checked from OUTSIDE (the
canary file's mode, times and attributes, a listening socket, this process's limits,
priority, CPUs and keyring), with the audit hook first switched off the way an attacker
would (the hook is messages, not a boundary: its module globals are reachable through `gc`),
then the calls made through ctypes, which no audit event sees. In `strict`, on this
machine's kernel (user namespace, Landlock, seccomp: `test_sandbox_unit.py` checks they
apply), every one is contained. Bounded (one call each, 5 s) and loopback only."""

from __future__ import annotations

import ctypes
import os
import platform
import resource
import socket
import textwrap

import pytest

from megatron_rl.envs.sandbox import SandboxConfig, run_code

CONFIG = SandboxConfig(timeout_s=5.0)

HOOK_OFF = textwrap.dedent(
    """\
    import gc
    for f in gc.get_objects():
        code = getattr(f, "__code__", None)
        if code is not None and f.__name__ == "hook" and code.co_filename.endswith("sandbox_child.py"):
            f.__globals__["is_ctypes"] = lambda *a: False
    import ctypes
    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall.restype = ctypes.c_long
    def report(name, rc):
        print(name, rc, ctypes.get_errno())
    """
)
"""Prefix of every attack: the audit hook's ctypes check disabled, libc at hand."""

SYSCALLS = {"x86_64": {"keyctl": 250, "add_key": 248}, "aarch64": {"keyctl": 219, "add_key": 217}}
KEY_SPEC_SESSION_KEYRING, KEY_SPEC_USER_KEYRING = -3, -4
KEYCTL_REVOKE, KEYCTL_SEARCH, KEYCTL_READ = 3, 10, 11


def attack(body: str) -> str:
    result = run_code(HOOK_OFF + textwrap.dedent(body), CONFIG)
    assert result.status in ("ok", "error"), result.observation()
    return result.stdout


def test_the_hook_is_really_off_in_these_attacks(tmp_path):
    """The prefix works: ctypes, refused by the hook, is usable after it (so what holds
    below holds in the kernel)."""
    out = attack("report('getpid', libc.getpid())")
    assert out.startswith("getpid ")


@pytest.fixture
def canary(tmp_path):
    path = tmp_path / "canary"
    path.write_text("host file")
    os.chmod(path, 0o600)
    os.utime(path, (1_000_000, 1_000_000))
    return path


def test_no_metadata_change_on_a_host_file(canary):
    p = str(canary).encode()
    attack(f"""
        report("chmod", libc.chmod({p!r}, 0o4777))
        report("utimes", libc.utimes({p!r}, None))
        report("setxattr", libc.setxattr({p!r}, b"user.planted", b"1", 1, 0))
        report("chown", libc.chown({p!r}, 65534, 65534))
    """)
    st = os.stat(canary)
    assert (st.st_mode & 0o7777, st.st_mtime, st.st_uid) == (0o600, 1_000_000, os.getuid())
    assert os.listxattr(canary) == []


def test_no_unix_socket_reaches_a_host_listener(tmp_path):
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    path = str(tmp_path / "host.sock")
    listener.bind(path)
    listener.listen(1)
    listener.setblocking(False)
    out = attack(f"""
        import struct
        fd = libc.socket(1, 1, 0)  # AF_UNIX, SOCK_STREAM
        report("socket", fd)
        addr = struct.pack("H108s", 1, {path.encode()!r})
        report("connect", libc.connect(fd, addr, len(addr)))
        report("sendto", libc.sendto(fd, b"x", 1, 0, addr, len(addr)))
    """)
    with pytest.raises(BlockingIOError):
        listener.accept()
    listener.close()
    assert out.startswith("socket -1 1")  # EPERM: no socket at all


def test_no_limit_priority_or_cpus_of_the_trainer_change():
    """The sandbox's parent is this process (its caller): the same uid, so only seccomp
    stands between the code and these calls."""
    limits = resource.getrlimit(resource.RLIMIT_NOFILE)
    nice = os.getpriority(os.PRIO_PROCESS, 0)
    cpus = os.sched_getaffinity(0)
    try:
        attack(f"""
            import os
            parent = os.getppid()
            class Rlimit(ctypes.Structure):
                _fields_ = [("cur", ctypes.c_ulong), ("max", ctypes.c_ulong)]
            new = Rlimit({limits[0] - 1}, {limits[1]})
            report("prlimit64", libc.prlimit64(parent, 7, ctypes.byref(new), None))
            report("setpriority", libc.setpriority(0, parent, {min(nice + 1, 19)}))
            report("setpriority_user", libc.setpriority(2, 0, {min(nice + 1, 19)}))
            mask = ctypes.c_ulong(1)
            report("affinity", libc.sched_setaffinity(parent, ctypes.sizeof(mask), ctypes.byref(mask)))
        """)
        assert resource.getrlimit(resource.RLIMIT_NOFILE) == limits
        assert os.getpriority(os.PRIO_PROCESS, 0) == nice
        assert os.sched_getaffinity(0) == cpus
    finally:  # an escape must not break the tests after this one
        resource.setrlimit(resource.RLIMIT_NOFILE, limits)
        os.sched_setaffinity(0, cpus)


@pytest.mark.skipif(platform.machine() not in SYSCALLS, reason="keyctl's number on this CPU")
def test_the_callers_keyrings_are_out_of_reach():
    """A secret key in this process's session keyring is not read back, and no key is
    planted in its session or user keyring to outlive the call."""
    numbers = SYSCALLS[platform.machine()]
    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall.restype = ctypes.c_long
    tag = f"sandbox-{os.getpid()}".encode()
    secret = libc.syscall(
        numbers["add_key"], b"user", tag + b"-secret", b"hunter2", 7, KEY_SPEC_SESSION_KEYRING
    )
    assert secret > 0, f"add_key: errno {ctypes.get_errno()}"
    try:
        out = attack(f"""
            buf = ctypes.create_string_buffer(64)
            report("read", libc.syscall({numbers["keyctl"]}, {KEYCTL_READ}, {secret}, buf, 64))
            print(buf.value)
            for keyring in ({KEY_SPEC_SESSION_KEYRING}, {KEY_SPEC_USER_KEYRING}):
                report("add_key", libc.syscall({numbers["add_key"]}, b"user", {tag + b"-planted"!r},
                                               b"x", 1, keyring))
        """)
        assert "hunter2" not in out
        for keyring in (KEY_SPEC_SESSION_KEYRING, KEY_SPEC_USER_KEYRING):
            found = libc.syscall(
                numbers["keyctl"], KEYCTL_SEARCH, keyring, b"user", tag + b"-planted", 0
            )
            assert found == -1  # ENOKEY
    finally:
        libc.syscall(numbers["keyctl"], KEYCTL_REVOKE, secret)
