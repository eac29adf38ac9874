"""A math-verify worker process, started and fed by grpokit.rewards.verify_pool.

Run as a script (never imported by grpokit): it imports math_verify and nothing of grpokit,
so it starts in about a second without torch. It reads one JSON job per line on stdin and
answers one JSON line on stdout:

    job:    {"gold": str, "preds": [str, ...], "budget_s": float}
    answer: {"verdict": "yes" | "no" | "timeout" | "error", "detail": str}

"yes" means every pred is equivalent to gold. Jobs run one at a time in this process's main
thread, so a SIGALRM interval timer can stop a slow sympy computation after budget_s; the
pool kills the whole process when a computation ignores signals (long C-level arithmetic).
The first line written is {"ready": true}, or a startup error.

argv: memory_limit_mb (0: no limit on the address space), [folder holding math_verify]
"""

import json
import logging
import os
import signal
import sys
import threading
import time
from functools import lru_cache


class _Deadline(BaseException):
    """Raised by the alarm. A BaseException, so math-verify's `except Exception` cannot swallow it."""


def _on_alarm(signum, frame):
    raise _Deadline()


def _limit_memory(megabytes: int) -> None:
    # A runaway big-integer power should fail with MemoryError here, not exhaust the host.
    if megabytes <= 0:
        return
    try:
        import resource

        limit = megabytes * 1024 * 1024
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    except (ImportError, ValueError, OSError):
        pass


def _make_judge():
    from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse, verify

    # Timeouts are ours (the alarm above); math-verify's own would reset our SIGALRM handler.
    logging.getLogger("math_verify").setLevel(logging.CRITICAL)
    config = [LatexExtractionConfig(), ExprExtractionConfig()]

    @lru_cache(maxsize=8192)  # references repeat across a group and across epochs
    def parsed(answer: str) -> tuple:
        return tuple(parse("\\boxed{" + answer + "}", config, parsing_timeout=None))

    def judge(gold: str, preds: list[str]) -> bool:
        gold_parsed = list(parsed(gold))
        if not gold_parsed:
            return False
        return all(verify(gold_parsed, list(parsed(p)), timeout_seconds=None) for p in preds)

    return judge


def _run_job(judge, job: dict) -> dict:
    try:
        try:
            signal.setitimer(signal.ITIMER_REAL, max(float(job["budget_s"]), 0.001))
            ok = judge(job["gold"], job["preds"])
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
    except _Deadline:  # also when the alarm lands inside the finally above
        return {"verdict": "timeout", "detail": f"over {job['budget_s']}s"}
    except (Exception, RecursionError) as err:
        return {"verdict": "error", "detail": f"{type(err).__name__}: {str(err)[:200]}"}
    return {"verdict": "yes" if ok else "no", "detail": ""}


def main() -> None:
    # Answers go to a private copy of stdout; anything a library prints lands on stderr.
    channel = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)

    def send(message: dict) -> None:
        channel.write(json.dumps(message) + "\n")

    _exit_with_parent(os.getppid())
    _limit_memory(int(sys.argv[1]) if len(sys.argv) > 1 else 0)
    if len(sys.argv) > 2 and sys.argv[2] not in sys.path:
        sys.path.append(sys.argv[2])  # last: it must not shadow the standard library
    try:
        judge = _make_judge()
    except Exception as err:
        send({"verdict": "error", "detail": f"cannot start math-verify: {type(err).__name__}: {err}"})
        return
    signal.signal(signal.SIGALRM, _on_alarm)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the trainer's to handle
    send({"ready": True})
    for line in sys.stdin:  # ends when the pool closes our stdin or dies
        try:
            job = json.loads(line)
        except ValueError as err:
            send({"verdict": "error", "detail": f"bad job: {err}"})
            continue
        send(_run_job(judge, job))


def _exit_with_parent(parent: int) -> None:
    """End when the pool's process is gone. Its death does not always close our stdin: a process it
    forked (a data loader, a spawned rollout worker) can hold the pipe's other end open. Being
    reparented (getppid changes) tells us anyway; checked each second in a thread of its own."""

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(1.0)
        os._exit(0)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


if __name__ == "__main__":
    main()
