"""A torch.distributed store that admits only processes holding the run's secret.

torch's `TCPStore` has no authentication: any process that reaches its port can
`list_keys()`, read every key and write its own (a `PrefixStore` named after a
secret does not hide it: `list_keys` shows the prefix). The learner ranks and
the relay meet here instead: `RunStoreServer` listens on one address (loopback
for a single-host run) and answers only connections that pass a mutual HMAC
challenge on the run's secret (`multiprocessing.connection`'s handshake, the one
`Listener(authkey=...)` uses); `RunStore` is the client, a `torch.distributed.Store`
that gloo and `init_process_group(store=...)` use like any other. Mutual: a
process that took the port first cannot pose as the server either.
"""

from __future__ import annotations

import pickle
import socket
import struct
import threading
import time
from datetime import timedelta
from multiprocessing.connection import Connection, answer_challenge, deliver_challenge
from typing import Any

import torch.distributed as dist

HANDSHAKE_TIMEOUT_S = 10.0
"""A connection that has not answered the challenge within this many seconds is dropped (it holds only its own
thread meanwhile)."""


class StoreAuthError(ConnectionError):
    """The other end does not hold the run's secret (or is not a run store)."""


def _authkey(secret: str) -> bytes:
    if not isinstance(secret, str) or len(secret) < 32:
        raise ValueError(f"run store secret of {len(secret) if isinstance(secret, str) else type(secret).__name__} "
                         "characters, expected a string of at least 32 (secrets.token_hex(16) or longer)")
    return secret.encode()


def _recv_timeout(fd: int, seconds: float) -> None:
    """Bound every read on `fd` (0: no bound). Connection reads the raw descriptor (os.read), which honours
    SO_RCVTIMEO but not socket.settimeout."""
    sec = int(seconds)
    s = socket.socket(fileno=fd)  # a view of the descriptor; detach() leaves it open
    try:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, struct.pack("ll", sec, int((seconds - sec) * 1e6)))
    finally:
        s.detach()


class RunStoreServer:
    """The key-value table of one run, served on `host:port` to holders of `secret` (a daemon thread per client).

    `port=0` picks a free port (read it back from `.port`)."""

    def __init__(self, host: str, port: int, secret: str) -> None:
        self._authkey = _authkey(secret)
        self._data: dict[str, bytes] = {}
        self._cond = threading.Condition()
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            self._sock.bind((host, port))
        except OSError as e:
            self._sock.close()
            raise OSError(f"run store: cannot listen on {host}:{port}: {e}") from e
        self._sock.listen(128)
        self.host, self.port = host, int(self._sock.getsockname()[1])
        self.rejected = 0
        """Connections dropped for failing the handshake."""
        self._closed = False
        threading.Thread(target=self._accept, name="run-store-accept", daemon=True).start()

    def _accept(self) -> None:
        while not self._closed:
            try:
                sock, _ = self._sock.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(sock,), name="run-store-client", daemon=True).start()

    def _serve(self, sock: socket.socket) -> None:
        conn = Connection(sock.detach())
        _recv_timeout(conn.fileno(), HANDSHAKE_TIMEOUT_S)
        try:
            deliver_challenge(conn, self._authkey)
            answer_challenge(conn, self._authkey)
        except Exception:  # noqa: BLE001 - wrong key, garbage, silence or a closed socket: drop it
            with self._cond:
                self.rejected += 1
            conn.close()
            return
        _recv_timeout(conn.fileno(), 0)
        try:
            while True:
                op, args = pickle.loads(conn.recv_bytes())  # authenticated peers only
                conn.send_bytes(pickle.dumps(self._apply(op, *args)))
        except (EOFError, OSError):
            pass
        finally:
            conn.close()

    def _apply(self, op: str, *args: Any) -> Any:
        with self._cond:
            d = self._data
            if op == "set":
                d[args[0]] = bytes(args[1])
                self._cond.notify_all()
                return None
            if op == "get":  # non-blocking: the client polls (one connection never waits on another's write)
                return d.get(args[0])
            if op == "add":
                value = int(d.get(args[0], b"0")) + int(args[1])
                d[args[0]] = str(value).encode()
                self._cond.notify_all()
                return value
            if op == "compare_set":
                key, expected, desired = args
                current = d.get(key)
                if (current is None and expected == b"") or current == expected:
                    d[key] = desired
                    self._cond.notify_all()
                    return desired
                return current if current is not None else expected
            if op == "append":
                d[args[0]] = d.get(args[0], b"") + bytes(args[1])
                self._cond.notify_all()
                return None
            if op == "check":
                return all(k in d for k in args[0])
            if op == "delete_key":
                return d.pop(args[0], None) is not None
            if op == "num_keys":
                return len(d)
            raise ValueError(f"run store: unknown operation {op!r}")

    def close(self) -> None:
        self._closed = True
        self._sock.close()


class RunStore(dist.Store):
    """Client of a `RunStoreServer`: a `torch.distributed.Store` for `init_process_group(store=...)` and gloo.

    Connects (retrying until `timeout`: the server may still be starting) and proves it holds `secret`; raises
    `StoreAuthError` when the process listening there does not hold it."""

    def __init__(self, host: str, port: int, secret: str, timeout: timedelta = timedelta(seconds=300)) -> None:
        super().__init__()
        self._authkey = _authkey(secret)
        self._secret = secret
        self.host, self.port = host, int(port)
        self._timeout = timeout
        self._lock = threading.Lock()
        self._clones: list[RunStore] = []
        self._conn = self._connect()

    def _connect(self) -> Connection:
        deadline = time.monotonic() + self._timeout.total_seconds()
        delay = 0.05
        while True:
            try:
                sock = socket.create_connection((self.host, self.port), timeout=HANDSHAKE_TIMEOUT_S)
                break
            except OSError as e:
                if time.monotonic() + delay > deadline:
                    raise TimeoutError(f"run store at {self.host}:{self.port} not reachable within "
                                       f"{self._timeout.total_seconds():.0f} s: {e}") from e
                time.sleep(delay)
                delay = min(1.0, delay * 2)
        sock.settimeout(None)
        conn = Connection(sock.detach())
        _recv_timeout(conn.fileno(), HANDSHAKE_TIMEOUT_S)
        try:
            answer_challenge(conn, self._authkey)
            deliver_challenge(conn, self._authkey)
        except Exception as e:  # noqa: BLE001
            conn.close()
            raise StoreAuthError(f"the process listening on {self.host}:{self.port} is not this run's store "
                                 f"(handshake failed: {e})") from e
        _recv_timeout(conn.fileno(), 0)
        return conn

    def _call(self, op: str, *args: Any) -> Any:
        with self._lock:
            self._conn.send_bytes(pickle.dumps((op, args)))
            return pickle.loads(self._conn.recv_bytes())

    # torch.distributed.Store's interface (what the PyStore trampoline calls)
    def set(self, key: str, value: Any) -> None:
        self._call("set", key, value.encode() if isinstance(value, str) else bytes(value))

    def get(self, key: str) -> bytes:
        self.wait([key])
        value = self._call("get", key)
        if value is None:
            raise KeyError(f"run store: key {key!r} was deleted while waiting for it")
        return value

    def add(self, key: str, value: int) -> int:
        return int(self._call("add", key, int(value)))

    def compare_set(self, key: str, expected: Any, desired: Any) -> bytes:
        enc = (lambda v: v.encode() if isinstance(v, str) else bytes(v))
        return self._call("compare_set", key, enc(expected), enc(desired))

    def check(self, keys: list[str]) -> bool:
        return bool(self._call("check", list(keys)))

    def delete_key(self, key: str) -> bool:
        return bool(self._call("delete_key", key))

    def num_keys(self) -> int:
        return int(self._call("num_keys"))

    def clone(self) -> RunStore:
        """A second client of the same store on its own connection (gloo clones the store per group)."""
        twin = RunStore(self.host, self.port, self._secret, self._timeout)
        self._clones.append(twin)  # torch keeps only the C++ half: the Python half must stay referenced
        return twin

    def append(self, key: str, value: Any) -> None:
        self._call("append", key, value.encode() if isinstance(value, str) else bytes(value))

    def multi_get(self, keys: list[str]) -> list[bytes]:
        return [self.get(k) for k in keys]

    def multi_set(self, keys: list[str], values: list[Any]) -> None:
        for k, v in zip(keys, values):
            self.set(k, v)

    def has_extended_api(self) -> bool:
        return True

    def set_timeout(self, timeout: timedelta) -> None:
        self._timeout = timeout

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        limit = (timeout or self._timeout).total_seconds()
        deadline = time.monotonic() + limit
        delay = 0.001
        while not self.check(keys):
            if time.monotonic() > deadline:
                raise TimeoutError(f"run store at {self.host}:{self.port}: keys {list(keys)} not set within "
                                   f"{limit:.0f} s")
            time.sleep(delay)
            delay = min(0.05, delay * 2)

    def close(self) -> None:
        self._conn.close()
