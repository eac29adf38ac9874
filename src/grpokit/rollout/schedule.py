"""Which policy version samples which batch, and which worker samples which prompts: fixed by the
config, never by timing, so an asynchronous run is reproducible (docs/async.md).

Versions count optimizer steps: version v is the policy after v steps, and step s (1-based)
learns from batch s. With staleness k (rollout.mode sync: 0, one_step_off: 1, async:
rollout.max_staleness), batch s is sampled by version max(0, s - 1 - k): it can be sampled as
soon as step s - 1 - k has finished, while steps s - k .. s - 1 learn.
"""

from __future__ import annotations


def sampling_version(batch: int, staleness: int) -> int:
    """The policy version that samples batch `batch` (1-based) under staleness k."""
    if batch < 1 or staleness < 0:
        raise ValueError(f"batch must be >= 1 and staleness >= 0, got batch={batch}, staleness={staleness}")
    return max(0, batch - 1 - staleness)


def batches_ready(version: int, staleness: int, last_batch: int) -> range:
    """The batches version `version` is the sampler of, or may sample once it exists: every batch up
    to version + 1 + k (and at most `last_batch`). The trainer submits them after pushing it."""
    return range(1, min(last_batch, version + 1 + staleness) + 1)


def worker_shares(prompts: int, workers: int) -> list[range]:
    """Contiguous, nearly equal shares of a batch's `prompts` (whole groups), one per worker;
    the first `prompts % workers` shares hold one prompt more."""
    if workers < 1 or prompts < workers:
        raise ValueError(f"{prompts} prompts cannot be shared by {workers} rollout workers: every worker needs a "
                         f"prompt; lower rollout.workers to at most grpo.prompts_per_step")
    size, extra = divmod(prompts, workers)
    bounds = [0]
    for w in range(workers):
        bounds.append(bounds[-1] + size + (w < extra))
    return [range(bounds[w], bounds[w + 1]) for w in range(workers)]
