"""Which Ray cluster `distributed.launcher: ray` joins (pipeline/ray_cluster.py, connect): RAY_ADDRESS's, the
one `ray start` left on this machine, or a private one sized to this machine, always with RAY_ADDRESS=local.
Ray itself is replaced by a recorder: the choice is grpokit's, and this runs without Ray installed."""

from __future__ import annotations

import os

import pytest

from grpokit.pipeline import ray_cluster


class _RecordingRay:
    def __init__(self):
        self.calls: list[dict] = []

    def is_initialized(self) -> bool:
        return False

    def init(self, **kwargs) -> None:
        self.calls.append(kwargs)


@pytest.fixture
def recorded(monkeypatch):
    fake = _RecordingRay()
    monkeypatch.setattr(ray_cluster, "import_ray", lambda: fake)
    monkeypatch.setattr(ray_cluster, "_running_cluster", lambda: True)  # `ray start` left a cluster here
    return fake


@pytest.mark.parametrize("address, joins", [("10.0.0.5:6379", "10.0.0.5:6379"), (None, "auto")])
def test_a_run_joins_ray_address_or_the_cluster_left_running_here(recorded, monkeypatch, address, joins):
    if address is None:
        monkeypatch.delenv("RAY_ADDRESS", raising=False)
    else:
        monkeypatch.setenv("RAY_ADDRESS", address)
    ray_cluster.connect(None)
    assert [call.get("address") for call in recorded.calls] == [joins]
    assert "num_cpus" not in recorded.calls[0]  # a cluster that exists keeps its own size


def test_ray_address_local_starts_a_private_cluster_even_where_one_is_running(recorded, monkeypatch):
    monkeypatch.setenv("RAY_ADDRESS", "local")
    ray_cluster.connect(None)
    (call,) = recorded.calls
    assert "address" not in call  # ray.init reads RAY_ADDRESS=local itself: a new cluster
    assert call["num_cpus"] == os.cpu_count() and call["object_store_memory"] == ray_cluster.OBJECT_STORE_BYTES
