"""grpokit.tools.sandbox against hostile programs: each test runs a real program and checks that the
harness survives, the deadline holds, and nothing outside the sandbox changed.

Tests marked `namespaced` need working user namespaces and skip, with the reason, where
they are unavailable; the rest also run without namespaces (isolate=False).
"""

import errno
import os
import socket
import subprocess
import sys
import tempfile
import time
import uuid
import warnings
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from grpokit.tools import sandbox
from grpokit.tools.sandbox import SandboxResult, namespace_problem, namespaces_available, run_many, run_python

REPO = Path(__file__).resolve().parents[1]
# Start-up of unshare and two interpreters, plus the drain grace, on a busy machine.
SLACK_S = 5.0

namespaced = pytest.mark.skipif(
    not namespaces_available(), reason=f"namespaces unavailable here: {namespace_problem()}"
)
both_modes = pytest.mark.parametrize(
    "isolate", [pytest.param(True, marks=namespaced, id="namespaces"), pytest.param(False, id="plain")]
)


@pytest.fixture(autouse=True)
def private_tempdir(tmp_path, monkeypatch):
    """This test's sandbox directories only, so another process's runs never look like leftovers."""
    directory = tmp_path / "tmp"
    directory.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(directory))


def _outside_state() -> tuple:
    """What a program must not change: the repository's top level, and leftover sandbox
    directories in the temporary directory (each run removes its own)."""
    tmp = Path(tempfile.gettempdir())
    return (sorted(os.listdir(REPO)), sorted(p.name for p in tmp.glob("grpokit-sandbox-*")))


def attack(code: str, timeout_s: float = 5.0, **options) -> SandboxResult:
    """Run `code`; assert the deadline held and nothing outside the sandbox changed."""
    before = _outside_state()
    start = time.monotonic()
    result = run_python(code, timeout_s=timeout_s, **options)
    wall = time.monotonic() - start
    assert wall < timeout_s + SLACK_S, f"run took {wall:.1f} s with a {timeout_s} s deadline"
    assert _outside_state() == before
    assert result.isolated == (options.get("isolate", True) and namespaces_available())
    return result


def _processes_with(marker: str) -> list[int]:
    """PIDs of the processes whose argv[0] is `marker`."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                cmdline = Path(f"/proc/{entry}/cmdline").read_bytes()
            except OSError:
                continue  # it ended while we looked
            if cmdline.split(b"\0")[0] == marker.encode():  # argv[0]: not a command line that mentions it
                found.append(int(entry))
    return found


def _wait_until_gone(marker: str, within_s: float = 5.0) -> list[int]:
    """The marked processes still alive after `within_s`; those are then killed, so a failing
    test leaves nothing behind."""
    deadline = time.monotonic() + within_s
    while (alive := _processes_with(marker)) and time.monotonic() < deadline:
        time.sleep(0.05)
    for pid in alive:
        os.kill(pid, 9)
    return alive


# --- ordinary programs -------------------------------------------------------------------


@both_modes
def test_program_output(isolate):
    result = attack("print(2 + 3)\nprint('ok')", isolate=isolate)
    assert result.stdout == "5\nok\n"
    assert result.error is None and not result.timed_out and result.returncode == 0


@both_modes
def test_program_runs_as_main_with_a_clean_namespace(isolate):
    """The program runs in the interpreter that set the sandbox up: as `python main.py` would,
    __main__ with argv ["main.py"], none of the set-up's names in its globals, UTF-8 mode on."""
    code = ("import sys\nif __name__ == '__main__':\n    print(sys.argv, __file__, sys.flags.utf8_mode)\n"
            "print(sorted(n for n in globals() if not n.startswith('__')))\n"
            "import pickle\nclass Point: pass\nprint(type(pickle.loads(pickle.dumps(Point()))).__name__)")
    result = attack(code, isolate=isolate)
    assert result.stdout == "['main.py'] main.py 1\n['sys']\nPoint\n", result


@both_modes
def test_exception_gives_last_traceback_line(isolate):
    result = attack("print('before')\nx = 1 / 0", isolate=isolate)
    assert result.error == "ZeroDivisionError: division by zero"
    assert result.stdout == "before\n"
    assert "Traceback" in result.stderr and result.returncode == 1


@both_modes
def test_syntax_error_and_exit_status(isolate):
    assert attack("def f(:\n", isolate=isolate).error == "SyntaxError: invalid syntax"
    assert attack("import sys; sys.exit(3)", isolate=isolate).error == "Exited with status 3"
    assert attack("import sys; sys.exit(0)", isolate=isolate).error is None


@both_modes
def test_invalid_utf8_output_is_replaced(isolate):
    code = "import sys\nsys.stdout.buffer.write(b'\\xff\\xfe ok \\xc3\\n')\nsys.stderr.buffer.write(b'\\x80 bad')\nraise SystemExit(1)"
    result = attack(code, isolate=isolate)
    assert result.stdout == "\ufffd\ufffd ok \ufffd\n"
    assert result.error == "\ufffd bad"


@both_modes
def test_program_sees_an_empty_environment(isolate, monkeypatch):
    secret = f"secret-{uuid.uuid4().hex}"
    monkeypatch.setenv("GRPOKIT_TEST_SECRET", secret)
    result = attack("import os\nprint(sorted(os.environ))\nprint(os.environ.get('GRPOKIT_TEST_SECRET'))", isolate=isolate)
    # Python itself sets LC_CTYPE when it coerces the C locale to UTF-8.
    assert result.stdout == "['LC_CTYPE']\nNone\n"
    assert secret not in result.stdout


def test_run_many_runs_in_parallel_and_keeps_order():
    codes = [f"import time\ntime.sleep(1.0)\nprint({i})" for i in range(6)]
    codes.append("1 / 0")
    start = time.monotonic()
    results = run_many(codes, timeout_s=10, workers=len(codes))
    wall = time.monotonic() - start
    assert [r.stdout for r in results[:6]] == [f"{i}\n" for i in range(6)]
    assert results[6].error == "ZeroDivisionError: division by zero"
    assert wall < 6 * 1.0, f"6 programs sleeping 1 s took {wall:.1f} s: not run in parallel"
    assert run_many([]) == []


def test_limits_must_be_positive():
    with pytest.raises(ValueError, match="timeout_s=0"):
        run_python("print(1)", timeout_s=0)


def test_without_namespaces_warns_once_and_still_runs(monkeypatch):
    # A fresh probe on a PATH without `unshare`: what a machine without util-linux sees.
    monkeypatch.setattr(sandbox, "_ISOLATION", sandbox._Isolation())
    monkeypatch.setenv("PATH", "/nonexistent")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        first = run_python("print('hi')")
        second = run_python("print('hi')")
    assert len([w for w in caught if "WITHOUT network" in str(w.message)]) == 1
    assert "unshare" in sandbox.namespace_problem()
    assert first.stdout == second.stdout == "hi\n"
    assert not first.isolated and not sandbox.namespaces_available()


@given(chunks=st.lists(st.binary(max_size=40), max_size=12), limit=st.integers(1, 64))
def test_capture_keeps_head_and_tail_exactly(chunks, limit):
    capture = sandbox._Capture(limit)
    for chunk in chunks:
        capture.add(chunk)
    data = b"".join(chunks)
    head, tail = limit // 2, limit - limit // 2
    if len(data) <= limit:
        expected = data
    else:
        expected = data[:head] + f"\n[... {len(data) - limit} bytes cut ...]\n".encode() + data[-tail:]
    assert capture.truncated == (len(data) > limit)
    assert capture.text() == expected.decode("utf-8", errors="replace")


# --- resource attacks ----------------------------------------------------------------------


@both_modes
def test_infinite_loop_is_killed_at_the_deadline(isolate):
    start = time.monotonic()
    result = attack("print('start', flush=True)\nwhile True:\n    pass", timeout_s=2.0, isolate=isolate)
    assert result.timed_out and result.returncode is None
    assert result.error.startswith("TimeoutError")
    assert result.stdout == "start\n"
    assert time.monotonic() - start >= 2.0


@both_modes
def test_ten_gigabyte_allocation_fails_with_memory_error(isolate):
    result = attack("x = bytearray(10 * 1024**3)\nprint('allocated')", memory_mb=512, isolate=isolate)
    assert result.error == "MemoryError" and result.stdout == ""
    growing = attack("chunks = []\nwhile True:\n    chunks.append(bytearray(50 * 1024**2))", memory_mb=512, isolate=isolate)
    assert growing.error == "MemoryError" and not growing.timed_out


@both_modes
def test_hundred_megabytes_of_output_are_capped(isolate):
    code = "import sys\nsys.stdout.write('<')\nfor _ in range(100):\n    sys.stdout.write('x' * 10**6)\nsys.stdout.write('>')\nsys.stderr.write('e' * 10**7)"
    result = attack(code, timeout_s=20, isolate=isolate)
    assert result.error is None and result.stdout_truncated
    assert result.stdout.startswith("<xxx") and result.stdout.endswith("xxx>")
    assert f"[... {100 * 10**6 + 2 - sandbox.OUTPUT_LIMIT_BYTES} bytes cut ...]" in result.stdout
    assert len(result.stdout) < sandbox.OUTPUT_LIMIT_BYTES + 100
    assert len(result.stderr) < sandbox.OUTPUT_LIMIT_BYTES + 100


@both_modes
def test_endless_output_is_capped_and_killed(isolate):
    result = attack("while True:\n    print('y' * 1000)", timeout_s=1.0, isolate=isolate)
    assert result.timed_out and len(result.stdout) < sandbox.OUTPUT_LIMIT_BYTES + 100


@both_modes
def test_file_size_is_limited(isolate):
    code = "with open('big.bin', 'wb') as f:\n    f.write(b'0' * (40 * 1024**2))"
    result = attack(code, disk_mb=16, isolate=isolate)
    # The tmpfs fills (namespaces) or the file-size rlimit bites (plain): either way an OSError.
    assert result.error.startswith("OSError: [Errno") and ("27" in result.error or "28" in result.error)


BOMB = """
import os, sys, time
children = 0
for _ in range(300):
    if os.fork() == 0:
        if {escape}:
            os.setsid()  # leaves the process group: only the PID namespace can catch it
        os.execv("/bin/sleep", ["{marker}", "1000"])
    children += 1
print(children, flush=True)
if {wait}:
    time.sleep(1000)
"""


@namespaced
@pytest.mark.parametrize("wait", [True, False], ids=["killed-at-deadline", "program-exits"])
def test_fork_bomb_dies_with_the_namespace(wait):
    marker = f"grpokit-bomb-{uuid.uuid4().hex}"
    result = attack(BOMB.format(escape=True, marker=marker, wait=wait), timeout_s=4.0)
    assert result.stdout == "300\n", result.error
    assert result.timed_out == wait
    assert _wait_until_gone(marker) == []


def test_fork_bomb_without_namespaces_dies_with_the_process_group():
    marker = f"grpokit-bomb-{uuid.uuid4().hex}"
    result = attack(BOMB.format(escape=False, marker=marker, wait=True), timeout_s=4.0, isolate=False)
    assert result.stdout == "300\n" and result.timed_out
    assert _wait_until_gone(marker) == []


@pytest.mark.skipif(os.geteuid() == 0, reason="the kernel does not apply RLIMIT_NPROC to root")
@namespaced
def test_process_count_is_limited():
    code = "import os, time\nn = 0\ntry:\n    for _ in range(200):\n        if os.fork() == 0:\n            time.sleep(1000)\n        n += 1\nexcept OSError as e:\n    print(n, e.errno)"
    result = attack(code, max_processes=50)
    count, err = result.stdout.split()
    assert int(count) < 50 and int(err) == errno.EAGAIN


@both_modes
def test_program_dies_with_its_harness(isolate, tmp_path):
    """A harness killed mid-run (kill -9, out of memory) leaves no sandboxed program behind."""
    marker = f"grpokit-orphan-{uuid.uuid4().hex}"
    program = f"import os\nos.execv('/bin/sleep', [{marker!r}, '1000'])"
    # The harness loads sandbox.py alone, so it starts without importing torch.
    harness_code = (
        "import importlib.util, sys\n"
        f"spec = importlib.util.spec_from_file_location('sandbox_alone', {sandbox.__file__!r})\n"
        "module = sys.modules['sandbox_alone'] = importlib.util.module_from_spec(spec)\n"
        "spec.loader.exec_module(module)\n"
        f"module.run_python({program!r}, timeout_s=120, isolate={isolate})\n"
    )
    # The killed harness cannot remove its temporary directory: keep it in tmp_path.
    harness = subprocess.Popen([sys.executable, "-c", harness_code], env={**os.environ, "TMPDIR": str(tmp_path)})
    try:
        deadline = time.monotonic() + 30
        while not _processes_with(marker) and time.monotonic() < deadline and harness.poll() is None:
            time.sleep(0.05)
        assert _processes_with(marker), "the sandboxed program never started"
    finally:
        harness.kill()
        harness.wait()
    assert _wait_until_gone(marker) == []


# --- escapes -------------------------------------------------------------------------------


@namespaced
def test_network_is_unreachable():
    with socket.create_server(("127.0.0.1", 0)) as server:
        port = server.getsockname()[1]
        code = (
            "import socket\ntry:\n"
            f"    socket.create_connection(('127.0.0.1', {port}), timeout=2)\n    print('connected')\n"
            "except OSError as e:\n    print('refused', e.errno)"
        )
        # Control: without namespaces the same program reaches the listener.
        assert attack(code, isolate=False).stdout == "connected\n"
        server.accept()[0].close()
        result = attack(code)
        assert result.stdout == f"refused {errno.ENETUNREACH}\n"
        server.settimeout(0.2)
        with pytest.raises(TimeoutError):
            server.accept()


@namespaced
def test_writes_outside_the_sandbox_leave_no_trace():
    name = f"grpokit-escape-{uuid.uuid4().hex}"
    targets = [REPO / name, Path(tempfile.gettempdir()) / name, Path("/dev/shm") / name, Path.cwd() / "tests" / name]
    code = (
        f"import os\nfor path in {[str(t) for t in targets]!r} + ['../{name}', '../../{name}']:\n"
        "    try:\n        open(path, 'w').write('escaped')\n        print('wrote', path)\n"
        "    except OSError as e:\n        print('blocked', e.errno)\n"
        "open('inside.txt', 'w').write('fine')\nprint(open('inside.txt').read())"
    )
    result = attack(code)
    try:
        # /tmp inside is the sandbox's own tmpfs: writing there works and vanishes with it.
        tmp_target = Path(tempfile.gettempdir()) / name
        wrote = [line for line in result.stdout.splitlines() if line.startswith("wrote")]
        assert wrote in ([], [f"wrote {tmp_target}"]), wrote
        assert result.stdout.endswith("fine\n")
        assert [t for t in targets if t.exists()] == []
    finally:
        for t in targets:
            t.unlink(missing_ok=True)


@namespaced
def test_files_of_the_caller_cannot_be_deleted(tmp_path):
    precious = [tmp_path / "precious.txt", REPO / f".grpokit-precious-{uuid.uuid4().hex}"]
    for p in precious:
        p.write_text("keep")
    code = (
        "import os, shutil\n"
        f"for path in {[str(p) for p in precious]!r}:\n"
        "    for target in (path, os.path.relpath(path)):\n"
        "        try:\n            os.remove(target)\n            print('deleted', target)\n"
        "        except OSError as e:\n            print('blocked', e.errno)\n"
        f"shutil.rmtree({str(tmp_path)!r}, ignore_errors=True)\n"
        f"shutil.rmtree(os.path.relpath({str(tmp_path)!r}), ignore_errors=True)"
    )
    try:
        result = attack(code)
        assert "deleted" not in result.stdout and result.error is None
        assert all(p.read_text() == "keep" for p in precious)
    finally:
        precious[1].unlink(missing_ok=True)


@namespaced
def test_read_only_filesystem_cannot_be_undone():
    name = f"grpokit-remount-{uuid.uuid4().hex}"
    code = f"""
import ctypes, os
libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
class MountAttr(ctypes.Structure):
    _fields_ = [(n, ctypes.c_uint64) for n in ("attr_set", "attr_clr", "propagation", "userns_fd")]
attr = MountAttr(0, 1, 0, 0)  # clear MOUNT_ATTR_RDONLY
print("clear read-only", libc.syscall(442, -100, b"/", 0x8000, ctypes.byref(attr), ctypes.sizeof(attr)))
print("remount /", libc.mount(None, b"/", None, 32 | 4096, None))  # MS_REMOUNT | MS_BIND
print("unmount /proc", libc.umount2(b"/proc", 2))
for path in ("/{name}", {str(REPO / name)!r}):
    try:
        open(path, "w").write("x")
        print("wrote", path)
    except OSError as e:
        print("blocked", e.errno)
"""
    result = attack(code)
    assert result.stdout.splitlines()[:3] == ["clear read-only -1", "remount / -1", "unmount /proc -1"]
    assert "wrote" not in result.stdout
    assert not (REPO / name).exists() and not Path("/", name).exists()


@namespaced
def test_program_cannot_kill_the_harness_or_its_neighbours():
    neighbour = subprocess.Popen(["sleep", "60"])
    try:
        code = f"""
import os, signal
print("ppid", os.getppid(), "pid", os.getpid(), flush=True)
# The harness and a neighbour by PID; then everyone (only once we know we are PID 1 of our
# own namespace, where kill(-1) cannot leave it); then our parent, as getppid() names it.
targets = [{os.getpid()}, {neighbour.pid}] + ([-1] if os.getpid() == 1 else []) + [os.getppid()]
for pid in targets:
    try:
        os.kill(pid, signal.SIGKILL)
        print("signalled", pid, flush=True)
    except OSError as e:
        print("blocked", e.errno, flush=True)
"""
        result = attack(code)
        lines = result.stdout.splitlines()
        assert lines[0] == "ppid 0 pid 1"
        # kill(0) reaches only its own session inside the namespace, where PID 1 ignores it.
        assert lines[1:] == [f"blocked {errno.ESRCH}"] * 3 + ["signalled 0"], lines
        assert result.error is None
        assert neighbour.poll() is None
    finally:
        neighbour.kill()
        neighbour.wait()


@namespaced
def test_caller_processes_and_environment_are_invisible():
    code = """
import os
pids = sorted(int(p) for p in os.listdir('/proc') if p.isdigit())
print(pids)
for pid in pids:
    try:
        if b'PATH=' in open(f'/proc/{pid}/environ', 'rb').read():
            print('foreign environment', pid)
    except OSError:
        pass
"""
    result = attack(code)
    assert result.stdout == "[1]\n"
