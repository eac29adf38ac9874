"""Nobody outside a run reads or writes it (docs/guides/security.md): the rollout workers' store listens
on rollout.worker_address's interface alone (loopback by default), a peer without the run's secret is
refused before it sees a byte, every message is authenticated (forged, altered and replayed ones are
dropped unread and logged once per peer), and a bad address or secret is one line before any model
loads. The real runs (slow tier) are attacked while they train and end with an undisturbed run's weights."""

from __future__ import annotations

import datetime
import os
import re
import socket
import subprocess
import sys
import threading
import time

import psutil
import pytest
import torch
from safetensors.torch import load_file

from grpokit.checks import load_config
from grpokit.config import ConfigError
from grpokit.rollout.auth_store import FRAME, MAGIC, NONCE_BYTES, _request, client_handshake
from grpokit.rollout.transport import SECRET_ENV, StoreTransport, TransportError
from run_helpers import RUN, cli

SECRET = "a-secret-of-the-run-0123456789"


def own_address() -> str | None:
    """An address of this machine beyond loopback (the one other machines would reach it at)."""
    found = subprocess.run(["hostname", "-I"], capture_output=True, text=True).stdout.split()
    for address in found + [socket.gethostbyname(socket.gethostname())]:
        if ":" not in address and not address.startswith("127."):
            return address
    return None


OWN = own_address()
needs_own = pytest.mark.skipif(OWN is None, reason="this machine has no address beyond loopback")


def _log_of(transport: StoreTransport) -> list[str]:
    lines: list[str] = []
    transport.server.log = lines.append
    return lines


def _read_all(sock: socket.socket, timeout_s: float = 5.0) -> bytes:
    """Everything the peer sends until it closes the connection."""
    sock.settimeout(timeout_s)
    data = b""
    try:
        while chunk := sock.recv(1 << 16):
            data += chunk
    except (ConnectionResetError, TimeoutError):
        pass
    return data


def _port(transport: StoreTransport) -> int:
    return int(transport.address.rpartition(":")[2])


def _eventually(condition, timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.02)
    return False


def _forged_frame(key: str, value: bytes) -> bytes:
    """A message in the store's format whose MAC a stranger had to guess."""
    body = _request(b"S", key, value)
    return FRAME.pack(0, len(body)) + os.urandom(32) + body


class Recorder:
    """A socket whose every byte sent is kept (what an eavesdropper on the wire would replay)."""

    def __init__(self, sock):
        self.sock, self.sent = sock, b""

    def sendall(self, data: bytes) -> None:
        self.sent += data
        self.sock.sendall(data)

    def recv(self, n: int) -> bytes:
        return self.sock.recv(n)


# ---------------------------------------------------------------------------- the store (seconds)


@needs_own
def test_the_store_listens_on_loopback_alone_by_default():
    trainer = StoreTransport.host("127.0.0.1:0", 10.0, secret="")
    try:
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection((OWN, _port(trainer)), timeout=5)
        socket.create_connection(("127.0.0.1", _port(trainer)), timeout=5).close()
    finally:
        trainer.close()


@needs_own
def test_a_stranger_reads_no_byte_of_the_run_and_what_it_writes_changes_nothing(monkeypatch):
    monkeypatch.setattr("grpokit.rollout.auth_store.HANDSHAKE_S", 1.0)
    trainer = StoreTransport.host(f"{OWN}:0", 10.0, secret=SECRET)
    lines = _log_of(trainer)
    try:
        trainer.set("setup", b"the run's configuration")
        # our format with a guessed MAC: a forged result and a forged stop
        _attack(OWN, _port(trainer), "result/1/0")
        # torch's TCPStore protocol, as the old store spoke it
        import torch.distributed as dist

        with pytest.raises(Exception):  # noqa: B017 - refused, however torch words it
            store = dist.TCPStore(OWN, _port(trainer), is_master=False, timeout=datetime.timedelta(seconds=3))
            store.set("stop", b"1")
            store.get("setup")
        assert _eventually(lambda: lines)
        assert trainer.keys.values == {"setup": b"the run's configuration"}
        time.sleep(1.5)  # the TCPStore client's connection is refused too, and not logged again
        assert len(lines) == 1 and f"refused a connection from {OWN}" in lines[0], lines
    finally:
        trainer.close()


def test_altered_and_replayed_messages_are_dropped_unread_and_end_their_connection():
    trainer = StoreTransport.host("127.0.0.1:0", 10.0, secret=SECRET)
    lines = _log_of(trainer)
    try:
        # an eavesdropper records a worker's whole connection, then replays it on a connection of its own
        sock = socket.create_connection(("127.0.0.1", _port(trainer)), timeout=5)
        recorder = Recorder(sock)
        channel = client_handshake(recorder, SECRET.encode(), trainer.address)
        channel.send(_request(b"S", "result/0/0", b"honest"))
        assert channel.receive() == b"\x01"
        trainer.delete("result/0/0")
        replay = socket.create_connection(("127.0.0.1", _port(trainer)), timeout=5)
        replay.recv(len(MAGIC) + NONCE_BYTES)
        replay.sendall(recorder.sent)
        assert _read_all(replay) == b""  # refused at the handshake: its nonce is not this connection's
        assert not trainer.check("result/0/0")
        # the same message sent again on its own connection: its sequence number is spent
        sent = recorder.sent
        channel.sock.sendall(sent[len(sent) - (FRAME.size + 32 + len(_request(b"S", "result/0/0", b"honest"))):])
        assert _read_all(sock) == b""
        assert not trainer.check("result/0/0")
        # an altered message on a fresh honest connection
        sock = socket.create_connection(("127.0.0.1", _port(trainer)), timeout=5)
        channel = client_handshake(sock, SECRET.encode(), trainer.address)
        body = _request(b"S", "stop", b"1")
        head = FRAME.pack(0, len(body))
        from grpokit.rollout.auth_store import _mac
        sock.sendall(head + _mac(channel.key, b"c", head, _request(b"S", "stoq", b"1")) + body)
        assert _read_all(sock) == b""
        assert not trainer.check("stop")
        assert len(lines) == 1 and "refused a connection from 127.0.0.1" in lines[0], lines  # once per peer
    finally:
        trainer.close()


@needs_own
def test_a_worker_with_the_wrong_secret_is_refused_naming_its_address():
    trainer = StoreTransport.host(f"{OWN}:0", 10.0, secret=SECRET)
    lines = _log_of(trainer)
    try:
        trainer.set("setup", b"x")
        with pytest.raises(TransportError, match=f"refused this worker: its secret differs.*set {SECRET_ENV}"):
            StoreTransport.connect(trainer.address, 10.0, secret="another-secret-0123456789")
        assert _eventually(lambda: lines)
        assert len(lines) == 1 and re.search(rf"refused a connection from {re.escape(OWN)} .*secret", lines[0])
        worker = StoreTransport.connect(trainer.address, 10.0, secret=SECRET)
        assert worker.get("setup") == b"x" and worker.local_host == OWN  # its weight group listens there
        worker.close()
    finally:
        trainer.close()


def test_the_weight_group_meets_through_the_authenticated_store():
    """A gloo group whose peers exchange their addresses as keys of the store (nothing of TCPStore's)."""
    trainer = StoreTransport.host("127.0.0.1:0", 30.0, secret=SECRET)
    trainer.set("setup", b"x")
    received = {}

    def worker():
        transport = StoreTransport.connect(trainer.address, 30.0, secret=SECRET)
        channel = transport.weights(1, 2, torch.device("cpu"), 30.0)
        version, count = channel.receive_header()
        buffers = [torch.zeros(3), torch.zeros(2, dtype=torch.bfloat16)]
        channel.receive_into(buffers)
        received.update(version=version, count=count, buffers=buffers)

    thread = threading.Thread(target=worker)
    thread.start()
    try:
        channel = trainer.weights(0, 2, torch.device("cpu"), 30.0)
        tensors = [torch.arange(3.0), torch.tensor([1.5, -2.0])]
        channel.push(4, iter(tensors), [torch.float32, torch.bfloat16], 2)
        thread.join(30)
        assert (received["version"], received["count"]) == (4, 2)
        assert torch.equal(received["buffers"][0], tensors[0])
        assert torch.equal(received["buffers"][1], tensors[1].to(torch.bfloat16))
    finally:
        trainer.close()


# ---------------------------------------------------------------------------- bad input (one line)


@needs_own
def test_an_address_beyond_loopback_without_a_secret_is_one_line_naming_the_key(monkeypatch):
    monkeypatch.delenv(SECRET_ENV, raising=False)
    with pytest.raises(ConfigError, match=rf"rollout.worker_address={re.escape(OWN)}:0 listens beyond this machine's "
                                          rf"loopback interface: set {SECRET_ENV}"):
        load_config(None, ["--rollout.workers=1", "--rollout.mode=one_step_off", f"--rollout.worker_address={OWN}:0"])
    with pytest.raises(ConfigError, match="rollout.worker_address=0.0.0.0:0 listens beyond"):
        load_config(None, ["--rollout.workers=1", "--rollout.worker_address=0.0.0.0:0"])
    load_config(None, ["--rollout.workers=1", "--rollout.worker_address=localhost:0"])  # loopback by name
    monkeypatch.setenv(SECRET_ENV, SECRET)
    load_config(None, ["--rollout.workers=1", f"--rollout.worker_address={OWN}:0"])


def test_a_short_secret_is_one_line_on_the_trainer_and_on_a_worker(monkeypatch, capsys):
    monkeypatch.setenv(SECRET_ENV, "short")
    with pytest.raises(ConfigError, match=rf"{SECRET_ENV} is 5 bytes long: a shared secret needs at least 16"):
        load_config(None, ["--rollout.workers=1"])
    from grpokit.pipeline.rollout_worker import main

    assert main(["--connect", "127.0.0.1:1", "--index", "0"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"{SECRET_ENV} is 5 bytes long" in err[0], err


def test_a_second_worker_with_a_taken_index_is_refused_in_one_line(monkeypatch, capsys):
    from grpokit.pipeline.rollout_worker import main

    monkeypatch.setenv(SECRET_ENV, SECRET)
    trainer = StoreTransport.host("127.0.0.1:0", 10.0)
    try:
        trainer.set("setup", b"x")
        first = StoreTransport.connect(trainer.address, 10.0)
        assert first.add("claim/1", 1) == 1  # what the first worker with --index 1 did
        assert main(["--connect", trainer.address, "--index", "1"]) == 1
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "index 1 is already taken by another worker of the run" in err[0], err
        assert not trainer.check("error/1")  # the run and its first worker go on
    finally:
        trainer.close()


# ---------------------------------------------------------------------------- real runs, attacked (slow tier)

STEPS = ["--grpo.max_steps=4", *RUN, "--rollout.mode=one_step_off", "--rollout.workers=1"]


@pytest.fixture(scope="module")
def undisturbed(tmp_path_factory):
    """The run no stranger disturbs: the built-in tiny model (no pi_SFT to train first: the weights, not
    what they learn, are compared)."""
    out = tmp_path_factory.mktemp("undisturbed") / "run"
    cli("train", f"--output_dir={out}", *STEPS, timeout=1800)
    return load_file(out / "checkpoints" / "step-4" / "model.safetensors")


def _store_address(trainer: subprocess.Popen) -> str:
    """HOST:PORT of the run's store, from the line the trainer prints once its workers are ready."""
    for line in trainer.stdout:
        found = re.search(r"rollout worker\(s\) ready at (\S+) in", line)
        if found:
            return found.group(1)
    raise AssertionError("the trainer ended before its workers were ready")


def _listening(pids: list[int]) -> list[tuple[str, int]]:
    return [(c.laddr.ip, c.laddr.port) for pid in pids for c in psutil.Process(pid).net_connections("tcp")
            if c.status == psutil.CONN_LISTEN]


def _attack(host: str, port: int, result_key: str = "result/2/0") -> None:
    """A stranger at `host`: reads what the store sends, then sends a forged result and a forged stop
    (in the store's format, its MAC guessed), and finally tries as a worker with a guessed secret."""
    stranger = socket.create_connection((host, port), timeout=5)
    greeting = b""
    while len(greeting) < len(MAGIC) + NONCE_BYTES:
        greeting += stranger.recv(64)
    assert greeting.startswith(MAGIC) and len(greeting) == len(MAGIC) + NONCE_BYTES  # a nonce: no byte of the run
    stranger.sendall(b"\0" * (NONCE_BYTES + 32) + _forged_frame(result_key, b"forged") + _forged_frame("stop", b"1"))
    assert _read_all(stranger, 15) == b""  # then closed
    with pytest.raises(TransportError, match="refused this worker"):
        StoreTransport.connect(f"{host}:{port}", 10.0, secret="a-guessed-secret-0000000")


def _train_attacked(tmp_path, extra: list[str], env: dict, attacker: str) -> tuple[str, dict]:
    out, log = tmp_path / "run", tmp_path / "trainer.err"
    with open(log, "w") as stderr:  # a file: a pipe nobody reads while the run trains could fill
        trainer = subprocess.Popen([sys.executable, "-m", "grpokit.cli", "train", f"--output_dir={out}", *STEPS,
                                    *extra], text=True,
                                   stdout=subprocess.PIPE, stderr=stderr, env={**env, "PYTHONUNBUFFERED": "1"})
    try:
        host, _, port = _store_address(trainer).rpartition(":")
        workers = [p.pid for p in psutil.Process(trainer.pid).children(recursive=True)]
        listening = _listening([trainer.pid, *workers])
        _attack(attacker, int(port))
        trainer.communicate(timeout=1800)
    finally:
        trainer.kill()
    err = log.read_text()
    assert trainer.returncode == 0, err[-3000:]
    return err, {"host": host, "listening": listening,
                 "weights": load_file(out / "checkpoints" / "step-4" / "model.safetensors")}


@needs_own
@pytest.mark.slow  # two runs of 4 steps with a worker (about a minute each on 2 cores)
def test_a_run_at_default_settings_is_unreachable_from_the_network_and_a_local_stranger_changes_nothing(
        tmp_path, undisturbed):
    env = {k: v for k, v in os.environ.items() if k != SECRET_ENV}
    err, run = _train_attacked(tmp_path, [], env, "127.0.0.1")
    assert run["host"] == "127.0.0.1"
    assert run["listening"] and all(ip == "127.0.0.1" for ip, _ in run["listening"]), run["listening"]
    for _, port in run["listening"]:  # the store, and the weight group's gloo listeners
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection((OWN, port), timeout=5)
    # spawned workers share a secret made for the run: even another user of this machine is refused
    assert re.search(r"refused a connection from 127\.0\.0\.1 to the rollout workers' store", err), err[-3000:]
    assert all(torch.equal(run["weights"][k], undisturbed[k]) for k in undisturbed)


@needs_own
@pytest.mark.slow  # a run of 4 steps with a worker
def test_a_run_beyond_loopback_with_a_secret_refuses_strangers_and_ends_as_undisturbed(
        tmp_path, undisturbed):
    port = socket.socket()
    port.bind(("", 0))
    free = port.getsockname()[1]
    port.close()
    err, run = _train_attacked(tmp_path, [f"--rollout.worker_address={OWN}:{free}"],
                               {**os.environ, SECRET_ENV: SECRET}, OWN)
    assert run["host"] == OWN
    assert all(ip == OWN for ip, _ in run["listening"]), run["listening"]  # that interface alone
    refusals = [line for line in err.splitlines() if "refused a connection" in line]
    assert len(refusals) == 1 and f"from {OWN} " in refusals[0], refusals  # once per peer
    assert all(torch.equal(run["weights"][k], undisturbed[k]) for k in undisturbed)
