"""Hostile frames against the live sockets of a running run: every frame is dropped and counted, no
worker crashes or grows, and the run computes exactly what it computes unattacked.

The attacker knows the inbox addresses (status.json) but not the run's secret. As a stranger, it
connects with an earlier attempt's connection password and sends messages of 48 frames of 1 MB, each
frame under the size limit: the inboxes' gates refuse the connections, so nothing of them is held. As one
who read a handshake of this attempt on the network (PLAIN sends the password in the clear), it connects
with the password and sends, round-robin to every inbox while the run goes on: frames under another
secret (wrong MAC), frames whose header claims arrays of terabytes (with a wrong MAC: never parsed),
truncated messages, random bytes, and messages above `transport.max_message_mb` (ZeroMQ disconnects the sender before buffering them). As one
who captured valid frames on the network, it also sends frames under the run's own secret addressed to
another worker (misdirected: the recipient is under the MAC), and frames to the very worker it sends them
to as an earlier attempt of the run (a requeue, a resume) would have sent them: the key of each attempt is
its own (wire.attempt_secret). Replays of a frame to the receiver it was meant for, in the same attempt,
are tested at the codec (tests/unit/test_wire.py).
"""

from __future__ import annotations

import collections
import json
import os
import subprocess
import sys
import threading
import time

import msgpack
import numpy as np
import pytest
import zmq
from zmq.utils.monitor import recv_monitor_message

from tests.conftest import REPO, alive, two_generator_grpo
from toolkit.transport.gate import enter
from toolkit.transport.wire import MAGIC, NONCE_BYTES, Codec, attempt_secret, connection_password, new_secret

pytestmark = pytest.mark.integration


def hostile(kind: str, rng: np.random.Generator, run: "Keys", target: str, elsewhere: str) -> list[bytes]:
    """A frame of `kind` for worker `target`; `elsewhere`: a worker other than it."""
    intruder = Codec(new_secret(), "generator:0")
    if kind == "misdirected":  # (a valid frame, as if captured on its way to `elsewhere`)
        return Codec(run.attempt, "generator:0").encode("samples", {"step": 0, "stage": "scorer"},
                                                       {"x": np.arange(8, dtype=np.int32)}, to=elsewhere)
    if kind == "earlier attempt":  # (as if captured on its way to `target` in an earlier attempt)
        return Codec(run.earlier, "generator:0").encode("samples", {"step": 0, "stage": "scorer"},
                                                       {"x": np.arange(8, dtype=np.int32)}, to=target)
    if kind == "wrong MAC":
        return intruder.encode("samples", {"step": 0, "stage": "scorer"}, {"x": np.arange(8, dtype=np.int32)})
    if kind == "lying header":
        header = {"kind": "samples", "sender": "generator:0#0", "seq": 1, "meta": {},
                  "arrays": [["x", "float32", [2**39]]]}  # 2 TB claimed, 4 bytes sent
        return [MAGIC + bytes(NONCE_BYTES), msgpack.packb(header), b"", b"1234", bytes(16)]
    if kind == "truncated":
        frames = [bytes(f) for f in intruder.encode("samples", {"step": 1}, {"x": np.ones(64, np.float32)})]
        cut = int(rng.integers(1, len(frames)))
        return frames[:cut] + [frames[cut][: len(frames[cut]) // 2]]
    if kind == "random bytes":
        return [rng.bytes(int(rng.integers(1, 4096))) for _ in range(int(rng.integers(1, 6)))]
    if kind == "oversized":
        return [MAGIC, rng.bytes(3 * 2**20)]  # (the run allows 2 MB)
    raise ValueError(kind)


KINDS = ["wrong MAC", "lying header", "truncated", "random bytes", "oversized", "misdirected", "earlier attempt",
         "stranger"]
MEGABYTE = bytes(2**20)


class Keys:
    """What one who captured frames on the network could use: this attempt's key, and an earlier one's."""

    def __init__(self, secret: bytes, attempt: str):
        self.attempt, self.earlier = attempt_secret(secret, attempt), attempt_secret(secret, "0" * 16)


class Attacker(threading.Thread):
    def __init__(self, inboxes: dict[str, str], keys: Keys):
        super().__init__(daemon=True)
        self.inboxes, self.keys, self.sent, self.stop = inboxes, keys, {k: 0 for k in KINDS}, threading.Event()
        self.handshakes: collections.Counter = collections.Counter()  # of the strangers' connections

    def run(self) -> None:
        ctx, rng = zmq.Context(), np.random.default_rng(0)
        sockets, others, targets = [], [], list(self.inboxes)
        for worker, address in self.inboxes.items():
            others.append(next(w for w in self.inboxes if w.split(":")[0] != worker.split(":")[0]))
            s = ctx.socket(zmq.PUSH)
            s.setsockopt(zmq.SNDHWM, 4)
            s.setsockopt(zmq.LINGER, 0)
            enter(s, connection_password(self.keys.attempt))
            s.connect(address)
            sockets.append(s)
        i = 0
        while not self.stop.is_set():
            kind = KINDS[i % len(KINDS)]
            try:
                target = (i + i // len(KINDS)) % len(sockets)  # (every kind reaches every inbox)
                if kind == "stranger":  # (a connection of its own, each time: a refused one is not retried)
                    self.sent[kind] += self.stranger(ctx, list(self.inboxes.values())[target])
                    i += 1
                    continue
                sockets[target].send_multipart(hostile(kind, rng, self.keys, targets[target], others[target]),
                                               zmq.NOBLOCK)
                self.sent[kind] += 1
            except zmq.Again:
                pass
            i += 1
            time.sleep(0.002)
        for s in sockets:
            s.close(linger=0)
        ctx.term()

    def stranger(self, ctx: zmq.Context, address: str) -> int:
        """Connect with an earlier attempt's password, send a message of 48 frames of 1 MB, and note how
        the handshake ended (each stranger must be refused). 0 if it did not end in 10 s (the run ended)."""
        s = ctx.socket(zmq.PUSH)
        s.setsockopt(zmq.LINGER, 0)
        enter(s, connection_password(self.keys.earlier))
        monitor = s.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_HANDSHAKE_FAILED_AUTH)
        s.connect(address)
        try:
            s.send_multipart([MEGABYTE] * 48, zmq.NOBLOCK, copy=False)
        except zmq.Again:
            pass
        ended = monitor.poll(10_000)
        if ended:
            event = recv_monitor_message(monitor)["event"]
            self.handshakes["refused" if event == zmq.EVENT_HANDSHAKE_FAILED_AUTH else "let in"] += 1
        s.disable_monitor()
        monitor.close(linger=0)
        s.close(linger=0)
        return int(bool(ended))


def test_hostile_frames_are_dropped_counted_and_change_nothing(tiny, two_generator_run, tmp_path):
    """The attacked run is `two_generator_run` again (the same config): it must compute the same."""
    import psutil

    run_dir, config = tmp_path / "attacked", two_generator_grpo(tiny, tmp_path, "attacked")
    proc = subprocess.Popen([sys.executable, "-m", "toolkit", "run", str(config), "--run-dir", str(run_dir)], cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    attacker, peak_rss, pids = None, {}, {}
    try:
        deadline = time.monotonic() + 240
        while attacker is None:
            assert proc.poll() is None and time.monotonic() < deadline, "the run ended before its inboxes were up"
            try:
                status = json.loads((run_dir / "status.json").read_text())
                workers = status["workers"]
            except (OSError, ValueError, KeyError):
                status, workers = {}, {}
            inboxes = {name: w["inbox"] for name, w in workers.items() if w.get("inbox")}
            if len(inboxes) == 4:  # two generators, the scorer, the trainer
                pids = {name: w["pid"] for name, w in workers.items()}
                attacker = Attacker(inboxes, Keys((run_dir / "secret").read_bytes(), status["attempt"]))
                attacker.start()
            time.sleep(0.2)
        while proc.poll() is None:
            for name, pid in pids.items():
                try:
                    peak_rss[name] = max(peak_rss.get(name, 0), psutil.Process(pid).memory_info().rss)
                except psutil.NoSuchProcess:
                    pass
            time.sleep(0.2)
        out, err = proc.communicate(timeout=60)
    finally:
        if attacker is not None:
            attacker.stop.set()
            attacker.join(10)
        if proc.poll() is None:
            os.killpg(proc.pid, 9)
    assert proc.returncode == 0, out + err
    assert not alive(pids.values())
    sent = attacker.sent
    assert all(n > 0 for n in sent.values()), sent
    quiet, attacked = ([json.loads(line) for line in (d / "metrics.jsonl").read_text().splitlines()]
                       for d in (two_generator_run, run_dir))
    for a, b in zip(quiet, attacked, strict=True):  # the same samples, rewards and updates
        assert (a["reward_mean"], a["loss"], a["kl"]) == (b["reward_mean"], b["loss"], b["kl"])
    status = json.loads((run_dir / "status.json").read_text())
    rejected: dict[str, int] = {}
    for w in status["workers"].values():
        for reason, n in w.get("rejected_frames", {}).items():
            rejected[reason] = rejected.get(reason, 0) + n
    counted = sum(n for kind, n in sent.items() if kind not in ("oversized", "stranger"))
    assert set(rejected) <= {"bad-mac", "malformed", "misdirected", "unauthenticated"}, rejected
    assert attacker.handshakes == {"refused": sent["stranger"]}, attacker.handshakes
    assert rejected.get("unauthenticated", 0) > 0, (rejected, sent)
    rejected_frames = sum(n for reason, n in rejected.items() if reason != "unauthenticated")
    assert rejected_frames >= counted // 2 and rejected.get("misdirected", 0) > 0, (rejected, sent)
    log = "".join(p.read_text() for p in (run_dir / "logs").glob("*.log"))
    assert "dropped a frame (bad-mac" in log and "dropped a frame (malformed" in log
    assert "refused a connection from 127.0.0.1 (PLAIN; not this run's key, or an earlier attempt's)" in log
    assert "dropped a frame (misdirected: a frame for 'generator:0' from generator:0#" in log
    assert max(peak_rss.values()) < 4 * 2**30, peak_rss  # (no worker buffered the claimed terabytes)
    print(f"hostile frames sent: {sent}; dropped and counted by the workers: {rejected}; "
          f"peak worker RSS {max(peak_rss.values()) / 2**20:.0f} MB")
