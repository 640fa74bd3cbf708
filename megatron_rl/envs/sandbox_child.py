"""The sandbox's child: restricts itself, then runs one piece of code (see `sandbox.py`).

Started by `sandbox.run_code` as `python -I -B -u sandbox_child.py DIR STATUS_FD CONFIG_JSON`
(by path, not `-m`: `-I` ignores PYTHONPATH and the repository is no part of what the code may
read). It imports nothing from `megatron_rl`, only the standard library, for the same reason.

The restrictions are applied by the child to itself, in this order, before any user code:
1. `PR_SET_PDEATHSIG` SIGKILL (dies with the thread that started it), job signals ignored;
2. rlimits: CPU, address space, file size, open files, no core files;
3. the uid: as root, the paths it will need opened (O_PATH), DIR given to `run_as_uid`, then
   setgroups([]), setresgid, setresuid to it, PDEATHSIG set again (the change cleared it);
   not root: the trainer's uid stays. Then a fresh session keyring (keyctl);
4. `unshare(CLONE_NEWUSER | CLONE_NEWNET | CLONE_NEWIPC)`: an empty network namespace (no
   interface is up, not even loopback), no capability over the host's files or processes,
   none of the host's IPC objects; then RLIMIT_NPROC = `max_threads`, counted in this
   namespace: this call's threads only;
5. Landlock: read-only access to the interpreter's files and the system libraries, read-write
   access to DIR, nothing else (rules made from the descriptors of step 3); no TCP
   bind/connect (ABI >= 4); no signals or abstract sockets beyond the sandbox (ABI >= 6);
6. seccomp: no new process (fork, vfork, clone without CLONE_THREAD, clone3), no socket, no
   io_uring, no ptrace, nothing on another process (limits, priority, CPUs, scheduling, I/O
   priority), no file metadata change (mode, owner, times, attributes), no keyring;
   then the `sys.path` folders the new uid cannot search by path are reached through their
   descriptors (`/proc/self/fd/N`), and DIR as HOME and TMPDIR through `/proc/self/cwd`;
7. an audit hook (PEP 578) that turns the same attempts into one-line
   `PermissionError("sandbox: ...")` messages. It is not a security boundary.
The layers the kernel granted (3-6, plus "audit_hook") are written to STATUS_FD as JSON before
the code runs; with `isolation: strict` and a kernel layer that could not be applied the child
writes a refusal there instead and exits without running anything.

`--probe DIR OUTSIDE_FILE LIMITS_JSON` applies layers 2-6 (LIMITS_JSON: `run_as_uid`,
`max_threads`) and checks, from inside, what they actually stop (a TCP and a UDP connection,
reading OUTSIDE_FILE, a fork, the thread past `max_threads`) and that the standard library
still imports; it prints a JSON report on stdout (read by `sandbox.probe_isolation`).
"""

from __future__ import annotations

import ctypes
import errno
import json
import linecache
import math
import os
import resource
import signal
import socket
import stat
import sys
import sysconfig
import threading
import traceback
import types

CODE_FILE = "tool_code.py"
REFUSED_EXIT = 3
"""Exit code when `isolation: strict` could not be honoured (the code was not run)."""

PR_SET_PDEATHSIG = 1
PR_SET_NO_NEW_PRIVS = 38
CLONE_THREAD = 0x00010000
CLONE_NEWIPC = 0x08000000
CLONE_NEWUSER = 0x10000000
CLONE_NEWNET = 0x40000000
KEYCTL_JOIN_SESSION_KEYRING = 1
FSIZE_BYTES = 16 * 2**20
NOFILE = 64

# Read-only roots besides the interpreter's own directories: the shared libraries that
# extension modules load (and ld.so's cache to find them), time zone data. No /etc, /proc,
# /home or repository: nothing a tool call needs.
SYSTEM_READ_ROOTS = (
    "/lib",
    "/lib64",
    "/usr/lib",
    "/usr/lib64",
    "/usr/local/lib",
    "/usr/share/zoneinfo",
    "/etc/ld.so.cache",
    "/etc/localtime",
)

_libc = ctypes.CDLL(None, use_errno=True)
_libc.syscall.restype = ctypes.c_long


def _errno_text() -> str:
    return os.strerror(ctypes.get_errno())


# ---------------------------------------------------------------------------- 1-2: always


def die_with_parent(parent_pid: int) -> None:
    """SIGKILL when the parent thread goes, and ignore the job's stop signals: like the other
    helpers (`procutil.outlive_job_signals`, not imported: the child imports no package), the
    sandbox lives exactly as long as the call that started it."""
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1):
        signal.signal(sig, signal.SIG_IGN)
    _libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != parent_pid:  # the parent died before prctl: no signal will come
        os._exit(137)


def set_limits(timeout_s: float, memory_limit_mb: int) -> None:
    """CPU one second past the wall limit (the parent's deadline comes first; this catches a
    parent that could not kill), address space, file size, open files, no core dumps.
    RLIMIT_NPROC (the thread bound) comes later, inside the user namespace
    (`bound_threads`)."""
    limits = {
        resource.RLIMIT_CPU: math.ceil(timeout_s) + 1,
        resource.RLIMIT_AS: memory_limit_mb * 2**20,
        resource.RLIMIT_FSIZE: FSIZE_BYTES,
        resource.RLIMIT_NOFILE: NOFILE,
        resource.RLIMIT_CORE: 0,
    }
    for which, value in limits.items():
        resource.setrlimit(which, (value, value))


def read_roots() -> list[str]:
    """The directories and files the code may read: the interpreter's standard library and
    site-packages (so `import math, json, numpy` work) and the system libraries."""
    paths = sysconfig.get_paths()
    roots = [sys.base_prefix, sys.base_exec_prefix, paths["purelib"], paths["platlib"]]
    roots += [paths["stdlib"], paths["platstdlib"], *SYSTEM_READ_ROOTS]
    seen: list[str] = []
    for root in roots:
        real = os.path.realpath(root)
        if os.path.exists(real) and real not in seen:
            seen.append(real)
    return seen


# ---------------------------------------------------------------------------- 3: the uid


def open_paths(paths: list[str]) -> dict[str, int]:
    """An O_PATH descriptor for each path, opened while the child may still be root: the
    Landlock rules are made from them after the uid drop (the roots may lie under a folder
    only root can search, e.g. a pyenv interpreter in /root)."""
    fds = {}
    for path in paths:
        try:
            fds[path] = os.open(path, os.O_PATH | os.O_CLOEXEC)
        except OSError:
            continue
    return fds


def drop_privileges(workdir: str, uid: int, parent_pid: int) -> str | None:
    """As root: give DIR to `uid`, then become `uid` / gid `uid` with no supplementary
    groups, so the kernel's own checks on other processes and files (signals, /proc,
    ptrace, same-uid limits, RLIMIT_NPROC) see an unprivileged user. Not root (the trainer's
    own uid is already unprivileged): nothing to do. Then a fresh session keyring, so no
    key of the caller's is reachable even by its id. None if done, else why not."""
    if os.geteuid() == 0:
        try:
            os.chown(workdir, uid, uid, follow_symlinks=False)
            os.setgroups([])
            os.setresgid(uid, uid, uid)
            os.setresuid(uid, uid, uid)
        except OSError as e:
            return f"dropping to run_as_uid={uid} (mapped here? /proc/self/uid_map): {e}"
        if os.getresuid() != (uid, uid, uid) or os.getresgid() != (uid, uid, uid):
            return f"dropping to run_as_uid={uid}: still {os.getresuid()} / {os.getresgid()}"
        # A credential change clears the parent-death signal: set it again, then make sure
        # the parent did not die in between (no signal would come).
        _libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        if os.getppid() != parent_pid:
            os._exit(137)
    return join_fresh_keyring()


def join_fresh_keyring() -> str | None:
    """A new anonymous session keyring (keyctl JOIN_SESSION_KEYRING), before seccomp
    forbids keyctl; None if done (or no keyring is reachable at all), else why not."""
    number = _syscall_number("keyctl")
    if number is None:
        return None
    if _syscall(number, ctypes.c_long(KEYCTL_JOIN_SESSION_KEYRING), None) < 0:
        # No keyrings in this kernel, or keyctl refused to this process already (an outer
        # seccomp filter, a container's): no key is reachable from here either way.
        if ctypes.get_errno() in (errno.ENOSYS, errno.EPERM):
            return None
        return f"keyctl(JOIN_SESSION_KEYRING): {_errno_text()}"
    return None


def _syscall_number(name: str) -> int | None:
    try:
        lib = ctypes.CDLL("libseccomp.so.2")
    except OSError:
        return SYSCALL_NUMBERS.get(os.uname().machine, {}).get(name)
    lib.seccomp_syscall_resolve_name.argtypes = [ctypes.c_char_p]
    number = lib.seccomp_syscall_resolve_name(name.encode())
    return number if number >= 0 else None


SYSCALL_NUMBERS = {"x86_64": {"keyctl": 250}, "aarch64": {"keyctl": 219}}
"""Where libseccomp is missing (best_effort): the numbers the fresh keyring needs."""


def reach_unsearchable(fds: dict[str, int], workdir: str) -> None:
    """After the drop: a `sys.path` folder this uid cannot search by its path (a pyenv
    interpreter under /root, 0700) is reached through the descriptor opened as root
    (`/proc/self/fd/N`, which the kernel resolves without searching the folders above);
    the same for DIR as HOME and TMPDIR when its parents are closed (`/proc/self/cwd`).
    Landlock still decides what may be read: the folder the link leads to."""
    links = {}
    for i, entry in enumerate(sys.path):
        if entry in fds and not os.access(entry, os.R_OK | os.X_OK):
            links[entry] = sys.path[i] = f"/proc/self/fd/{fds.pop(entry)}"
    for fd in fds.values():
        os.close(fd)
    # Packages already imported (encodings, collections, ...) find their submodules through
    # their own __path__, not sys.path.
    for module in list(sys.modules.values()):
        path = getattr(module, "__path__", None)
        if not isinstance(path, list):
            continue
        for i, folder in enumerate(path):
            for entry, link in links.items():
                if folder.startswith(entry + os.sep):
                    path[i] = link + folder[len(entry) :]
    if not os.access(workdir, os.W_OK | os.X_OK):
        os.environ["HOME"] = os.environ["TMPDIR"] = "/proc/self/cwd"


def bound_threads(max_threads: int) -> None:
    """RLIMIT_NPROC, set inside the new user namespace: since Linux 5.14 the kernel counts
    it per (user namespace, uid) and checks every level up to the host's, where the limit
    is the one the namespace was created with (the trainer's). So it counts this call's
    threads alone, not every process of the uid, however many sandboxes share it. It does
    not bind uid 0 (`drop_privileges` comes first)."""
    resource.setrlimit(resource.RLIMIT_NPROC, (max_threads, max_threads))


# ---------------------------------------------------------------------------- 4: namespaces


def enter_namespaces() -> str | None:
    """A new user, network and IPC namespace for this process; None if done, else why not.
    No uid map is written: the host's uids (root included) stay unmapped inside, so no
    capability applies to the host's files. No pid namespace: it needs a forking pid 1
    (see sandbox.py), and seccomp already refuses every new process."""
    if _libc.unshare(CLONE_NEWUSER | CLONE_NEWNET | CLONE_NEWIPC) != 0:
        return f"unshare(user, net, ipc): {_errno_text()}"
    return None


# ---------------------------------------------------------------------------- 5: Landlock

LANDLOCK_CREATE_RULESET, LANDLOCK_ADD_RULE, LANDLOCK_RESTRICT_SELF = 444, 445, 446
LANDLOCK_CREATE_RULESET_VERSION = 1
LANDLOCK_RULE_PATH_BENEATH = 1
FS_EXECUTE, FS_WRITE_FILE, FS_READ_FILE, FS_READ_DIR = 1 << 0, 1 << 1, 1 << 2, 1 << 3
FS_ALL_ABI1 = (1 << 13) - 1  # execute .. make_sym
FS_REFER, FS_TRUNCATE, FS_IOCTL_DEV = 1 << 13, 1 << 14, 1 << 15
NET_BIND_TCP, NET_CONNECT_TCP = 1 << 0, 1 << 1
SCOPE_ABSTRACT_UNIX_SOCKET, SCOPE_SIGNAL = 1 << 0, 1 << 1
FILE_RIGHTS = FS_EXECUTE | FS_WRITE_FILE | FS_READ_FILE | FS_TRUNCATE | FS_IOCTL_DEV


class _RulesetAttr(ctypes.Structure):
    _fields_ = [
        ("handled_access_fs", ctypes.c_uint64),
        ("handled_access_net", ctypes.c_uint64),
        ("scoped", ctypes.c_uint64),
    ]


class _PathBeneath(ctypes.Structure):
    _pack_ = 1  # the kernel's struct is __attribute__((packed))
    _fields_ = [("allowed_access", ctypes.c_uint64), ("parent_fd", ctypes.c_int32)]


def _syscall(number: int, *args) -> int:
    """libc's variadic syscall() reads longs: pass every integer as one."""
    return _libc.syscall(ctypes.c_long(number), *args)


def landlock_abi() -> int:
    """The kernel's Landlock ABI version; 0 without Landlock (old kernel, not in the LSMs)."""
    version = _syscall(
        LANDLOCK_CREATE_RULESET,
        None,
        ctypes.c_long(0),
        ctypes.c_long(LANDLOCK_CREATE_RULESET_VERSION),
    )
    return max(int(version), 0)


def _handled_fs(abi: int) -> int:
    handled = FS_ALL_ABI1
    if abi >= 2:
        handled |= FS_REFER
    if abi >= 3:
        handled |= FS_TRUNCATE
    if abi >= 5:
        handled |= FS_IOCTL_DEV
    return handled


def _allow(ruleset_fd: int, path: str, fd: int, access: int) -> None:
    """A rule for `path`, given by `fd` (opened as root, `open_paths`)."""
    if not stat.S_ISDIR(os.fstat(fd).st_mode):
        access &= FILE_RIGHTS  # directory rights on a file are EINVAL
    rule = _PathBeneath(access, fd)
    if _syscall(LANDLOCK_ADD_RULE, ctypes.c_long(ruleset_fd), ctypes.c_long(LANDLOCK_RULE_PATH_BENEATH),
                ctypes.byref(rule), ctypes.c_long(0)) != 0:  # fmt: skip
        raise OSError(ctypes.get_errno(), f"landlock_add_rule({path}): {_errno_text()}")


def apply_landlock(workdir: str, roots: list[str], fds: dict[str, int]) -> tuple[int, str | None]:
    """Restrict files to `roots` (read) and `workdir` (read-write, no execute), each given by
    its descriptor in `fds`; TCP and signals beyond the sandbox where the ABI has them.
    Returns (ABI, None) or (ABI, why not)."""
    abi = landlock_abi()
    if abi < 1:
        return 0, f"Landlock not available: {_errno_text()}"
    handled = _handled_fs(abi)
    attr = _RulesetAttr(handled, NET_BIND_TCP | NET_CONNECT_TCP if abi >= 4 else 0,
                        SCOPE_ABSTRACT_UNIX_SOCKET | SCOPE_SIGNAL if abi >= 6 else 0)  # fmt: skip
    size = 8 if abi < 4 else 16 if abi < 6 else 24
    ruleset_fd = _syscall(
        LANDLOCK_CREATE_RULESET, ctypes.byref(attr), ctypes.c_long(size), ctypes.c_long(0)
    )
    if ruleset_fd < 0:
        return abi, f"landlock_create_ruleset: {_errno_text()}"
    try:
        for root in roots:
            if root in fds:
                _allow(ruleset_fd, root, fds[root], FS_READ_FILE | FS_READ_DIR)
        if workdir not in fds:
            return abi, f"{workdir} could not be opened"
        _allow(ruleset_fd, workdir, fds[workdir], handled & ~FS_EXECUTE)
        if _syscall(LANDLOCK_RESTRICT_SELF, ctypes.c_long(ruleset_fd), ctypes.c_long(0)) != 0:
            return abi, f"landlock_restrict_self: {_errno_text()}"
    except OSError as e:
        return abi, str(e)
    finally:
        os.close(ruleset_fd)
    return abi, None


# ---------------------------------------------------------------------------- 6: seccomp

SCMP_ACT_ALLOW = 0x7FFF0000
SCMP_CMP_NE, SCMP_CMP_MASKED_EQ = 1, 7


def _scmp_errno(code: int) -> int:
    return 0x00050000 | (code & 0xFFFF)


class _ArgCmp(ctypes.Structure):
    _fields_ = [
        ("arg", ctypes.c_uint),
        ("op", ctypes.c_int),
        ("datum_a", ctypes.c_uint64),
        ("datum_b", ctypes.c_uint64),
    ]


NOT_THIS_PROCESS = ((0, SCMP_CMP_NE, 0, 0),)
"""The first argument (a pid) is not 0, this process: another process is the target."""

# (syscall, errno, argument comparisons: all must hold); several rules for one call: any.
# clone3 passes its flags in memory, which seccomp cannot read: ENOSYS makes glibc fall back
# to clone, whose flags it can (threads still work).
SECCOMP_RULES: tuple[tuple[str, int, tuple[tuple[int, int, int, int], ...]], ...] = (
    # no new process
    ("fork", errno.EPERM, ()),
    ("vfork", errno.EPERM, ()),
    ("clone", errno.EPERM, ((0, SCMP_CMP_MASKED_EQ, CLONE_THREAD, 0),)),
    ("clone3", errno.ENOSYS, ()),
    # no socket of any family (a unix socket reaches the host's listeners by path, which
    # neither Landlock nor the namespace sees); socketpair, a connected pair, stays
    ("socket", errno.EPERM, ()),
    ("io_uring_setup", errno.ENOSYS, ()),  # io_uring can open sockets without socket()
    # no reaching into another process
    ("ptrace", errno.EPERM, ()),
    ("process_vm_readv", errno.EPERM, ()),
    ("process_vm_writev", errno.EPERM, ()),
    # no limits, priorities, CPUs or scheduling of another process (the same uid as the
    # trainer passes the kernel's permission check: RLIMIT_CPU on it would kill it)
    ("prlimit64", errno.EPERM, NOT_THIS_PROCESS),
    ("setpriority", errno.EPERM, ((0, SCMP_CMP_NE, 0, 0),)),  # PRIO_PGRP / PRIO_USER
    ("setpriority", errno.EPERM, ((1, SCMP_CMP_NE, 0, 0),)),  # another process
    ("sched_setaffinity", errno.EPERM, NOT_THIS_PROCESS),
    ("sched_setscheduler", errno.EPERM, NOT_THIS_PROCESS),
    ("sched_setparam", errno.EPERM, NOT_THIS_PROCESS),
    ("sched_setattr", errno.EPERM, NOT_THIS_PROCESS),
    ("ioprio_set", errno.EPERM, ()),
    # no file metadata changes (Landlock does not cover them: a host file's mode, owner,
    # times or attributes), inside DIR either: a tool's code writes and reads, no more
    *(
        (name, errno.EPERM, ())
        for name in (
            "chmod",
            "fchmod",
            "fchmodat",
            "fchmodat2",
            "chown",
            "fchown",
            "lchown",
            "fchownat",
            "utime",
            "utimes",
            "futimesat",
            "utimensat",
            "setxattr",
            "lsetxattr",
            "fsetxattr",
            "removexattr",
            "lremovexattr",
            "fremovexattr",
        )
    ),  # fmt: skip
    # no kernel keyrings (the caller's session keyring is inherited: its keys readable, a
    # key planted there outliving the call)
    ("keyctl", errno.EPERM, ()),
    ("add_key", errno.EPERM, ()),
    ("request_key", errno.EPERM, ()),
)


def _load_libseccomp():
    lib = ctypes.CDLL("libseccomp.so.2")
    lib.seccomp_init.restype = ctypes.c_void_p
    lib.seccomp_init.argtypes = [ctypes.c_uint32]
    lib.seccomp_rule_add_array.argtypes = [ctypes.c_void_p, ctypes.c_uint32, ctypes.c_int,
                                           ctypes.c_uint, ctypes.POINTER(_ArgCmp)]  # fmt: skip
    lib.seccomp_syscall_resolve_name.argtypes = [ctypes.c_char_p]
    lib.seccomp_load.argtypes = [ctypes.c_void_p]
    lib.seccomp_release.argtypes = [ctypes.c_void_p]
    return lib


def apply_seccomp(lib) -> str | None:
    """Install `SECCOMP_RULES` (everything else allowed); None if done, else why not.
    libseccomp's default for a foreign architecture (i386 syscalls on x86-64) is to kill."""
    if isinstance(lib, str):
        return lib
    ctx = lib.seccomp_init(SCMP_ACT_ALLOW)
    if not ctx:
        return "seccomp_init failed"
    try:
        for name, code, cmps in SECCOMP_RULES:
            number = lib.seccomp_syscall_resolve_name(name.encode())
            if number < 0:  # not on this architecture (e.g. fork on aarch64)
                continue
            array = (_ArgCmp * max(len(cmps), 1))(*[_ArgCmp(*c) for c in cmps])
            rc = lib.seccomp_rule_add_array(ctx, _scmp_errno(code), number, len(cmps), array)
            if rc < 0:
                return f"seccomp_rule_add({name}): {os.strerror(-rc)}"
        rc = lib.seccomp_load(ctx)
        return None if rc == 0 else f"seccomp_load: {os.strerror(-rc)}"
    finally:
        lib.seccomp_release(ctx)


def apply_kernel_layers(workdir: str, config: dict) -> tuple[list[str], list[str]]:
    """Layers 3-6, each as far as the kernel allows: (layers applied, why the others not).
    `config`: `run_as_uid`, `max_threads`, `parent_pid`."""
    layers, missing = [], []
    # Landlock and an unprivileged seccomp filter both require no_new_privs.
    _libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0)
    # All before the uid drop and Landlock: the library and realpath still see the whole
    # tree, and root opens what the new uid could not reach by path.
    roots = read_roots()
    fds = open_paths([*roots, workdir])
    path_fds = open_paths([p for p in sys.path if p and p not in fds and os.path.isdir(p)])
    try:
        seccomp = _load_libseccomp()
    except OSError as e:
        seccomp = f"libseccomp not loadable: {e}"

    def namespaces() -> str | None:
        why = enter_namespaces()
        if why is None:
            bound_threads(config["max_threads"])
        return why

    for name, apply in (
        ("uid", lambda: drop_privileges(workdir, config["run_as_uid"], config["parent_pid"])),
        ("namespaces", namespaces),
        ("landlock", lambda: apply_landlock(workdir, roots, fds)[1]),
        ("seccomp", lambda: apply_seccomp(seccomp)),
    ):
        why = apply()
        (missing if why else layers).append(f"{name}: {why}" if why else name)
    reach_unsearchable({**path_fds, **{p: fds.pop(p) for p in sys.path if p in fds}}, workdir)
    for fd in fds.values():
        os.close(fd)
    return layers, missing


# ---------------------------------------------------------------------------- 7: audit hook

PROCESS_EVENTS = frozenset(
    {"os.fork", "os.forkpty", "os.posix_spawn", "os.exec", "os.spawn", "os.system",
     "subprocess.Popen", "pty.spawn", "os.startfile"}
)  # fmt: skip
# Events whose first argument is a path the code changes (write-side) or lists (read-side).
WRITE_PATH_EVENTS = frozenset(
    {"os.remove", "os.rmdir", "os.mkdir", "os.chmod", "os.chown", "os.truncate", "os.utime",
     "os.link", "os.symlink", "os.rename", "shutil.rmtree", "os.chflags", "os.setxattr",
     "os.removexattr"}
)  # fmt: skip
READ_PATH_EVENTS = frozenset({"os.listdir", "os.scandir", "os.listxattr", "os.getxattr"})
WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND


def _is_under(path: str, root: str) -> bool:
    return path == root or path.startswith(root.rstrip("/") + "/")


def is_ctypes(event: str, args: tuple) -> bool:
    return event.startswith("ctypes.") or (
        event == "import" and args[0].split(".")[0] in ("ctypes", "_ctypes")
    )


def called_from_tool() -> bool:
    """Whether the innermost frame outside the import machinery and ctypes itself is the
    code's own: `import ctypes` in the code is refused, numpy's own use of it is not (numpy
    and sympy import ctypes; the kernel layers bound what any of it can do)."""
    frame = sys._getframe(2)
    while frame is not None:
        name = frame.f_code.co_filename
        if not (name.startswith("<frozen") or f"{os.sep}ctypes{os.sep}" in name):
            return name == "<tool>"
        frame = frame.f_back
    return False


def make_audit_hook(workdir: str, roots: list[str]):
    """A hook refusing, with one-line messages: files outside `workdir` (reads also allowed
    under `roots`), sockets, new processes, ctypes, signals to other processes. PEP 578: the
    code can still reach around it (e.g. through objects already in memory); the kernel
    layers are the boundary, this is for clear observations."""
    realpath, fspath, getpid = os.path.realpath, os.fsdecode, os.getpid
    workdir = realpath(workdir)

    def check_path(path, write: bool) -> None:
        if isinstance(path, int) or path is None:  # an fd the code already holds
            return
        real = realpath(fspath(path))
        allowed = [workdir] if write else [workdir, *roots]
        if not any(_is_under(real, root) for root in allowed):
            raise PermissionError(f"sandbox: {real} is outside its directory")

    def hook(event: str, args: tuple) -> None:
        if event == "open":
            path, mode, flags = args
            write = any(c in (mode or "") for c in "wax+") or bool((flags or 0) & WRITE_FLAGS)
            check_path(path, write)
        elif event in WRITE_PATH_EVENTS or event in READ_PATH_EVENTS:
            if args:
                check_path(args[0], event in WRITE_PATH_EVENTS)
                if event in ("os.rename", "os.link", "os.symlink") and len(args) > 1:
                    check_path(args[1], True)
        elif event in PROCESS_EVENTS:
            raise PermissionError("sandbox: starting a process is not allowed")
        elif event.startswith("socket."):
            raise PermissionError("sandbox: network is not available")
        elif is_ctypes(event, args) and called_from_tool():
            raise PermissionError("sandbox: ctypes is not allowed")
        elif event in ("os.kill", "os.killpg") and args[0] not in (0, getpid()):
            raise PermissionError("sandbox: signalling other processes is not allowed")

    return hook


# ---------------------------------------------------------------------------- running


def run_user_code(code: str) -> None:
    """Run `code` as `__main__` with fresh globals; an exception is printed as a traceback
    without this file's frames and exits 1 (so its last line is the error)."""
    main = types.ModuleType("__main__")
    main.__dict__["__builtins__"] = __builtins__
    sys.modules["__main__"] = main  # this module (which holds ctypes) is no longer reachable
    # The traceback quotes the code's own lines, as it would for a file.
    linecache.cache["<tool>"] = (len(code), None, code.splitlines(True), "<tool>")
    try:
        exec(compile(code, "<tool>", "exec"), main.__dict__)
    except SystemExit:
        raise
    except BaseException as e:  # noqa: BLE001 - KeyboardInterrupt, MemoryError: the code's
        tb = e.__traceback__.tb_next if e.__traceback__ else None
        traceback.print_exception(type(e), e, tb)
        sys.stderr.flush()
        os._exit(1)


def forget_ctypes() -> None:
    """Drop every loaded ctypes module, so that the code's `import ctypes` reaches the hook."""
    for name in [n for n in sys.modules if n.split(".")[0] in ("ctypes", "_ctypes")]:
        del sys.modules[name]


def child_main(workdir: str, status_fd: int, config: dict) -> None:
    die_with_parent(config["parent_pid"])
    set_limits(config["timeout_s"], config["memory_limit_mb"])
    code_path = os.path.join(workdir, CODE_FILE)
    with open(code_path, encoding="utf-8", errors="replace") as f:
        code = f.read()
    os.remove(code_path)  # DIR is the code's own, empty directory
    roots = read_roots()
    layers, missing = apply_kernel_layers(workdir, config)
    with os.fdopen(status_fd, "w") as status:
        if config["isolation"] == "strict" and missing:  # strict: every layer (sandbox.py)
            json.dump({"refused": "; ".join(missing)}, status)
            status.close()
            os._exit(REFUSED_EXIT)
        json.dump({"layers": [*layers, "audit_hook"], "missing": missing}, status)
    sys.dont_write_bytecode = True
    forget_ctypes()
    sys.addaudithook(make_audit_hook(workdir, roots))
    run_user_code(code)


# ---------------------------------------------------------------------------- probe


def _refused(attempt) -> str | None:
    """None if `attempt()` succeeded, else the error it met."""
    try:
        attempt()
    except OSError as e:
        return f"{type(e).__name__}: {e.strerror or e}"
    return None


def _connect(kind: int) -> None:
    with socket.socket(socket.AF_INET, kind) as s:
        s.settimeout(1.0)
        s.connect(("127.0.0.1", 9))
        if kind == socket.SOCK_DGRAM:
            s.send(b"x")


def _tcp_refused() -> str | None:
    why = _refused(lambda: _connect(socket.SOCK_STREAM))
    # Refused by a listening host is not isolation: the network was reached.
    return None if why and "Connection refused" in why else why


def _threads_until_refused(most: int) -> int:
    """Threads (the main one included) this process reaches before a start is refused, up to
    `most` (small stacks: the address-space limit is not what stops them)."""
    threading.stack_size(65536)
    gate, started = threading.Event(), 1
    try:
        while started < most:
            threading.Thread(target=gate.wait, daemon=True).start()
            started += 1
    except RuntimeError:  # "can't start new thread": EAGAIN from clone
        pass
    finally:
        gate.set()
        threading.stack_size(0)
    return started


def _fork() -> None:
    pid = os.fork()
    if pid == 0:
        os._exit(0)
    os.waitpid(pid, 0)


def probe_main(workdir: str, outside_file: str, config: dict) -> None:
    """Apply the kernel layers, then check what they stop; print the report as JSON.
    `outside_file` is readable by anyone: only Landlock keeps it from the code."""
    set_limits(10.0, 1024)
    layers, missing = apply_kernel_layers(workdir, {**config, "parent_pid": os.getppid()})
    checks = {
        "tcp": _tcp_refused(),
        "udp": _refused(lambda: _connect(socket.SOCK_DGRAM)),
        "read_outside": _refused(lambda: open(outside_file).read()),
        "write_inside": _refused(lambda: open("w", "w").write("x")),  # cwd: DIR
        "fork": _refused(_fork),
    }
    try:
        # why: the check itself: a module not yet loaded must still import under the layers
        import fractions  # noqa: F401

        stdlib = None
    except Exception as e:  # noqa: BLE001
        stdlib = f"{type(e).__name__}: {e}"
    threads = _threads_until_refused(config["max_threads"] + 8)
    print(json.dumps({"layers": layers, "missing": missing, "checks": checks, "stdlib": stdlib,
                      "landlock_abi": landlock_abi(), "threads": threads,
                      "max_threads": config["max_threads"]}))  # fmt: skip


if __name__ == "__main__":
    if sys.argv[1] == "--probe":
        probe_main(sys.argv[2], sys.argv[3], json.loads(sys.argv[4]))
    else:
        child_main(sys.argv[1], int(sys.argv[2]), json.loads(sys.argv[3]))
