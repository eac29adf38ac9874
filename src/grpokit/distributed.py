"""Processes under torchrun: init, rank, world size, and the few collectives the loop needs.

In one process (no torchrun, WORLD_SIZE unset or 1) every function here is a no-op that
returns its input, so the training loop reads the same either way. Under
`torchrun --nproc_per_node=N -m grpokit ...` each process trains on its own whole groups of
the global batch; the loss counts are summed over processes before backward (docs/algorithm.md,
"the same loss on any number of processes"), and rank 0 alone writes files.

Backend: nccl when CUDA is visible, gloo on the CPU. Every collective has a deadline
(`timeout_s`): when a peer dies, the others raise instead of waiting for ever.
"""

from __future__ import annotations

import atexit
import datetime
import faulthandler
import os
import sys
from collections.abc import Iterable, Mapping
from typing import NoReturn

import torch
import torch.distributed as dist

from grpokit.seeds import derive_seed

DEFAULT_TIMEOUT_S = 600.0


RAY_TRAINER_RANK_ENV = "GRPOKIT_RAY_TRAINER_RANK"  # set in the trainer's rank actors that Ray starts


class PeerFailure(RuntimeError):
    """A collective failed or timed out: another process died or stopped answering."""


def env_world_size() -> int:
    """The world size torchrun announces (1 without it); readable before init, so config checks
    can use it before any model loads."""
    try:
        return max(1, int(os.environ.get("WORLD_SIZE", "1")))
    except ValueError:
        return 1


def local_world_size() -> int:
    """The processes on this machine (torchrun's LOCAL_WORLD_SIZE; the world size without it)."""
    try:
        return max(1, int(os.environ["LOCAL_WORLD_SIZE"]))
    except (KeyError, ValueError):
        return world_size()


def is_initialized() -> bool:
    return dist.is_available() and dist.is_initialized()


def launched() -> bool:
    """Whether a launcher (torchrun) set up a process group to join."""
    return "WORLD_SIZE" in os.environ and "MASTER_ADDR" in os.environ


def started_by_ray() -> bool:
    """Whether Ray started this process as one of the trainer's ranks (pipeline/ray_trainers.py)."""
    return os.environ.get(RAY_TRAINER_RANK_ENV) == "1"


def init(timeout_s: float = DEFAULT_TIMEOUT_S) -> bool:
    """Join the process group torchrun set up (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT),
    even of one process (FSDP2 needs a group); True when joined. Without a launcher, or when
    already joined, nothing happens."""
    if is_initialized():
        return True
    if not launched():
        return False
    if not dist.is_available():
        raise RuntimeError("WORLD_SIZE > 1 but this torch build has no torch.distributed")
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    kwargs = {}
    if backend == "nccl":
        local = local_rank()
        torch.cuda.set_device(local)
        kwargs["device_id"] = torch.device("cuda", local)
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout_s), **kwargs)
    return True


def shutdown(finished: bool = False) -> None:
    """Destroy the process group. finished: every process got here without an error, so they meet at a
    barrier first: a group torn down under a peer's collective still in flight (FSDP2's last
    reduce-scatter) aborts gloo. After an error no barrier: the failed peer would never come."""
    if not is_initialized():
        return
    if finished:
        barrier()
    dist.destroy_process_group()


def report_crashes() -> None:
    """A launched process prints every thread's Python stack if it dies on a signal (SIGABRT, SIGSEGV):
    torchrun's own report names only the rank and the signal."""
    if launched() and not faulthandler.is_enabled():
        faulthandler.enable(file=sys.stderr, all_threads=True)


def leave(code: int) -> NoReturn:
    """End a launched process once its process group is destroyed: atexit handlers (worker pools stop),
    flushed output, then os._exit, without the interpreter's own finalization. There a gloo thread can
    drop the last reference to a tensor and take the GIL after the interpreter is gone: a SIGABRT
    ("terminate called without an active exception") that turns a finished run into a failed one."""
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # closed, or a pipe the reader left
            pass
    os._exit(code)


def exit_process(code: int) -> NoReturn:
    """A `python -m` entry point's end: leave() in a process torchrun launched, sys.exit elsewhere."""
    if launched():  # its group is destroyed: skip the interpreter's teardown
        leave(code)
    sys.exit(code)


def local_rank() -> int:
    """This process's rank on its machine, as the launcher set it (0 without one)."""
    return int(os.environ.get("LOCAL_RANK", "0"))


def rank() -> int:
    return dist.get_rank() if is_initialized() else 0


def world_size() -> int:
    return dist.get_world_size() if is_initialized() else 1


def is_main() -> bool:
    return rank() == 0


def device() -> torch.device:
    """Where collectives' tensors live: this process's GPU under nccl, else the CPU."""
    if is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def process_seed(seed: int) -> int:
    """This process's seed for torch's global RNG (which transformers' generate samples from):
    the run's seed on rank 0, so one process reproduces a single-process run, and a distinct
    stream derived from (seed, rank) on every other rank."""
    r = rank()
    if r == 0:
        return seed
    return derive_seed(seed, "rank", r)


def _collective(op, what: str):
    """Run a collective; a dead or silent peer becomes a PeerFailure that says so."""
    try:
        return op()
    except (RuntimeError, dist.DistError) as err:
        raise PeerFailure(
            f"rank {rank()} of {world_size()}: {what} failed ({type(err).__name__}: {str(err)[:300]}); another "
            "process probably died or stopped answering, see its own message. The last checkpoint is intact: "
            "resume it with the same number of processes and --resume"
        ) from err


def all_reduce_sum(value):
    """Sum of a count (a float, an int or a tensor) over all processes; the same value in one process."""
    if not is_initialized():
        return value
    if isinstance(value, torch.Tensor):
        out = value.detach().to(device(), copy=True)
        _collective(lambda: dist.all_reduce(out), "all_reduce(sum)")
        return out.to(value.device)
    out = torch.tensor(float(value), dtype=torch.float64, device=device())
    _collective(lambda: dist.all_reduce(out), "all_reduce(sum)")
    return type(value)(out.item()) if isinstance(value, int) and not isinstance(value, bool) else out.item()


def all_reduce_max(value: int) -> int:
    """The largest of an integer over all processes; the value itself in one process."""
    if not is_initialized():
        return int(value)
    out = torch.tensor(int(value), dtype=torch.int64, device=device())
    _collective(lambda: dist.all_reduce(out, op=dist.ReduceOp.MAX), "all_reduce(max)")
    return int(out.item())


def all_agree(flag: bool) -> bool:
    """True when `flag` holds on every process (a logical AND over processes)."""
    if not is_initialized():
        return bool(flag)
    out = torch.tensor(1 if flag else 0, dtype=torch.int64, device=device())
    _collective(lambda: dist.all_reduce(out, op=dist.ReduceOp.MIN), "all_reduce(min)")
    return bool(out.item())


def any_process(flag: bool) -> bool:
    """True when `flag` holds on at least one process."""
    return not all_agree(not flag)


def sum_dict(values: Mapping[str, float]) -> dict[str, float]:
    """Each value summed over processes, in one collective. Every process must pass the same keys."""
    if not is_initialized() or not values:
        return dict(values)
    keys = sorted(values)
    out = torch.tensor([float(values[k]) for k in keys], dtype=torch.float64, device=device())
    _collective(lambda: dist.all_reduce(out), "all_reduce(sum)")
    return dict(zip(keys, out.tolist()))


def reduce_metrics(record: Mapping, sums: Iterable[str] = (), maxes: Iterable[str] = ()) -> dict:
    """A metrics row reduced over processes: the mean of each number, except the keys in `sums`
    (counts, throughputs) and `maxes` (maxima, wall times), which are summed or maxed. Other
    values are rank 0's. Every process must pass the same keys."""
    if not is_initialized():
        return dict(record)
    sums, maxes = set(sums), set(maxes)
    numeric = sorted(k for k, v in record.items() if isinstance(v, (int, float)) and not isinstance(v, bool))
    added = [k for k in numeric if k not in maxes]
    maxed = [k for k in numeric if k in maxes]
    out = dict(record)
    if added:
        t = torch.tensor([float(record[k]) for k in added], dtype=torch.float64, device=device())
        _collective(lambda: dist.all_reduce(t), "all_reduce(metrics)")
        for k, v in zip(added, t.tolist()):
            out[k] = v if k in sums else v / world_size()
    if maxed:
        t = torch.tensor([float(record[k]) for k in maxed], dtype=torch.float64, device=device())
        _collective(lambda: dist.all_reduce(t, op=dist.ReduceOp.MAX), "all_reduce(max)")
        out.update(zip(maxed, t.tolist()))
    for k in numeric:  # counts stay integers
        if isinstance(record[k], int) and (k in sums or k in maxes or k == "step"):
            out[k] = int(round(out[k]))
    return out


def barrier() -> None:
    if is_initialized():
        _collective(dist.barrier, "barrier")


def broadcast_object(obj):
    """Rank 0's `obj` on every process."""
    if not is_initialized():
        return obj
    box = [obj]
    _collective(lambda: dist.broadcast_object_list(box, src=0), "broadcast")
    return box[0]


def main_only_stdout() -> None:
    """Silence stdout on ranks other than 0, so a run prints its tables once; errors (stderr) stay."""
    if is_initialized() and not is_main():
        sys.stdout = open(os.devnull, "w")
