"""How the trainer and its rollout workers reach each other (docs/async.md): one interface, two kinds.

- `store` (distributed.launcher: torchrun, the default): a key store the trainer hosts at
  rollout.worker_address, bound to that address alone (loopback by default), carries setup, tasks,
  results, heartbeats and errors as keys, every message authenticated with the run's secret
  (rollout/auth_store.py); weights go over a gloo/NCCL group of their own (rollout/weight_channel.py)
  whose peers meet through that store and listen on the same interface.
- `ray` (distributed.launcher: ray): a mailbox actor of the run carries the same keys; results and
  weights travel as Ray object references (the bytes stay in the object store, the mailbox holds
  only references), so nothing funnels through one process's memory.

Everything above this layer, the schedule, the per-completion seeds, the worker-order joins and the
checkpointed tasks in flight, is the same for both: a run's numbers do not depend on the transport.
"""

from __future__ import annotations

import os
import secrets
import threading
import time
from collections.abc import Iterable
from typing import Protocol

import torch
import torch.distributed as dist

from grpokit.config.validation import WORKER_SECRET_ENV, worker_secret_problems
from grpokit.rollout.auth_store import KeyClient, KeyServer, KeyTable, Refused
from grpokit.rollout.weight_channel import BUCKET_BYTES, STOP, WeightChannel, buckets

SECRET_ENV = WORKER_SECRET_ENV
SETUP_WAIT_S = 30.0  # how long a worker that reached the store waits for the run's setup key
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
    def close(self) -> None: ...


# ------------------------------------------------------------------------------------ the key store

def run_secret(spawned: bool) -> str:
    """The secret of a run's store: GRPOKIT_WORKER_SECRET, or for workers this process spawns a fresh
    one (they inherit it), so that not even another user of this machine can talk to the store. Only
    external workers on loopback go without one: any process of this machine may then join."""
    return os.environ.get(SECRET_ENV, "") or (secrets.token_hex(16) if spawned else "")


class StoreTransport:
    """The trainer's key store at HOST:PORT (port 0: a free one): `host` on the trainer, which reads and
    writes the keys in place, `connect` on a worker, whose every call is an authenticated message."""

    def __init__(self, keys: KeyTable | KeyClient, address: str, secret: str, timeout_s: float,
                 server: KeyServer | None = None, local_host: str = ""):
        self.keys, self.address, self.secret, self.timeout_s = keys, address, secret, timeout_s
        self.server, self.local_host = server, local_host

    @classmethod
    def host(cls, address: str, timeout_s: float, secret: str | None = None) -> StoreTransport:
        """The trainer's end, listening on the address's interface alone. Beyond loopback the store holds
        a run's config and accepts results, so it needs a secret (grpokit.config checks it before any
        model loads; this is the last line)."""
        secret = os.environ.get(SECRET_ENV, "") if secret is None else secret
        problem = next(worker_secret_problems(address, secret), None)
        if problem is not None:
            raise TransportError(problem)
        host, _, port = address.rpartition(":")
        try:
            server = KeyServer(host.strip("[]"), int(port), secret.encode())
        except OSError as err:
            raise TransportError(f"rollout.worker_address={address}: cannot listen there ({err.strerror or err}); "
                                 "name an address of this machine, or port 0 for a free port") from None
        # the weight group listens on the same interface (any, when the store does)
        local = "" if host.strip("[]") in ("0.0.0.0", "::", "") else host.strip("[]")
        return cls(server.table, f"{host}:{server.port}", secret, timeout_s, server, local)

    @classmethod
    def connect(cls, address: str, timeout_s: float, secret: str | None = None) -> StoreTransport:
        """A worker's end: the trainer's store at HOST:PORT, with this environment's secret."""
        secret = os.environ.get(SECRET_ENV, "") if secret is None else secret
        try:
            client = KeyClient(address, secret.encode(), timeout_s)
        except Refused as err:
            raise TransportError(f"{err}: set {SECRET_ENV} to the trainer's") from None
        except OSError as err:
            raise TransportError(f"cannot reach the trainer at {address}: {err.strerror or err}") from None
        transport = cls(client, address, secret, timeout_s, local_host=client.local_host)
        if not transport.wait_any(["setup"], min(timeout_s, SETUP_WAIT_S)):  # set before the trainer waits for us
            raise TransportError(f"the trainer at {address} has no run for this worker")
        return transport

    def reconnect(self) -> StoreTransport:
        """A connection of another thread's own (the trainer's own end needs none)."""
        if isinstance(self.keys, KeyTable):
            return self
        return StoreTransport.connect(self.address, self.timeout_s, self.secret)

    def set(self, key: str, value: bytes) -> None:
        self.keys.set(key, value)

    def get(self, key: str) -> bytes:
        return self.keys.get(key, self.timeout_s)

    def check(self, key: str) -> bool:
        return self.keys.check(key)

    def wait_any(self, keys: list[str], timeout_s: float) -> str | None:
        """The first of `keys`, in their order, that is set within timeout_s (None: none yet); the store
        waits, so a waiting worker sends one message per wake-up."""
        return self.keys.wait_any(keys, timeout_s)

    def pop(self, key: str) -> bytes:
        """The value of `key`, which is deleted."""
        return self.keys.pop(key, self.timeout_s)

    def delete(self, key: str) -> None:
        self.keys.delete(key)

    def add(self, key: str, amount: int) -> int:
        return self.keys.add(key, amount)

    def weights(self, rank: int, size: int, device: torch.device, timeout_s: float) -> WeightChannel:
        """The weight group: its peers' addresses go through this store, so only holders of the secret
        learn them; each listens on the interface that reaches the store."""
        return WeightChannel(RendezvousStore(self.keys, "weights/", timeout_s), rank, size, device, timeout_s,
                             hostname=self.local_host)

    def close(self) -> None:
        if self.server is not None:
            self.server.close()
        elif isinstance(self.keys, KeyClient):
            self.keys.close()


class RendezvousStore(dist.Store):
    """The keys a gloo/NCCL group's peers exchange to meet, kept in the run's store under a prefix of
    their own (torch calls these methods while the group forms)."""

    def __init__(self, keys: KeyTable | KeyClient, prefix: str, timeout_s: float):
        super().__init__()
        self.keys, self.prefix, self.timeout_s = keys, prefix, timeout_s

    def set(self, key, value) -> None:
        self.keys.set(self.prefix + key, value.encode() if isinstance(value, str) else bytes(value))

    def get(self, key) -> bytes:
        return self.keys.get(self.prefix + key, self.timeout_s)

    def wait(self, keys, timeout=None) -> None:
        for key in keys:
            self.keys.get(self.prefix + key, timeout.total_seconds() if timeout else self.timeout_s)

    def check(self, keys) -> bool:
        return all(self.keys.check(self.prefix + key) for key in keys)

    def add(self, key, amount) -> int:
        return self.keys.add(self.prefix + key, amount)

    def compare_set(self, key, expected, desired) -> bytes:
        as_bytes = (lambda v: v.encode() if isinstance(v, str) else bytes(v))
        return self.keys.compare_set(self.prefix + key, as_bytes(expected), as_bytes(desired))

    def delete_key(self, key) -> bool:
        return self.keys.delete(self.prefix + key)


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

    def close(self) -> None:
        """The mailbox goes with the run's RayLaunch."""

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
