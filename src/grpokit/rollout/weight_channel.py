"""The trainer's weights to its rollout workers over a torch.distributed process group of their
own: the trainer is rank 0, worker i is rank i + 1 (gloo on CPU, nccl on CUDA). Its peers meet through
the trainer's key store (rollout/transport.py), apart from any group torchrun made, so it spans machines
as the store does; gloo listens on the interface the store is reached through.

A push is a header (version, tensor count) and then the tensors in the order both sides agreed at
start, in buckets: consecutive tensors of one dtype, together at most BUCKET_BYTES, go as one flat
broadcast (a tensor larger than that goes alone, with no copy). Both sides cut the same buckets from
the same (size, dtype) sequence, so nothing about them is sent. No file and, on CUDA, no copy
through host memory. A peer that dies or hangs makes the collective fail within the group's timeout
instead of waiting forever."""

from __future__ import annotations

import datetime
import os
from collections.abc import Iterable, Iterator

import torch
import torch.distributed as dist

STOP = -1  # the header version that tells a worker's receiver no more weights come
# A model's small tensors (norms, biases, LoRA factors) one broadcast each cost a round trip apiece;
# 32 MiB buckets make them a few broadcasts while the memory held beside the model stays small.
BUCKET_BYTES = 32 << 20


def buckets(tensors: Iterable[torch.Tensor], bucket_bytes: int) -> Iterator[list[torch.Tensor]]:
    """Consecutive tensors grouped: one dtype, at most bucket_bytes together, a larger tensor alone.
    Reads the iterable lazily, so the sender holds one bucket at a time."""
    group: list[torch.Tensor] = []
    size = 0
    for tensor in tensors:
        nbytes = tensor.numel() * tensor.element_size()
        if group and (tensor.dtype != group[0].dtype or size + nbytes > bucket_bytes):
            yield group
            group, size = [], 0
        group.append(tensor)
        size += nbytes
    if group:
        yield group


def _process_group(store, rank: int, size: int, device: torch.device, timeout_s: float, hostname: str = ""):
    timeout = datetime.timedelta(seconds=timeout_s)
    if device.type == "cuda":
        # NCCL's wait() only orders streams and a timeout aborts the process from a watchdog; blocking
        # wait makes it raise in the caller instead, which names the worker and how to resume
        os.environ.setdefault("TORCH_NCCL_BLOCKING_WAIT", "1")
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        return dist.ProcessGroupNCCL(store, rank, size, options)
    options = dist.ProcessGroupGloo._Options()
    options._timeout = timeout
    # bound to one interface (hostname), not to whatever this machine's name resolves to
    options._devices = [dist.ProcessGroupGloo.create_device(hostname=hostname) if hostname
                        else dist.ProcessGroupGloo.create_default_device()]
    return dist.ProcessGroupGloo(store, rank, size, options)


class WeightChannel:
    """One end of the weight group: `push` on the trainer (rank 0), `receive_*` on a worker."""

    def __init__(self, store, rank: int, size: int, device: torch.device, timeout_s: float, hostname: str = "",
                 bucket_bytes: int = BUCKET_BYTES):
        """store: where the peers meet (a torch.distributed Store holding nothing else of theirs);
        hostname: the address of the interface gloo listens on ("": the one this machine's name gives)."""
        self.rank, self.size, self.device = rank, size, torch.device(device)
        self.bucket_bytes = bucket_bytes
        self.group = _process_group(store, rank, size, self.device, timeout_s, hostname)
        self.broadcasts = 0  # collectives issued, headers included (what bucketing saves)

    def _broadcast(self, tensor: torch.Tensor) -> None:
        options = dist.BroadcastOptions()
        options.rootRank = 0
        self.group.broadcast([tensor], options).wait()
        self.broadcasts += 1

    def push(self, version: int, tensors: Iterable[torch.Tensor], dtypes: list[torch.dtype], count: int) -> int:
        """Send policy `version` (`count` tensors in the agreed order, each cast to the dtype the workers
        hold it in: rounded once, as they would round it); returns the bytes sent."""
        self._broadcast(torch.tensor([version, count], dtype=torch.int64, device=self.device))
        cast = (tensor.detach().to(device=self.device, dtype=dtype).contiguous()
                for tensor, dtype in zip(tensors, dtypes, strict=True))
        sent = 0
        for group in buckets(cast, self.bucket_bytes):
            self._broadcast(group[0] if len(group) == 1 else torch.cat([t.flatten() for t in group]))
            sent += sum(t.numel() * t.element_size() for t in group)
        return sent

    def abort(self) -> None:
        """Drop the group without waiting on its peers (after a failure; NCCL only, gloo needs nothing)."""
        abort = getattr(self.group, "abort", None)
        if abort is not None and self.device.type == "cuda":
            abort()

    def stop(self) -> None:
        self._broadcast(torch.tensor([STOP, 0], dtype=torch.int64, device=self.device))

    def receive_header(self) -> tuple[int, int]:
        header = torch.zeros(2, dtype=torch.int64, device=self.device)
        self._broadcast(header)
        return int(header[0]), int(header[1])

    def receive_into(self, buffers: list[torch.Tensor]) -> None:
        for group in buckets(buffers, self.bucket_bytes):
            if len(group) == 1 and group[0].is_contiguous():
                self._broadcast(group[0])
                continue
            flat = torch.empty(sum(b.numel() for b in group), dtype=group[0].dtype, device=self.device)
            self._broadcast(flat)
            for buffer, part in zip(group, flat.split([b.numel() for b in group]), strict=True):
                buffer.copy_(part.view_as(buffer))
