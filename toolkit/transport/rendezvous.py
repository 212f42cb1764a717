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
polling loop), and give up after the store's timeout with an error that names the keys, as TCPStore's do.

What is left unauthenticated is torch.distributed's own connections between ranks (gloo, NCCL), which
the store's addresses point to (see README, "Security").
"""

from __future__ import annotations

import collections
import datetime
import itertools
import logging
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

MAX_REQUEST_BYTES = 16 * 2**20  # (keys and values are addresses, ids and small layouts)
SERVER, CLIENT = "store", "store-client"
StoreError = getattr(dist, "DistStoreError", RuntimeError)  # (a RuntimeError, as TCPStore's errors are)


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
    server = StoreServer(host, key, timeout_s)
    server.start()
    store = RendezvousStore(host, server.port, key, timeout_s)
    store.server = server  # (the server lives as long as the client that rank 0 holds)
    return store


def connect_store(host: str, port: int, timeout_s: float, key: bytes | None = None) -> "RendezvousStore":
    """A client of the store at host:port; raises StoreError if it does not answer within `timeout_s`."""
    store = RendezvousStore(host, port, key if key is not None else run_key(), timeout_s)
    store.num_keys()  # (as TCPStore's constructor: fail here, by name, if nothing answers)
    return store


def _tcp(host: str) -> str:
    return f"tcp://[{host}]" if ":" in host else f"tcp://{host}"


@dataclass
class _Waiting:
    """A `get` or `wait` request that the server answers once its keys exist."""

    identity: bytes
    op: str
    id: int
    keys: list
    until: float


class StoreServer(threading.Thread):
    """The store's keys and values, served on a socket of its own (its own ZeroMQ context and gate)."""

    def __init__(self, host: str, key: bytes, timeout_s: float):
        super().__init__(name="rendezvous-store", daemon=True)
        self.timeout_s = timeout_s
        self.codec = Codec(key, SERVER, accepts={SERVER})
        self.ctx = zmq.Context(1)
        self.socket = self.ctx.socket(zmq.ROUTER)
        self.socket.setsockopt(zmq.MAXMSGSIZE, MAX_REQUEST_BYTES)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.setsockopt(zmq.IPV6, int(":" in host))
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
                if self.socket.poll(100):
                    identity, *frames = self.socket.recv_multipart()
                    msg = decode_or_count(self.codec, frames, self.rejected)
                    if msg is not None:
                        self._handle(identity, msg.kind, msg.meta)
                if self.waiting:
                    self._answer_waiting()
        finally:
            self.socket.close(linger=0)

    def close(self) -> None:
        self._closing.set()
        if self.is_alive():
            self.join(5)
        self.ctx.term()

    def _handle(self, identity: bytes, op: str, meta: dict) -> None:
        try:
            rid, data = int(meta["id"]), self.data
            if op in ("get", "wait"):
                keys = [meta["key"]] if op == "get" else list(meta["keys"])
                self.waiting.append(_Waiting(identity, op, rid, keys, time.monotonic() + float(meta["timeout_s"])))
                return self._answer_waiting()
            if op == "set":
                data[meta["key"]] = bytes(meta["value"])
                value = None
            elif op == "add":
                value = int(data.get(meta["key"], b"0")) + int(meta["n"])
                data[meta["key"]] = str(value).encode()
            elif op == "check":
                value = all(k in data for k in meta["keys"])
            elif op == "compare_set":  # (TCPStore's: set when the value is `expected`, or absent and `expected` empty)
                key, current = meta["key"], data.get(meta["key"])
                if current == meta["expected"] or (current is None and not meta["expected"]):
                    data[key] = current = bytes(meta["desired"])
                value = current if current is not None else bytes(meta["expected"])
            elif op == "delete_key":
                value = data.pop(meta["key"], None) is not None
            elif op == "num_keys":
                value = len(data)
            else:
                raise ValueError(f"unknown operation {op!r}")
        except (KeyError, TypeError, ValueError) as e:  # (an insider's malformed request: answer, go on)
            return self._reply(identity, {"id": meta.get("id"), "error": f"{op}: {type(e).__name__}: {e}"})
        self._reply(identity, {"id": rid, "value": value})
        if op in ("set", "add", "compare_set") and self.waiting:
            self._answer_waiting()

    def _answer_waiting(self) -> None:
        now, still = time.monotonic(), []
        for w in self.waiting:
            if all(k in self.data for k in w.keys):
                self._reply(w.identity, {"id": w.id, "value": self.data[w.keys[0]] if w.op == "get" else None})
            elif now < w.until:
                still.append(w)
            # (else the client gave up already: it raised on its side)
        self.waiting = still

    def _reply(self, identity: bytes, meta: dict) -> None:
        self.socket.send_multipart([identity, *self.codec.encode("reply", meta, to=CLIENT)])


class RendezvousStore(dist.Store):
    """A client of the run's store (thread-safe: one request at a time)."""

    def __init__(self, host: str, port: int, key: bytes, timeout_s: float):
        super().__init__()
        self.set_timeout(datetime.timedelta(seconds=timeout_s))
        self.host, self.port, self._key = host, port, key
        self.server = None
        self._address = f"{_tcp(host)}:{port}"
        self._codec = Codec(key, CLIENT, accepts={CLIENT})
        self._ids = itertools.count(1)
        self._lock = threading.Lock()
        self.rejected: collections.Counter = collections.Counter()
        self._ctx = zmq.Context(1)
        self._socket = self._ctx.socket(zmq.DEALER)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.setsockopt(zmq.MAXMSGSIZE, MAX_REQUEST_BYTES)
        self._socket.setsockopt(zmq.IPV6, int(":" in host))
        enter(self._socket, self._codec.password)
        self._socket.connect(self._address)

    def _call(self, op: str, timeout: datetime.timedelta | None = None, **meta):
        timeout_s = (timeout or self.timeout).total_seconds()
        with self._lock:
            rid = next(self._ids)
            self._socket.send_multipart(self._codec.encode(op, {"id": rid, "timeout_s": timeout_s, **meta}, to=SERVER))
            deadline = time.monotonic() + timeout_s
            while True:
                msg = recv_valid(self._socket, self._codec, self.rejected, max(0.0, deadline - time.monotonic()))
                if msg is None:
                    what = f" {meta.get('key') or meta.get('keys')}" if op in ("get", "wait") else ""
                    raise StoreError(
                        f"the rendezvous store at {self._address} did not answer {op}{what} within {timeout_s:g} s: "
                        "a peer did not come, or the store is gone, or it refused this process's key (another "
                        "run's, or an earlier attempt's)")
                if msg.meta.get("id") == rid:  # (else a late answer to a request that timed out)
                    break
        if "error" in msg.meta:
            raise StoreError(f"rendezvous store: {msg.meta['error']}")
        return msg.meta["value"]

    def set(self, key: str, value) -> None:
        self._call("set", key=key, value=value.encode() if isinstance(value, str) else bytes(value))

    def get(self, key: str) -> bytes:
        return self._call("get", key=key)

    def add(self, key: str, n: int) -> int:
        return self._call("add", key=key, n=int(n))

    def check(self, keys: list[str]) -> bool:
        return self._call("check", keys=list(keys))

    def wait(self, keys: list[str], timeout: datetime.timedelta | None = None) -> None:
        self._call("wait", timeout, keys=list(keys))

    def compare_set(self, key: str, expected, desired) -> bytes:
        as_bytes = lambda v: v.encode() if isinstance(v, str) else bytes(v)  # noqa: E731
        return self._call("compare_set", key=key, expected=as_bytes(expected), desired=as_bytes(desired))

    def delete_key(self, key: str) -> bool:
        return self._call("delete_key", key=key)

    def num_keys(self) -> int:
        return self._call("num_keys")

    def clone(self) -> "RendezvousStore":
        """A client of its own (torch asks for one to call the store from another thread)."""
        return RendezvousStore(self.host, self.port, self._key, self.timeout.total_seconds())

    def close(self) -> None:
        """Close this client (and the server, if this is rank 0's)."""
        self._socket.close(linger=0)
        self._ctx.term()
        if self.server is not None:
            self.server.close()
