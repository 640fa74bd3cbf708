"""Hostile code against the sandbox's kernel layers, each attack checked from OUTSIDE (the
canary files' contents, modes, times, attributes and links, listening sockets, this
process's limits, priority, scheduling, I/O priority, signals and keyring, a canary
process's life and tracer, host IPC objects, the child's own uid, threads and limits in
/proc), with the audit hook first switched off the way an attacker would (the hook is
messages, not a boundary: its module globals are reachable through `gc`), then the calls
made through ctypes, which no audit event sees. In `strict`, on this machine's kernel
(user namespace, Landlock, seccomp: `test_sandbox_unit.py` checks they apply), every one is
contained. Host files the code aims at lie in a folder any uid may write (`open_dir`), so
that what stops the code is the sandbox, not the files' modes. Bounded (one call each, 5 s,
threads and IPC objects removed) and loopback only."""

from __future__ import annotations

import contextlib
import ctypes
import glob
import math
import os
import platform
import resource
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from megatron_rl.envs.sandbox import SandboxConfig, run_code
from megatron_rl.envs.sandbox_child import FSIZE_BYTES, NOFILE

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

SYSCALLS = {
    "x86_64": {"keyctl": 250, "add_key": 248, "sched_setattr": 314, "ioprio_set": 251,
               "ioprio_get": 252},
    "aarch64": {"keyctl": 219, "add_key": 217, "sched_setattr": 274, "ioprio_set": 30,
                "ioprio_get": 31},
}  # fmt: skip
NUMBERS = SYSCALLS.get(platform.machine(), {})
needs_numbers = pytest.mark.skipif(not NUMBERS, reason=f"syscall numbers for {platform.machine()}")
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


@needs_numbers
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


# ---------------------------------------------------------------------------- helpers

ROOT_TRAINER = pytest.mark.skipif(
    os.geteuid() != 0,
    reason="the trainer is not root: its sandboxes keep its own (unprivileged) uid",
)
WAIT = """
open("ready", "w").close()
import os as _os, time as _time
while not _os.path.exists("done"):
    _time.sleep(0.01)
"""
"""Suffix of a paused attack: says it is ready, then waits for the test's `done` (or its
time limit), so the test can look at the child from outside meanwhile."""


@pytest.fixture
def open_dir():
    """A folder in /tmp any uid may write, with a canary any uid may write: only the sandbox
    (Landlock) keeps the code from them, not their modes or a closed parent folder."""
    path = Path(tempfile.mkdtemp(prefix="sandbox-open-", dir="/tmp"))
    os.chmod(path, 0o777)
    canary = path / "canary"
    canary.write_text("host file")
    os.chmod(canary, 0o666)
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def canary_process():
    """A host process (`sleep`, started by this process) with a secret in its environment."""
    secret = f"sandbox-secret-{os.getpid()}"
    proc = subprocess.Popen(["sleep", "60"], env={"SANDBOX_SECRET": secret}, start_new_session=True)
    yield proc, secret
    proc.kill()
    proc.wait()


def child_in(workdir: str) -> int | None:
    """The sandbox child whose working directory is `workdir`."""
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            if os.readlink(f"/proc/{entry}/cwd") == workdir:
                return int(entry)
        except OSError:
            continue
    return None


def wait_for(condition, timeout_s: float = 10.0):
    deadline = time.monotonic() + timeout_s
    while not (value := condition()) and time.monotonic() < deadline:
        time.sleep(0.01)
    return value


@contextlib.contextmanager
def paused(body: str, parent: Path, config: SandboxConfig = CONFIG):
    """Run an attack, then `WAIT`, in a thread, in a fresh folder under `parent`; yields
    (the child's pid, its folder, the future of its result) once it is ready."""
    before = set(glob.glob(f"{parent}/sandbox-*/"))
    with ThreadPoolExecutor(1) as pool:
        future = pool.submit(run_code, HOOK_OFF + textwrap.dedent(body) + WAIT, config,
                             workdir_parent=str(parent))  # fmt: skip

        def ready():
            fresh = set(glob.glob(f"{parent}/sandbox-*/ready")) - {f"{d}ready" for d in before}
            return next(iter(fresh), None) or future.done()

        marker = wait_for(ready)
        assert isinstance(marker, str), future.result().observation()
        workdir = os.path.dirname(marker)
        pid = child_in(workdir)
        try:
            yield pid, workdir, future
        finally:
            Path(workdir, "done").touch()
            result = future.result()
            assert result.status == "ok", result.observation()


def proc_status(pid: int) -> dict[str, str]:
    lines = Path(f"/proc/{pid}/status").read_text().splitlines()
    return dict(line.split(":", 1) for line in lines if ":" in line)


# ---------------------------------------------------------------------------- the uid, threads, limits


@ROOT_TRAINER
def test_the_child_runs_as_an_unprivileged_kernel_uid(open_dir):
    """Seen from the host (/proc, outside its user namespace): uid and gid `run_as_uid`, no
    supplementary group, every capability in the host's namespace gone; its folder is its
    own. Root's child would otherwise pass every same-uid check of the kernel."""
    with paused("", open_dir) as (pid, workdir, _):
        status = proc_status(pid)
        uid = str(CONFIG.run_as_uid)
        assert status["Uid"].split() == [uid] * 4
        assert status["Gid"].split() == [uid] * 4
        assert status["Groups"].strip() == ""
        assert os.stat(workdir).st_uid == CONFIG.run_as_uid


FLOOD = """
    attr = ctypes.create_string_buffer(64)  # pthread_attr_t: 56 bytes on 64-bit Linux
    libc.pthread_attr_init(attr)
    libc.pthread_attr_setstacksize(attr, ctypes.c_size_t(65536))  # not bound by RLIMIT_AS
    tid = ctypes.c_ulong()
    pause = ctypes.cast(libc.pause, ctypes.c_void_p)  # each thread waits in C, forever
    made = 0
    while made < 3000 and libc.pthread_create(ctypes.byref(tid), attr, pause, None) == 0:
        made += 1
    print("made", made)
"""


def test_a_thread_flood_is_bounded_per_call(open_dir):
    """Raw pthread_create through ctypes (small stacks: the address-space limit is not what
    stops them) in two calls at once: each stops at `max_threads` (its own count, not one
    shared by the uid), seen in /proc; both calls end and leave no thread or process, and
    this process still starts both."""
    config = SandboxConfig(timeout_s=5.0, max_threads=32)
    with paused(FLOOD, open_dir, config) as (first, _, first_result):
        with paused(FLOOD, open_dir, config) as (second, _, second_result):
            for pid in (first, second):
                assert int(proc_status(pid)["Threads"]) == config.max_threads
    for result in (first_result.result(), second_result.result()):
        assert result.stdout == f"made {config.max_threads - 1}\n"
    for pid in (first, second):
        assert not os.path.exists(f"/proc/{pid}/task") or proc_status(pid)["State"][1] == "Z"
    thread = threading.Thread(target=lambda: None)
    thread.start()
    thread.join()
    assert subprocess.run([sys.executable, "-c", "print(7)"], capture_output=True).stdout == b"7\n"


def test_no_limit_is_raised_back(open_dir):
    """Every hard limit raised to infinity (prlimit64 on itself, setrlimit): /proc shows the
    sandbox's limits unchanged."""
    body = """
        class Rlimit(ctypes.Structure):
            _fields_ = [("cur", ctypes.c_ulong), ("max", ctypes.c_ulong)]
        up = Rlimit(2**64 - 1, 2**64 - 1)
        for which in (0, 1, 6, 7, 9):  # CPU, FSIZE, NPROC, NOFILE, AS
            report("prlimit64", libc.prlimit64(0, which, ctypes.byref(up), None))
            report("setrlimit", libc.setrlimit(which, ctypes.byref(up)))
    """
    with paused(body, open_dir) as (pid, _, _):
        limits = {line[:26].strip(): line[26:].split()[:2]
                  for line in Path(f"/proc/{pid}/limits").read_text().splitlines()[1:]}  # fmt: skip
    hard = {name: values[1] for name, values in limits.items()}
    assert hard["Max processes"] == str(CONFIG.max_threads)
    assert hard["Max open files"] == str(NOFILE)
    assert hard["Max address space"] == str(CONFIG.memory_limit_mb * 2**20)
    assert hard["Max cpu time"] == str(math.ceil(CONFIG.timeout_s) + 1)
    assert hard["Max file size"] == str(FSIZE_BYTES)


# ---------------------------------------------------------------------------- other processes


@needs_numbers
def test_no_scheduling_or_io_priority_of_the_trainer_changes():
    """sched_setscheduler, sched_setparam, sched_setattr and ioprio_set aimed at the parent
    (this process's main thread): its policy, priority and I/O priority stay."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall.restype = ctypes.c_long
    policy, param = os.sched_getscheduler(0), os.sched_getparam(0)
    ioprio = libc.syscall(NUMBERS["ioprio_get"], 1, 0)  # IOPRIO_WHO_PROCESS, this one
    try:
        out = attack(f"""
            import os
            parent = os.getppid()
            prio = ctypes.c_int(0)
            report("sched_setscheduler", libc.sched_setscheduler(parent, 5, ctypes.byref(prio)))
            report("sched_setparam", libc.sched_setparam(parent, ctypes.byref(ctypes.c_int(1))))
            attr = (ctypes.c_uint32 * 14)(56, 5)  # size, SCHED_IDLE
            report("sched_setattr", libc.syscall({NUMBERS["sched_setattr"]}, parent, attr, 0))
            report("ioprio_set", libc.syscall({NUMBERS["ioprio_set"]}, 1, parent, 3 << 13))
        """)
        assert os.sched_getscheduler(0) == policy
        assert os.sched_getparam(0) == param
        assert libc.syscall(NUMBERS["ioprio_get"], 1, 0) == ioprio
        assert out.count(" -1 ") == 4, out
    finally:  # an escape must not slow the tests after this one
        os.sched_setscheduler(0, policy, param)
        libc.syscall(NUMBERS["ioprio_set"], 1, 0, ioprio)


def test_no_signal_reaches_the_trainer_or_another_process(canary_process):
    """kill and tgkill of a host process (SIGKILL) and of the parent (SIGUSR2, caught here):
    the process lives, the parent receives nothing."""
    proc, _ = canary_process
    received = []
    previous = signal.signal(signal.SIGUSR2, lambda *a: received.append(a))
    try:
        out = attack(f"""
            import os
            parent = os.getppid()
            report("kill", libc.kill({proc.pid}, 9))
            report("tgkill", libc.tgkill({proc.pid}, {proc.pid}, 9))
            report("kill_parent", libc.kill(parent, {int(signal.SIGUSR2)}))
            report("tgkill_parent", libc.tgkill(parent, parent, {int(signal.SIGUSR2)}))
            report("killpg", libc.killpg({proc.pid}, 9))  # its own group
        """)
        time.sleep(0.05)  # a signal sent would have arrived by now
    finally:
        signal.signal(signal.SIGUSR2, previous)
    assert proc.poll() is None
    assert received == []
    assert out.count(" -1 ") == 5, out


def test_no_other_process_is_read_or_traced(canary_process):
    """/proc/<pid>/environ and /proc/<pid>/mem of a host process and of the parent, and
    PTRACE_ATTACH / PTRACE_SEIZE: nothing read (the secret never printed), no tracer."""
    proc, secret = canary_process
    out = attack(f"""
        import os
        for pid in ({proc.pid}, os.getppid()):
            for name in ("environ", "mem", "cmdline"):
                fd = libc.open(f"/proc/{{pid}}/{{name}}".encode(), 0)
                report(name, fd)
                if fd >= 0:
                    print(os.read(fd, 4096))
        report("attach", libc.ptrace(16, {proc.pid}, None, None))
        report("seize", libc.ptrace(0x4206, {proc.pid}, None, None))
    """)
    assert secret not in out
    assert proc_status(proc.pid)["TracerPid"].strip() == "0"
    assert proc.poll() is None
    assert out.count(" -1 ") == 8, out


# ---------------------------------------------------------------------------- host IPC objects

IPC_CREAT, IPC_RMID, IPC_STAT = 0o1000, 0, 2


def host_libc():
    libc = ctypes.CDLL(None, use_errno=True)
    libc.shmat.restype = ctypes.c_void_p
    libc.shmat.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_int]
    libc.mq_open.argtypes = [ctypes.c_char_p, ctypes.c_int, ctypes.c_uint, ctypes.c_void_p]
    return libc


def test_no_host_sysv_shared_memory_is_read_or_removed():
    """A host segment any uid may read and write, by key and by id: not found, not
    attached, not removed (the child's IPC namespace holds none); its content stays."""
    libc = host_libc()
    key = 0x5A000000 + os.getpid() % 0xFFFF
    shmid = libc.shmget(key, 4096, IPC_CREAT | 0o666)
    assert shmid >= 0, f"shmget: errno {ctypes.get_errno()}"
    try:
        addr = libc.shmat(shmid, None, 0)
        ctypes.memmove(addr, b"host secret\0", 12)
        out = attack(f"""
            libc.shmat.restype = ctypes.c_void_p
            report("shmget", libc.shmget({key}, 0, 0))
            addr = libc.shmat({shmid}, None, 0o10000)  # SHM_RDONLY
            print("shmat", addr)
            if addr not in (None, 2**64 - 1):
                print(ctypes.string_at(addr, 11))
            report("rmid", libc.shmctl({shmid}, {IPC_RMID}, None))
        """)
        assert "host secret" not in out
        assert ctypes.string_at(addr, 11) == b"host secret"
        assert libc.shmctl(shmid, IPC_STAT, ctypes.create_string_buffer(256)) == 0  # still there
        libc.shmdt(ctypes.c_void_p(addr))
    finally:
        libc.shmctl(shmid, IPC_RMID, None)


def test_no_host_posix_message_queue_is_read_or_removed():
    """A host queue any uid may use, holding one message: not opened, not unlinked; the
    message is still there."""
    libc = host_libc()
    name = f"/sandbox-canary-{os.getpid()}".encode()
    mq = libc.mq_open(name, os.O_CREAT | os.O_RDWR, 0o666, None)
    assert mq >= 0, f"mq_open: errno {ctypes.get_errno()}"
    try:
        os.fchmod(mq, 0o666)  # mq_open's mode passed through the umask
        assert libc.mq_send(mq, b"host secret", 11, 0) == 0
        out = attack(f"""
            libc.mq_open.argtypes = [ctypes.c_char_p, ctypes.c_int]
            mq = libc.mq_open({name!r}, 2)  # O_RDWR
            report("mq_open", mq)
            buf = ctypes.create_string_buffer(8192)
            if mq >= 0:
                print(libc.mq_receive(mq, buf, 8192, None), buf.value)
            report("mq_unlink", libc.mq_unlink({name!r}))
        """)
        assert "host secret" not in out
        attr = (ctypes.c_long * 8)()
        assert libc.mq_getattr(mq, attr) == 0 and attr[3] == 1  # mq_curmsgs
        again = libc.mq_open(name, os.O_RDONLY, 0, None)
        assert again >= 0  # still linked
        libc.mq_close(again)
    finally:
        libc.mq_close(mq)
        libc.mq_unlink(name)


def test_no_host_posix_shared_memory_is_read_or_removed():
    """/dev/shm/NAME (shm_open's files), any uid may read and write: unread, unremoved."""
    path = Path(f"/dev/shm/sandbox-canary-{os.getpid()}")
    path.write_text("host secret")
    os.chmod(path, 0o666)
    try:
        out = attack(f"""
            fd = libc.open({str(path).encode()!r}, 2)  # O_RDWR
            report("open", fd)
            if fd >= 0:
                print(__import__("os").read(fd, 64))
            report("unlink", libc.unlink({str(path).encode()!r}))
        """)
        assert "host secret" not in out
        assert path.read_text() == "host secret"
    finally:
        path.unlink(missing_ok=True)


# ---------------------------------------------------------------------------- sockets


def test_no_abstract_unix_socket_reaches_a_host_listener():
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    name = f"\0sandbox-canary-{os.getpid()}"
    listener.bind(name)
    listener.listen(1)
    listener.setblocking(False)
    out = attack(f"""
        import struct
        fd = libc.socket(1, 1, 0)  # AF_UNIX, SOCK_STREAM
        report("socket", fd)
        addr = struct.pack("H", 1) + {name.encode()!r}
        report("connect", libc.connect(fd, addr, len(addr)))
    """)
    with pytest.raises(BlockingIOError):
        listener.accept()
    listener.close()
    assert out.startswith("socket -1 1")


def test_no_tcp_or_udp_reaches_a_host_loopback_listener():
    tcp = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    tcp.bind(("127.0.0.1", 0))
    tcp.listen(8)
    udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    udp.bind(("127.0.0.1", 0))
    for s in (tcp, udp):
        s.setblocking(False)
    out = attack(f"""
        import socket, struct
        def addr(port):
            return struct.pack("=H", 2) + struct.pack("!H", port) + socket.inet_aton("127.0.0.1") + bytes(8)
        for kind, port in ((1, {tcp.getsockname()[1]}), (2, {udp.getsockname()[1]})):
            fd = libc.socket(2, kind, 0)
            report("socket", fd)
            report("connect", libc.connect(fd, addr(port), 16))
            report("sendto", libc.sendto(fd, b"x", 1, 0, addr(port), 16))
    """)
    with pytest.raises(BlockingIOError):
        tcp.accept()
    with pytest.raises(BlockingIOError):
        udp.recv(16)
    tcp.close()
    udp.close()
    assert out.count("socket -1 1") == 2, out


# ---------------------------------------------------------------------------- files


def host_tree(folder: Path) -> dict[str, tuple[int, int, str]]:
    """Each entry of `folder` (but sandboxes' own folders): its link count, mode, content."""
    return {entry.name: (entry.lstat().st_nlink, entry.lstat().st_mode,
                         entry.read_text() if entry.is_file() else "")
            for entry in folder.iterdir() if not entry.name.startswith("sandbox-")}  # fmt: skip


def test_nothing_outside_its_folder_is_read_or_written(open_dir):
    """A file any uid may read and write, in a folder any uid may write: not read, not
    truncated, not replaced, no new file, folder or fifo, nothing renamed or removed."""
    before = host_tree(open_dir)
    c, d = str(open_dir / "canary").encode(), str(open_dir).encode()
    out = attack(f"""
        fd = libc.open({c!r}, 0)  # O_RDONLY
        report("read_open", fd)
        if fd >= 0:
            print(__import__("os").read(fd, 64))
        fd = libc.open({c!r}, 0o1001)  # O_WRONLY | O_TRUNC
        report("truncate_open", fd)
        if fd >= 0:
            libc.write(fd, b"escaped", 7)
        report("create", libc.open({d + b"/new"!r}, 0o101, 0o666))  # O_WRONLY | O_CREAT
        report("mkdir", libc.mkdir({d + b"/newdir"!r}, 0o777))
        report("mkfifo", libc.mkfifo({d + b"/fifo"!r}, 0o666))
        report("truncate", libc.truncate({c!r}, 0))
        report("rename", libc.rename({c!r}, b"stolen"))
        report("unlink", libc.unlink({c!r}))
    """)
    assert host_tree(open_dir) == before
    assert "host file" not in out
    assert out.count(" -1 ") == 8, out


def test_no_link_out_of_its_folder_is_written_through(open_dir):
    """A symlink and a hard link, made in its own folder, to a host file any uid may write,
    and a symlink to a host folder: nothing written through them; the file keeps one link."""
    (open_dir / "d").mkdir()
    os.chmod(open_dir / "d", 0o777)
    before = host_tree(open_dir)
    c, d = str(open_dir / "canary").encode(), str(open_dir / "d").encode()
    out = attack(f"""
        report("symlink", libc.symlink({c!r}, b"s"))
        fd = libc.open(b"s", 0o1001)  # O_WRONLY | O_TRUNC
        report("open_symlink", fd)
        if fd >= 0:
            libc.write(fd, b"escaped", 7)
        report("link", libc.link({c!r}, b"h"))
        fd = libc.open(b"h", 0o1001)
        report("open_link", fd)
        if fd >= 0:
            libc.write(fd, b"escaped", 7)
        report("symlink_dir", libc.symlink({d!r}, b"sd"))
        report("create_through", libc.open(b"sd/new", 0o101, 0o666))
    """)
    assert host_tree(open_dir) == before
    assert (open_dir / "canary").read_text() == "host file"
    assert os.stat(open_dir / "canary").st_nlink == 1
    assert list((open_dir / "d").iterdir()) == []
    assert "open_symlink -1" in out and "open_link -1" in out and "create_through -1" in out, out


# ---------------------------------------------------------------------------- other sandboxes


def test_no_sandbox_reaches_another(open_dir):
    """Two calls at once share `run_as_uid` (and a non-root trainer's uid), so the kernel's
    same-uid checks pass between them: the second neither kills, traces nor reads the
    first, nor opens its folder's file; the first ends normally, its file intact."""
    with paused('open("mine", "w").write("sandbox secret")', open_dir) as (pid, workdir, _):
        mine = f"{workdir}/mine".encode()
        out = attack(f"""
            report("kill", libc.kill({pid}, 9))
            report("attach", libc.ptrace(16, {pid}, None, None))
            for path in ({mine!r}, b"/proc/{pid}/environ", b"/proc/{pid}/mem"):
                fd = libc.open(path, 2 if path == {mine!r} else 0)
                report("open", fd)
                if fd >= 0:
                    print(__import__("os").read(fd, 64))
        """)
        assert proc_status(pid)["State"].split()[0] in ("S", "R")
        assert proc_status(pid)["TracerPid"].strip() == "0"
        assert Path(workdir, "mine").read_text() == "sandbox secret"
    assert "sandbox secret" not in out
    assert out.count(" -1 ") == 5, out
