"""Run math-verify in persistent worker processes, with a deadline per job, from any thread.

math-verify's own timeouts use signal.alarm, which works only in the main thread, and even
there cannot stop arithmetic that runs inside C (9**9**9 on Python ints). So equivalence
checks run in worker processes (`_verify_worker.py`), each in its own main thread:

    soft deadline  timeout_s             the worker's interval timer stops sympy; it answers "timeout"
    hard deadline  timeout_s + grace_s   the pool kills the worker, answers "timeout", starts a new one

Workers live as long as the pool, so interpreter start-up and reference parsing are paid
once, not per call. A pool serves one batch at a time (calls from several threads queue on
a lock) and, in a forked child, starts its own workers instead of sharing the parent's.
"""

from __future__ import annotations

import importlib.util
import json
import os
import selectors
import subprocess
import sys
import threading
import time
import weakref
from collections import deque
from pathlib import Path

VERDICTS = ("yes", "no", "timeout", "error")
_WORKER_SCRIPT = Path(__file__).with_name("_verify_worker.py")
# `python -c` instead of `python script.py`: running a script would put this package's folder
# first on the worker's sys.path, where its module names could shadow libraries.
_BOOT = "import runpy, sys; del sys.path[0]; sys.argv = sys.argv[1:]; runpy.run_path(sys.argv[0], run_name='__main__')"


class WorkerStartError(RuntimeError):
    """No verification worker could be started."""


class _Worker:
    """One worker process and the job it is running (index into the batch, or None)."""

    def __init__(self, command: list[str], start_timeout_s: float):
        self.proc = subprocess.Popen(
            command,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            close_fds=True,
            start_new_session=True,  # a terminal's Ctrl-C goes to the trainer, not to workers
        )
        os.set_blocking(self.proc.stdout.fileno(), False)
        self.owner = os.getpid()
        self.buffer = b""
        self.ready = self.exited = False
        self.job: int | None = None
        self.deadline = time.monotonic() + start_timeout_s  # for start-up, then per job

    def send(self, index: int, message: dict, deadline: float) -> bool:
        try:
            self.proc.stdin.write((json.dumps(message) + "\n").encode())
            self.proc.stdin.flush()
        except (BrokenPipeError, OSError):
            return False
        self.job, self.deadline = index, deadline
        return True

    def read_messages(self) -> list[dict] | None:
        """Complete lines received so far; None once the worker has exited."""
        try:
            chunk = os.read(self.proc.stdout.fileno(), 1 << 16)
        except BlockingIOError:  # spurious wake-up: nothing yet, and not an exit
            return []
        if not chunk:
            self.exited = True
            return None
        self.buffer += chunk
        *lines, self.buffer = self.buffer.split(b"\n")
        out = []
        for line in lines:
            try:
                out.append(json.loads(line))
            except ValueError:
                out.append({"verdict": "error", "detail": f"unreadable worker output {line[:80]!r}"})
        return out

    def kill(self) -> None:
        if os.getpid() != self.owner:  # a forked child must not stop its parent's workers
            return
        if self.proc.poll() is None:
            self.proc.kill()
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            pass
        for stream in (self.proc.stdin, self.proc.stdout):
            try:
                stream.close()
            except OSError:
                pass


class VerifierPool:
    """Persistent math-verify workers; `run` judges a batch of (gold, preds) jobs.

    workers: processes (default: min(4, CPU count)); timeout_s: soft deadline per job;
    grace_s: extra time before a worker that ignores its deadline is killed and replaced;
    memory_mb: address-space limit of each worker (0: none).
    """

    def __init__(
        self,
        workers: int | None = None,
        timeout_s: float = 3.0,
        grace_s: float = 2.0,
        memory_mb: int = 4096,
        start_timeout_s: float = 60.0,
    ):
        if timeout_s <= 0 or grace_s < 0:
            raise ValueError(f"need timeout_s > 0 and grace_s >= 0, got {timeout_s}, {grace_s}")
        self.size = workers if workers is not None else max(1, min(4, os.cpu_count() or 1))
        if self.size < 1:
            raise ValueError(f"workers must be >= 1, got {workers}")
        self.timeout_s, self.grace_s = float(timeout_s), float(grace_s)
        self.memory_mb, self.start_timeout_s = int(memory_mb), float(start_timeout_s)
        self._workers: list[_Worker] = []
        self._lock = threading.Lock()
        self._pid = os.getpid()
        self.restarts = 0  # workers killed or lost and replaced, over the pool's life
        # Stops the workers when the pool is garbage-collected or the interpreter exits.
        self._finalizer = weakref.finalize(self, _stop_all, self._workers)

    def _command(self) -> list[str]:
        spec = importlib.util.find_spec("math_verify")
        if spec is None or not spec.submodule_search_locations:
            raise WorkerStartError("math-verify is not installed; pip install math-verify")
        # The worker must find math_verify wherever this process found it.
        site = str(Path(list(spec.submodule_search_locations)[0]).parent)
        return [sys.executable, "-c", _BOOT, str(_WORKER_SCRIPT), str(self.memory_mb), site]

    def _spawn(self) -> _Worker:
        command = self._command()
        try:
            return _Worker(command, self.start_timeout_s)
        except OSError as err:
            raise WorkerStartError(f"cannot start a verification worker: {err}") from err

    def run(self, jobs: list[tuple[str, list[str]]]) -> list[str]:
        """One verdict per (gold, preds) job, in order: "yes" when every pred is equivalent
        to gold, "no", "timeout" (a deadline passed), or "error" (math-verify raised, or the
        worker died on it twice). Raises WorkerStartError only when no worker can start at all."""
        if not jobs:
            return []
        with self._lock:
            if os.getpid() != self._pid:  # forked: the workers belong to the parent
                self._workers.clear()
                self._pid = os.getpid()
            try:
                while len(self._workers) < min(self.size, len(jobs)):
                    self._workers.append(self._spawn())
                return self._run_locked(jobs)
            except BaseException:  # workers may hold half-done jobs: start clean next time
                self.close()
                raise

    def _run_locked(self, jobs: list[tuple[str, list[str]]]) -> list[str]:
        verdicts: list[str | None] = [None] * len(jobs)
        queue = deque(range(len(jobs)))
        retried = [0] * len(jobs)
        failed_starts = 0
        with selectors.DefaultSelector() as selector:
            for w in self._workers:
                selector.register(w.proc.stdout, selectors.EVENT_READ, w)
            while queue or any(w.job is not None for w in self._workers):
                now = time.monotonic()
                for w in self._workers:
                    if w.ready and w.job is None and queue:
                        i = queue.popleft()
                        gold, preds = jobs[i]
                        message = {"gold": gold, "preds": list(preds), "budget_s": self.timeout_s}
                        if not w.send(i, message, now + self.timeout_s + self.grace_s):
                            queue.appendleft(i)
                            w.deadline = now  # dead pipe: replaced below
                wait = max(0.0, min(w.deadline for w in self._workers) - time.monotonic())
                for key, _ in selector.select(timeout=wait):
                    w = key.data
                    messages = w.read_messages()
                    if messages is None:  # exited: the deadline check below replaces it
                        w.deadline = 0.0
                        continue
                    for message in messages:
                        if message.get("ready"):
                            w.ready, w.deadline, failed_starts = True, float("inf"), 0
                        elif not w.ready:
                            raise WorkerStartError(f"verification worker failed to start: {message.get('detail')}")
                        elif w.job is not None:
                            verdict = message.get("verdict")
                            verdicts[w.job] = verdict if verdict in VERDICTS else "error"
                            w.job, w.deadline = None, float("inf")
                now = time.monotonic()
                for k, w in enumerate(self._workers):
                    if w.deadline > now:
                        continue
                    if not w.ready:
                        failed_starts += 1
                        if failed_starts > 3:
                            raise WorkerStartError(
                                f"verification workers keep failing to start (exit code {w.proc.poll()}, "
                                f"start timeout {self.start_timeout_s:g}s)"
                            )
                    if w.job is not None and not w.exited:  # ignored its deadline
                        verdicts[w.job] = "timeout"
                    elif w.job is not None:  # died mid-job: one more try on a fresh worker
                        retried[w.job] += 1
                        if retried[w.job] > 1:
                            verdicts[w.job] = "error"
                        else:
                            queue.appendleft(w.job)
                    selector.unregister(w.proc.stdout)
                    w.kill()
                    self.restarts += 1
                    self._workers[k] = self._spawn()
                    selector.register(self._workers[k].proc.stdout, selectors.EVENT_READ, self._workers[k])
        return [v or "error" for v in verdicts]

    def close(self) -> None:
        """Stop the workers. The pool starts new ones if used again."""
        _stop_all(self._workers)


def _stop_all(workers: list[_Worker]) -> None:
    for w in workers:
        w.kill()
    workers.clear()
