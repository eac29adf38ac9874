"""FSDP2 (torch.distributed.fsdp.fully_shard) for the policy, the reference and PPO's critic.

Each decoder layer is its own FSDP unit and the root holds the rest (embeddings, final norm,
LM head), so a forward all-gathers one layer at a time. Gradients are summed over processes,
not averaged: each process back-propagates sum_local / global count (docs/algorithm.md, "the
same loss on any number of processes"), and the sum of those is the whole batch's gradient.
A MixedPrecisionPolicy computes in the model's compute dtype (bf16) over fp32 master shards and
reduces gradients in fp32 (models/precision.py).

A sharded model runs forward, backward and `generate` like the plain one, but every process
must make the same calls in the same order (each forward all-gathers). Its state dict holds
DTensor shards: `full_state_dict` gathers the plain tensors a Hugging Face checkpoint holds.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
from torch.distributed.tensor import DTensor

from grpokit import distributed
from grpokit.errors import ConfigError
from grpokit.models.precision import compute_dtype
from grpokit.models.wrapping import fsdp_root, is_sharded

LAYER_LIST_NAMES = ("layers", "h", "blocks")


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The transformer blocks: the first ModuleList named layers / h / blocks (Llama, Qwen2, GPT-2
    style; also inside a PEFT wrapper or a token-classification critic)."""
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.ModuleList) and name.rsplit(".", 1)[-1] in LAYER_LIST_NAMES and len(module):
            return list(module)
    raise ValueError(f"{type(model).__name__} has no ModuleList named {' / '.join(LAYER_LIST_NAMES)} to shard "
                     "layer by layer; FSDP2 needs the decoder blocks")


def mixed_precision_policy(model: torch.nn.Module):
    """FSDP2's MixedPrecisionPolicy for `model`: its weights gathered in its compute dtype
    (models/precision.py) and its gradients reduced in fp32, when that dtype is lower than the
    weights'; else none. fp16 is refused: FSDP2 has no loss scaling for it."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    held = next(model.parameters()).dtype
    compute = compute_dtype(model) or held
    if torch.float16 in (compute, held):
        raise ConfigError("model.dtype=fp16 cannot train under FSDP2 (no loss scaling): set model.dtype=bf16")
    if compute == held:
        return MixedPrecisionPolicy()
    return MixedPrecisionPolicy(param_dtype=compute, reduce_dtype=torch.float32)


def shard_model(model: torch.nn.Module) -> torch.nn.Module:
    """fully_shard each decoder layer and the root (see fsdp_root), in place; gradients summed
    over processes."""
    from torch.distributed.fsdp import FSDPModule, fully_shard

    policy = mixed_precision_policy(model)
    for layer in decoder_layers(model):
        fully_shard(layer, mp_policy=policy)
    fully_shard(fsdp_root(model), mp_policy=policy)
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)  # a sum: the loss already divides by the global count
            module.set_force_sum_reduction_for_comms(True)  # gloo has no PREMUL_SUM; plain SUM everywhere
    return model


@contextmanager
def gathered_for_generation(model: torch.nn.Module):
    """Every FSDP2 unit of `model` all-gathered once for a whole `generate` call, and freed after,
    instead of once per decoded token (one forward each). Each process holds the full weights
    meanwhile, as a colocated rollout engine would. Yields whether it gathered: the forwards inside
    then run no collectives, so processes need not step together (no synced_gpus)."""
    from torch.distributed.fsdp import FSDPModule

    if not is_sharded(model):
        yield False
        return
    root = fsdp_root(model)
    units = [m for m in root.modules() if isinstance(m, FSDPModule)]
    root.set_reshard_after_forward(False, recurse=True)
    try:
        for unit in units:  # the same order on every process: each is a collective
            unit.unshard()
        yield True
    finally:
        for unit in units:
            unit.reshard()
        # back to shard_model's layout: layers free their gathered weights after a forward; the
        # root keeps them, as fully_shard does for the module its backward starts from
        root.set_reshard_after_forward(True, recurse=True)
        root.set_reshard_after_forward(False, recurse=False)


def reshard(model: torch.nn.Module) -> None:
    """Put every FSDP2 unit of `model` back to its sharded parameters (a no-op for a plain model).
    The root stays unsharded after a forward that no backward follows, with plain tensors
    registered in place of its DTensor shards."""
    from torch.distributed.fsdp import FSDPModule

    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()


def full_state_dict(model: torch.nn.Module, everywhere: bool = False) -> dict[str, torch.Tensor]:
    """The plain (unsharded) state dict, on the CPU. Collective for a sharded model: every
    process must call it; the tensors come back on rank 0 only unless `everywhere`."""
    if not is_sharded(model):
        return {k: v.detach().cpu() for k, v in model.state_dict().items()}
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    options = StateDictOptions(full_state_dict=True, cpu_offload=not everywhere)
    state = get_model_state_dict(model, options=options)
    return {k: v.cpu() for k, v in state.items()} if everywhere else state


def load_full_state_dict(model: torch.nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Load a plain state dict (every process holds the same one) into a plain or sharded model."""
    if not is_sharded(model):
        model.load_state_dict(state)
        return
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    set_model_state_dict(model, state, options=StateDictOptions(full_state_dict=True))


def local_tensors(obj):
    """`obj` with every DTensor replaced by this process's shard: what torch.save stores per rank
    (weights_only loading cannot rebuild a DTensor's device mesh)."""
    if isinstance(obj, DTensor):
        return obj.to_local().detach().clone()
    if isinstance(obj, dict):
        return {k: local_tensors(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(local_tensors(v) for v in obj)
    return obj


def load_optimizer_state(optimizer: torch.optim.Optimizer, state: dict) -> None:
    """optimizer.load_state_dict for a state saved by `local_tensors`: each per-parameter tensor
    that holds a shard is wrapped back into a DTensor laid out like its parameter."""
    optimizer.load_state_dict(state)
    for group in optimizer.param_groups:
        for p in group["params"]:
            if not isinstance(p, DTensor):
                continue
            for key, value in optimizer.state.get(p, {}).items():
                if isinstance(value, torch.Tensor) and not isinstance(value, DTensor) \
                        and value.shape == p.to_local().shape and value.dim() > 0:
                    optimizer.state[p][key] = DTensor.from_local(value, p.device_mesh, p.placements,
                                                                 run_check=False, shape=p.shape, stride=p.stride())


def grad_norm_value(norm) -> torch.Tensor:
    """clip_grad_norm_'s result as a plain tensor (a DTensor over sharded parameters)."""
    return norm.full_tensor() if isinstance(norm, DTensor) else norm


def world_sharding(config_fsdp: str) -> bool:
    """Whether to shard: distributed.fsdp 'on', or 'auto' in a multi-process run."""
    if config_fsdp == "on" and not distributed.is_initialized():
        raise ConfigError("distributed.fsdp=on needs a process group: start the run with torchrun "
                          "(torchrun --nproc_per_node=1 -m grpokit ... for one process)")
    return config_fsdp == "on" or (config_fsdp == "auto" and distributed.world_size() > 1)
