"""Connection gate: only a peer that holds the attempt's key gets past ZeroMQ's handshake.

Every socket that listens (a worker's inbox, the driver's coordinator) is a ZeroMQ PLAIN server, and
every socket that connects gives the password drawn from the attempt's key (wire.connection_password).
A handler thread in each listening process answers ZeroMQ's authentication requests (ZAP, RFC 27) for
its context, and refuses a peer whose password is wrong; ZeroMQ then drops the connection before any
message of it is taken in. With no handler answering (a gate that died), ZeroMQ refuses every peer.

Why, beside the MAC of every message (wire.py): ZeroMQ hands a message over only when all its frames
have come, and its size limit (MAXMSGSIZE) bounds each frame, not a message. So a peer without the key
could make a worker hold one message of endless frames, each under the limit, before the MAC check ever
ran. Now such a peer sends no message. What it can still do is send one handshake command of up to
MAXMSGSIZE (`transport.max_message_mb`) on each connection it opens, which ZeroMQ reads whole before it
asks the gate; a handshake not done within HANDSHAKE_S drops the connection, and that memory with it.

A context with a gate must be ended with term(), never destroy(): destroy() closes every socket from the
calling thread, the gate's too while the gate's thread reads it, and libzmq then aborts the process.

PLAIN sends the password in the clear, once per connection, and adds nothing to a message after that.
On a shared cluster, a user who is not root cannot read another user's TCP traffic; one who can would
read the run's frames too. (CURVE, ZeroMQ's encrypting handshake, would answer that, at a cost: it
moved 550-650 MB/s per connection here, against 1.4-6 GB/s in the clear.)
"""

from __future__ import annotations

import collections
import hmac
import logging
import threading
import weakref

import zmq

log = logging.getLogger(__name__)

ZAP_ENDPOINT = "inproc://zeromq.zap.01"  # (fixed by RFC 27: one handler per context)
DOMAIN = b"slurm-rlhf"
USER = b"slurm-rlhf"
HANDSHAKE_S = 10  # (ZeroMQ's default is 30 s; ours take milliseconds, or a second or two on a busy node)

_gates: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_gates_lock = threading.Lock()


class Gate(threading.Thread):
    """The authentication handler of one ZeroMQ context. It ends when the context is terminated."""

    def __init__(self, ctx: zmq.Context, password: bytes):
        super().__init__(name="zmq-gate", daemon=True)
        self.password = password
        self.refused: collections.Counter = collections.Counter()  # {"unauthenticated": n}
        # Bound here, before any listening socket exists: ZeroMQ asks the handler bound when a peer connects.
        self._socket = ctx.socket(zmq.REP)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.bind(ZAP_ENDPOINT)

    def run(self) -> None:
        try:
            while True:
                request = self._socket.recv_multipart()
                self._socket.send_multipart(self._answer(request))
        except zmq.ContextTerminated:  # (the process's context is ending: term() waits for this socket)
            pass
        finally:
            with _gates_lock:  # (the entry holds its context through this socket: weakness alone never frees it)
                _gates.pop(self._socket.context, None)
            self._socket.close(linger=0)

    def _answer(self, request: list[bytes]) -> list[bytes]:
        request_id = request[1] if len(request) > 1 else b""
        address = request[3].decode(errors="replace") if len(request) > 3 else "?"
        mechanism, credentials = (request[5], request[6:]) if len(request) > 5 else (b"", [])
        if (mechanism == b"PLAIN" and len(credentials) == 2 and credentials[0] == USER
                and hmac.compare_digest(credentials[1], self.password)):
            return [b"1.0", request_id, b"200", b"OK", USER, b""]
        if (n := tally(self.refused, "unauthenticated")) is not None:
            log.warning("refused a connection from %s (%s; not this run's key, or an earlier attempt's); "
                        "%d refused so far", address, mechanism.decode(errors="replace") or "no mechanism", n)
        return [b"1.0", request_id, b"400", b"not this run's key", b"", b""]


def tally(counter: collections.Counter, reason: str) -> int | None:
    """Count one more of `reason` in `counter`; its new count when it is one to log (the 1st, 2nd, 4th,
    8th, ...: a flood of refused peers or bad frames does not fill the run's log), else None."""
    counter[reason] += 1
    n = counter[reason]
    return n if n & (n - 1) == 0 else None


def guard(socket: zmq.Socket, password: bytes) -> Gate:
    """Make `socket` (before it binds) admit only peers that give `password`; start its context's
    handler if it has none yet. Returns the handler, which counts the peers it refused."""
    ctx = socket.context
    with _gates_lock:
        gate = _gates.get(ctx)
        if gate is None:
            gate = Gate(ctx, password)
            try:
                gate.start()
            except BaseException:  # (no thread to close its socket: an open one would hold term() forever)
                gate._socket.close(linger=0)
                raise
            _gates[ctx] = gate
        elif not hmac.compare_digest(gate.password, password):
            raise ValueError("a ZeroMQ context serves one run attempt: its gate has another password")
    socket.setsockopt(zmq.ZAP_DOMAIN, DOMAIN)
    socket.setsockopt(zmq.PLAIN_SERVER, 1)
    socket.setsockopt(zmq.HANDSHAKE_IVL, HANDSHAKE_S * 1000)
    return gate


def enter(socket: zmq.Socket, password: bytes) -> None:
    """Make `socket` (before it connects) give `password` to the listening socket's gate."""
    socket.setsockopt(zmq.PLAIN_USERNAME, USER)
    socket.setsockopt(zmq.PLAIN_PASSWORD, password)
