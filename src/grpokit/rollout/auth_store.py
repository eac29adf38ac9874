"""The key store a trainer hosts for its rollout workers: a small TCP server bound to the one address
rollout.worker_address names, whose every message is authenticated (docs/guides/security.md).

torch's TCPStore listens on every interface and checks nothing: anyone who reaches its port can list,
read and write a run's keys. Here:
- a connection opens with a challenge and response: the server sends a fresh nonce, the client answers
  with its own nonce and HMAC-SHA256(secret, both nonces), and the server proves it holds the secret
  too. A peer without the secret is refused before it sends or reads a byte of the run; the refusal is
  logged once per address.
- every message after that carries its sequence number and HMAC-SHA256 over direction, number and
  body under a key derived from both nonces, compared in constant time. A message altered, forged,
  replayed (from this connection or an earlier one) or reordered fails the check: it is dropped
  unread, logged once per address, and its connection closed. The run goes on.
- a value is bytes, and nothing here unpickles it: its readers (rollout/wire.py) only ever see bytes
  that passed the check. There is no way to list the keys.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import socket
import struct
import sys
import threading
import time
from collections.abc import Callable

NONCE_BYTES = 16
MAC_BYTES = 32
MAGIC = b"grpokit-store/1\n"
FRAME = struct.Struct("!QI")  # sequence number, body bytes
MAX_BODY = (1 << 32) - 1  # what FRAME can say
HANDSHAKE_S = 10.0  # how long a new connection has to prove it holds the secret


class Refused(ConnectionError):
    """The peer does not hold this run's secret (or is not a grpokit trainer); the message says which."""


class BadMessage(ConnectionError):
    """A message that failed its authentication check."""


def _mac(key: bytes, *parts: bytes) -> bytes:
    return hmac.new(key, b"".join(parts), hashlib.sha256).digest()


def _exactly(sock: socket.socket, n: int) -> bytes:
    data = bytearray()
    while len(data) < n:
        chunk = sock.recv(min(n - len(data), 1 << 20))
        if not chunk:
            raise ConnectionError("the peer closed the connection")
        data += chunk
    return bytes(data)


class Channel:
    """One authenticated connection: send and receive whole messages, each checked."""

    def __init__(self, sock: socket.socket, key: bytes, client: bool):
        self.sock, self.key = sock, key
        self.out_tag, self.in_tag = (b"c", b"s") if client else (b"s", b"c")
        self.sent = self.received = 0

    def send(self, body: bytes) -> None:
        head = FRAME.pack(self.sent, len(body))
        self.sock.sendall(head + _mac(self.key, self.out_tag, head, body) + body)
        self.sent += 1

    def receive(self) -> bytes:
        head = _exactly(self.sock, FRAME.size)
        number, size = FRAME.unpack(head)
        if number != self.received or size > MAX_BODY:
            raise BadMessage(f"message {number} where {self.received} was due")
        mac = _exactly(self.sock, MAC_BYTES)
        body = _exactly(self.sock, size)
        if not hmac.compare_digest(mac, _mac(self.key, self.in_tag, head, body)):
            raise BadMessage("its MAC does not match")
        self.received += 1
        return body


def server_handshake(sock: socket.socket, secret: bytes) -> Channel:
    server_nonce = os.urandom(NONCE_BYTES)
    sock.sendall(MAGIC + server_nonce)
    answer = _exactly(sock, NONCE_BYTES + MAC_BYTES)
    client_nonce, mac = answer[:NONCE_BYTES], answer[NONCE_BYTES:]
    if not hmac.compare_digest(mac, _mac(secret, b"client", server_nonce, client_nonce)):
        raise Refused("it does not hold this run's secret")
    sock.sendall(_mac(secret, b"server", server_nonce, client_nonce))
    return Channel(sock, _mac(secret, b"session", server_nonce, client_nonce), client=False)


def client_handshake(sock: socket.socket, secret: bytes, address: str) -> Channel:
    try:
        hello = _exactly(sock, len(MAGIC) + NONCE_BYTES)
    except (ConnectionError, TimeoutError):
        raise Refused(f"{address} is not a grpokit trainer") from None
    if not hello.startswith(MAGIC):
        raise Refused(f"{address} is not a grpokit trainer")
    server_nonce, client_nonce = hello[len(MAGIC):], os.urandom(NONCE_BYTES)
    sock.sendall(client_nonce + _mac(secret, b"client", server_nonce, client_nonce))
    try:
        proof = _exactly(sock, MAC_BYTES)
    except (ConnectionError, TimeoutError):
        raise Refused(f"the trainer at {address} refused this worker: its secret differs from this "
                      "environment's") from None
    if not hmac.compare_digest(proof, _mac(secret, b"server", server_nonce, client_nonce)):
        raise Refused(f"the peer at {address} does not hold this run's secret")
    return Channel(sock, _mac(secret, b"session", server_nonce, client_nonce), client=True)


# ------------------------------------------------------------------------------------ the keys

class KeyTable:
    """The keys themselves, shared by the server's connections and the trainer (which holds it)."""

    def __init__(self):
        self.values: dict[str, bytes] = {}
        self.changed = threading.Condition()

    def set(self, key: str, value: bytes) -> None:
        with self.changed:
            self.values[key] = bytes(value)
            self.changed.notify_all()

    def get(self, key: str, timeout_s: float) -> bytes:
        """The value of `key`, waiting up to timeout_s for it to be set (TimeoutError)."""
        with self.changed:
            if not self.changed.wait_for(lambda: key in self.values, timeout_s):
                raise TimeoutError(f"key {key!r} was not set within {timeout_s:g}s")
            return self.values[key]

    def pop(self, key: str, timeout_s: float) -> bytes:
        with self.changed:
            value = self.get(key, timeout_s)
            del self.values[key]
            return value

    def check(self, key: str) -> bool:
        with self.changed:
            return key in self.values

    def wait_any(self, keys: list[str], timeout_s: float) -> str | None:
        """The first of `keys`, in their order, that is set within timeout_s (None: none yet)."""
        with self.changed:
            self.changed.wait_for(lambda: any(key in self.values for key in keys), timeout_s)
            return next((key for key in keys if key in self.values), None)

    def delete(self, key: str) -> bool:
        with self.changed:
            return self.values.pop(key, None) is not None

    def add(self, key: str, amount: int) -> int:
        with self.changed:
            value = int(self.values.get(key, b"0")) + amount
            self.values[key] = str(value).encode()
            self.changed.notify_all()
            return value

    def compare_set(self, key: str, expected: bytes, desired: bytes) -> bytes:
        with self.changed:
            current = self.values.get(key)
            if (current is None and not expected) or current == expected:
                self.values[key] = bytes(desired)
                self.changed.notify_all()
                return bytes(desired)
            return expected if current is None else current


# A request is an operation byte, the key's length and the key, then its argument (a value, a
# number, or keys joined by newlines); an answer is a status byte and its value.
_KEY = struct.Struct("!H")
_NUMBER = struct.Struct("!q")
_TIMEOUT = struct.Struct("!d")


def _request(op: bytes, key: str, argument: bytes = b"") -> bytes:
    encoded = key.encode()
    return op + _KEY.pack(len(encoded)) + encoded + argument


def _parse(body: bytes) -> tuple[bytes, str, bytes]:
    (size,) = _KEY.unpack_from(body, 1)
    return body[:1], body[1 + _KEY.size:1 + _KEY.size + size].decode(), body[1 + _KEY.size + size:]


def _answer(table: KeyTable, body: bytes) -> bytes:
    op, key, argument = _parse(body)
    try:
        if op == b"S":
            table.set(key, argument)
            return b"\x01"
        if op in (b"G", b"P"):
            (timeout_s,) = _TIMEOUT.unpack(argument)
            return b"\x01" + (table.get if op == b"G" else table.pop)(key, timeout_s)
        if op == b"C":
            return b"\x01" if table.check(key) else b"\x00"
        if op == b"W":
            (timeout_s,) = _TIMEOUT.unpack_from(argument)
            found = table.wait_any(argument[_TIMEOUT.size:].decode().split("\n"), timeout_s)
            return b"\x01" + found.encode() if found is not None else b"\x00"
        if op == b"D":
            return b"\x01" if table.delete(key) else b"\x00"
        if op == b"A":
            return b"\x01" + _NUMBER.pack(table.add(key, _NUMBER.unpack(argument)[0]))
        if op == b"X":
            (size,) = _KEY.unpack_from(argument)
            expected, desired = argument[_KEY.size:_KEY.size + size], argument[_KEY.size + size:]
            return b"\x01" + table.compare_set(key, expected, desired)
    except TimeoutError:
        return b"\x00"
    return b"\x02"  # an operation this server does not know


class KeyServer:
    """Serves a KeyTable at HOST:PORT (port 0: a free one), bound to that address alone."""

    def __init__(self, host: str, port: int, secret: bytes, table: KeyTable | None = None,
                 log: Callable[[str], None] | None = None):
        self.table, self.secret = table or KeyTable(), secret
        self.log = log or (lambda line: print(line, file=sys.stderr, flush=True))
        family, kind, proto, _, sockaddr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
        self.listener = socket.socket(family, kind, proto)
        self.listener.bind(sockaddr)
        self.listener.listen(64)
        self.host, self.port = host, self.listener.getsockname()[1]
        self.logged: set[str] = set()  # peers already named in the log
        self.connections: set[socket.socket] = set()
        self.closed = False
        self.lock = threading.Lock()
        threading.Thread(target=self._accept, name="key-server", daemon=True).start()

    def _accept(self) -> None:
        while not self.closed:
            try:
                sock, peer = self.listener.accept()
            except OSError:
                return
            with self.lock:
                self.connections.add(sock)
            threading.Thread(target=self._serve, args=(sock, peer[0]), name="key-server-peer", daemon=True).start()

    def _serve(self, sock: socket.socket, peer: str) -> None:
        try:
            sock.settimeout(HANDSHAKE_S)
            try:
                channel = server_handshake(sock, self.secret)
            except (Refused, ConnectionError, TimeoutError, OSError):
                self._refused(peer, "it did not prove it holds this run's secret (GRPOKIT_WORKER_SECRET differs, or "
                                    "it is not a grpokit rollout worker); it was disconnected")
                return
            sock.settimeout(None)
            while True:
                try:
                    body = channel.receive()
                except BadMessage:
                    self._refused(peer, "a message failed its authentication check (forged, altered or replayed); it "
                                        "was dropped unread and the connection closed")
                    return
                channel.send(_answer(self.table, body))
        except (ConnectionError, OSError, struct.error, UnicodeDecodeError):
            return
        finally:
            with self.lock:
                self.connections.discard(sock)
            sock.close()

    def _refused(self, peer: str, why: str) -> None:
        with self.lock:
            if peer in self.logged or self.closed:
                return
            self.logged.add(peer)
        self.log(f"grpokit: refused a connection from {peer} to the rollout workers' store at "
                 f"{self.host}:{self.port}: {why}")

    def close(self) -> None:
        self.closed = True
        try:
            self.listener.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.listener.close()
        with self.lock:
            for sock in list(self.connections):
                try:
                    sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass


class KeyClient:
    """A connection to a KeyServer, with KeyTable's methods (one request at a time)."""

    def __init__(self, address: str, secret: bytes, timeout_s: float):
        host, _, port = address.rpartition(":")
        self.address, self.secret, self.timeout_s = address, secret, timeout_s
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                sock = socket.create_connection((host.strip("[]"), int(port)), timeout=HANDSHAKE_S)
                break
            except OSError:  # the trainer may not listen yet
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)
        try:
            self.channel = client_handshake(sock, secret, address)
        except BaseException:
            sock.close()
            raise
        sock.settimeout(None)
        self.sock = sock
        self.lock = threading.Lock()

    @property
    def local_host(self) -> str:
        """The address of this machine's interface that reaches the server."""
        return self.sock.getsockname()[0]

    def _call(self, body: bytes) -> bytes:
        with self.lock:
            self.channel.send(body)
            answer = self.channel.receive()
        if answer[:1] == b"\x02":
            raise RuntimeError("the trainer's store does not know this request")
        return answer

    def set(self, key: str, value: bytes) -> None:
        self._call(_request(b"S", key, bytes(value)))

    def get(self, key: str, timeout_s: float) -> bytes:
        answer = self._call(_request(b"G", key, _TIMEOUT.pack(timeout_s)))
        if answer[:1] != b"\x01":
            raise TimeoutError(f"key {key!r} was not set within {timeout_s:g}s")
        return answer[1:]

    def pop(self, key: str, timeout_s: float) -> bytes:
        answer = self._call(_request(b"P", key, _TIMEOUT.pack(timeout_s)))
        if answer[:1] != b"\x01":
            raise TimeoutError(f"key {key!r} was not set within {timeout_s:g}s")
        return answer[1:]

    def check(self, key: str) -> bool:
        return self._call(_request(b"C", key)) == b"\x01"

    def wait_any(self, keys: list[str], timeout_s: float) -> str | None:
        answer = self._call(_request(b"W", "", _TIMEOUT.pack(timeout_s) + "\n".join(keys).encode()))
        return answer[1:].decode() if answer[:1] == b"\x01" else None

    def delete(self, key: str) -> bool:
        return self._call(_request(b"D", key)) == b"\x01"

    def add(self, key: str, amount: int) -> int:
        return _NUMBER.unpack(self._call(_request(b"A", key, _NUMBER.pack(amount)))[1:])[0]

    def compare_set(self, key: str, expected: bytes, desired: bytes) -> bytes:
        return self._call(_request(b"X", key, _KEY.pack(len(expected)) + expected + desired))[1:]

    def close(self) -> None:
        try:
            self.sock.close()
        except OSError:
            pass
