"""How the trainer and its rollout workers reach each other (docs/async.md).

- `store` (distributed.launcher: torchrun, the default): a key store the trainer hosts at
  rollout.worker_address, bound to that address alone (loopback by default), carries setup, tasks,
  results, heartbeats and errors as keys, every message authenticated with the run's secret
  (rollout/auth_store.py); weights go over a gloo/NCCL group of their own (rollout/weight_channel.py)
  whose peers meet through that store and listen on the same interface.
- `ray` (distributed.launcher: ray) needs no transport of this kind: the workers are actors whose calls
  carry the tasks and results, and the weights go over a gloo/NCCL group as here
  (pipeline/rollout_worker.py, RayWorkers).

Everything above this layer, the schedule, the per-completion seeds, the worker-order joins and the
checkpointed tasks in flight, is the same for both: a run's numbers do not depend on the transport.
"""

from __future__ import annotations

import os
import secrets
from typing import Protocol

import torch
import torch.distributed as dist

from grpokit.config.validation import WORKER_SECRET_ENV, worker_secret_problems
from grpokit.rollout.auth_store import KeyClient, KeyServer, KeyTable, Refused
from grpokit.rollout.weight_channel import WeightChannel

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
