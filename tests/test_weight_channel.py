"""The weight channel's buckets (rollout/weight_channel.py): a push arrives bit for bit, in fewer
broadcasts than tensors, with both sides cutting the same buckets without telling each other."""

import datetime
import os

import pytest
import torch
import torch.distributed as dist

from grpokit.rollout.weight_channel import WeightChannel, buckets
from run_helpers import spawn_ranks

BUCKET = 1024  # bytes: small enough that the tensors below make several buckets of several tensors


def _weights() -> tuple[list[torch.Tensor], list[torch.dtype]]:
    """Mixed sizes and dtypes, in an order a model has them: a tensor larger than a bucket (4,000 B),
    runs of small ones, dtype changes inside a run, a transposed (non-contiguous) source, and casts."""
    g = torch.Generator().manual_seed(0)
    shapes = [(3,), (10, 10), (300,), (1000,), (7,), (50,), (8, 4), (2,), (20, 20), (1,)]
    dtypes = [torch.float32, torch.float32, torch.float32, torch.float32, torch.bfloat16, torch.bfloat16,
              torch.float32, torch.float32, torch.bfloat16, torch.float32]
    tensors = [torch.randn(shape, generator=g) for shape in shapes]
    tensors[6] = tensors[6].t()  # (4, 8), not contiguous
    return tensors, dtypes


def _channel_worker(rank: int, world: int, port: int, out_dir: str) -> None:
    store = dist.TCPStore("127.0.0.1", port, world, is_master=rank == 0, timeout=datetime.timedelta(seconds=60))
    channel = WeightChannel(store, rank, world, torch.device("cpu"), timeout_s=60, bucket_bytes=BUCKET)
    tensors, dtypes = _weights()
    if rank == 0:
        sent = channel.push(7, iter(tensors), dtypes, len(tensors))
        channel.stop()
        torch.save({"sent": sent, "broadcasts": channel.broadcasts}, os.path.join(out_dir, "sender.pt"))
        return
    version, count = channel.receive_header()
    buffers = [torch.full(t.shape, float("nan"), dtype=d) for t, d in zip(tensors, dtypes)]
    channel.receive_into(buffers)
    stop, _ = channel.receive_header()
    torch.save({"version": version, "count": count, "buffers": buffers, "stop": stop,
                "broadcasts": channel.broadcasts}, os.path.join(out_dir, f"receiver{rank}.pt"))


def test_a_bucketed_push_arrives_bit_for_bit_in_fewer_broadcasts(tmp_path):
    spawn_ranks(_channel_worker, 3, str(tmp_path))
    tensors, dtypes = _weights()
    sender = torch.load(tmp_path / "sender.pt")
    expected_bytes = sum(t.numel() * torch.empty(0, dtype=d).element_size() for t, d in zip(tensors, dtypes))
    assert sender["sent"] == expected_bytes
    # by hand, at 1,024 B: [3, 100 fp32 = 412 B] [300 fp32 = 1,200 B, alone] [1,000 fp32, alone]
    # [7, 50 bf16 = 114 B] [32, 2 fp32 = 136 B] [400 bf16 = 800 B] [1 fp32]: 7 buckets for 10 tensors
    assert sender["broadcasts"] == 1 + 7 + 1  # header, buckets, stop
    for rank in (1, 2):
        got = torch.load(tmp_path / f"receiver{rank}.pt")
        assert (got["version"], got["count"], got["stop"]) == (7, len(tensors), -1)
        assert got["broadcasts"] == sender["broadcasts"]
        for buffer, tensor, dtype in zip(got["buffers"], tensors, dtypes, strict=True):
            assert buffer.dtype == dtype and torch.equal(buffer, tensor.to(dtype)), (buffer, tensor)


def _tensor(numel: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.empty(numel, dtype=dtype)


def test_buckets_keep_order_one_dtype_each_and_stay_under_the_size_unless_alone():
    sizes = [1, 200, 60, 300, 5, 5, 5, 1000, 2, 256, 1]
    kinds = [torch.float32, torch.float32, torch.bfloat16, torch.float32, torch.float32, torch.bfloat16,
             torch.bfloat16, torch.float32, torch.float32, torch.float32, torch.float32]
    tensors = [_tensor(n, d) for n, d in zip(sizes, kinds)]
    groups = list(buckets(iter(tensors), 1024))
    assert [t for group in groups for t in group] == tensors  # every tensor, once, in order
    for group in groups:
        assert len({t.dtype for t in group}) == 1
        assert len(group) == 1 or sum(t.numel() * t.element_size() for t in group) <= 1024
    # by hand: [1, 200 fp32 = 804 B] [60 bf16] [300 fp32 = 1,200 B, alone] [5 fp32] [5, 5 bf16]
    # [1000 fp32, alone] [2 fp32: + 256 fp32 would be 1,032 B] [256 fp32 = 1,024 B, full] [1]
    assert [[t.numel() for t in group] for group in groups] == [[1, 200], [60], [300], [5], [5, 5], [1000],
                                                                [2], [256], [1]]


@pytest.mark.parametrize("bucket_bytes", [1, 4, 10 ** 9])
def test_buckets_at_the_extremes(bucket_bytes):
    tensors = [_tensor(n) for n in (1, 1, 3, 1)]
    groups = list(buckets(tensors, bucket_bytes))
    if bucket_bytes < 8:  # two fp32 scalars never fit together: each tensor alone
        assert [len(group) for group in groups] == [1, 1, 1, 1]
    else:
        assert [len(group) for group in groups] == [4]
    assert list(buckets([], bucket_bytes)) == []
