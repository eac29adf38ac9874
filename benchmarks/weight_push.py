"""A weight push to one rollout worker over the gloo weight channel: one broadcast per tensor against
WeightChannel's buckets, side by side, alternating over rounds.

    OMP_NUM_THREADS=1 python benchmarks/weight_push.py --model models/smollm2-135m-instruct
    OMP_NUM_THREADS=1 python benchmarks/weight_push.py --json docs/results/data/weight-push.json

The tensors are the model's own, in its state dict's order (tied embeddings once), in fp32 and in bf16
(the dtype a bf16 worker holds them in). Two processes on this machine (the trainer, rank 0, and one
worker), a TCP store on loopback. Reported: the median seconds of a push (header, tensors) over --pushes,
the broadcasts it took, and the bytes.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import socket
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))
from grpokit.rollout.weight_channel import BUCKET_BYTES, WeightChannel  # noqa: E402

LAYOUTS = {"per tensor": 0, "buckets": BUCKET_BYTES}  # bucket_bytes 0: every tensor alone


def model_tensors(path: str) -> list[torch.Tensor]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    seen, tensors = set(), []
    for tensor in model.state_dict().values():
        if tensor.data_ptr() not in seen:  # tied embeddings go once
            seen.add(tensor.data_ptr())
            tensors.append(tensor)
    return tensors


def _worker(rank: int, port: int, path: str, dtype_name: str, pushes: int, rounds: int, out: str) -> None:
    torch.set_num_threads(1)
    dtype = getattr(torch, dtype_name)
    store = dist.TCPStore("127.0.0.1", port, 2, is_master=rank == 0, timeout=datetime.timedelta(seconds=300))
    tensors = model_tensors(path)
    dtypes = [dtype] * len(tensors)
    buffers = [torch.empty(t.shape, dtype=dtype) for t in tensors] if rank else None
    results = {name: [] for name in LAYOUTS}
    broadcasts = {}
    for round_ in range(rounds):
        for name, bucket_bytes in LAYOUTS.items():
            channel = WeightChannel(store, rank, 2, torch.device("cpu"), 300, prefix=f"{dtype_name}{round_}{name}/",
                                    bucket_bytes=bucket_bytes)
            for _ in range(pushes):
                started = time.perf_counter()
                if rank == 0:
                    sent = channel.push(1, iter(tensors), dtypes, len(tensors))
                else:
                    channel.receive_header()
                    channel.receive_into(buffers)
                results[name].append(time.perf_counter() - started)
            broadcasts[name] = channel.broadcasts // pushes
            store.set(f"done/{dtype_name}{round_}{name}/{rank}", "1")
            store.wait([f"done/{dtype_name}{round_}{name}/{1 - rank}"])
    if rank == 0:
        with open(out, "w") as f:
            json.dump({"tensors": len(tensors), "bytes": sent, "seconds": results, "broadcasts": broadcasts}, f)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="models/smollm2-135m-instruct")
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--pushes", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--json", default="")
    args = parser.parse_args()
    rows = []
    for dtype_name in args.dtypes.split(","):
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        out = f"/tmp/weight_push_{os.getpid()}_{dtype_name}.json"
        mp.spawn(_worker, args=(port, args.model, dtype_name, args.pushes, args.rounds, out), nprocs=2, join=True)
        with open(out) as f:
            got = json.load(f)
        for name in LAYOUTS:
            rows.append({"dtype": dtype_name.replace("float32", "fp32").replace("bfloat16", "bf16"),
                         "push": name, "tensors": got["tensors"], "broadcasts": got["broadcasts"][name],
                         "MB": round(got["bytes"] / 1e6, 1),
                         "median s": round(statistics.median(got["seconds"][name]), 4)})
        per_tensor, bucketed = rows[-2]["median s"], rows[-1]["median s"]
        rows[-1]["vs per tensor"] = f"{bucketed / per_tensor:.2f}x"
        rows[-2]["vs per tensor"] = "1"
    columns = ["dtype", "push", "tensors", "broadcasts", "MB", "median s", "vs per tensor"]
    print("| " + " | ".join(columns) + " |\n|" + "---|" * len(columns))
    for row in rows:
        print("| " + " | ".join(str(row[c]) for c in columns) + " |")
    if args.json:  # docs/results/data's layout: the page's table is this file's (tests/test_results_tables.py)
        import platform

        command = "OMP_NUM_THREADS=1 python benchmarks/weight_push.py " + " ".join(sys.argv[1:])
        about = (f"A weight push of {args.model} to one rollout worker over the gloo weight channel, one broadcast "
                 f"per tensor against 32 MiB buckets, median of {args.pushes} pushes x {args.rounds} alternating "
                 f"rounds, 2 processes with 1 thread each on {platform.processor() or platform.machine()} "
                 f"({os.cpu_count()} CPUs), torch {torch.__version__}, {time.strftime('%Y-%m-%d')}. Command: {command}")
        table = {"columns": [{"title": c, "key": c} for c in columns], "rows": rows}
        with open(args.json, "w") as f:
            json.dump({"about": about, "tables": {"push": table}}, f, indent=1, ensure_ascii=False)
            f.write("\n")


if __name__ == "__main__":
    main()
