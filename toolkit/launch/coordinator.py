"""Coordinator: the driver's ZeroMQ ROUTER socket for control (registration, heartbeats, events, commands).

Every worker connects twice: for commands and events, and for heartbeats (answered with `pong`). Each
connection's routing identity is its codec's sender name, unique to the process (`trainer:0#3fa1c2d4`,
`trainer:0/hb#77e0b1a9`), and must equal the authenticated sender of what comes over it. Commands go to
the connection a worker registered over (a worker started again is a new process: a new name, registered
anew); an identity already connected is not handed over to a new connection. So a peer without the run's
secret that connects under a worker's name gets nothing meant for it (before, with ZeroMQ's handover, the
commands and pongs went to the newest connection of that name, and the worker, hearing no pong, ended
itself). Each command and pong is addressed to that process's name, which the MAC covers, and the
worker takes nothing addressed otherwise: a frame captured on its way to an earlier process of a worker
started again is refused by the new one (the worker's name alone would pass). The other way, a message
of an earlier process of a worker that was started again (one it left queued as it died, or one
captured and sent again) is dropped once the new one registers, where it was taken as the new one's.
The coordinator remembers when each worker was last heard from and the status
its last heartbeat carried; `recv` hands the driver every message except heartbeats.

The driver's main thread answers heartbeats whenever it waits for messages. Where it waits on something
else (a Slurm command such as the scancel of a hung worker's step, a step that must end), `answering()`
lends the socket to a thread that answers them and keeps every other message for `recv`: without it,
every worker would hear nothing for that long and end itself after transport.heartbeat_timeout_s, which
Slurm's commands on a busy controller can exceed (scancel is given 30 s, scontrol requeue 60 s).
"""

from __future__ import annotations

import collections
import contextlib
import logging
import threading
import time

import zmq

from toolkit.transport.gate import guard, tally
from toolkit.transport.sockets import decode_or_count
from toolkit.transport.wire import Codec, Message

log = logging.getLogger(__name__)

ANSWER_POLL_MS = 100
"""Longest wait of the answering thread before it looks whether the driver wants its socket back."""


class Coordinator:
    def __init__(self, ctx: zmq.Context, secret: bytes, host: str, max_message_mb: float = 64):
        self.codec = Codec(secret, "coordinator", accepts={"coordinator"})
        self.socket = ctx.socket(zmq.ROUTER)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.setsockopt(zmq.MAXMSGSIZE, int(max_message_mb * 2**20))
        self.gate = guard(self.socket, self.codec.password)  # (peers without the key never get a message in)
        port = self.socket.bind_to_random_port(f"tcp://{host}")
        self.address = f"tcp://{host}:{port}"
        self.last_seen: dict[str, float] = {}
        self.status: dict[str, dict] = {}
        self.routes: dict[str, bytes] = {}  # worker -> the identity of its command connection
        self.earlier: set[bytes] = set()  # the command connections of processes replaced (`forget`)
        self.rejected: collections.Counter = collections.Counter()
        self.kept: collections.deque[tuple[bytes, str, Message]] = collections.deque()  # (taken, not handed out)

    def recv(self, timeout_s: float) -> tuple[str, Message] | None:
        """The next non-heartbeat message as (worker_id, message), or None after `timeout_s`."""
        deadline = time.monotonic() + timeout_s
        while True:
            while self.kept and not self._current(*self.kept[0]):
                self.kept.popleft()
            if self.kept:
                break
            left_ms = max(0, int((deadline - time.monotonic()) * 1000))
            if not self.socket.poll(left_ms):
                return None
            if (item := self._take()) is not None:
                self.kept.append(item)
            elif time.monotonic() >= deadline:  # (heartbeats or bad frames that keep coming do not hold it)
                return None
        identity, worker_id, msg = self.kept.popleft()
        if msg.kind == "register":  # (not any message: one a killed process left queued comes after; and
            self.routes[worker_id] = identity  # when handed out: a worker started again is forgotten before)
        return worker_id, msg

    def _current(self, identity: bytes, worker_id: str, msg: Message) -> bool:
        """Whether `msg` comes from the process that is `worker_id` now: its register, or what the process
        that registered last sends. One of an earlier process is dropped, counted and logged."""
        if identity not in self.earlier and (msg.kind == "register"
                                             or self.routes.get(worker_id, identity) == identity):
            return True
        if (n := tally(self.rejected, "earlier-process")) is not None:
            log.warning("dropped %r from %s, an earlier process of %s; %d dropped so far, %d for this reason",
                        msg.kind, msg.sender, worker_id, sum(self.rejected.values()), n)
        return False

    @contextlib.contextmanager
    def answering(self):
        """While the body runs (and does not use this coordinator), a thread answers heartbeats and keeps
        the other messages, in order, for `recv` after it."""
        done, ended = threading.Event(), threading.Event()
        thread = threading.Thread(target=self._answer_until, args=(done, ended), name="coordinator-answering",
                                  daemon=True)
        thread.start()  # (the socket passes to the thread and back with the start and its end: ZeroMQ asks for that)
        try:
            yield
        finally:
            done.set()
            # A Ctrl-C or SIGTERM (KeyboardInterrupt here) while the thread ends must not leave it on the socket,
            # which the driver's clean-up closes next: it is waited for still, then the interrupt goes on. (Not
            # with join(): an interrupted join marks a thread that runs on as ended, in CPython 3.11.)
            interrupted = None
            while not ended.is_set():
                try:
                    ended.wait(0.1)
                except KeyboardInterrupt as e:
                    interrupted = e
            thread.join()
            if interrupted is not None:
                raise interrupted

    def _answer_until(self, done: threading.Event, ended: threading.Event) -> None:
        try:
            while not done.is_set():
                if self.socket.poll(ANSWER_POLL_MS) and (item := self._take()) is not None:
                    self.kept.append(item)
        except zmq.ZMQError as e:  # (the context ended under it: the driver is ending)
            log.warning("heartbeats no longer answered: %s", e)
        finally:
            ended.set()

    def _take(self) -> tuple[bytes, str, Message] | None:
        """The message waiting on the socket as (connection, worker_id, message); None for a heartbeat
        (answered) and for a frame dropped."""
        identity, *frames = self.socket.recv_multipart()
        msg = decode_or_count(self.codec, frames, self.rejected)
        if msg is None:
            return None
        name = identity.decode(errors="replace")
        if msg.sender != name:  # (the routing identity is not authenticated; the sender is)
            if (n := tally(self.rejected, "identity")) is not None:
                log.warning("dropped a frame: connection %r sent as %r; %d dropped so far, %d for this reason",
                            name, msg.sender, sum(self.rejected.values()), n)
            return None
        peer = msg.sender.split("#")[0]  # (`trainer:0`, or `trainer:0/hb`)
        worker_id = peer.removesuffix("/hb")
        self.last_seen[worker_id] = time.monotonic()
        if msg.kind == "heartbeat":
            self.status[worker_id] = msg.meta.get("status", {})
            self.socket.send_multipart([identity, *self.codec.encode("pong", to=msg.sender)])
            return None
        return identity, worker_id, msg

    def send(self, worker_id: str, kind: str, **meta) -> None:
        """Send to the worker's command connection; nothing if it has not registered (ZeroMQ dropped it too)."""
        identity = self.routes.get(worker_id)
        if identity is not None:
            self.socket.send_multipart([identity, *self.codec.encode(kind, meta, to=identity.decode())])

    def silent(self, worker_ids, timeout_s: float) -> list[tuple[str, float]]:
        """Workers among `worker_ids` (that have registered) not heard from for more than `timeout_s`."""
        now = time.monotonic()
        return [(w, now - self.last_seen[w]) for w in worker_ids
                if w in self.last_seen and now - self.last_seen[w] > timeout_s]

    def forget(self, worker_id: str) -> None:
        """A worker replaced by a new process: what its heartbeats said no longer holds."""
        self.last_seen.pop(worker_id, None)
        self.status.pop(worker_id, None)
        if (identity := self.routes.pop(worker_id, None)) is not None:
            self.earlier.add(identity)

    def close(self) -> None:
        self.socket.close(linger=0)
