"""What rollout workers buy at scale: replay measured stage times through grpokit's schedule.

    python benchmarks/async_simulation.py                               # the defaults below
    python benchmarks/async_simulation.py --generate 120 --update 40 --push 6 --tail 0.5 --workers 1,4,16

A discrete-event replay of the fixed schedule (rollout/schedule.py): batch s is sampled by
version max(0, s - 1 - k) on every worker at once (each worker takes 1/N of the batch's prompts),
a worker starts it once it is free and that version has been pushed, and step s starts once
batch s is back and step s - 1 is done; after each step the trainer pushes the new version (the
workers stage it, so a push costs the trainer only its transfer time). Generation time per
worker share is generate / N x a lognormal factor (sigma = --tail) drawn per share, so the batch
waits for its slowest worker: the long tail that asynchrony hides. Colocated sync (one machine
that samples and learns, the others idle) is generate x the same factor + update per step, no push.
Worker layouts use N + 1 machines: compare them with each other, and with colocated sync only as
"what the extra machines buy".

Prints steps per hour per layout and the speed-up over the same layout's sync. The inputs are
the stage times you measured (metrics.jsonl: perf/update_time_s, rollout/sync_time_s, and the
rollout time of a colocated sync run), not a model of any GPU.
"""

from __future__ import annotations

import argparse
import random


def simulate(steps: int, generate: float, update: float, push: float, workers: int, staleness: int, tail: float,
             seed: int = 0) -> float:
    """Seconds for `steps` steps of the fixed schedule with `workers` workers and staleness k."""
    rng = random.Random(seed)
    pushed = {0: 0.0}  # version -> when every worker holds it
    free = [0.0] * workers  # when each worker is free
    ready: dict[int, float] = {}
    step_done = 0.0
    next_batch = 1
    for s in range(1, steps + 1):
        # sample every batch whose version exists, in order, before step s needs batch s
        while next_batch <= steps and max(0, next_batch - 1 - staleness) in pushed:
            version = max(0, next_batch - 1 - staleness)
            finish = 0.0
            for w in range(workers):
                start = max(free[w], pushed[version])
                free[w] = start + generate / workers * rng.lognormvariate(0.0, tail)
                finish = max(finish, free[w])
            ready[next_batch] = finish
            next_batch += 1
        start = max(step_done, ready[s])
        step_done = start + update + push
        pushed[s] = step_done
    return step_done


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--generate", type=float, default=120.0, help="seconds one worker takes to sample a batch")
    parser.add_argument("--update", type=float, default=60.0, help="seconds of a trainer step without sampling")
    parser.add_argument("--push", type=float, default=5.0, help="seconds a weight push holds the trainer")
    parser.add_argument("--tail", type=float, default=0.3, help="lognormal sigma of each share's generation time")
    parser.add_argument("--workers", default="1,2,4,8", help="worker counts to replay")
    parser.add_argument("--steps", type=int, default=200)
    args = parser.parse_args()
    rng = random.Random(0)
    colocated = sum(args.generate * rng.lognormvariate(0.0, args.tail) + args.update for _ in range(args.steps))
    print(f"generate {args.generate:g}s/batch on one worker, update {args.update:g}s, push {args.push:g}s, "
          f"tail sigma {args.tail:g}; colocated sync: {3600 * args.steps / colocated:.1f} steps/h")
    print(f"{'workers':>7} {'sync':>8} {'1-off':>8} {'async2':>8}   1-off/sync async2/sync  async2/colocated")
    for n in (int(x) for x in args.workers.split(",")):
        rates = [3600 * args.steps / simulate(args.steps, args.generate, args.update, args.push, n, k, args.tail)
                 for k in (0, 1, 2)]
        print(f"{n:7d} {rates[0]:8.1f} {rates[1]:8.1f} {rates[2]:8.1f}   {rates[1] / rates[0]:9.2f}x "
              f"{rates[2] / rates[0]:9.2f}x {rates[2] * colocated / (3600 * args.steps):12.2f}x")


if __name__ == "__main__":
    main()
