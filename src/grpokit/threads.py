"""How many CPU threads torch uses in a loop, chosen by timing the loop's own steps.

On a small machine shared with other jobs, two OpenMP threads on two cores can run a
training step several times slower than one thread: every parallel region waits for a
thread the scheduler has parked. On a quiet machine two threads are faster. Neither is
right for both, and which one holds changes while a run goes on, so `ThreadTuner` times a
few steps at each thread count, runs with the fastest, and checks again now and then.

Switching must not change results. torch's elementwise operations and reductions in the
tiny model's training step and in generation give the same bits at any thread count (the
tests run both pinned to 1 and 2 threads and switching), but MKL splits long matrix products
(a weight gradient sums over every token of the batch) across threads, which changes the
last bits of the sum; over a long training run that grows into a different model. MKL's
strict conditional numerical reproducibility mode (MKL_CBWR=AUTO,STRICT) keeps its products
the same at any thread count, at no measurable cost here. MKL reads that setting at its
first call, so `request_thread_independent_blas` asks for it before a loop's first product,
and the tuner switches only when `blas_thread_independent` confirms that products agree bit
for bit; otherwise it leaves the thread count alone.
"""

from __future__ import annotations

import contextlib
import os
import statistics
import time

import torch

THREADS_ENV = ("OMP_NUM_THREADS", "MKL_NUM_THREADS")
MKL_REPRODUCIBLE = ("MKL_CBWR", "AUTO,STRICT")


def usable_cpus() -> int:
    """CPUs this process may run on (its affinity mask, not the machine's count)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # no sched_getaffinity (macOS, Windows)
        return max(1, os.cpu_count() or 1)


def threads_fixed_by_user() -> bool:
    """True when OMP_NUM_THREADS / MKL_NUM_THREADS is set: the user chose, so leave it."""
    return any(os.environ.get(name) for name in THREADS_ENV)


def default_candidates() -> tuple[int, ...]:
    """All usable CPUs, and one thread (the count that never waits for another thread)."""
    n = usable_cpus()
    return (n, 1) if n > 1 else (1,)


def request_thread_independent_blas() -> None:
    """Ask MKL for products that do not depend on the thread count, unless MKL_CBWR is set.
    Takes effect only if no matrix product has run in this process yet."""
    name, value = MKL_REPRODUCIBLE
    os.environ.setdefault(name, value)


def blas_thread_independent(counts: tuple[int, ...]) -> bool:
    """Whether matrix products with a long inner dimension, the kind BLAS libraries split
    across threads, come out bit for bit the same at every thread count in `counts`."""
    saved = torch.get_num_threads()
    generator = torch.Generator().manual_seed(0)
    pairs = [(torch.randn(m, k, generator=generator), torch.randn(k, n, generator=generator))
             for m, k, n in ((32, 2048, 32), (16, 8192, 16), (128, 1024, 128))]
    try:
        results = []
        for count in counts:
            torch.set_num_threads(count)
            results.append([a @ b for a, b in pairs])
        return all(torch.equal(x, y) for other in results[1:] for x, y in zip(results[0], other))
    finally:
        torch.set_num_threads(saved)


class ThreadTuner:
    """Picks torch's intra-op thread count for a loop by timing its steps.

    Call `step()` once per loop iteration, before the work (or let `per_forward(model)` call
    it before every forward pass). Each call records how long the previous step took at its
    thread count and sets the count for the next step: `probe_steps` steps at each
    candidate, then the fastest (lowest median) until `recheck_seconds` have passed, and at
    least long enough that probing takes at most `probe_share` of the time; then it probes
    again. As a context manager it restores the thread count on exit.

    enabled=None: on when the user has not fixed the thread count (OMP_NUM_THREADS /
    MKL_NUM_THREADS), there is more than one candidate, and matrix products do not depend
    on the thread count (it asks MKL for that first; see the module docstring). Off, it never
    touches the threads.
    """

    def __init__(self, candidates: tuple[int, ...] | None = None, probe_steps: int = 3,
                 recheck_seconds: float = 30.0, probe_share: float = 0.1, enabled: bool | None = None,
                 clock=time.perf_counter):
        candidates = tuple(dict.fromkeys(default_candidates() if candidates is None else candidates))
        if not candidates or any(c < 1 for c in candidates):
            raise ValueError(f"thread candidates must be counts >= 1, got {candidates}")
        if probe_steps < 1 or not 0 < probe_share <= 1:
            raise ValueError(f"need probe_steps >= 1 and 0 < probe_share <= 1, got {probe_steps}, {probe_share}")
        self.candidates = candidates
        self.probe_steps = probe_steps
        self.recheck_seconds = recheck_seconds
        self.probe_share = probe_share
        if enabled is None:
            enabled = len(candidates) > 1 and not threads_fixed_by_user()
            if enabled:
                request_thread_independent_blas()
                enabled = blas_thread_independent(candidates)
        self.enabled = enabled and len(candidates) > 1
        self.clock = clock
        self.choice: int | None = None  # the winner of the latest probe
        self.history: list[tuple[int, float]] = []  # (threads, seconds) of every timed step
        self._plan: list[int] = []  # thread counts still to probe, one entry per step
        self._probe: dict[int, list[float]] = {}
        self._probe_started = 0.0
        self._next_probe = 0.0
        self._running: int | None = None  # thread count of the step in progress
        self._started = 0.0
        self._saved_threads: int | None = None

    def __enter__(self) -> ThreadTuner:
        self._saved_threads = torch.get_num_threads()
        return self

    def __exit__(self, *exc) -> None:
        self.finish()
        if self._saved_threads is not None:
            torch.set_num_threads(self._saved_threads)

    def step(self) -> None:
        """End the previous step's timing (if any) and set the threads for the next step."""
        if not self.enabled:
            return
        now = self.clock()
        self.finish(now)
        if not self._plan and (self.choice is None or now >= self._next_probe):
            self._start_probe(now)
        threads = self._plan.pop(0) if self._plan else self.choice
        if torch.get_num_threads() != threads:
            torch.set_num_threads(threads)
        self._running, self._started = threads, self.clock()

    def finish(self, now: float | None = None) -> None:
        """Record the step in progress, if any (call after the loop's last step)."""
        if self._running is None:
            return
        now = self.clock() if now is None else now
        self.history.append((self._running, now - self._started))
        if self._running in self._probe:
            self._probe[self._running].append(now - self._started)
            if not self._plan and all(self._probe.values()):
                self._decide(now)
        self._running = None

    @contextlib.contextmanager
    def per_forward(self, model: torch.nn.Module):
        """Treat every forward pass of `model` as a step, e.g. each token `generate` makes."""
        handle = model.register_forward_pre_hook(lambda module, args: self.step())
        try:
            yield self
        finally:
            handle.remove()
            self.finish()

    def _start_probe(self, now: float) -> None:
        # Probe the current choice last: the first step after a switch pays for waking threads.
        order = sorted(self.candidates, key=lambda c: c == self.choice)
        self._plan = [c for c in order for _ in range(self.probe_steps)]
        self._probe = {c: [] for c in self.candidates}
        self._probe_started = now

    def _decide(self, now: float) -> None:
        medians = {c: statistics.median(times) for c, times in self._probe.items()}
        self.choice = min(medians, key=lambda c: (medians[c], c))
        probe_seconds = now - self._probe_started
        self._next_probe = now + max(self.recheck_seconds, probe_seconds * (1 - self.probe_share) / self.probe_share)
        self._probe = {}
