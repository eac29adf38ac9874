"""Run model-written Python programs: a fresh process each, no network, a deadline, rlimits.

Each program runs in a fresh `python -I -B -X utf8` process with an empty environment and
stdin from /dev/null: a short trusted prologue sets the sandbox up from the inside, then the
same interpreter runs the program as `__main__` (one interpreter start per program, not two). When Linux namespaces work (`unshare` from util-linux, user namespaces
allowed, Linux >= 5.12), it runs inside new user, network, PID, mount, IPC and UTS namespaces:

    network      only a loopback interface that is down: every connect fails (ENETUNREACH)
    processes    the program is PID 1 of its own PID namespace; it cannot see or signal the
                 caller (getppid() is 0), and when it ends or is killed every process it
                 started dies with it, including ones that called setsid()
    filesystem   everything is read-only except /tmp, a fresh tmpfs of `disk_mb` MiB that is
                 also the working directory; /proc shows only the sandbox's processes.
                 A nested user namespace locks the read-only mounts so the program cannot
                 undo them. Files stay readable.

Without namespaces the program runs in a plain child process, in a temporary directory,
with the same rlimits and deadline, but with the network, the filesystem and the caller's
processes reachable; `namespaces_available()` tells which, and a warning says so once.

Limits in both cases: address space (`memory_mb`, so a large allocation raises MemoryError),
CPU time (a backstop behind the wall-clock deadline), file size, open files, no core files,
and the number of processes. The kernel never applies that last limit to root (uid 0), so a
harness running as root contains forks only by the deadline and the PID namespace.

At the deadline the sandbox's process group is killed with SIGKILL; under namespaces that
is `unshare`, whose death takes the whole PID namespace with it. A program also dies with
its caller (a parent-death signal), so a harness killed mid-run leaves nothing behind.
stdout and stderr are read as they come; past `output_limit_bytes` only the head and the
tail are kept, so a program printing 100 MB neither fills memory nor blocks.
"""

from __future__ import annotations

import math
import os
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

OUTPUT_LIMIT_BYTES = 64 * 1024
# How long to keep reading after the program ended or was killed, for its last output.
_DRAIN_GRACE_S = 2.0
_POLL_S = 0.05

# The first code the child runs (trusted): it finishes the sandbox from the inside, then runs
# the program as __main__ in the same interpreter (a second interpreter start per program
# doubled the cost of a short one). Kept in this string, not a module, so the child never
# imports grpokit (and torch with it). A setup failure exits 125 with SandboxSetupError;
# from the program on, exceptions and exits are the program's own.
_BOOTSTRAP = r"""
import ctypes, os, resource, sys, types

MS_NOSUID, MS_NODEV = 0x2, 0x4
PR_SET_PDEATHSIG = 1
CLONE_NEWNS, CLONE_NEWUSER = 0x00020000, 0x10000000
AT_FDCWD, AT_RECURSIVE, MOUNT_ATTR_RDONLY = -100, 0x8000, 0x1
SYS_MOUNT_SETATTR = 442  # Linux 5.12; one number on every architecture but alpha


class MountAttr(ctypes.Structure):
    _fields_ = [("attr_set", ctypes.c_uint64), ("attr_clr", ctypes.c_uint64),
                ("propagation", ctypes.c_uint64), ("userns_fd", ctypes.c_uint64)]


def isolate_filesystem(code, disk_mb):
    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall.restype = ctypes.c_long

    def check(rc, what):
        if rc != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"{what}: {os.strerror(err)}")

    def set_read_only(path, read_only, flags):
        attr = MountAttr(MOUNT_ATTR_RDONLY if read_only else 0, 0 if read_only else MOUNT_ATTR_RDONLY, 0, 0)
        check(libc.syscall(SYS_MOUNT_SETATTR, AT_FDCWD, path, flags, ctypes.byref(attr), ctypes.sizeof(attr)),
              f"mount_setattr {path.decode()}")

    options = f"size={disk_mb}m,mode=0700".encode()
    check(libc.mount(b"tmpfs", b"/tmp", b"tmpfs", MS_NOSUID | MS_NODEV, options), "mount a tmpfs on /tmp")
    set_read_only(b"/", True, AT_RECURSIVE)
    set_read_only(b"/tmp", False, 0)
    os.chdir("/tmp")
    with open("main.py", "wb") as f:
        f.write(code)
    # Mounts copied into a namespace owned by a less privileged user namespace have their
    # read-only flag locked, and the program holds no capability over this one.
    check(libc.unshare(CLONE_NEWUSER | CLONE_NEWNS), "unshare a nested user namespace")


def set_up(program, isolate, disk_mb, caller, limits):  # isolate, limit; return the program's source
    with open(program, "rb") as f:
        code = f.read()
    if isolate == "1":
        isolate_filesystem(code, int(disk_mb))
        # A session of its own inside the namespace: kill(0) cannot reach the `unshare`
        # outside. The caller kills `unshare`, which takes the namespace down with it.
        os.setsid()
    else:
        # Die with the caller (its thread, to be exact) instead of running on unattended.
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, 9)
        if os.getppid() != int(caller):
            os._exit(1)  # the caller ended before prctl took effect
        os.chdir(os.path.dirname(program))
    for limit in limits.split(","):
        name, value = limit.split("=")
        resource.setrlimit(getattr(resource, name), (int(value), int(value)))
    return code


try:  # arguments: program path, isolate (1/0), disk MiB, caller PID, NAME=value,... (json costs an import)
    _source = set_up(*sys.argv[1:])
except BaseException as e:
    sys.stderr.write(f"SandboxSetupError: {e}\n")
    sys.stderr.flush()
    os._exit(125)
# The program runs as `python main.py` would run it: a fresh __main__ module, argv ["main.py"].
sys.argv = ["main.py"]
_main = sys.modules["__main__"] = types.ModuleType("__main__")
_main.__file__ = "main.py"
exec(compile(_source, "main.py", "exec"), _main.__dict__)
"""

_UNSHARE_FLAGS = ["--user", "--map-root-user", "--net", "--pid", "--fork", "--kill-child",
                  "--mount", "--mount-proc", "--ipc", "--uts"]


@dataclass
class SandboxResult:
    """What one program did.

    stdout: its standard output, decoded as UTF-8 with invalid bytes replaced; past the
        output limit, the head and the tail with a "[... N bytes cut ...]" line between.
    error: None when it exited with status 0; else the last line of its stderr (for an
        exception, the traceback's last line, e.g. "ZeroDivisionError: division by zero";
        "MemoryError" past the memory limit), or a note for a timeout or a signal.
    timed_out: True when it was killed at the deadline.
    isolated: True when it ran inside the namespaces (no network, read-only filesystem).
    returncode: the exit status; -N for signal N; None when it timed out.
    stderr: its standard error, capped like stdout (the whole traceback, for a log).
    stdout_truncated: True when the middle of stdout was cut.
    seconds: wall time from its start to its end (or its kill).
    """

    stdout: str
    error: str | None
    timed_out: bool
    isolated: bool
    returncode: int | None = None
    stderr: str = ""
    stdout_truncated: bool = False
    seconds: float = 0.0


class _Capture:
    """Keeps the first `head_limit` and the last `tail_limit` bytes of a stream."""

    def __init__(self, limit: int):
        self.head_limit = limit // 2
        self.tail_limit = limit - self.head_limit
        self.head = bytearray()
        self.tail = bytearray()
        self.total = 0

    def add(self, data: bytes) -> None:
        self.total += len(data)
        room = self.head_limit - len(self.head)
        if room > 0:
            self.head += data[:room]
            data = data[room:]
        self.tail += data
        if len(self.tail) > 2 * self.tail_limit:  # trim rarely, so a byte is copied O(1) times
            del self.tail[: -self.tail_limit]

    @property
    def truncated(self) -> bool:
        return self.total > self.head_limit + self.tail_limit

    def text(self) -> str:
        tail = bytes(self.tail[-self.tail_limit :]) if self.tail_limit else b""
        if self.truncated:
            cut = self.total - len(self.head) - len(tail)
            middle = f"\n[... {cut} bytes cut ...]\n".encode()
            return (bytes(self.head) + middle + tail).decode("utf-8", errors="replace")
        return (bytes(self.head) + bytes(self.tail)).decode("utf-8", errors="replace")


class _Isolation:
    """Whether namespaces work here, found once by running a real program in them."""

    def __init__(self):
        self._lock = threading.Lock()
        self._checked = False
        self._warned = False
        self.available = False
        self.problem: str | None = None
        self.launcher: list[str] | None = None  # the command that starts a program in namespaces

    def check(self) -> bool:
        with self._lock:
            if not self._checked:
                self.available, self.problem = self._probe()
                self._checked = True
            return self.available

    def _probe(self) -> tuple[bool, str | None]:
        if not sys.platform.startswith("linux"):
            return False, f"namespaces need Linux, this is {sys.platform}"
        unshare, setpriv = shutil.which("unshare"), shutil.which("setpriv")
        if unshare is None:
            return False, "the `unshare` command (util-linux) is not installed"
        # setpriv (util-linux too) makes `unshare`, and so the namespace, die with the caller.
        launchers = ([[setpriv, "--pdeathsig", "KILL"]] if setpriv else []) + [[]]
        for prefix in launchers:
            launcher = [*prefix, unshare, *_UNSHARE_FLAGS]
            result = _run("print('sandbox ok')", 30.0, 1024, disk_mb=4, output_limit_bytes=OUTPUT_LIMIT_BYTES,
                          max_processes=64, launcher=launcher)
            if result.returncode == 0 and result.stdout == "sandbox ok\n":
                self.launcher = launcher
                return True, None
        return False, f"a test program in namespaces failed: {result.error or result.stdout[-200:]!r}"

    def warn_once(self) -> None:
        with self._lock:
            if self._warned:
                return
            self._warned = True
        warnings.warn(
            f"grpokit.tools.sandbox: programs run WITHOUT network, PID and filesystem isolation ({self.problem}). "
            "To isolate them, install util-linux's `unshare` and allow unprivileged user namespaces "
            "(sysctl kernel.unprivileged_userns_clone=1 or user.max_user_namespaces>0; on Ubuntu also "
            "kernel.apparmor_restrict_unprivileged_userns=0).",
            RuntimeWarning,
            stacklevel=3,
        )


_ISOLATION = _Isolation()


def namespaces_available() -> bool:
    """True when programs can run in their own namespaces here (checked once, by running one)."""
    return _ISOLATION.check()


def namespace_problem() -> str | None:
    """Why namespaces are unavailable, or None when they work."""
    _ISOLATION.check()
    return _ISOLATION.problem


def run_python(
    code: str,
    timeout_s: float = 10.0,
    memory_mb: int = 1024,
    *,
    isolate: bool = True,
    disk_mb: int = 64,
    output_limit_bytes: int = OUTPUT_LIMIT_BYTES,
    max_processes: int = 256,
) -> SandboxResult:
    """Run one program and return what it printed and how it ended.

    isolate: use namespaces when they work here (see `namespaces_available`); False runs the
        program without them (rlimits and the deadline still hold).
    disk_mb: size of the program's /tmp under namespaces, and the largest file it may write.
    max_processes: processes and threads it may have at once (not enforced for root).
    """
    if timeout_s <= 0 or memory_mb <= 0 or disk_mb <= 0 or output_limit_bytes <= 0 or max_processes <= 0:
        raise ValueError(
            "run_python needs positive limits, got "
            f"timeout_s={timeout_s}, memory_mb={memory_mb}, disk_mb={disk_mb}, "
            f"output_limit_bytes={output_limit_bytes}, max_processes={max_processes}"
        )
    use_namespaces = isolate and _ISOLATION.check()
    if isolate and not use_namespaces:
        _ISOLATION.warn_once()
    return _run(code, timeout_s, memory_mb, disk_mb=disk_mb, output_limit_bytes=output_limit_bytes,
                max_processes=max_processes, launcher=_ISOLATION.launcher if use_namespaces else None)


def run_many(
    codes: Sequence[str],
    timeout_s: float = 10.0,
    memory_mb: int = 1024,
    workers: int | None = None,
    **options,
) -> list[SandboxResult]:
    """run_python over `codes` with up to `workers` programs at a time (default: one per CPU);
    results in the order of `codes`. `options` go to run_python."""
    codes = list(codes)
    if not codes:
        return []
    workers = max(1, min(len(codes), workers or os.cpu_count() or 1))
    namespaces_available()  # probe once here, not in every worker thread at the same time
    with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="grpokit-sandbox") as pool:
        return list(pool.map(lambda code: run_python(code, timeout_s, memory_mb, **options), codes))


def _limits(timeout_s: float, memory_mb: int, disk_mb: int, max_processes: int, isolate: bool) -> dict[str, int]:
    cpu_s = math.ceil(timeout_s) + 1  # the wall-clock deadline comes first; this is a backstop
    limits = {
        "RLIMIT_AS": memory_mb * 1024 * 1024,
        "RLIMIT_CPU": cpu_s,
        "RLIMIT_FSIZE": disk_mb * 1024 * 1024,
        "RLIMIT_NOFILE": 256,
        "RLIMIT_CORE": 0,
    }
    if isolate:
        # Inside its own user namespace the count covers the sandbox's processes only; outside,
        # it would count every process of this user, the caller's included.
        limits["RLIMIT_NPROC"] = max_processes
    return limits


def _run(code: str, timeout_s: float, memory_mb: int, *, disk_mb: int, output_limit_bytes: int,
         max_processes: int, launcher: list[str] | None) -> SandboxResult:
    """Run `code` in namespaces with `launcher`, or without them when it is None."""
    isolate = launcher is not None
    started = time.monotonic()
    workdir = tempfile.mkdtemp(prefix="grpokit-sandbox-")
    try:
        program = os.path.join(workdir, "main.py")
        with open(program, "w", encoding="utf-8", errors="surrogatepass") as f:
            f.write(code)
        limits = ",".join(f"{name}={value}" for name, value in
                          _limits(timeout_s, memory_mb, disk_mb, max_processes, isolate).items())
        command = [sys.executable, "-I", "-B", "-X", "utf8", "-c", _BOOTSTRAP, program, str(int(isolate)),
                   str(disk_mb), str(os.getpid()), limits]
        if isolate:
            command = [*launcher, *command]
        proc = subprocess.Popen(
            command,
            cwd=workdir,
            env={},
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            close_fds=True,
            start_new_session=True,  # its own process group, killed as one
        )
        stdout, stderr = _Capture(output_limit_bytes), _Capture(output_limit_bytes)
        timed_out = _collect(proc, time.monotonic() + timeout_s, stdout, stderr)
        returncode = proc.wait()
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    return SandboxResult(
        stdout=stdout.text(),
        error=_error_line(timed_out, returncode, stderr.text(), timeout_s),
        timed_out=timed_out,
        isolated=isolate,
        returncode=None if timed_out else returncode,
        stderr=stderr.text(),
        stdout_truncated=stdout.truncated,
        seconds=time.monotonic() - started,
    )


def _exited(pid: int) -> bool:
    """Whether the child has exited, without reaping it: while it is a zombie its PID, and
    so its process group's ID, cannot be reused, which keeps killpg safe."""
    return os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _exit_notifier(pid: int) -> int | None:
    """A pidfd that turns readable when `pid` exits (Linux >= 5.3), so the wait for a short
    program's end costs no polling delay; None where there is none (then poll every _POLL_S)."""
    try:
        return os.pidfd_open(pid)
    except (AttributeError, OSError):
        return None


def _collect(proc: subprocess.Popen, deadline: float, stdout: _Capture, stderr: _Capture) -> bool:
    """Read both pipes until the program ends or the deadline passes; kill what is left of
    its process group either way. Returns whether the deadline passed."""
    exit_fd = _exit_notifier(proc.pid)
    with selectors.DefaultSelector() as selector:
        for stream, capture in ((proc.stdout, stdout), (proc.stderr, stderr)):
            os.set_blocking(stream.fileno(), False)
            selector.register(stream, selectors.EVENT_READ, capture)
        if exit_fd is not None:
            selector.register(exit_fd, selectors.EVENT_READ, None)
        timed_out = False
        drain_until = None  # set once the program has ended or been killed
        try:
            while True:
                now = time.monotonic()
                if drain_until is None:
                    if _exited(proc.pid):
                        _kill_group(proc.pid)  # children it left behind (no PID namespace)
                        drain_until = now + _DRAIN_GRACE_S
                    elif now >= deadline:
                        timed_out = True
                        _kill_group(proc.pid)
                        drain_until = now + _DRAIN_GRACE_S
                open_pipes = any(key.data is not None for key in selector.get_map().values())
                if drain_until is not None and (not open_pipes or now >= drain_until):
                    break  # past the grace, a process that escaped the group may still hold a pipe
                wait = max(0.0, (deadline if drain_until is None else drain_until) - now)
                if exit_fd is None or drain_until is not None:
                    wait = min(wait, _POLL_S)
                if not selector.get_map():  # nothing to wait on: wait for its end or the deadline
                    time.sleep(wait)
                    continue
                for key, _ in selector.select(wait):
                    if key.data is None:  # the pidfd: the program has exited (checked above next round)
                        selector.unregister(key.fileobj)
                        continue
                    data = os.read(key.fd, 65536)
                    if data:
                        key.data.add(data)
                    else:
                        selector.unregister(key.fileobj)
        finally:
            if exit_fd is not None:
                os.close(exit_fd)
    proc.stdout.close()
    proc.stderr.close()
    return timed_out


def _error_line(timed_out: bool, returncode: int, stderr: str, timeout_s: float) -> str | None:
    if timed_out:
        return f"TimeoutError: the program ran past its {timeout_s:g} s deadline and was killed"
    if returncode == 0:
        return None
    lines = [line.strip() for line in stderr.splitlines() if line.strip()]
    if lines:
        return lines[-1]
    if returncode < 0:
        try:
            name = signal.Signals(-returncode).name
        except ValueError:
            name = f"signal {-returncode}"
        return f"Killed by {name}" + (" (CPU time limit)" if name == "SIGXCPU" else "")
    return f"Exited with status {returncode}"
