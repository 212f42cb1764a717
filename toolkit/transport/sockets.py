"""Data-plane sockets: an Inbox (bound PULL) and an Outbox (PUSH to every consumer of the next stage).

Outboxes round-robin across the workers of the next stage and hold at most `hwm` messages per
connection: when consumers fall behind, `send` blocks (backpressure) and gives up after a timeout
instead of filling memory. Frames that fail authentication are dropped and counted by reason.
"""

from __future__ import annotations

import collections
import logging
import time
from typing import Callable

import zmq
from zmq.utils.monitor import recv_monitor_message

from toolkit.transport.gate import enter, guard, tally
from toolkit.transport.wire import Codec, FrameError, Message

log = logging.getLogger(__name__)


class Inbox:
    """Receives authenticated messages on a socket bound to `host` (at `port`, or a free port)."""

    def __init__(self, ctx: zmq.Context, codec: Codec, host: str, hwm: int, max_message_mb: float = 1024,
                 port: int | None = None):
        self.codec = codec
        self.socket = ctx.socket(zmq.PULL)
        self.socket.setsockopt(zmq.RCVHWM, hwm)
        self.socket.setsockopt(zmq.MAXMSGSIZE, int(max_message_mb * 2**20))
        self.socket.setsockopt(zmq.LINGER, 0)
        self.gate = guard(self.socket, codec.password)  # (peers without the key never get a message in)
        if port is None:
            port = self.socket.bind_to_random_port(f"tcp://{host}")
        else:
            try:
                self.socket.bind(f"tcp://{host}:{port}")
            except zmq.ZMQError as e:
                self.socket.close(linger=0)
                raise RuntimeError(f"cannot listen at tcp://{host}:{port}, where the worker this one replaces "
                                   f"listened ({e}); another process took the port") from None
        self.address = f"tcp://{host}:{port}"
        self.rejected: collections.Counter = collections.Counter()

    def recv(self, timeout_s: float) -> Message | None:
        """The next valid message, or None when nothing valid came within `timeout_s`."""
        return recv_valid(self.socket, self.codec, self.rejected, timeout_s, copy=False)

    def close(self) -> None:
        self.socket.close(linger=0)


class Outbox:
    """Sends to the consumers at `addresses`, round-robin, blocking when `hwm` messages are queued.

    The constructor waits until every consumer's connection is up (round-robin only spreads work over
    connected peers), so the first messages are shared fairly too.
    """

    def __init__(self, ctx: zmq.Context, codec: Codec, addresses: list[str], hwm: int, connect_timeout_s: float = 60,
                 to: str = "", max_message_mb: float = 1024):
        self.codec, self.to = codec, to  # (`to`: the consumers' name, bound into every message's MAC)
        self.max_frame = int(max_message_mb * 2**20)  # (the consumers' limit: a frame above it would be dropped)
        self.socket = ctx.socket(zmq.PUSH)
        self.socket.setsockopt(zmq.SNDHWM, hwm)
        self.socket.setsockopt(zmq.LINGER, 0)
        # Queue only to peers whose connection is up: a missing peer blocks the sender, not memory.
        self.socket.setsockopt(zmq.IMMEDIATE, 1)
        self.socket.setsockopt(zmq.SNDTIMEO, 200)
        self.addresses = list(addresses)
        enter(self.socket, codec.password)
        monitor = self.socket.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_HANDSHAKE_FAILED_AUTH)
        try:
            for address in addresses:
                self.socket.connect(address)
            deadline = time.monotonic() + connect_timeout_s
            # (by address: a consumer that connects twice, started again on its port, is one consumer still.
            # libzmq names the address it connected to, a host name resolved: the addresses here are IPs)
            waiting = set(addresses)
            while waiting:
                left_ms = int((deadline - time.monotonic()) * 1000)
                if left_ms <= 0 or not monitor.poll(left_ms):
                    missing = [a for a in addresses if a in waiting]
                    raise TimeoutError(f"connected to {len(addresses) - len(missing)} of {len(addresses)} consumers "
                                       f"in {connect_timeout_s:g} s; none answered at {', '.join(missing)}")
                event = recv_monitor_message(monitor)
                endpoint = event["endpoint"].decode(errors="replace")  # (the address as given to connect)
                if event["event"] == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
                    raise ConnectionRefusedError(
                        f"the consumer at {endpoint} refused this run's key: "
                        "it belongs to another run or to an earlier attempt of this one")
                waiting.discard(endpoint)
        except BaseException:
            # (a timeout or an interrupt here: nobody holds this object to close it, and an open socket
            # makes the context's term() wait forever)
            self.socket.disable_monitor()
            monitor.close(linger=0)
            self.socket.close(linger=0)
            raise
        self.socket.disable_monitor()
        monitor.close(linger=0)

    def send(self, kind: str, meta: dict | None = None, arrays: dict | None = None, timeout_s: float = 60.0,
             while_blocked: Callable[[], None] | None = None) -> None:
        """Send one message; raise TimeoutError if no consumer took it within `timeout_s`.

        `while_blocked` is called between tries (every 0.2 s) while consumers are full; it may raise
        to give up early (the driver checks its workers' health there).
        """
        frames = self.codec.encode(kind, meta, arrays, to=self.to)
        largest = max(memoryview(f).nbytes for f in frames)
        if largest > self.max_frame:  # (ZeroMQ would drop the connection, and the message, without a word)
            raise ValueError(f"a {kind!r} message has a frame of {largest / 2**20:.1f} MB (its header with the "
                             f"texts, or one array), over transport.max_message_mb ({self.max_frame / 2**20:g} "
                             f"MB), which its consumers would refuse: raise transport.max_message_mb")
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                self.socket.send_multipart(frames, copy=False)
                return
            except zmq.Again:
                if while_blocked is not None:
                    while_blocked()
                if time.monotonic() > deadline:
                    raise TimeoutError(
                        f"no consumer at {', '.join(self.addresses)} accepted a {kind!r} message in {timeout_s:.0f} s"
                    ) from None

    def close(self) -> None:
        self.socket.close(linger=0)


def recv_valid(socket: zmq.Socket, codec: Codec, rejected: collections.Counter, timeout_s: float,
               copy: bool = True) -> Message | None:
    """The next message on `socket` that decodes, or None after `timeout_s`; bad frames are counted."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:  # (a queued message is taken at once; the poll is for waiting)
            frames = socket.recv_multipart(zmq.NOBLOCK, copy=copy)
        except zmq.Again:
            left_ms = max(0, int((deadline - time.monotonic()) * 1000))
            if not socket.poll(left_ms):
                return None
            continue
        msg = decode_or_count(codec, frames, rejected)
        if msg is not None:
            return msg
        if time.monotonic() >= deadline:  # (a peer that keeps bad frames coming must not hold us past it)
            return None


def decode_or_count(codec: Codec, frames: list, rejected: collections.Counter) -> Message | None:
    """Decode frames; on a bad frame count its reason, log it (at counts 1, 2, 4, ... of that reason) and
    return None."""
    try:
        return codec.decode(frames)
    except FrameError as e:
        if (n := tally(rejected, e.reason)) is not None:
            log.warning("dropped a frame (%s); %d dropped so far, %d for this reason (logged at 1, 2, 4, ...)",
                        e, sum(rejected.values()), n)
        return None
