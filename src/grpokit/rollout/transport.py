"""How the trainer and its rollout workers reach each other (docs/async.md): one interface, two kinds.

- `store` (distributed.launcher: torchrun, the default): a torch.distributed TCPStore that the trainer
  hosts carries setup, tasks, results, heartbeats and errors as keys; weights go over a gloo/NCCL
  group of their own (rollout/weight_channel.py). Beyond loopback it needs a shared secret
  (GRPOKIT_WORKER_SECRET), which every message key is prefixed with.
- `ray` (distributed.launcher: ray): a mailbox actor of the run carries the same keys; results and
  weights travel as Ray object references (the bytes stay in the object store, the mailbox holds
  only references), so nothing funnels through one process's memory.

Everything above this layer, the schedule, the per-completion seeds, the worker-order joins and the
checkpointed tasks in flight, is the same for both: a run's numbers do not depend on the transport.
"""

from __future__ import annotations

import datetime
import hmac
import ipaddress
import os
import socket
import threading
import time
from collections.abc import Iterable
from typing import Protocol

import torch

from grpokit.rollout.weight_channel import BUCKET_BYTES, STOP, WeightChannel, buckets

SECRET_ENV = "GRPOKIT_WORKER_SECRET"
SETUP_WAIT_S = 30.0  # how long a worker that reached the store waits for the run's setup key
POLL_S = 0.005  # how often a wait on the TCP store looks again (a check costs it microseconds)
WAIT_WINDOW_S = 0.5  # the longest one wait_any blocks before its caller looks at anything else


class TransportError(RuntimeError):
    """A transport that cannot start: the message is one line with the fix."""


class Transport(Protocol):
    """Keys of bytes shared by the trainer and its workers, plus the weight pushes."""

    address: str

    def set(self, key: str, value: bytes) -> None: ...
    def get(self, key: str) -> bytes: ...
    def check(self, key: str) -> bool: ...
    def wait_any(self, keys: list[str], timeout_s: float) -> str | None: ...
    def pop(self, key: str) -> bytes: ...
    def delete(self, key: str) -> None: ...
    def add(self, key: str, amount: int) -> int: ...
    def weights(self, rank: int, size: int, device: torch.device, timeout_s: float): ...
    def reconnect(self) -> Transport: ...


# ------------------------------------------------------------------------------------ the TCP store

def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(socket.gethostbyname(host)).is_loopback
    except (OSError, ValueError):
        return False


class StoreTransport:
    """The TCPStore the trainer hosts at HOST:PORT (port 0: a free one)."""

    def __init__(self, store, address: str, prefix: str = ""):
        self.store, self.address, self.prefix = store, address, prefix

    @classmethod
    def host(cls, address: str, timeout_s: float) -> StoreTransport:
        """The trainer's end. A store reachable from other machines holds a run's config and accepts
        tasks' results, so it must not be open to anyone who finds the port: it needs a shared secret."""
        host, _, port = address.rpartition(":")
        secret = os.environ.get(SECRET_ENV, "")
        if not _is_loopback(host) and not secret:
            raise TransportError(
                f"rollout.worker_address={address} listens beyond this machine, and the store has no authentication: "
                f"set {SECRET_ENV} to a shared secret in the trainer's and every worker's environment (e.g. "
                f"`export {SECRET_ENV}=$(openssl rand -hex 16)`), or use distributed.launcher=ray")
        import torch.distributed as dist

        store = dist.TCPStore(host, int(port), is_master=True, wait_for_workers=False,
                              timeout=datetime.timedelta(seconds=timeout_s))
        return cls(store, f"{host}:{store.port}", _key_prefix(secret))

    @classmethod
    def connect(cls, address: str, timeout_s: float) -> StoreTransport:
        """A worker's end: the trainer's store at HOST:PORT, with this environment's secret."""
        import torch.distributed as dist

        host, _, port = address.rpartition(":")
        store = dist.TCPStore(host, int(port), is_master=False, timeout=datetime.timedelta(seconds=timeout_s))
        transport = cls(store, address, _key_prefix(os.environ.get(SECRET_ENV, "")))
        waited = time.monotonic()
        while not transport.check("setup"):  # the trainer writes it before it waits for its workers
            if time.monotonic() - waited > min(timeout_s, SETUP_WAIT_S):
                raise TransportError(f"the trainer at {address} has no run for this worker: its {SECRET_ENV} "
                                     "differs from this environment's, or it is not a grpokit trainer")
            time.sleep(0.05)
        return transport

    def reconnect(self) -> StoreTransport:
        """Another client of the same store (a second thread's own connection)."""
        import torch.distributed as dist

        host, _, port = self.address.rpartition(":")
        store = dist.TCPStore(host, int(port), is_master=False, timeout=self.store.timeout)
        return StoreTransport(store, self.address, self.prefix)

    def set(self, key: str, value: bytes) -> None:
        self.store.set(self.prefix + key, value)

    def get(self, key: str) -> bytes:
        return self.store.get(self.prefix + key)

    def check(self, key: str) -> bool:
        return self.store.check([self.prefix + key])

    def wait_any(self, keys: list[str], timeout_s: float) -> str | None:
        """The first of `keys`, in their order, that is set within timeout_s (None: none yet)."""
        deadline = time.monotonic() + timeout_s
        while True:
            for key in keys:
                if self.store.check([self.prefix + key]):
                    return key
            if time.monotonic() >= deadline:
                return None
            time.sleep(POLL_S)

    def pop(self, key: str) -> bytes:
        """The value of `key`, which is deleted."""
        value = self.get(key)
        self.delete(key)
        return value

    def delete(self, key: str) -> None:
        self.store.delete_key(self.prefix + key)

    def add(self, key: str, amount: int) -> int:
        return self.store.add(self.prefix + key, amount)

    def weights(self, rank: int, size: int, device: torch.device, timeout_s: float) -> WeightChannel:
        return WeightChannel(self.store, rank, size, device, timeout_s, self.prefix)


def _key_prefix(secret: str) -> str:
    """Keys under a secret's digest: a worker with another secret finds no setup, and one without
    the secret cannot read or write the run's keys by name."""
    if not secret:
        return ""
    return hmac.new(secret.encode(), b"grpokit-rollout-workers", "sha256").hexdigest()[:32] + "/"


# ------------------------------------------------------------------------------------ Ray

def _ray():
    try:
        import ray
    except ImportError:
        raise TransportError("distributed.launcher=ray needs Ray: pip install 'grpokit[ray]'") from None
    return ray


def mailbox_class():
    """The Ray actor class that holds a run's keys (built on first use: Ray is optional)."""
    ray = _ray()

    @ray.remote(num_cpus=0, max_restarts=0, max_concurrency=64)
    class Mailbox:
        def __init__(self):
            self.values: dict[str, object] = {}
            self.changed = threading.Condition()  # methods run on up to max_concurrency threads

        def set(self, key: str, value) -> None:
            with self.changed:
                self.values[key] = value
                self.changed.notify_all()

        def wait_any(self, keys: list[str], timeout_s: float) -> str | None:
            # Blocks in the actor, not in its callers: a poll from every waiter every few
            # milliseconds is a Ray call each, CPU the rollout workers need (docs/results/async.md).
            with self.changed:
                self.changed.wait_for(lambda: any(key in self.values for key in keys), timeout_s)
                return next((key for key in keys if key in self.values), None)

        def get(self, key: str):
            return self.values.get(key)

        def pop(self, key: str):
            with self.changed:
                return self.values.pop(key, None)

        def check(self, key: str) -> bool:
            return key in self.values

        def delete(self, key: str) -> None:
            self.values.pop(key, None)

        def add(self, key: str, amount: int) -> int:
            with self.changed:
                self.values[key] = int(self.values.get(key, 0)) + amount
                self.changed.notify_all()
                return self.values[key]

    return Mailbox


class RayTransport:
    """The run's mailbox actor (named after the run: workers find it by name). Values of more than
    INLINE_BYTES are put in the object store and the mailbox keeps their reference."""

    INLINE_BYTES = 64 << 10

    def __init__(self, mailbox, name: str):
        self.mailbox, self.address = mailbox, name
        self.ray = _ray()

    @classmethod
    def host(cls, name: str) -> RayTransport:
        return cls(mailbox_class().options(name=name).remote(), name)

    @classmethod
    def connect(cls, name: str) -> RayTransport:
        ray = _ray()
        try:
            mailbox = ray.get_actor(name)
        except ValueError:
            raise TransportError(f"no grpokit run's mailbox named {name!r} in this Ray cluster") from None
        return cls(mailbox, name)

    def reconnect(self) -> RayTransport:
        return self

    def set(self, key: str, value: bytes) -> None:
        if len(value) > self.INLINE_BYTES:
            value = [self.ray.put(value)]  # a list: Ray passes a reference inside one on as a reference
        self.ray.get(self.mailbox.set.remote(key, value))

    def get(self, key: str) -> bytes:
        return self._value(key, self.ray.get(self.mailbox.get.remote(key)))

    def pop(self, key: str) -> bytes:
        """get and delete in one call: each call to the mailbox is about a millisecond on the path
        between a worker's batches (docs/results/async.md)."""
        return self._value(key, self.ray.get(self.mailbox.pop.remote(key)))

    def _value(self, key: str, value) -> bytes:
        if isinstance(value, list):  # a reference in the object store
            value = self.ray.get(value[0])
        if value is None:
            raise KeyError(key)
        return value

    def check(self, key: str) -> bool:
        return self.ray.get(self.mailbox.check.remote(key))

    def wait_any(self, keys: list[str], timeout_s: float) -> str | None:
        return self.ray.get(self.mailbox.wait_any.remote(keys, timeout_s))

    def delete(self, key: str) -> None:
        self.ray.get(self.mailbox.delete.remote(key))

    def add(self, key: str, amount: int) -> int:
        return self.ray.get(self.mailbox.add.remote(key, amount))

    def weights(self, rank: int, size: int, device: torch.device, timeout_s: float) -> RayWeights:
        return RayWeights(self, rank, size, device, timeout_s)


class RayWeights:
    """WeightChannel's interface over the object store: a push puts the tensors in WeightChannel's buckets
    (one Ray object each: a worker fetches the next while it copies one in) and posts their references under weights/<n>; each worker reads pushes in
    order. A push's buckets are dropped once every worker has read it (acknowledged under weights/<n>/read)."""

    POLL_S = 0.005

    def __init__(self, transport: RayTransport, rank: int, size: int, device: torch.device, timeout_s: float):
        self.transport, self.rank, self.size, self.timeout_s = transport, rank, size, timeout_s
        self.device = torch.device(device)
        self.sent = 0  # pushes posted (trainer) or read (worker)
        self._pending: list[torch.Tensor] = []
        # the trainer's check of its workers (RemoteRollouts.check_workers), run while a push waits on them:
        # a dead worker is named at once, not after distributed.timeout_s
        self.health_check = None

    # the trainer's side
    def push(self, version: int, tensors: Iterable[torch.Tensor], dtypes: list[torch.dtype], count: int) -> int:
        cast = (tensor.detach().to(device="cpu", dtype=dtype).contiguous()
                for tensor, dtype in zip(tensors, dtypes, strict=True))
        refs, sent = [], 0
        for group in buckets(cast, BUCKET_BYTES):
            refs.append(self.transport.ray.put(group))
            sent += sum(t.numel() * t.element_size() for t in group)
        self._post(version, count, refs)
        return sent

    def _post(self, version: int, count: int, buckets: list) -> None:
        ray, mailbox = self.transport.ray, self.transport.mailbox
        if self.sent > 0:  # the previous push, once every worker has read it, leaves the object store
            previous, started = self.sent - 1, time.monotonic()
            while (ray.get(mailbox.get.remote(f"weights/{previous}/read")) or 0) < self.size - 1:
                if time.monotonic() - started > self.timeout_s:
                    raise RuntimeError(f"the rollout workers did not read weight push {previous} within "
                                       f"distributed.timeout_s={self.timeout_s:g}s")
                if self.health_check is not None:
                    self.health_check()
                time.sleep(self.POLL_S)
            ray.get(mailbox.delete.remote(f"weights/{previous}"))
        ray.get(mailbox.set.remote(f"weights/{self.sent}", {"version": version, "count": count, "buckets": buckets}))
        self.sent += 1

    def stop(self) -> None:
        self.transport.ray.get(self.transport.mailbox.set.remote(f"weights/{self.sent}",
                                                                  {"version": STOP, "count": 0, "buckets": []}))

    def abort(self) -> None:
        """Nothing to tear down: the mailbox goes with the run."""

    # a worker's side
    def receive_header(self) -> tuple[int, int]:
        ray, mailbox = self.transport.ray, self.transport.mailbox
        key = f"weights/{self.sent}"
        while not ray.get(mailbox.wait_any.remote([key], WAIT_WINDOW_S)):
            pass
        push = ray.get(mailbox.get.remote(key))
        self._pending = [t for bucket in ray.get(push["buckets"]) for t in bucket] if push["buckets"] else []
        if push["version"] != STOP:
            ray.get(mailbox.add.remote(f"{key}/read", 1))
        self.sent += 1
        return int(push["version"]), int(push["count"])

    def receive_into(self, buffers: list[torch.Tensor]) -> None:
        for buffer, tensor in zip(buffers, self._pending, strict=True):
            buffer.copy_(tensor)
        self._pending = []
