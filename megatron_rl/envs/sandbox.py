"""A sandboxed Python interpreter for tool calls: one fresh, limited child process per call.

`run_code(code, config)` writes the code to a new `mkdtemp` directory DIR, starts
`python -I -B -u sandbox_child.py DIR ...` in a new session (cwd = HOME = TMPDIR = DIR, a
scrubbed environment, stdin /dev/null), reads stdout and stderr without blocking, keeps the
head and tail of each, kills the process group at the wall deadline or past
`max_output_bytes`, reaps it within a bounded time and removes DIR. It never hangs and never
raises on bad code: every outcome is a `SandboxResult` whose `observation()` is the one short
text the policy sees. State does not carry over between calls (SandboxFusion's model).

The child restricts itself before running anything (`sandbox_child.py`; no `preexec_fn`, which
is unsafe in the threaded trainer). What each layer gives, and what it does not:
- always: rlimits (CPU, address space = `memory_limit_mb`, 16 MiB files, 64 open files, no
  core), `PR_SET_PDEATHSIG` (a killed trainer takes its sandboxes with it), a new session.
- `uid`: a trainer running as root has its child drop to `run_as_uid` (65534, `nobody`, by
  default; gid the same, no supplementary group) before anything else, so the kernel's own
  checks on processes and files (signals, /proc, ptrace, priorities, RLIMIT_NPROC, a file's
  owner bits) see an unprivileged user; PDEATHSIG is set again after the change (the kernel
  clears it) and the parent checked alive. A trainer that is not root is unprivileged
  already: its child keeps its uid (nothing else changes). Either way the child then joins a
  fresh session keyring, so no key of the caller's is reachable even by its id.
  What root could reach and the new uid cannot by path (the interpreter under /root, 0700,
  with pyenv; DIR under pytest's 0700 tmp_path) is opened by the child while still root and
  reached through those descriptors: Landlock's rules are made from them, `sys.path` entries
  (and the `__path__` of packages already imported) become `/proc/self/fd/N`, HOME and
  TMPDIR become `/proc/self/cwd`. The kernel resolves these links without searching the
  folders above; what may be read is still Landlock's decision. DIR is given to the uid by
  the child (chown, as root, before the drop). Tracebacks through standard-library frames
  then lack their source lines (their files' recorded paths are not reachable).
- `namespaces`: an unprivileged user + network + IPC namespace. The network is empty (no
  interface up, loopback included); the host's uids are unmapped inside, so the child has no
  capability over host files or processes; the host's SysV and POSIX IPC objects are not
  visible. Files stay visible. Then the thread bound: RLIMIT_NPROC = `max_threads`, set inside
  the namespace (below).
- `landlock`: files: read-only the interpreter's stdlib and site-packages and the system
  libraries, read-write DIR, nothing else, no execve; TCP bind/connect refused (ABI >= 4);
  no signals or abstract sockets beyond the sandbox (ABI >= 6).
- `seccomp` (libseccomp via ctypes, after no_new_privs): no new process (fork, vfork, clone
  without CLONE_THREAD, clone3 -> ENOSYS so glibc falls back to clone); no socket (a unix
  socket reaches host listeners by path); no io_uring, no ptrace; nothing on another process
  (prlimit, priority, affinity, scheduler, I/O priority: a same-uid check would pass for a
  trainer that is not root); no metadata change of any file (chmod / chown / utime / xattr
  families: Landlock does not see them); no keyring. Threads still work, up to the bound.
- `audit_hook` (always, on top): a `sys.addaudithook` guard that turns the same attempts into
  one-line `PermissionError: sandbox: ...` observations. It is NOT a security boundary
  (PEP 578: code can reach around it through objects in memory). Each kernel layer covers
  what the others cannot (a root child keeps the trainer's uid for every same-uid check and
  is bound by no RLIMIT_NPROC; without the namespace the network and the host's IPC are
  reachable; without seccomp a process can leave the group kill; without Landlock files are
  open), so `isolation: strict` (the default) refuses to run unless all four apply
  (`KERNEL_LAYERS`), naming the missing ones, and `best_effort` must be chosen explicitly.
  For untrusted models at scale use a service (SandboxFusion, gVisor). The threat model
  (what is promised, on which kernels, what is not) is in docs/tools.md.

The thread bound. RLIMIT_NPROC counts tasks (threads too) of a uid, and does not bind uid 0:
hence the drop first. Set inside the child's own user namespace it binds per call: since
Linux 5.14 the kernel counts it per (user namespace, uid) and checks each level up to the
host's, where the limit is the one the namespace was created with (the trainer's); so
concurrent sandboxes under one uid, or a non-root trainer's own processes, do not share it
(tested: two floods at once stop at `max_threads` each). Older kernels count it per uid on the
host: a non-root trainer's sandboxes would then share it with the trainer. A pids cgroup was
not used: this machine has cgroup v1 (the pids controller is there; the unified hierarchy has
no controller), and on a cluster node the trainer's cgroup is seldom delegated to it (a cgroup
v2 child needs write access and, by the no-internal-process rule, a parent without processes).

Where the design (docs/design/tools.md §3.5) was changed for this machine:
- No pid namespace. Its pid 1 must be a forked child of the sandbox process; when the parent
  kills the group, that pid 1 is orphaned to the host's init, and on this VM init
  (`process_api`) does not reap orphans: every killed call would leave a zombie (measured).
  With seccomp no process can be created at all, so the group is the one process, and
  `killpg` + `wait` end it. Without seccomp (best_effort) the hook refuses forks; a process
  created around it and then `setsid` would escape the group kill: stated, not handled.
- No mount namespace or `pivot_root`: Landlock confines files more cheaply; where it is
  missing, `files` is False and `strict` refuses.
- `max_processes` other than 0 is refused: seccomp cannot count processes.

Measured on this machine (Firecracker VM, kernel 6.18, Debian 12, Python 3.11.7 from pyenv
under /root, 2 cores), as root and (the same results but the uid) as uid 54321 with the
system's Python: user namespaces work (`unshare -rn true`), Landlock ABI 7,
libseccomp 2.5.4; `probe_isolation` finds network, files and processes isolated by all four
layers (TCP and UDP connect -> EPERM from seccomp, or ENETUNREACH from the namespace alone; a
world-readable file outside DIR -> EACCES from Landlock; fork -> EPERM), root's child at uid
65534 in /proc. A trivial call takes about 50 ms. RLIMIT_AS counts virtual memory: `import
numpy` needs >= 128 MiB, `import numpy, sympy` >= 192 MiB (threads at 1); a `threading`
thread reserves an 8 MiB stack and maybe a 64 MiB malloc arena, so at the default 1 GiB
`threading` stops at 21 threads, before `max_threads` (threads with small stacks through
ctypes reach `max_threads` exactly); `print("x" * 10**9)` needs ~2 GiB (the string and its
UTF-8 copy), so at the default 1 GiB it is a MemoryError.

The design's `python -I -m megatron_rl.envs.sandbox_child` is run by path instead: the child
imports nothing of the package, and `-I` would not see a repository that is not installed.
The sandbox has its own session, so a process-group kill of its caller does not reach it;
PDEATHSIG does (it dies with the thread that started it).
"""

from __future__ import annotations

import json
import os
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from megatron_rl.procutil import THREAD_ENV_VARS

CHILD_SCRIPT = Path(__file__).with_name("sandbox_child.py")
CODE_FILE = "tool_code.py"
"""The file the child reads (and removes) in DIR; the name `sandbox_child.CODE_FILE` reads."""
REFUSED_EXIT = 3
"""The child's exit code when `strict` could not be honoured (`sandbox_child.REFUSED_EXIT`)."""
KEEP_BYTES = 16 * 2**10
"""Head and tail kept of each stream, this many bytes each; the tool layer cuts further."""
REAP_TIMEOUT_S = 5.0
"""After SIGKILL, how long to wait for the kernel to end the process (a D-state read)."""
PROBE_TIMEOUT_S = 30.0


KERNEL_LAYERS = ("uid", "namespaces", "landlock", "seccomp")
"""The kernel layers `isolation: strict` needs, every one (the module docstring). "uid": the
child's kernel uid is not root (dropped to `run_as_uid`, or the trainer's own)."""


class SandboxUnavailable(RuntimeError):
    """`isolation: strict` was asked for and the kernel does not isolate network and files."""


@dataclass(frozen=True)
class SandboxConfig:
    """Limits of one `run_code` call (verl's names and defaults where it has them)."""

    timeout_s: float = 5.0
    """Wall clock per call, seconds (verl `default_timeout`); the process group is then killed."""
    memory_limit_mb: int = 1024
    """RLIMIT_AS in MiB (verl `memory_limit_mb`): virtual memory, so keep room for imports."""
    max_output_bytes: int = 8 * 2**20
    """stdout + stderr read from the child; past it the process group is killed."""
    max_processes: int = 0
    """Processes a call may start. Only 0 (refused by seccomp and the hook) is supported."""
    max_threads: int = 64
    """Threads a call may have, its main thread included (RLIMIT_NPROC inside its own user
    namespace: counted per call, not per uid). Python's `threading`, numpy and sympy need a
    few (the math libraries are told to use one thread); a thread flood stops here."""
    run_as_uid: int = 65534
    """When the trainer runs as root: the kernel uid and gid the child drops to before its
    user namespace (65534, `nobody`, by default; one that owns nothing on the host). A
    trainer that is not root is already unprivileged: its sandboxes keep its uid."""
    isolation: str = "strict"
    """"strict": refuse to run unless all four kernel layers apply (`KERNEL_LAYERS`: an
    unprivileged uid, a user namespace, Landlock, seccomp) and the probe finds network, files
    and processes isolated and threads bounded;
    "best_effort": run under whatever layers the kernel allows (maybe only the audit hook: no
    boundary)."""
    error_lines: int = 1
    """Lines of a traceback kept in the observation, from its end (ToRL keeps the last)."""

    def __post_init__(self) -> None:
        def is_int(value) -> bool:
            return isinstance(value, int) and not isinstance(value, bool)

        timeout = self.timeout_s
        checks = (
            ("timeout_s", isinstance(timeout, (int, float)) and 0 < timeout <= 3600,
             "seconds in (0, 3600]"),
            ("memory_limit_mb", is_int(self.memory_limit_mb) and self.memory_limit_mb >= 64,
             "an int >= 64 (MiB)"),
            ("max_output_bytes", is_int(self.max_output_bytes) and self.max_output_bytes >= 1024,
             "an int >= 1024"),
            ("max_processes", self.max_processes == 0,
             "0: the sandbox refuses every new process, other counts are not supported"),
            ("max_threads", is_int(self.max_threads) and 1 <= self.max_threads <= 4096,
             "an int in [1, 4096]"),
            ("run_as_uid", is_int(self.run_as_uid) and 1 <= self.run_as_uid < 2**32 - 1
             and self.run_as_uid != 65535, "a uid >= 1, not 65535 or 2**32 - 1 (not root)"),
            ("isolation", self.isolation in ("strict", "best_effort"), "'strict' or 'best_effort'"),
            ("error_lines", is_int(self.error_lines) and self.error_lines >= 1, "an int >= 1"),
        )  # fmt: skip
        for name, ok, expected in checks:
            if not ok:
                value = getattr(self, name)
                raise ValueError(f"SandboxConfig.{name}: expected {expected}, got {value!r}")


@dataclass(frozen=True)
class SandboxResult:
    """What one call did; `observation()` is what the policy sees."""

    status: str
    """"ok" | "error" (exception, syntax error, non-zero exit) | "timeout" | "output_limit" |
    "killed" (any other signal, e.g. the kernel's OOM killer)."""
    stdout: str
    """What was kept: all of it, or head and tail around `...(truncated N bytes)...`."""
    stderr: str
    seconds: float
    isolation: str
    """The layers it ran under, joined by "+", e.g. "namespaces+landlock+seccomp+audit_hook"."""
    timeout_s: float = 0.0
    """The limit it ran under (for the timeout message)."""
    signal: str = ""
    """The signal that ended it, for status "killed" (e.g. "SIGKILL")."""
    exit_code: int | None = None
    """The child's exit status when it exited by itself (0 for "ok")."""

    def observation(self, error_lines: int = 1) -> str:
        """stdout, then for a failure one line saying how it ended: an error's last
        `error_lines` traceback lines, `TimeoutError: stopped after 5 s`, ... Never empty."""
        parts = [self.stdout.rstrip("\n")] if self.stdout.strip() else []
        if self.status == "error":
            lines = [line for line in self.stderr.splitlines() if line.strip()]
            parts += lines[-error_lines:] or [f"SystemExit: {self.exit_code}"]
        elif self.status == "timeout":
            parts.append(f"TimeoutError: stopped after {self.timeout_s:g} s")
        elif self.status == "output_limit":
            parts.append("OutputLimitError: stopped, too much output")
        elif self.status == "killed":
            parts.append(f"Killed: {self.signal or 'signal'} (memory or CPU limit?)")
        elif not parts and self.stderr.strip():  # ok, only warnings on stderr
            parts.append(self.stderr.rstrip("\n"))
        return "\n".join(parts) or "(no output)"


@dataclass(frozen=True)
class IsolationReport:
    """What the kernel isolates for a sandbox started by this process, checked from inside."""

    network: bool
    """TCP and UDP connections to 127.0.0.1 fail (empty namespace, seccomp or Landlock)."""
    files: bool
    """A file outside DIR cannot be read (Landlock)."""
    processes: bool
    """fork is refused by the kernel (seccomp)."""
    threads: bool
    """Threads stop at `max_threads` (RLIMIT_NPROC binds: the uid is not root)."""
    layers: tuple[str, ...]
    """The kernel layers that applied: "uid", "namespaces", "landlock", "seccomp"."""
    details: str
    """The probe's findings, one clause per layer and per check."""


# ---------------------------------------------------------------------------- the probe

_probe_lock = threading.Lock()
_probe_cache: list[IsolationReport] = []


def _probe_report(raw: dict) -> IsolationReport:
    checks = raw["checks"]
    refused = {name: why is not None for name, why in checks.items()}
    usable = raw["stdlib"] is None and not refused["write_inside"]
    details = [f"layers: {', '.join(raw['layers']) or 'none'}"]
    details += [f"not applied: {m}" for m in raw["missing"]]
    details += [f"{name}: {why or 'allowed'}" for name, why in checks.items()]
    if not usable:
        details.append(
            f"the sandbox is unusable: stdlib import {raw['stdlib']}, write {checks['write_inside']}"
        )
    details.append(f"threads: {raw['threads']} ran, max_threads {raw['max_threads']}")
    return IsolationReport(
        network=usable and refused["tcp"] and refused["udp"],
        files=usable and refused["read_outside"],
        processes=usable and refused["fork"],
        threads=usable and raw["threads"] == raw["max_threads"],
        layers=tuple(raw["layers"]),
        details="; ".join(details),
    )  # fmt: skip


def _run_probe() -> IsolationReport:
    nothing = IsolationReport(False, False, False, False, (), "")
    if not sys.platform.startswith("linux"):
        return IsolationReport(**{**nothing.__dict__, "details": f"not Linux ({sys.platform})"})
    top = tempfile.mkdtemp(prefix="sandbox-probe-")
    try:
        workdir, outside = os.path.join(top, "dir"), os.path.join(top, "outside.txt")
        os.mkdir(workdir)
        Path(outside).write_text("outside\n")
        # Readable by any uid: what keeps it from the probe is Landlock, not the file's mode.
        os.chmod(top, 0o755)
        os.chmod(outside, 0o644)
        limits = {"run_as_uid": SandboxConfig.run_as_uid, "max_threads": SandboxConfig.max_threads}
        proc = subprocess.run(
            [sys.executable, "-I", "-B", str(CHILD_SCRIPT), "--probe", workdir, outside,
             json.dumps(limits)],
            cwd=workdir, env=_child_env(workdir), stdin=subprocess.DEVNULL,
            capture_output=True, text=True, timeout=PROBE_TIMEOUT_S, start_new_session=True,
        )  # fmt: skip
        return _probe_report(json.loads(proc.stdout))
    except (OSError, ValueError, KeyError, subprocess.SubprocessError) as e:
        return IsolationReport(**{**nothing.__dict__, "details": f"the probe failed: {e}"})
    finally:
        shutil.rmtree(top, ignore_errors=True)


def probe_isolation() -> IsolationReport:
    """What this kernel lets this process's sandboxes isolate, measured once per process in a
    probe child (applying the layers here would restrict the trainer itself)."""
    with _probe_lock:
        if not _probe_cache:
            _probe_cache.append(_run_probe())
        return _probe_cache[0]


def check_isolation(config: SandboxConfig) -> IsolationReport:
    """The probe's report; raises `SandboxUnavailable` when `config` is strict and a kernel
    layer is missing or the probe found network, files or processes reachable or threads
    unbounded. Call before
    any model is loaded."""
    report = probe_isolation()
    missing = [layer for layer in KERNEL_LAYERS if layer not in report.layers]
    isolated = report.network and report.files and report.processes and report.threads
    if config.isolation == "strict" and (missing or not isolated):
        raise SandboxUnavailable(
            f"sandbox: isolation 'strict' needs every kernel layer ({', '.join(KERNEL_LAYERS)}) "
            f"and this machine lacks {', '.join(missing) or 'none'}, isolating "
            f"network={report.network}, files={report.files}, processes={report.processes}, "
            f"threads={report.threads} "
            f"({report.details}). Set `isolation: best_effort` to run under the layers there "
            f"are (or the audit hook only: clear messages, no security boundary), or use a "
            f"sandbox service (SandboxFusion, gVisor)."
        )  # fmt: skip
    return report


# ---------------------------------------------------------------------------- one call


class _Capture:
    """One stream: its first and last `KEEP_BYTES` bytes and how many came in all."""

    def __init__(self) -> None:
        self.head, self.tail, self.total = bytearray(), bytearray(), 0

    def add(self, data: bytes) -> None:
        self.total += len(data)
        room = KEEP_BYTES - len(self.head)
        if room > 0:
            self.head += data[:room]
            data = data[room:]
        self.tail += data
        if len(self.tail) > 2 * KEEP_BYTES:  # trim in bulk: amortised O(1) per byte
            del self.tail[:-KEEP_BYTES]

    def text(self) -> str:
        tail = bytes(self.tail[-KEEP_BYTES:])
        dropped = self.total - len(self.head) - len(tail)
        middle = f"\n...(truncated {dropped} bytes)...\n".encode() if dropped > 0 else b""
        return (bytes(self.head) + middle + tail).decode("utf-8", errors="replace")


@dataclass
class _Outcome:
    """How reading ended: "timeout", "output_limit" or "" (both streams closed)."""

    stop: str = ""
    stdout: _Capture = field(default_factory=_Capture)
    stderr: _Capture = field(default_factory=_Capture)


def _child_env(workdir: str) -> dict[str, str]:
    """Nothing of the trainer's environment (tokens, proxies, CUDA): a path, a UTF-8 locale,
    one thread per math library, DIR as home and temp."""
    env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8", "LC_ALL": "C.UTF-8"}
    env.update(HOME=workdir, TMPDIR=workdir, **{name: "1" for name in THREAD_ENV_VARS})
    return env


def _read_streams(proc: subprocess.Popen, deadline: float, limit: int) -> _Outcome:
    """Read stdout and stderr until both close, the deadline passes or `limit` bytes came."""
    outcome = _Outcome()
    with selectors.DefaultSelector() as selector:
        for stream, capture in ((proc.stdout, outcome.stdout), (proc.stderr, outcome.stderr)):
            os.set_blocking(stream.fileno(), False)
            selector.register(stream.fileno(), selectors.EVENT_READ, capture)
        while selector.get_map():
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                outcome.stop = "timeout"
                return outcome
            for key, _ in selector.select(remaining):
                data = os.read(key.fd, 65536)
                if not data:
                    selector.unregister(key.fd)
                    continue
                key.data.add(data)
                if outcome.stdout.total + outcome.stderr.total > limit:
                    outcome.stop = "output_limit"
                    return outcome
    return outcome


def _exited_by(pid: int, deadline: float) -> bool:
    """Wait for `pid` to exit WITHOUT reaping it (WNOWAIT), so its group id cannot be reused
    before the group is killed; False at the deadline. Polls: waitid has no timeout."""
    while True:
        if os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None:
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.005)


def _end_group(proc: subprocess.Popen) -> int | None:
    """SIGKILL the child's whole process group (still unreaped, so the id is its own), then
    reap it within `REAP_TIMEOUT_S`; its return code, None if it would not die."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    try:
        return proc.wait(timeout=REAP_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return None


def _read_status(fd: int) -> dict:
    """The child's JSON line from the status pipe: its layers, or a refusal; {} if none."""
    os.set_blocking(fd, False)
    chunks = []
    try:
        while chunk := os.read(fd, 65536):
            chunks.append(chunk)
    except BlockingIOError:
        pass
    try:
        return json.loads(b"".join(chunks) or b"{}")
    except ValueError:
        return {}


def _status(stop: str, returncode: int | None) -> tuple[str, str]:
    """(status, signal name) from how reading stopped and how the child ended."""
    if stop:
        return stop, ""
    if returncode is None:
        return "killed", "unkillable"
    if returncode < 0:
        name = signal.Signals(-returncode).name
        return ("timeout", name) if name == "SIGXCPU" else ("killed", name)
    return ("ok", "") if returncode == 0 else ("error", "")


def _run_in(workdir: str, code: str, config: SandboxConfig) -> SandboxResult:
    Path(workdir, CODE_FILE).write_text(code, encoding="utf-8", errors="surrogateescape")
    child_config = {"timeout_s": config.timeout_s, "memory_limit_mb": config.memory_limit_mb,
                    "isolation": config.isolation, "parent_pid": os.getpid(),
                    "run_as_uid": config.run_as_uid, "max_threads": config.max_threads}  # fmt: skip
    status_r, status_w = os.pipe()
    start = time.monotonic()
    deadline = start + config.timeout_s
    try:
        # PDEATHSIG fires when the *thread* that started the child ends: this thread waits
        # for the child below, so it outlives it.
        proc = subprocess.Popen(
            [sys.executable, "-I", "-B", "-u", str(CHILD_SCRIPT), workdir, str(status_w),
             json.dumps(child_config)],
            cwd=workdir, env=_child_env(workdir), stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, pass_fds=(status_w,),
            start_new_session=True,
        )  # fmt: skip
    except BaseException:
        os.close(status_r)
        raise
    finally:
        os.close(status_w)
    # Not `with proc`: its exit waits without a bound, and a child may be unkillable.
    try:
        outcome = _read_streams(proc, deadline, config.max_output_bytes)
        if not outcome.stop and not _exited_by(proc.pid, deadline):
            outcome.stop = "timeout"  # closed its streams but kept running
    finally:
        returncode = _end_group(proc)
        proc.stdout.close()
        proc.stderr.close()
        status = _read_status(status_r)
        os.close(status_r)
    if "refused" in status:
        raise SandboxUnavailable(
            f"sandbox: isolation 'strict' could not be applied in the child: {status['refused']}; "
            f"set `isolation: best_effort` to run without it"
        )  # fmt: skip
    state, sig = _status(outcome.stop, returncode)
    return SandboxResult(
        status=state, stdout=outcome.stdout.text(), stderr=outcome.stderr.text(), seconds=time.monotonic() - start,
        isolation="+".join(status.get("layers", [])) or "unknown", timeout_s=config.timeout_s,
        signal=sig, exit_code=returncode if returncode is not None and returncode >= 0 else None,
    )  # fmt: skip


DIRECTORY = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW


def _remove_tree(path: str) -> None:
    """Remove `path` and whatever the code left in it, however hostile the tree: iterative (a
    tree thousands of folders deep does not exhaust Python's recursion), relative to one open
    folder at a time (no path outgrows PATH_MAX, no descriptor per level), never following a
    symlink out (O_NOFOLLOW; a link is unlinked, not entered), and each folder made
    searchable and writable by its owner first (the code may have taken those bits off). What
    cannot be removed is left, said on stderr: the clean-up never raises for what the code
    did."""
    names: list[str] = []  # the folders from `path` down to the current one
    try:
        os.chmod(path, 0o700)
        fd = os.open(path, DIRECTORY)
        while True:
            sub = None
            with os.scandir(fd) as entries:
                for entry in entries:
                    if entry.is_dir(follow_symlinks=False):
                        sub = entry.name
                        break
                    os.unlink(entry.name, dir_fd=fd)
            if sub is not None:  # down into it
                os.chmod(sub, 0o700, dir_fd=fd)
                child = os.open(sub, DIRECTORY, dir_fd=fd)
                os.close(fd)
                fd = child
                names.append(sub)
                continue
            if not names:  # `path` itself is empty
                os.close(fd)
                os.rmdir(path)
                return
            parent = os.open("..", DIRECTORY, dir_fd=fd)  # up, and the emptied folder goes
            os.close(fd)
            fd = parent
            os.rmdir(names.pop(), dir_fd=fd)
    except OSError as e:
        print(f"sandbox: could not remove its folder {path}: {e}", file=sys.stderr, flush=True)


def run_code(
    code: str, config: SandboxConfig, *, workdir_parent: str | None = None
) -> SandboxResult:
    """Run `code` in a fresh sandbox under `config`'s limits (see the module docstring).
    Raises only `SandboxUnavailable` (strict isolation impossible) and errors of this
    machine (no temp space, no processes left), never for anything the code does."""
    check_isolation(config)
    workdir = tempfile.mkdtemp(prefix="sandbox-", dir=workdir_parent)
    try:
        return _run_in(workdir, code, config)
    finally:
        _remove_tree(workdir)
