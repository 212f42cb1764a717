"""Control plane, worker side: a DEALER for commands and events, and a heartbeat thread.

Both connect to the coordinator's ROUTER socket, each under its codec's sender name (unique to the
process) as routing identity, and take only frames addressed to that name: a command or pong captured
on its way to an earlier process of the same worker (one that was started again) is refused. The heartbeat thread has its own socket (ZeroMQ sockets are not
thread-safe) and codec, named `<worker>/hb`; the coordinator answers each heartbeat with a
`pong`. A worker that hears no pong for `timeout_s` assumes the driver is gone and ends itself and its
children, so no worker outlives its run.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from typing import Callable

import zmq

from toolkit.transport.gate import enter
from toolkit.transport.sockets import decode_or_count, recv_valid
from toolkit.transport.wire import Codec, Message

log = logging.getLogger(__name__)


class ControlClient:
    """Commands from and events to the coordinator, for the worker's main thread."""

    def __init__(self, ctx: zmq.Context, codec: Codec, address: str, max_message_mb: float = 64):
        self.codec = codec
        self.socket = ctx.socket(zmq.DEALER)
        self.socket.setsockopt(zmq.MAXMSGSIZE, int(max_message_mb * 2**20))
        self.socket.setsockopt(zmq.IDENTITY, codec.sender.encode())  # (unique to this process: coordinator.py)
        self.socket.setsockopt(zmq.LINGER, 2000)  # let a last `failed` event out before exit
        enter(self.socket, codec.password)
        self.socket.connect(address)
        self.rejected = collections.Counter()

    def send(self, kind: str, **meta) -> None:
        self.socket.send_multipart(self.codec.encode(kind, meta, to="coordinator"))

    def recv(self, timeout_s: float) -> Message | None:
        """The next valid command, or None after `timeout_s`."""
        return recv_valid(self.socket, self.codec, self.rejected, timeout_s)

    def close(self) -> None:
        self.socket.close()


STOP_POLL_S = 0.1
"""Longest wait of the heartbeat thread before it looks at its stop flag again."""


class Heartbeat(threading.Thread):
    """Sends a heartbeat every `interval_s`; calls `on_lost` if the coordinator is silent for `timeout_s`, or
    at once if it refuses the connection (`refused_by` is set then).

    `status` is a dict the worker's main thread updates (phase, step, policy_version); each heartbeat
    carries a copy, so the driver can show what every worker is doing.
    """

    def __init__(self, ctx: zmq.Context, secret: bytes, address: str, worker_id: str, interval_s: float,
                 timeout_s: float, on_lost: Callable[[float], None]):
        super().__init__(name=f"heartbeat-{worker_id}", daemon=True)
        self._ctx, self._address, self._worker_id = ctx, address, worker_id
        # (pongs come to this thread's own name, unique to the process: one of an earlier process is refused)
        self._codec = Codec(secret, f"{worker_id}/hb", accepts=())
        self._interval_s, self._timeout_s, self._on_lost = interval_s, timeout_s, on_lost
        self._stop_event = threading.Event()
        self.status: dict = {}
        self.refused_by: str | None = None  # the coordinator's address, where it refused this worker's key

    def run(self) -> None:
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.IDENTITY, self._codec.sender.encode())
        sock.setsockopt(zmq.LINGER, 0)
        enter(sock, self._codec.password)
        # (a coordinator that refuses this run's key answers nothing: without this the worker waited out
        # timeout_s and then said the driver was gone, though its gate had refused the worker at once)
        monitor = sock.get_monitor_socket(zmq.EVENT_HANDSHAKE_FAILED_AUTH)
        sock.connect(self._address)
        last_pong = time.monotonic()
        rejected = collections.Counter()
        try:
            while not self._stop_event.is_set():
                if monitor.poll(0):
                    self.refused_by = self._address
                    self._on_lost(time.monotonic() - last_pong)
                    return
                try:  # (a queue the coordinator does not read is full after 1000: the heartbeat is dropped, and
                    # the silence below decides, where a blocking send would have held this thread for good)
                    sock.send_multipart(self._codec.encode("heartbeat", {"status": dict(self.status)},
                                                           to="coordinator"), flags=zmq.NOBLOCK)
                except zmq.Again:
                    pass
                deadline = time.monotonic() + self._interval_s
                while (left := deadline - time.monotonic()) > 0 and not self._stop_event.is_set():
                    if sock.poll(int(min(left, STOP_POLL_S) * 1000) + 1):  # (short polls: `stop` acts at once)
                        msg = decode_or_count(self._codec, sock.recv_multipart(), rejected)
                        if msg is not None and msg.kind == "pong":
                            last_pong = time.monotonic()
                silent = time.monotonic() - last_pong
                if silent > self._timeout_s and not self._stop_event.is_set():
                    self._on_lost(silent)
                    return
        except zmq.ContextTerminated:  # the worker is ending and closed the context under us
            return
        finally:
            sock.disable_monitor()
            monitor.close(linger=0)
            sock.close()

    def stop(self, timeout_s: float = 2.0) -> None:
        """Stop sending and wait (at most `timeout_s`) until the thread has closed its socket, so that the
        worker's context can end without pulling it from under a poll."""
        self._stop_event.set()
        if self.is_alive() and threading.current_thread() is not self:
            self.join(timeout_s)
