"""Rendezvous for torch.distributed groups: a key-value store hosted by trainer rank 0, authenticated.

torch.distributed's process groups (the trainer's data-parallel group, each generator's weight-sync
group) find each other through a store: every rank writes its address under a key and reads the others'.
torch's own TCPStore lets anyone who reaches its port read and write every key, so on a shared cluster a
stranger could put its own address in place of a rank's and take that rank's part: feed a generator
weights of its choosing (with matching probe log-probs, which travel in the same group) or a trainer
gradients. This store answers only the run's own processes:
- the server is a thread of trainer rank 0: a ZeroMQ ROUTER socket bound to the job's own address
  (`transport.bind_host`), behind the run's gate (transport/gate.py: a peer without the attempt's key
  gets no request in);
- every request and reply is a message of the wire format (transport/wire.py), authenticated with the
  attempt's key, never pickled;
- a client is a `torch.distributed.Store`, so torch's groups use it as they would a TCPStore.

`get` and `wait` are answered by the server once their keys exist (the request waits there, not in a
polling loop); the client gives up after its timeout (the store's, or the one `wait` is given) with an
error that names the keys, as TCPStore's do, and starts a fresh socket, so nothing of the request is left.
A request the server cannot answer (a key not a string, a count past 64 bits) gets an error reply that
says what was wrong; nothing a client sends stops the server's thread.

torch.distributed's own connections between ranks, which the store's addresses point to, are not
authenticated by gloo or NCCL: once a gloo group is formed, its ranks prove this store's key over each
of them (transport/peers.py; see README, "Security").
"""

from __future__ import annotations

import collections
import datetime
import itertools
import logging
import math
import os
import threading
import time
from dataclasses import dataclass

import torch.distributed as dist
import zmq

from toolkit.transport.gate import enter, guard
from toolkit.transport.sockets import decode_or_count, recv_valid
from toolkit.transport.wire import Codec, attempt_secret, read_secret

log = logging.getLogger(__name__)

# Keys and values are addresses, ids and small layouts. A frame on its way in is held whole before the gate
# is asked, so this also bounds what a stranger can make the server hold per connection, for the gate's
# handshake time (transport/gate.py).
MAX_REQUEST_BYTES = 2**20
MAX_WAIT_S = 24 * 3600  # (how long the server keeps a get or wait that waits for a key, whatever the client asks)
SEND_TIMEOUT_MS = 10_000  # (a send queues at once; this bounds only a queue that is full, never here)
SERVER = "store"
StoreError = getattr(dist, "DistStoreError", RuntimeError)  # (a RuntimeError, as TCPStore's errors are)
INT64 = 2**63


def run_key() -> bytes:
    """The attempt's key of the worker this process belongs to, from its environment (a vLLM worker
    process inherits its generator's)."""
    from toolkit.launch.env import ATTEMPT, SECRET_FILE

    missing = [name for name in (SECRET_FILE, ATTEMPT) if name not in os.environ]
    if missing:
        raise RuntimeError(f"{' and '.join(missing)} unset: only a run's own processes may join its "
                           "rendezvous store (pass the key explicitly elsewhere)")
    return attempt_secret(read_secret(os.environ[SECRET_FILE]), os.environ[ATTEMPT])


def serve_store(host: str, timeout_s: float, key: bytes | None = None) -> "RendezvousStore":
    """Start the store's server on `host` (a free port) and return a client of it (`.port`, `.server`).
    `key`: the attempt's key (default: `run_key()`)."""
    key = run_key() if key is None else key
    server = StoreServer(host, key)
    server.start()
    try:
        store = RendezvousStore(host, server.port, key, timeout_s)
    except BaseException:
        server.close()
        raise
    store.server = server  # (closed with this client; else it serves until the process exits: a daemon thread)
    return store


def connect_store(host: str, port: int, timeout_s: float, key: bytes | None = None) -> "RendezvousStore":
    """A client of the store at host:port; raises StoreError if it does not answer within `timeout_s`."""
    store = RendezvousStore(host, port, key if key is not None else run_key(), timeout_s)
    try:
        store.num_keys()  # (as TCPStore's constructor: fail here, by name, if nothing answers)
    except BaseException:
        store.close()
        raise
    return store


def _tcp(host: str) -> str:
    return f"tcp://[{host}]" if ":" in host else f"tcp://{host}"


def _socket(ctx: zmq.Context, kind: int, host: str) -> zmq.Socket:
    """A socket of the store (server's or client's) for `host`, its frames bounded by MAX_REQUEST_BYTES."""
    socket = ctx.socket(kind)
    socket.setsockopt(zmq.LINGER, 0)
    socket.setsockopt(zmq.MAXMSGSIZE, MAX_REQUEST_BYTES)
    socket.setsockopt(zmq.IPV6, int(":" in host))
    return socket


@dataclass
class _Waiting:
    """A `get` or `wait` request that the server answers once its keys exist."""

    identity: bytes
    sender: str
    op: str
    id: int
    keys: list
    until: float


class BadRequest(ValueError):
    """A request of the run's own key that is not one the store answers (answered with an error)."""


def _str(meta: dict, field: str) -> str:
    value = meta.get(field)
    if not isinstance(value, str):
        raise BadRequest(f"{field} must be a string, not {type(value).__name__}")
    return value


def _strs(meta: dict, field: str) -> list[str]:
    value = meta.get(field)
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise BadRequest(f"{field} must be a list of strings")
    return value


def _bytes(meta: dict, field: str) -> bytes:
    value = meta.get(field)
    if not isinstance(value, bytes):
        raise BadRequest(f"{field} must be bytes, not {type(value).__name__}")
    return value


def _int64(meta: dict, field: str) -> int:
    value = meta.get(field)
    if type(value) is not int or not -INT64 <= value < INT64:
        raise BadRequest(f"{field} must be a 64-bit integer")
    return value


class StoreServer(threading.Thread):
    """The store's keys and values, served on a socket of its own (its own ZeroMQ context and gate).
    A request it cannot answer gets an error reply; nothing a client sends stops it."""

    def __init__(self, host: str, key: bytes):
        super().__init__(name="rendezvous-store", daemon=True)
        self.codec = Codec(key, SERVER, accepts={SERVER})
        self.ctx = zmq.Context(1)
        self.socket = _socket(self.ctx, zmq.ROUTER, host)
        try:
            self.gate = guard(self.socket, self.codec.password)
            self.port = self.socket.bind_to_random_port(_tcp(host))
        except BaseException:
            self.socket.close(linger=0)
            self.ctx.term()
            raise
        self.data: dict[str, bytes] = {}
        self.waiting: list[_Waiting] = []
        self.rejected: collections.Counter = collections.Counter()
        self._closing = threading.Event()

    def run(self) -> None:
        try:
            while not self._closing.is_set():
                try:
                    self._serve_once()
                except zmq.ContextTerminated:
                    break
                except Exception:  # (a bug here must not end the rendezvous of every group)
                    log.exception("rendezvous store: a request failed; serving on")
        finally:
            self.socket.close(linger=0)

    def close(self) -> None:
        self._closing.set()
        if self.is_alive():
            self.join(5)
        self.ctx.term()

    def _serve_once(self) -> None:
        if self.socket.poll(100):
            identity, *frames = self.socket.recv_multipart()
            msg = decode_or_count(self.codec, frames, self.rejected)
            if msg is not None:
                self._handle(identity, msg.sender, msg.kind, msg.meta)
        if self.waiting:
            self._answer_waiting()

    def _handle(self, identity: bytes, sender: str, op: str, meta: dict) -> None:
        rid = None  # (the reply's id: None where the request's is not one)
        try:
            rid = _int64(meta, "id")
            if op in ("get", "wait"):
                timeout_s = meta.get("timeout_s")
                if not isinstance(timeout_s, (int, float)) or not 0 < timeout_s < math.inf:
                    raise BadRequest("timeout_s must be a positive number of seconds")
                keys = [_str(meta, "key")] if op == "get" else _strs(meta, "keys")
                until = time.monotonic() + min(timeout_s, MAX_WAIT_S)
                self.waiting.append(_Waiting(identity, sender, op, rid, keys, until))
                return self._answer_waiting()
            value = self._answer(op, meta)
        except Exception as e:  # (an insider's malformed request: answer it, serve on)
            return self._reply(identity, sender, {"id": rid, "error": f"{op}: {type(e).__name__}: {e}"})
        self._reply(identity, sender, {"id": rid, "value": value})
        if op in ("set", "add", "compare_set") and self.waiting:
            self._answer_waiting()

    def _answer(self, op: str, meta: dict):
        data = self.data
        if op == "set":
            data[_str(meta, "key")] = _bytes(meta, "value")
            return None
        if op == "add":
            key, n = _str(meta, "key"), _int64(meta, "n")
            value = int(data.get(key, b"0")) + n
            if not -INT64 <= value < INT64:
                raise BadRequest(f"{key} would leave 64 bits")
            data[key] = str(value).encode()
            return value
        if op == "check":
            return all(k in data for k in _strs(meta, "keys"))
        if op == "compare_set":  # (TCPStore's: set when the value is `expected`, or absent and `expected` empty)
            key, expected, desired = _str(meta, "key"), _bytes(meta, "expected"), _bytes(meta, "desired")
            current = data.get(key)
            if current == expected or (current is None and not expected):
                data[key] = current = desired
            return current if current is not None else expected
        if op == "delete_key":
            return data.pop(_str(meta, "key"), None) is not None
        if op == "num_keys":
            return len(data)
        raise BadRequest(f"unknown operation {op!r}")

    def _answer_waiting(self) -> None:
        now, still = time.monotonic(), []
        for w in self.waiting:
            if all(k in self.data for k in w.keys):
                value = self.data[w.keys[0]] if w.op == "get" else None
                self._reply(w.identity, w.sender, {"id": w.id, "value": value})
            elif now < w.until:
                still.append(w)
            # (else the client gave up already: it raised on its side)
        self.waiting = still

    def _reply(self, identity: bytes, to: str, meta: dict) -> None:
        self.socket.send_multipart([identity, *self.codec.encode("reply", meta, to=to)])


class RendezvousStore(dist.Store):
    """A client of the run's store (thread-safe: one request at a time).

    torch holds a store it is given only on its C++ side, and a Python store whose Python object is
    gone fails every call: whoever forms groups over a client keeps the client for the groups' life
    (a rank's `Ranks.store`, an engine's `_store`), and a client keeps the clones torch asks of it."""

    def __init__(self, host: str, port: int, key: bytes, timeout_s: float):
        super().__init__()
        self._timeout_s = float(timeout_s)
        self.set_timeout(datetime.timedelta(seconds=timeout_s))
        self.host, self.port, self._key = host, port, key
        self.server = None
        self._clones: list[RendezvousStore] = []
        self._address = f"{_tcp(host)}:{port}"
        self._codec = Codec(key, "store-client", accepts=())  # (replies come to its own sender name)
        self._ids = itertools.count(1)
        self._lock = threading.Lock()
        self._closing = threading.Event()
        self.rejected: collections.Counter = collections.Counter()
        self._ctx = zmq.Context(1)
        self._socket = self._connect()

    @property
    def key(self) -> bytes:
        """The attempt's key (the groups formed on this store prove it over their connections:
        transport/peers.py)."""
        return self._key

    def _connect(self) -> zmq.Socket:
        socket = _socket(self._ctx, zmq.DEALER, self.host)
        socket.setsockopt(zmq.SNDTIMEO, SEND_TIMEOUT_MS)
        enter(socket, self._codec.password)
        # (a server that refuses this key answers nothing: a call waited out its whole timeout, up to the
        # generators' 1800 s, and then guessed among three causes)
        self._refusals = socket.get_monitor_socket(zmq.EVENT_HANDSHAKE_FAILED_AUTH)
        socket.connect(self._address)
        return socket

    def _close_socket(self) -> None:
        self._socket.disable_monitor()
        self._refusals.close(linger=0)
        self._socket.close(linger=0)

    def _call(self, op: str, timeout: datetime.timedelta | None = None, **meta):
        timeout_s = (timeout if timeout is not None else self.timeout).total_seconds()
        if timeout_s <= 0:  # (torch's "no timeout": here every wait ends, after the store's own timeout)
            timeout_s = self._timeout_s
        what = f"{op} {meta['key'] if 'key' in meta else meta.get('keys', '')}".rstrip()
        with self._lock:
            self._check_open()
            rid = next(self._ids)
            frames = self._codec.encode(op, {"id": rid, "timeout_s": timeout_s, **meta}, to=SERVER)
            largest = max(len(f) for f in frames)
            if largest > MAX_REQUEST_BYTES:
                raise StoreError(f"rendezvous store: {what}: a request of {largest} bytes, over "
                                 f"the store's limit of {MAX_REQUEST_BYTES} (keys and values are for addresses and "
                                 "small layouts)")
            try:
                self._socket.send_multipart(frames)
            except zmq.Again:
                msg = None
            else:
                msg = self._reply_to(rid, time.monotonic() + timeout_s)
            if msg is None:
                # A fresh socket: what this one still queues (this request, a late answer) is dropped with it.
                self._close_socket()
                self._socket = self._connect()
                raise StoreError(
                    f"the rendezvous store at {self._address} did not answer {what} within {timeout_s:g} s: a peer "
                    "did not come, or the store is gone, or it refused this process's key (another run's, or an "
                    "earlier attempt's)")
        if "error" in msg.meta:
            raise StoreError(f"rendezvous store: {msg.meta['error']}")
        return msg.meta.get("value")

    def _reply_to(self, rid: int, deadline: float):
        """The server's reply to request `rid`, or None at `deadline`; looks at `close()` twice a second."""
        while (left := deadline - time.monotonic()) > 0:
            msg = recv_valid(self._socket, self._codec, self.rejected, min(0.5, left))
            self._check_open()
            if msg is not None and msg.meta.get("id") == rid:
                return msg
            if self._refusals.poll(0):
                self._close_socket()
                self._socket = self._connect()
                raise StoreError(f"the rendezvous store at {self._address} refused this process's key: it belongs "
                                 "to another run or to an earlier attempt of this one")
        return None

    def _check_open(self) -> None:
        if self._closing.is_set():
            raise StoreError(f"the client of the rendezvous store at {self._address} is closed")

    def set(self, key: str, value) -> None:
        self._call("set", key=key, value=_as_bytes(value))

    def get(self, key: str) -> bytes:
        return self._call("get", key=key)

    def add(self, key: str, n: int) -> int:
        return self._call("add", key=key, n=int(n))

    def check(self, keys: list[str]) -> bool:
        return self._call("check", keys=list(keys))

    def wait(self, keys: list[str], timeout: datetime.timedelta | None = None) -> None:
        self._call("wait", timeout, keys=list(keys))

    def compare_set(self, key: str, expected, desired) -> bytes:
        return self._call("compare_set", key=key, expected=_as_bytes(expected), desired=_as_bytes(desired))

    def delete_key(self, key: str) -> bool:
        return self._call("delete_key", key=key)

    def num_keys(self) -> int:
        return self._call("num_keys")

    # (the names torch's C++ side calls these two by)
    getNumKeys = num_keys
    deleteKey = delete_key

    def clone(self) -> "RendezvousStore":
        """A client of its own (torch asks for one to call the store from another thread), with this one's
        timeout; kept by this one, which closes it with itself."""
        with self._lock:
            self._check_open()
            clone = RendezvousStore(self.host, self.port, self._key, self.timeout.total_seconds() or self._timeout_s)
            self._clones.append(clone)
        return clone

    def close(self) -> None:
        """Close this client and its clones (and the server, if this is rank 0's); a call under way on
        another thread raises StoreError within half a second."""
        self._closing.set()
        with self._lock:
            clones, self._clones = self._clones, []
            if not self._ctx.closed:
                self._close_socket()
                self._ctx.term()
        for clone in clones:
            clone.close()
        if self.server is not None:
            self.server.close()


def _as_bytes(value) -> bytes:
    return value.encode() if isinstance(value, str) else bytes(value)
