"""`grpokit bench limit`'s generation half (bench/limit.py's module docstring says what it measures):
one rollout batch of a config through its policy, in each dtype and prefill way, and the least time
this machine needs for it. A module of its own so that `grpokit` starts without the model stack:
limit.py imports it when the measurement runs. (Moved here from bench/limit.py.)"""

from __future__ import annotations

import time

import torch

from grpokit.checks import load_config
from grpokit.models.lora import apply_lora
from grpokit.pipeline.build import load_policy
from grpokit.rollout import SamplingParams, make_engine
from grpokit.tasks import task_for


def model_shape(model) -> dict:
    """What the bound needs of a causal LM: its linear weights' elements (each tensor once: a tied LM head is
    the embedding), the LM head's, and the attention sizes."""
    seen, linear = set(), 0
    for module in model.modules():
        if isinstance(module, torch.nn.Linear) and module.weight.data_ptr() not in seen:
            seen.add(module.weight.data_ptr())
            linear += module.weight.numel()
    config = (model.get_base_model() if hasattr(model, "get_base_model") else model).config
    config = getattr(config, "text_config", config)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    head = model.get_output_embeddings().weight.numel()
    return {"linear_params": linear, "head_params": head, "layers": config.num_hidden_layers,
            "q_width": config.num_attention_heads * head_dim,
            "kv_width": getattr(config, "num_key_value_heads", config.num_attention_heads) * head_dim}


def bound_seconds(shape: dict, prompt_lengths: list[int], completion_lengths: list[int], itemsize: int,
                  bandwidth: float, peak: float) -> dict:
    """{prefill, decode, total}: the least seconds this machine needs for the batch (module docstring).
    prompt_lengths: each distinct prompt's tokens; completion_lengths: each row's generated tokens and
    the real prompt length it continues ([(prompt, completion)] flattened as two lists of one length)."""
    body = shape["linear_params"] - shape["head_params"]
    attention = 4 * shape["layers"] * shape["q_width"]  # QK^T and AV: 2 x 2 x width FLOPs per (query, key)
    prefill_flops = sum(2 * body * p + attention * p * (p + 1) / 2 + 2 * shape["head_params"] for p in prompt_lengths)
    decode_flops = kv_bytes = 0.0
    steps = max((t for _, t in completion_lengths), default=1) - 1
    for p, t in completion_lengths:
        for step in range(1, t):  # token `step` of the row is sampled from the logits of the forward at p + step
            context = p + step
            decode_flops += 2 * shape["linear_params"] + attention * context
            kv_bytes += 2 * shape["layers"] * shape["kv_width"] * context * itemsize
    weight_bytes = shape["linear_params"] * itemsize
    prefill = prefill_flops / peak
    decode = (weight_bytes * steps + kv_bytes) / bandwidth + decode_flops / peak
    return {"prefill_s": prefill, "decode_s": decode, "total_s": prefill + decode, "decode_steps": steps,
            "prefill_flops": prefill_flops, "decode_flops": decode_flops, "weight_bytes": weight_bytes}


def rollout_batch(config) -> tuple[list[str], int]:
    """(prompts, num_generations): the config's first prompts_per_step training prompts, rendered as training renders them."""
    _, tokenizer = load_policy(config, trainable=False)
    task = task_for(config)
    rows = task.data(tokenizer, sft=False).train[: config.grpo.prompts_per_step]
    return [row.get("prompt") or task.prompt(row, "cot", tokenizer) for row in rows], config.grpo.num_generations


def load_for_rollouts(config):
    """The policy of `config` as a training run builds it: the loaded model, with LoRA adapters when configured."""
    model, tokenizer = load_policy(config)
    if config.model.lora.r > 0:
        model = apply_lora(model, config.model.lora)
    return model, tokenizer


def measure_generation(path: str | None, overrides: list[str], repeats: int, bandwidth: float,
                       peaks: dict[str, float], say) -> tuple[dict, list[dict]]:
    """Each (dtype, prefill) way's best time for the batch, with its bound; the two prefill ways of one dtype
    alternate, so a slow spell of a shared machine hits both. Returns ({the batch}, [each way])."""
    ways, batch = [], {}
    for dtype in peaks:  # DTYPES, in the order the peaks were measured
        run_config = load_config(path, [*overrides, f"--model.dtype={dtype}"])
        g = run_config.grpo
        prompts, num_generations = rollout_batch(run_config)
        model, tokenizer = load_for_rollouts(run_config)
        engine = make_engine(run_config.rollout, model, tokenizer, run_config.seed)
        shape = model_shape(model)
        itemsize = {"fp32": 4, "bf16": 2}[dtype]
        distinct = [len(ids) for ids in tokenizer(prompts, add_special_tokens=False)["input_ids"]]
        batch = {"model": run_config.model.name_or_path or "tiny", "lora_r": run_config.model.lora.r,
                 "prompts": len(prompts), "num_generations": num_generations, "prompt_tokens": distinct,
                 "max_completion_length": g.max_completion_length, "temperature": g.temperature,
                 "generation_batch_size": g.generation_batch_size, "engine": run_config.rollout.engine, **shape}
        warm = SamplingParams(max_new_tokens=2, temperature=g.temperature, top_p=g.top_p)
        engine.generate(prompts[:1], 2, warm)  # first-call costs (allocator, kernels) stay out of the timing
        best: dict[bool, dict] = {}
        for _ in range(repeats):
            for shared in (False, True):
                params = SamplingParams(max_new_tokens=g.max_completion_length, temperature=g.temperature,
                                        top_p=g.top_p, batch_size=g.generation_batch_size, shared_prefill=shared)
                torch.manual_seed(run_config.seed)
                start = time.perf_counter()
                rollout = engine.generate(prompts, num_generations, params)
                seconds = time.perf_counter() - start
                if shared not in best or seconds < best[shared]["seconds"]:
                    lengths = rollout.completion_mask.sum(dim=1).tolist()
                    best[shared] = {"seconds": seconds, "completion_lengths": [int(n) for n in lengths]}
        for shared in (False, True):
            run = best[shared]
            rows = [(distinct[i // num_generations], t) for i, t in enumerate(run["completion_lengths"])]
            bound = bound_seconds(shape, distinct, rows, itemsize, bandwidth, peaks[dtype])
            tokens = sum(run["completion_lengths"])
            way = {"dtype": dtype, "shared_prefill": shared, "seconds": run["seconds"], "completion_tokens": tokens,
                   "tokens_per_s": tokens / run["seconds"], "bound": bound,
                   "fraction_of_limit": bound["total_s"] / run["seconds"]}
            ways.append(way)
            say(f"generation {dtype}, {'shared' if shared else 'per-row'} prefill: {run['seconds']:.1f} s "
                f"({way['tokens_per_s']:.0f} tokens/s); bound {bound['total_s']:.1f} s "
                f"(prefill {bound['prefill_s']:.2f}, decode {bound['decode_s']:.2f}); "
                f"at {100 * way['fraction_of_limit']:.0f}% of the limit")
        del engine, model
    return batch, ways
