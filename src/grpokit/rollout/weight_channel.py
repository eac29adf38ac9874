"""The trainer's weights to its rollout workers over a torch.distributed process group of their
own: the trainer is rank 0, worker i is rank i + 1 (gloo on CPU, nccl on CUDA). It is built on the
trainer's TCP store, apart from any group torchrun made, so it spans machines as the store does.

A push is a header (version, tensor count) and then one broadcast per tensor, in the order both
sides agreed at start: no file and, on CUDA, no copy through host memory. A peer that dies or
hangs makes the collective fail within the group's timeout instead of waiting forever."""

from __future__ import annotations

import datetime
import os
from collections.abc import Iterable

import torch
import torch.distributed as dist

STOP = -1  # the header version that tells a worker's receiver no more weights come


def _process_group(store, rank: int, size: int, device: torch.device, timeout_s: float, prefix: str = ""):
    timeout = datetime.timedelta(seconds=timeout_s)
    prefixed = dist.PrefixStore(prefix + "weights", store)
    if device.type == "cuda":
        # NCCL's wait() only orders streams and a timeout aborts the process from a watchdog; blocking
        # wait makes it raise in the caller instead, which names the worker and how to resume
        os.environ.setdefault("TORCH_NCCL_BLOCKING_WAIT", "1")
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        return dist.ProcessGroupNCCL(prefixed, rank, size, options)
    return dist.ProcessGroupGloo(prefixed, rank, size, timeout)


class WeightChannel:
    """One end of the weight group: `push` on the trainer (rank 0), `receive_*` on a worker."""

    def __init__(self, store, rank: int, size: int, device: torch.device, timeout_s: float, prefix: str = ""):
        """prefix: the run's key prefix on the store (a shared secret's digest, rollout/transport.py)."""
        self.rank, self.size, self.device = rank, size, torch.device(device)
        self.group = _process_group(store, rank, size, self.device, timeout_s, prefix)

    def _broadcast(self, tensor: torch.Tensor) -> None:
        options = dist.BroadcastOptions()
        options.rootRank = 0
        self.group.broadcast([tensor], options).wait()

    def push(self, version: int, tensors: Iterable[torch.Tensor], dtypes: list[torch.dtype], count: int) -> int:
        """Send policy `version` (`count` tensors in the agreed order, each cast to the dtype the workers
        hold it in: rounded once, as they would round it); returns the bytes sent."""
        self._broadcast(torch.tensor([version, count], dtype=torch.int64, device=self.device))
        sent = 0
        for tensor, dtype in zip(tensors, dtypes, strict=True):
            tensor = tensor.detach().to(device=self.device, dtype=dtype).contiguous()
            self._broadcast(tensor)
            sent += tensor.numel() * tensor.element_size()
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
        for buffer in buffers:
            self._broadcast(buffer)
