"""The resume policy: which differences between a run's saved config and the current one a
resumed run accepts (those that do not change what it computes)."""

from __future__ import annotations

from grpokit.config.loading import from_dict, renamed_keys
from grpokit.config.schema import Config, to_dict
from grpokit.errors import ConfigError

# Keys a resumed run may change without changing what it computes; any other difference is refused.
RESUME_SAFE_KEYS = (
    "output_dir", "grpo.max_steps", "grpo.save_steps", "grpo.save_total_limit", "grpo.micro_batch_size",
    "grpo.max_tokens_per_micro_batch", "grpo.pack_rows", "grpo.generation_batch_size", "grpo.max_failed_steps",
    "grpo.max_nonfinite_steps", "sft.max_tokens_per_micro_batch", "model.device",
    "model.attn_implementation", "eval.", "reward_model.device", "reward_model.batch_size", "stages", "report_to",
    "rollout.kv_cache_gb", "rollout.gpu_memory_utilization", "rollout.enforce_eager", "distributed.timeout_s",
    "model.gradient_checkpointing", "rollout.worker_launch", "rollout.worker_address", "rollout.worker_threads",
    "rollout.worker_start_timeout_s",
)


def _flatten(data, prefix: str = "") -> dict:
    if isinstance(data, dict):
        out = {}
        for k, v in data.items():
            out.update(_flatten(v, f"{prefix}{k}."))
        return out
    return {prefix.rstrip("."): data}


def resume_differences(saved: dict, current: dict) -> list[str]:
    """'key: saved -> current' for every key that differs and matters for an exact resume. A key
    added to grpokit after the run was saved compares as its default (a run from an older version
    still resumes), whenever the saved config still reads as one. A key since renamed compares under
    its new name (quietly: the saved file is grpokit's, not something the user wrote)."""
    try:
        saved = renamed_keys(saved, announce=False)
    except ConfigError:
        pass
    try:
        saved = to_dict(from_dict(Config, saved))
    except ConfigError:  # a key since removed: compare the files as written
        pass
    a, b = _flatten(saved), _flatten(current)
    out = []
    for key in sorted(set(a) | set(b)):
        if a.get(key, "<absent>") != b.get(key, "<absent>") and not any(
            key == safe or (safe.endswith(".") and key.startswith(safe)) for safe in RESUME_SAFE_KEYS
        ):
            out.append(f"{key}: {a.get(key, '<absent>')!r} -> {b.get(key, '<absent>')!r}")
    return out
