"""Validation of a whole config, before any model loads: each section's own rules (their
`problems()`, in grpokit.config.schema), then the few rules that span sections, all here. The
config is a leaf every layer reads, so none of these rules asks a registry: whether a name
(a reward, loss, engine, tool, task) names a registered piece is grpokit.checks', above them."""

from __future__ import annotations

import ipaddress
import itertools
import os
import socket
from collections.abc import Iterator

from grpokit.config.schema import Config, failed
from grpokit.errors import ConfigError


# Engines that report each sampled token's log-prob under the distribution it was drawn from (a
# fact of the engines in grpokit.rollout, written here as names so that the config asks no registry).
SAMPLER_LOGPROB_ENGINES = ("hf_static", "vllm")

# The shared secret of a trainer and its rollout workers (docs/guides/security.md): from the
# environment, never the config, which is saved with the run and sent to every worker.
WORKER_SECRET_ENV = "GRPOKIT_WORKER_SECRET"
MIN_SECRET_BYTES = 16
MAKE_SECRET = f"export {WORKER_SECRET_ENV}=$(openssl rand -hex 16)"


def is_loopback(host: str) -> bool:
    """Whether `host` names this machine's loopback interface (127.0.0.0/8, ::1, or a name for them)."""
    try:
        return all(ipaddress.ip_address(info[4][0]).is_loopback
                   for info in socket.getaddrinfo(host.strip("[]"), None, type=socket.SOCK_STREAM))
    except (OSError, ValueError):
        return False


def secret_length_problem(secret: str) -> str | None:
    """A secret too short to resist guessing (an empty one is no secret: the address decides)."""
    if secret and len(secret.encode()) < MIN_SECRET_BYTES:
        return (f"{WORKER_SECRET_ENV} is {len(secret.encode())} bytes long: a shared secret needs at least "
                f"{MIN_SECRET_BYTES} (e.g. `{MAKE_SECRET}`)")
    return None


def worker_secret_problems(address: str, secret: str) -> Iterator[str]:
    """A secret too short to resist guessing, or a rollout worker address beyond loopback without one."""
    if secret_length_problem(secret):
        yield secret_length_problem(secret)
    elif not secret and not is_loopback(address.rpartition(":")[0]):
        yield (f"rollout.worker_address={address} listens beyond this machine's loopback interface: set "
               f"{WORKER_SECRET_ENV} to a shared secret in the trainer's and every worker's environment (e.g. "
               f"`{MAKE_SECRET}`), or keep rollout.worker_address on 127.0.0.1")


def check_values(config: Config) -> None:
    """The first problem of `config` as a ConfigError: its sections' own rules, section by section,
    then the rules that span sections. The names it gives registered pieces are checked by
    grpokit.checks.check_names (grpokit.checks.validate: both)."""
    problem = next(itertools.chain(config.problems(), cross_section_problems(config)), None)
    if problem is not None:
        raise ConfigError(problem)


def cross_section_problems(config: Config) -> Iterator[str]:
    """The rules that tie keys of different sections together, one message each."""
    g, rm, model, iterations = config.grpo, config.reward_model, config.model, config.iterative.iterations
    longest_row = g.max_completion_length + max(1, config.data.max_prompt_length)
    yield from failed([
        (g.max_tokens_per_micro_batch >= longest_row,
         f"grpo.max_tokens_per_micro_batch={g.max_tokens_per_micro_batch} is smaller than the longest row, "
         f"{longest_row} tokens (grpo.max_completion_length + data.max_prompt_length, or 1 prompt token when that "
         f"is 0): raise it to at least that"),
        (bool(config.rewards) or rm.kind != "none",
         "rewards must name at least one reward function, or reward_model.kind must name a reward model"),
        (rm.kind != "process" or config.algo == "grpo",
         "process supervision (reward_model.kind=process) needs algo=grpo: PPO's critic takes one scalar reward"),
        (rm.kind != "process" or g.scale_rewards,
         "grpo.scale_rewards=false is not defined for process supervision: eq. 6 normalises step rewards by "
         "their group std"),
        (rm.data.hard_negatives == 0 or not (config.data.sources or config.data.sft_sources),
         "reward_model.data.hard_negatives needs the built-in task, whose rule makes and labels the one-slip twins: "
         "set it to 0 for data.sources"),
        (iterations == 1 or rm.kind != "none",
         "iterative.iterations > 1 refreshes a reward model: set reward_model.kind to outcome or process"),
        (g.max_steps >= iterations,
         "grpo.max_steps must be at least iterative.iterations (the steps are split over the iterations)"),
        (config.task.num_sft_tir_examples == 0 or model.name_or_path or model.tiny.alphabet != "arithmetic",
         "task.num_sft_tir_examples > 0 writes python programs, which model.tiny.alphabet=arithmetic cannot spell: "
         "use model.tiny.alphabet=arithmetic-tir, or task.num_sft_tir_examples=0"),
        (config.rollout.max_model_len == 0 or config.rollout.max_model_len > g.max_completion_length,
         f"rollout.max_model_len={config.rollout.max_model_len} leaves no room for a prompt before "
         f"grpo.max_completion_length={g.max_completion_length} tokens: raise it, or set 0 for the run's longest "
         f"prompt + grpo.max_completion_length"),
        (model.lora.r == 0 or iterations == 1,
         "iterative.iterations > 1 resets pi_ref to pi_theta, which LoRA's reference (the base model under the "
         "adapters) cannot follow: use model.lora.r=0"),
        (config.task.prompt_modes.get("tir", 0) == 0 or bool(config.rollout.tool),
         f"task.prompt_modes={config.task.prompt_modes} asks for tool-integrated prompts, whose completions call a "
         f"tool: set rollout.tool (registered: python), or give tir a share of 0"),
        # The loss's pi_old and TIS read the whole tempered distribution (models/logprobs.py); a nucleus
        # sampler draws from another one, which only an off-policy correction over the sampler's own
        # log-probs (hf_static and vllm report them) can account for.
        (g.top_p == 1.0 or (config.rollout.off_policy_correction() is not None
                            and config.rollout.engine in SAMPLER_LOGPROB_ENGINES),
         f"grpo.top_p={g.top_p} samples from the nucleus, while the loss's pi_old log-probs cover the whole "
         f"vocabulary at grpo.temperature, so every rollout would be off-policy unseen: set grpo.top_p=1, or "
         f"correct for it with rollout.engine=hf_static (or vllm) and rollout.is_correction=tis"),
        (g.generation_batch_size >= g.num_generations,
         f"grpo.generation_batch_size={g.generation_batch_size} cannot hold one group of grpo.num_generations="
         f"{g.num_generations} completions: raise it to at least {g.num_generations}"),
    ])
    yield from _worker_problems(config)


def _worker_problems(config: Config) -> Iterator[str]:
    """Rollout workers (rollout.workers > 0) with the keys that cannot go with them yet."""
    r, g = config.rollout, config.grpo
    if config.distributed.launcher == "ray" and not r.workers:
        yield ("distributed.launcher=ray places rollout workers: set rollout.workers to 1 or more (the trainer is "
               "this process)")
    if config.distributed.launcher == "ray" and r.worker_launch == "external":
        yield ("distributed.launcher=ray starts the rollout workers itself: leave rollout.worker_launch at spawn")
    if not r.workers:
        return
    if config.distributed.launcher != "ray":  # Ray carries the traffic itself: rollout.worker_address is unused
        yield from worker_secret_problems(r.worker_address, os.environ.get(WORKER_SECRET_ENV, ""))
    yield from failed([
        (r.workers <= g.prompts_per_step,
         f"rollout.workers={r.workers} is more than grpo.prompts_per_step={g.prompts_per_step}: each worker samples "
         f"whole groups of a step's prompts, so lower rollout.workers to at most {g.prompts_per_step}"),
        (not g.dynamic_sampling,
         "grpo.dynamic_sampling draws more questions when a step's groups have no reward spread, which rollout "
         "workers (rollout.workers) do not do yet: set grpo.dynamic_sampling=false, or rollout.workers=0"),
        (config.iterative.iterations == 1,
         "iterative.iterations > 1 retrains a reward model between iterations, which rollout workers "
         "(rollout.workers) do not follow yet: set rollout.workers=0"),
        (r.tensor_parallel_size == 1,
         f"rollout.tensor_parallel_size={r.tensor_parallel_size} spans a vLLM engine over torchrun's processes, "
         "and a rollout worker is one process: set it to 1 with rollout.workers"),
    ])


def check_world_size(config: Config, world_size: int, per_node: int | None = None) -> None:
    """Multi-process runs (torchrun): checks that need the world size (and `per_node`, the processes
    on each machine, torchrun's LOCAL_WORLD_SIZE; default all of them), before any model loads."""
    tp, per_node = config.rollout.tensor_parallel_size, per_node or world_size
    if tp > 1 and (world_size <= 1 or per_node % tp):
        raise ConfigError(
            f"rollout.tensor_parallel_size={tp} does not divide the {per_node if world_size > 1 else 1} "
            f"process(es) per node of this run: one vLLM engine spans {tp} processes (GPUs) of one machine, so "
            f"start torchrun with --nproc_per_node a multiple of {tp}, or lower rollout.tensor_parallel_size")
    if world_size <= 1:
        return
    g = config.grpo
    if g.prompts_per_step % world_size:
        raise ConfigError(
            f"grpo.prompts_per_step={g.prompts_per_step} does not split into whole groups over {world_size} "
            f"processes (the world size): set grpo.prompts_per_step to a multiple of {world_size}, or start "
            f"torchrun with a --nproc_per_node that divides {g.prompts_per_step}")
    if config.distributed.fsdp == "off":
        raise ConfigError(f"distributed.fsdp=off with {world_size} processes would train {world_size} separate "
                          "models (nothing sums their gradients): set distributed.fsdp to auto or on")
    unsupported = [
        (g.dynamic_sampling, "grpo.dynamic_sampling"),
        (config.reward_model.kind != "none", "reward_model.kind (learned reward models)"),
        (config.iterative.iterations > 1, "iterative.iterations > 1"),
    ]
    for on, key in unsupported:
        if on:
            raise ConfigError(f"{key} is not supported under torchrun with {world_size} processes yet; "
                              "run it in one process")
