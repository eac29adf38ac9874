"""Mixed precision: trainable weights in fp32, compute in bf16.

`model.dtype` names the compute dtype: the dtype matrix products run in (auto = bf16 on CUDA,
fp32 on CPU). `model.master_dtype` names the dtype trainable weights, their gradients and the
optimizer state are held in: fp32 by default, so an update of lr x grad, far below bf16's
resolution near a weight (8 bits of mantissa), still moves the weight. `same` holds them in the
compute dtype, with no master copy: half the weight memory, and small updates round away.

How compute runs in the lower dtype:
- one device: the forward runs under `torch.autocast` (`compute_autocast`), which casts weights
  and activations to bf16 at each matrix product and keeps reductions in fp32;
- FSDP2: `MixedPrecisionPolicy(param_dtype=compute, reduce_dtype=fp32)` (models/sharding.py)
  gathers each layer's fp32 shards as bf16 for the forward and reduces gradients in fp32.

Frozen models (pi_ref, a reward model that only scores, a LoRA base) hold their linear layers in
the compute dtype: they are never updated, so a master copy would be memory spent for nothing.
Log-probs, the loss and the reward scores are computed in fp32 from the bf16 logits.
"""

from __future__ import annotations

import contextlib
import functools
import sys
from dataclasses import dataclass

import torch

from grpokit.errors import ConfigError
from grpokit.models.wrapping import is_sharded

# The attribute a model carries its compute dtype in (set by `set_compute_dtype`); copies made
# with copy.deepcopy keep it.
_COMPUTE_DTYPE_ATTR = "grpokit_compute_dtype"
DTYPES = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp32": torch.float32, "float32": torch.float32,
          "fp16": torch.float16, "float16": torch.float16}


@dataclass(frozen=True)
class Precision:
    """compute: the dtype of matrix products; master: the dtype of trainable weights and optimizer state."""

    compute: torch.dtype
    master: torch.dtype

    @property
    def mixed(self) -> bool:
        return self.compute != self.master

    def describe(self) -> str:
        name = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}
        if not self.mixed:
            return f"{name[self.compute]} weights and compute"
        return f"{name[self.compute]} compute, {name[self.master]} master weights and optimizer state"


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" and torch.cuda.is_bf16_supported() else torch.float32
    if dtype not in DTYPES:
        raise ValueError(f"model.dtype must be 'auto' or one of {sorted(DTYPES)}, got {dtype!r}")
    return DTYPES[dtype]


def cpu_has_native_bf16() -> bool:
    """Whether this CPU multiplies bf16 in hardware (AMX tiles or AVX-512 BF16); elsewhere torch
    converts every bf16 product to fp32 and back, slower than fp32 itself."""
    probes = (getattr(torch.cpu, name, None) for name in ("_is_amx_tile_supported", "_is_avx512_bf16_supported"))
    return any(probe is not None and probe() for probe in probes)


_said_bf16_is_slow = False


def _note_emulated_bf16(dtype: str) -> None:
    """One line, once per process: bf16 runs on this CPU, correctly but slowly."""
    global _said_bf16_is_slow
    if not _said_bf16_is_slow:
        _said_bf16_is_slow = True
        print(f"grpokit: model.dtype={dtype} on a CPU without native bf16 (no AMX, no AVX-512 BF16): every bf16 "
              "matrix product is emulated, slower than fp32; model.dtype=fp32 runs faster here", file=sys.stderr)


def resolve_precision(dtype: str, master_dtype: str, device: torch.device) -> Precision:
    """model.dtype and model.master_dtype on `device` as a Precision; a dtype the device cannot run
    is a ConfigError naming the key and what to set."""
    compute = resolve_dtype(dtype, device)
    if compute == torch.bfloat16 and device.type == "cuda" and not torch.cuda.is_bf16_supported():
        raise ConfigError(f"model.dtype={dtype} but {torch.cuda.get_device_name(device)} has no bf16 support; "
                          "set model.dtype=fp16 (with model.master_dtype=fp32) or model.dtype=fp32")
    if compute == torch.bfloat16 and device.type == "cpu" and not cpu_has_native_bf16():
        _note_emulated_bf16(dtype)
    if master_dtype not in ("fp32", "same"):
        raise ConfigError(f"model.master_dtype must be 'fp32' or 'same', got {master_dtype!r}")
    master = torch.float32 if master_dtype == "fp32" else compute
    return Precision(compute, master)


def set_compute_dtype(model: torch.nn.Module, dtype: torch.dtype) -> torch.nn.Module:
    """Record on `model` the dtype its forward computes in (read by `compute_autocast`)."""
    setattr(model, _COMPUTE_DTYPE_ATTR, dtype)
    return model


def compute_dtype(model: torch.nn.Module) -> torch.dtype | None:
    """The compute dtype recorded on `model` (or on the model inside a PEFT wrapper), or None."""
    return getattr(model, _COMPUTE_DTYPE_ATTR, None)


def compute_autocast(model: torch.nn.Module):
    """A context for running `model`'s forward: `torch.autocast` to the model's compute dtype when
    some of its weights are wider (fp32 master weights, LoRA adapters), else a no-op. A sharded
    (FSDP2) model casts through its MixedPrecisionPolicy instead."""
    dtype = compute_dtype(model)
    if dtype is None or dtype == torch.float32 or is_sharded(model):
        return contextlib.nullcontext()
    first = next(model.parameters(), None)
    if first is None or all(p.dtype == dtype for p in model.parameters() if p.is_floating_point()):
        return contextlib.nullcontext()
    return torch.autocast(device_type=first.device.type, dtype=dtype)


def describe_precision(model: torch.nn.Module) -> str:
    """One phrase for the run's log: what `model` trains in, e.g. 'bf16 compute, fp32 master weights ...'."""
    trained = [p.dtype for p in model.parameters() if p.requires_grad] or [next(model.parameters()).dtype]
    held = trained[0]
    return Precision(compute_dtype(model) or held, held).describe()


def in_compute_dtype(fn):
    """Decorate `fn(model, ...)` so it runs under `compute_autocast(model)`."""

    @functools.wraps(fn)
    def wrapper(model, *args, **kwargs):
        with compute_autocast(model):
            return fn(model, *args, **kwargs)

    return wrapper


def as_frozen(model: torch.nn.Module) -> torch.nn.Module:
    """`model` (a frozen copy of a policy) with its linear layers' weights cast to the compute dtype,
    in place: they are most of its memory, and autocast would cast them at every product anyway.
    Embeddings and norms keep the policy's dtype, as autocast leaves them, so the copy computes
    exactly what the policy computes (the k3 KL of the first step is 0, as the paper's is). A
    linear weight tied to the embedding stays too."""
    dtype = compute_dtype(model)
    if dtype is None:
        return model
    embeddings = {id(m.weight) for m in model.modules() if isinstance(m, torch.nn.Embedding)}
    for module in model.modules():
        if isinstance(module, torch.nn.Linear) and id(module.weight) not in embeddings:
            module.to(dtype=dtype)
    return model


def compute_dtype_state(state: dict[str, torch.Tensor], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """`state` with its floating-point tensors cast to `dtype` (what a checkpoint's model.safetensors holds)."""
    return {k: v.to(dtype) if v.is_floating_point() and v.dtype != dtype else v for k, v in state.items()}
