"""Wire format: round trip, and rejection of forged, altered, replayed and malformed frames."""

from __future__ import annotations

import ctypes
import gc
import socket
import subprocess
import sys
import textwrap
import time

import msgpack
import numpy as np
import pytest
import zmq

from toolkit.errors import ConfigError
from toolkit.transport.sockets import Inbox, Outbox
from toolkit.transport.wire import MAGIC, NONCE_BYTES, Codec, FrameError, new_secret, read_secret

SECRET = b"s" * 32


def arrays():
    rng = np.random.default_rng(0)
    return {"tokens": rng.integers(0, 50000, 37, dtype=np.int32),
            "logprobs": rng.standard_normal((3, 5)).astype(np.float32),
            "mask": np.array([True, False, True]), "empty": np.zeros((0, 4), np.int64),
            "scalar": np.float64(2.5) * np.ones(())}


def test_round_trip():
    tx, rx = Codec(SECRET, "generator:0"), Codec(SECRET, "scorer:0")
    sent = arrays()
    msg = rx.decode(tx.encode("samples", {"step": 3, "names": ["a", "b"], "nested": {"x": 1.5}}, sent))
    assert msg.kind == "samples" and msg.meta == {"step": 3, "names": ["a", "b"], "nested": {"x": 1.5}}
    assert msg.sender.startswith("generator:0#") and msg.seq == 1
    assert set(msg.arrays) == set(sent)
    for name, a in sent.items():
        b = msg.arrays[name]
        assert b.dtype == a.dtype and b.shape == a.shape and np.array_equal(a, b)


def test_large_buffers_are_not_copied_on_send_and_small_ones_travel_joined():
    large, small = np.arange(1024, dtype=np.float32), np.arange(3, dtype=np.int16)  # (4096 and 6 bytes)
    frames = Codec(SECRET, "x").encode("k", {}, {"s": small, "a": large, "t": small})
    assert len(frames) == 5  # magic + nonce, header, the joined small arrays, the large one, tag
    assert np.shares_memory(np.frombuffer(frames[3], dtype=np.float32), large)
    assert bytes(frames[2]) == small.tobytes() + bytes(2) + small.tobytes() + bytes(2)  # (each padded to 8)


def test_wrong_secret_is_rejected():
    frames = Codec(new_secret(), "intruder").encode("samples", {"step": 0}, arrays())
    with pytest.raises(FrameError) as info:
        Codec(SECRET, "scorer:0").decode(frames)
    assert info.value.reason == "bad-mac"


def test_a_frame_of_another_attempt_of_the_run_is_rejected():
    """Each start of the workers (a requeue, a resume) has a key of its own, so that frames captured in an
    earlier attempt, whose sequence numbers the new receivers never saw, do not authenticate."""
    from toolkit.transport.wire import attempt_secret

    first, second = attempt_secret(SECRET, "a1b2c3d4e5f60718"), attempt_secret(SECRET, "0f1e2d3c4b5a6978")
    assert len(first) == 32 and first != second and attempt_secret(SECRET, "a1b2c3d4e5f60718") == first
    frames = Codec(first, "generator:0").encode("samples", {"step": 0}, arrays(), to="scorer:0")
    assert Codec(first, "scorer:0", accepts={"scorer:0"}).decode(frames).kind == "samples"
    with pytest.raises(FrameError, match="bad-mac"):
        Codec(second, "scorer:0", accepts={"scorer:0"}).decode(frames)


@pytest.mark.parametrize("index", [0, 1, 2, 3, 4])  # (the nonce, header, small arrays, large array, tag)
def test_altered_frame_is_rejected(index):
    frames = [bytes(f) for f in Codec(SECRET, "g").encode(
        "samples", {"step": 0}, {**arrays(), "large": np.ones(2048, np.float32)})]
    altered = bytearray(frames[index])
    altered[len(altered) // 2] ^= 0x01
    frames[index] = bytes(altered)
    with pytest.raises(FrameError, match="authentication failed"):
        Codec(SECRET, "s").decode(frames)


def test_the_tag_is_gmac_of_the_frame_lengths_and_frames_under_the_messages_own_key():
    """Worked out with AESGCM's one-shot API (not the Codec's incremental one): the tag is AES-256-GCM's
    over an empty plaintext, with the lengths (8 bytes each) and every frame as associated data, under
    HMAC-SHA256(secret, label + nonce), IV 0. Two messages never share a key: their nonces differ."""
    import hmac
    import struct

    from cryptography.hazmat.primitives.ciphers.aead import AESGCM

    big = np.arange(3000, dtype=np.int64)  # (a frame fed on its own, not joined with the small ones)
    first, second = (Codec(SECRET, "g").encode("samples", {"step": 1}, {"big": big, **arrays()}) for _ in range(2))
    for frames in (first, second):
        *body, tag = [bytes(memoryview(f)) for f in frames]
        key = hmac.digest(SECRET, b"slurm-rlhf gmac key:" + body[0][len(MAGIC):], "sha256")
        lengths = struct.pack(f"<{len(body)}Q", *map(len, body))
        assert tag == AESGCM(key).encrypt(bytes(12), b"", lengths + b"".join(body))
    assert first[1] != second[1] and first[-1] != second[-1]


def test_replay_is_rejected():
    tx, rx = Codec(SECRET, "g"), Codec(SECRET, "s")
    first = tx.encode("a", {}, {})
    rx.decode(first)
    rx.decode(tx.encode("b", {}, {}))
    with pytest.raises(FrameError) as info:
        rx.decode(first)
    assert info.value.reason == "replay"


def test_a_valid_frame_reaches_only_the_receiver_it_was_sent_to():
    """The recipient is under the MAC: a frame for the scorers, replayed to the trainer (or a command for
    one worker replayed to another), is refused; a frame for a group is taken by any of its workers."""
    tx = Codec(SECRET, "generator:0")
    trainer = Codec(SECRET, "trainer:0", accepts={"trainer:0", "trainer"})
    for scorer in ("scorer:0", "scorer:1"):
        Codec(SECRET, scorer, accepts={scorer, "scorer"}).decode(tx.encode("samples", {}, {}, to="scorer"))
    refused = "a frame for 'scorer' from generator:0#[0-9a-f]+ reached trainer/trainer:0"
    with pytest.raises(FrameError, match=refused) as info:
        trainer.decode(tx.encode("samples", {}, {}, to="scorer"))
    assert info.value.reason == "misdirected"
    command = Codec(SECRET, "coordinator").encode("start", {}, to="scorer:1")
    with pytest.raises(FrameError, match="misdirected"):
        Codec(SECRET, "scorer:0", accepts={"scorer:0", "scorer"}).decode(command)
    with pytest.raises(FrameError, match="a send-only socket"):  # (the driver's codec takes nothing)
        Codec(SECRET, "driver", accepts=()).decode(tx.encode("x", to=""))
    # A reply to one sender (the rendezvous store's to a client) reaches that sender alone.
    client, other = Codec(SECRET, "store-client", accepts=()), Codec(SECRET, "store-client", accepts=())
    reply = Codec(SECRET, "store").encode("reply", {"id": 1}, to=client.sender)
    assert client.decode(reply).meta == {"id": 1}
    with pytest.raises(FrameError, match="misdirected"):
        other.decode(reply)


def forged(header: dict, buffers: list[bytes]) -> list:
    """Frames with a valid MAC around an arbitrary header (as from a buggy peer that knows the secret)."""
    codec = Codec(SECRET, "x")
    body = [MAGIC + bytes(NONCE_BYTES), msgpack.packb(header), *(buffers or [b""])]
    return [*body, codec._mac(body)]


@pytest.mark.parametrize("header,buffers,detail", [
    ({"kind": "k", "sender": "a", "to": "", "seq": 1, "meta": {}, "arrays": [["x", "object", [1]]]}, [b"12345678"], "dtype"),
    ({"kind": "k", "sender": "a", "to": "", "seq": 1, "meta": {}, "arrays": [["x", ["int32"], [1]]]}, [b"1234"], "dtype"),
    ({"kind": "k", "sender": "a", "to": "", "seq": 1, "meta": {}, "arrays": [["x", "int32", [3]]]}, [b"1234"], "needs 12 bytes"),
    ({"kind": "k", "sender": "a", "to": "", "seq": 1, "meta": {}, "arrays": [["x", "int32", [-1]]]}, [b""], "bad shape"),
    ({"kind": "k", "sender": "a", "to": "", "seq": 1, "meta": {}, "arrays": []}, [b"extra"], "0 arrays, of 0 bytes joined"),
    ({"kind": "k", "sender": "a", "to": "", "seq": 1, "meta": {}, "arrays": []}, [b"", b"x" * 4096], "but 0 bytes and 1 buffers"),
    ({"kind": "k", "sender": "a", "to": "", "seq": 1, "meta": {}, "arrays": [["x", "int64", [512]]]}, [b""],
     "'x' int64\\(512,\\) has no buffer"),
    ({"kind": 5, "sender": "a", "to": "", "seq": 1, "meta": {}, "arrays": []}, [], "strings"),
    ({"kind": "k", "sender": "a", "to": 3, "seq": 1, "meta": {}, "arrays": []}, [], "strings"),
    ({"kind": "k", "sender": "a", "to": "", "seq": "1", "meta": {}, "arrays": []}, [], "seq"),
    ({"kind": "k", "sender": "a"}, [], "header keys"),
])
def test_malformed_header_is_rejected(header, buffers, detail):
    with pytest.raises(FrameError, match=detail) as info:
        Codec(SECRET, "s").decode(forged(header, buffers))
    assert info.value.reason == "malformed"


def test_garbage_is_rejected():
    rx = Codec(SECRET, "s")
    for frames in ([b"hello"], [b"SRLHF0", b"x", b"y", b"z"], [MAGIC, bytes(NONCE_BYTES), b"\xc1", b"0" * 16],
                   [MAGIC + b"short nonce", b"\xc1", b"", b"0" * 16]):
        with pytest.raises(FrameError):
            rx.decode(frames)
    body = [MAGIC + bytes(NONCE_BYTES), b"\xc1\xc1", b""]  # authenticated but not msgpack
    with pytest.raises(FrameError, match="not msgpack"):
        rx.decode([*body, Codec(SECRET, "x")._mac(body)])


def test_forged_frames_from_another_process_are_dropped_and_counted():
    """A real ZeroMQ inbox; a separate process connects without the run's key (refused at the handshake),
    with ZeroMQ's default mechanism (dropped at its greeting), and, as an insider that holds the
    connection password, sends a forged frame and garbage; then a valid message."""
    ctx = zmq.Context()
    inbox = Inbox(ctx, Codec(SECRET, "scorer:0"), "127.0.0.1", hwm=4)
    script = textwrap.dedent(f"""
        import numpy as np, zmq
        from toolkit.transport.gate import enter
        from toolkit.transport.sockets import Outbox
        from toolkit.transport.wire import Codec
        ctx = zmq.Context()
        try:
            Outbox(ctx, Codec(b"x" * 32, "intruder"), [{inbox.address!r}], hwm=4, connect_timeout_s=20)
        except ConnectionRefusedError as e:
            print("stranger:", e)
        plain = ctx.socket(zmq.PUSH); plain.connect({inbox.address!r})
        plain.send_multipart([b"no mechanism", b"x", b"y"])
        insider = ctx.socket(zmq.PUSH); enter(insider, Codec({SECRET!r}, "x").password)
        insider.connect({inbox.address!r})
        insider.send_multipart(Codec(b"x" * 32, "intruder").encode("samples", {{"step": 0}}, {{"a": np.ones(3)}}))
        insider.send_multipart([b"garbage", b"x", b"y"])
        good = Outbox(ctx, Codec({SECRET!r}, "generator:0"), [{inbox.address!r}], hwm=4)
        good.send("samples", {{"step": 7}}, {{"a": np.arange(4, dtype=np.int64)}})
        import time; time.sleep(0.5)
        good.close(); plain.close(linger=0); insider.close(linger=0)
    """)
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        # three senders on three connections: arrival order between them is not defined
        deadline = time.monotonic() + 30
        received = []
        while (not received or sum(inbox.rejected.values()) < 2) and time.monotonic() < deadline:
            msg = inbox.recv(timeout_s=0.5)
            if msg is not None:
                received.append(msg)
        assert len(received) == 1, "the valid message never came (or came twice)"
        assert received[0].meta == {"step": 7} and received[0].arrays["a"].tolist() == [0, 1, 2, 3]
        assert inbox.rejected == {"bad-mac": 1, "malformed": 1}
        assert inbox.gate.refused == {"unauthenticated": 1}
    finally:
        out, _ = proc.communicate(timeout=30)
        inbox.close()
        ctx.term()
    assert "stranger: the consumer at tcp://127.0.0.1:" in out and "refused this run's key" in out


@pytest.mark.parametrize("password", ["the run's", "another"])
def test_a_peer_without_the_key_cannot_make_an_inbox_hold_a_message_of_many_frames(password):
    """ZeroMQ takes a message in whole before the receiver sees a frame, and MAXMSGSIZE bounds each frame:
    a message of 48 frames of 1 MB passes a 2 MB limit. From a peer with the connection password, the
    inbox's process holds it (what any peer could do before the gate); from one without, nothing comes in."""
    import psutil

    ctx = zmq.Context()
    inbox = Inbox(ctx, Codec(SECRET, "scorer:0"), "127.0.0.1", hwm=4, max_message_mb=2)
    key = Codec(SECRET if password == "the run's" else new_secret(), "x").password
    script = textwrap.dedent(f"""
        import time, zmq
        from toolkit.transport.gate import enter
        ctx = zmq.Context(); s = ctx.socket(zmq.PUSH); s.setsockopt(zmq.SNDTIMEO, 5000); enter(s, {key!r})
        s.connect({inbox.address!r})
        try:
            s.send_multipart([bytes(2**20)] * 48)
        except zmq.Again:
            print("not sent")
        time.sleep(20)  # (ended by the test)
    """)
    me = psutil.Process()
    gc.collect()  # (what earlier tests left, freed now and not while this one measures)
    ctypes.CDLL("libc.so.6").malloc_trim(0)  # (and their free pages given back, so that new frames need new ones)
    before = me.memory_info().rss
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:  # (ends as soon as the message is in or refused; the deadline only bounds a sender slow to start)
        deadline, held = time.monotonic() + 120, 0
        while time.monotonic() < deadline and not inbox.gate.refused and held < 40 * 2**20:
            held = max(held, me.memory_info().rss - before)
            time.sleep(0.05)
        time.sleep(0.5)  # (what else may come in after a refusal)
        held = max(held, me.memory_info().rss - before)
        message = inbox.recv(0.5)
    finally:
        proc.kill()
        said = proc.communicate(timeout=10)[0]
        inbox.close()
        ctx.term()
    if password == "the run's":
        assert held > 40 * 2**20 and inbox.rejected == {"malformed": 1} and message is None, (held, inbox.rejected, said)
    else:
        assert inbox.gate.refused == {"unauthenticated": 1} and held < 8 * 2**20, (held, inbox.gate.refused)
        assert message is None and not inbox.rejected


def test_outbox_blocks_then_times_out_when_nobody_reads():
    """Backpressure: with nobody reading, sends stop after the high-water marks and then time out."""
    ctx = zmq.Context()
    inbox = Inbox(ctx, Codec(SECRET, "s"), "127.0.0.1", hwm=2)
    outbox = Outbox(ctx, Codec(SECRET, "g"), [inbox.address], hwm=2)
    big = {"a": np.zeros(2**20, np.uint8)}
    sent = 0
    try:
        with pytest.raises(TimeoutError, match="no consumer"):
            for _ in range(100):
                outbox.send("x", {}, big, timeout_s=1.0)
                sent += 1
        assert sent < 20, f"{sent} MB accepted with nobody reading"
        drained = 0
        while inbox.recv(1.0) is not None:  # the consumer catches up ...
            drained += 1
        assert drained == sent
        outbox.send("x", {}, big, timeout_s=5.0)  # ... and data flows again
        assert inbox.recv(5.0) is not None
    finally:
        outbox.close()
        inbox.close()
        ctx.term()


@pytest.mark.parametrize("interrupt", [False, True])
def test_an_outbox_that_never_connects_leaves_no_open_socket(interrupt, monkeypatch):
    """Its connect timeout (or an interrupt while it waits) closes its socket, so the context can end:
    before, `ctx.term()` waited forever for the PUSH socket nobody could close."""
    import threading

    ctx = zmq.Context()
    if interrupt:
        def interrupted(self, timeout=None, flags=zmq.POLLIN):
            raise KeyboardInterrupt

        monkeypatch.setattr(zmq.Socket, "poll", interrupted)
    nobody = "tcp://127.0.0.1:9"  # (discard port: nothing accepts there)
    with pytest.raises(KeyboardInterrupt if interrupt else TimeoutError) as info:
        Outbox(ctx, Codec(SECRET, "driver"), [nobody], hwm=2, connect_timeout_s=0.5)
    # (the exception's traceback keeps the half-built outbox alive, as in the driver's handler)
    assert info.traceback
    ended = threading.Event()
    threading.Thread(target=lambda: (ctx.term(), ended.set()), daemon=True).start()
    assert ended.wait(10), "ctx.term() blocked: the outbox left its socket open"


def test_an_outbox_waits_for_every_consumer_by_address_and_names_the_one_missing():
    """A consumer whose connection comes up twice (started again on its port) is one consumer: before, the
    handshakes were counted, and the outbox took the second for the consumer that never came; its timeout
    said "1 of 2 consumers (A, B)", not which one was missing."""
    import threading

    ctx = zmq.Context()
    inbox = Inbox(ctx, Codec(SECRET, "scorer:0"), "127.0.0.1", hwm=2)
    port = int(inbox.address.rsplit(":", 1)[1])
    nobody = "tcp://127.0.0.1:9"  # (discard port: nothing accepts there)
    again = []

    def start_again():
        time.sleep(0.5)
        inbox.close()
        time.sleep(0.3)
        again.append(Inbox(ctx, Codec(SECRET, "scorer:0"), "127.0.0.1", hwm=2, port=port))

    thread = threading.Thread(target=start_again)
    thread.start()
    started = time.monotonic()
    try:
        with pytest.raises(TimeoutError, match=f"connected to 1 of 2 consumers in 3 s; none answered at {nobody}$"):
            Outbox(ctx, Codec(SECRET, "generator:0"), [inbox.address, nobody], hwm=2, connect_timeout_s=3, to="scorer")
        assert time.monotonic() - started == pytest.approx(3, abs=1)
    finally:
        thread.join()
        for box in again:
            box.close()
        ctx.term()


def test_the_coordinator_takes_a_workers_identity_from_the_authenticated_sender():
    """ZeroMQ's routing identity is whatever the peer says; the MAC covers the sender. A message whose
    connection claims one worker and whose sender is another is dropped and counted. A peer without the
    secret that connects under a worker's identity gets none of its commands (with ZeroMQ's handover, the
    coordinator's replies went to the newest connection of a name). Both peers hold the connection password
    (as one who read a handshake on the network would), not the key."""
    from toolkit.transport.gate import enter
    from toolkit.launch.coordinator import Coordinator
    from toolkit.transport.control import ControlClient

    ctx = zmq.Context()
    coordinator = Coordinator(ctx, SECRET, "127.0.0.1")
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.IDENTITY, b"trainer:0")
    dealer.setsockopt(zmq.LINGER, 0)
    enter(dealer, coordinator.codec.password)
    dealer.connect(coordinator.address)
    trainer = ControlClient(ctx, Codec(SECRET, "trainer:0", accepts={"trainer:0"}), coordinator.address)
    thief = ctx.socket(zmq.DEALER)
    try:
        dealer.send_multipart(Codec(SECRET, "generator:0").encode("failed", {"error": "framed"}, to="coordinator"))
        dealer.send_multipart(Codec(SECRET, "trainer:0").encode("ready", {}, to="coordinator"))
        assert coordinator.recv(2) is None and coordinator.rejected == {"identity": 2}
        trainer.send("register")
        got = coordinator.recv(10)
        assert got is not None and got[0] == "trainer:0" and got[1].kind == "register"
        thief.setsockopt(zmq.IDENTITY, trainer.codec.sender.encode())
        thief.setsockopt(zmq.LINGER, 0)
        enter(thief, coordinator.codec.password)
        thief.connect(coordinator.address)
        thief.send_multipart(Codec(new_secret(), "trainer:0").encode("hello", {}, to="coordinator"))
        coordinator.recv(1)
        coordinator.send("trainer:0", "shutdown")
        command = trainer.recv(10)
        assert command is not None and command.kind == "shutdown"
        assert not thief.poll(1000)
    finally:
        for s in (dealer, thief):
            s.close(linger=0)
        trainer.socket.close(linger=0)
        coordinator.close()
        ctx.term()


def test_commands_bind_the_process_of_a_worker_and_an_earlier_processs_messages_are_dropped():
    """A worker started again is a new process of the same worker id. A command captured on its way to
    the earlier process (here: its raw frames) is refused by the new one, as misdirected: it is addressed
    to the earlier process's name, not to the worker's (which the new one would take, its sequence
    numbers starting afresh). The pong of a heartbeat likewise. The other way, once the driver forgets
    the earlier process (a restart), what it sent is dropped and counted, before and after the new one
    registers, where before it was taken as the new one's (a `failed` left queued as it died would end
    the run)."""
    from toolkit.launch.coordinator import Coordinator
    from toolkit.transport.control import ControlClient

    ctx = zmq.Context()
    coordinator = Coordinator(ctx, SECRET, "127.0.0.1")
    earlier = ControlClient(ctx, Codec(SECRET, "generator:0", accepts=()), coordinator.address)
    later = ControlClient(ctx, Codec(SECRET, "generator:0", accepts=()), coordinator.address)
    hb = ctx.socket(zmq.DEALER)
    try:
        earlier.send("register")
        assert coordinator.recv(10)[1].kind == "register"
        coordinator.send("generator:0", "start", book={})
        assert earlier.socket.poll(10000)
        captured = earlier.socket.recv_multipart()
        assert earlier.codec.decode(captured).kind == "start"  # (the process it was meant for takes it)
        with pytest.raises(FrameError, match="misdirected"):
            later.codec.decode(captured)
        hb_codec = Codec(SECRET, "generator:0/hb", accepts=())
        hb.setsockopt(zmq.IDENTITY, hb_codec.sender.encode())
        hb.setsockopt(zmq.LINGER, 0)
        from toolkit.transport.gate import enter

        enter(hb, hb_codec.password)
        hb.connect(coordinator.address)
        hb.send_multipart(hb_codec.encode("heartbeat", {"status": {}}, to="coordinator"))
        assert coordinator.recv(2) is None  # (it answers the heartbeat)
        assert hb.poll(10000)
        pong = hb.recv_multipart()
        assert hb_codec.decode(pong).kind == "pong"
        with pytest.raises(FrameError, match="misdirected"):
            Codec(SECRET, "generator:0/hb", accepts=()).decode(pong)

        coordinator.forget("generator:0")  # (the driver restarts it)
        earlier.send("failed", error="left queued as it died")
        assert coordinator.recv(1) is None and coordinator.rejected["earlier-process"] == 1
        later.send("register")
        earlier.send("ready")
        later.send("ready")
        got = [coordinator.recv(10) for _ in range(2)]
        assert [(w, m.kind, m.sender) for w, m in got] == [("generator:0", k, later.codec.sender)
                                                           for k in ("register", "ready")]
        # (the earlier process's `ready` comes on a socket of its own: it may come after the later one's)
        deadline = time.monotonic() + 10
        while coordinator.rejected["earlier-process"] < 2 and time.monotonic() < deadline:
            assert coordinator.recv(0.1) is None
        assert coordinator.rejected["earlier-process"] == 2
        coordinator.send("generator:0", "start", book={})
        command = later.recv(10)
        assert command is not None and command.kind == "start" and not earlier.socket.poll(500)
    finally:
        for client in (earlier, later):
            client.socket.close(linger=0)
        hb.close(linger=0)
        coordinator.close()
        ctx.term()


def test_a_header_as_large_as_a_big_steps_texts_is_read():
    """A step's prompts and responses travel in the header: 4,000 samples of 5,000 characters make 19 MB,
    which a cap of 16 MB on headers dropped as malformed (every message of such a step, so the run waited
    out its step timeout). The MAC is checked before the header is parsed, so its size needs no cap of
    its own beyond the socket's frame limit."""
    responses = [f"{i:05d}" + "x" * 4995 for i in range(4000)]
    frames = Codec(SECRET, "generator:0").encode("samples", {"responses": responses}, {"a": np.arange(3)})
    assert len(frames[1]) > 19 * 2**20
    msg = Codec(SECRET, "scorer:0").decode(frames)
    assert msg.meta["responses"] == responses


def test_a_message_over_the_frame_limit_is_refused_by_its_sender_with_the_setting_named():
    """ZeroMQ drops a connection that sends a frame over the receiver's MAXMSGSIZE without a word, and the
    message with it (the run would wait out its step timeout): the sender refuses such a message."""
    ctx = zmq.Context()
    inbox = Inbox(ctx, Codec(SECRET, "scorer:0"), "127.0.0.1", hwm=4, max_message_mb=1)
    outbox = Outbox(ctx, Codec(SECRET, "generator:0"), [inbox.address], hwm=4, max_message_mb=1)
    try:
        with pytest.raises(ValueError, match=r"a 'samples' message has a frame of 2.0 MB \(its header with the "
                                             r"texts, or one array\), over transport.max_message_mb \(1 MB\)"):
            outbox.send("samples", {}, {"a": np.zeros(2**21, np.uint8)})
        with pytest.raises(ValueError, match="frame of 1.1 MB"):
            outbox.send("samples", {"responses": ["x" * 2**20 + "y" * 2**17]})
        outbox.send("samples", {"responses": ["x" * 1000]}, {"a": np.zeros(2**19, np.uint8)})
        assert inbox.recv(10).meta == {"responses": ["x" * 1000]}
    finally:
        outbox.close()
        inbox.close()
        ctx.term()


def test_a_heartbeat_to_a_coordinator_that_reads_nothing_still_finds_it_lost():
    """The heartbeat thread sends without blocking: once ZeroMQ's queue to a coordinator that reads nothing
    is full (1000 messages, here in about a second at 1 ms a heartbeat), a blocking send held the thread
    before its silence check, so the worker never learned it was alone."""
    import threading

    from toolkit.transport.control import Heartbeat

    with socket.socket() as s:  # (a port nobody listens on: the connection never completes)
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = zmq.Context()
    lost = threading.Event()
    beat = Heartbeat(ctx, new_secret(), f"tcp://127.0.0.1:{port}", "generator:0", 0.001, 3.0, lambda s: lost.set())
    beat.start()
    try:
        assert lost.wait(60), "the heartbeat thread never found the coordinator silent"
    finally:
        beat.stop()
        ctx.term()


def test_a_heartbeat_the_coordinator_refuses_says_so_at_once():
    """A worker with an earlier attempt's key: the coordinator's gate refuses it at once, but the worker
    waited out its heartbeat timeout and then said the driver was gone."""
    import threading

    from toolkit.launch.coordinator import Coordinator
    from toolkit.transport.control import Heartbeat
    from toolkit.transport.wire import attempt_secret

    ctx = zmq.Context()
    coordinator = Coordinator(ctx, attempt_secret(SECRET, "attempt-2"), "127.0.0.1")
    lost = threading.Event()
    beat = Heartbeat(ctx, attempt_secret(SECRET, "attempt-1"), coordinator.address, "generator:0", 0.2, 600.0,
                     lambda s: lost.set())
    try:
        beat.start()
        deadline = time.monotonic() + 60
        while not lost.is_set() and time.monotonic() < deadline:
            coordinator.recv(0.2)
        assert lost.is_set() and beat.refused_by == coordinator.address, "not told of the refusal"
        assert coordinator.gate.refused["unauthenticated"] >= 1
    finally:
        beat.stop()
        coordinator.close()
        ctx.term()


def test_the_coordinator_answers_heartbeats_while_the_driver_waits_on_slurm_and_keeps_the_rest_in_order():
    """While the driver's main thread waits on something else (here 6 s of sleep, for a scancel of a hung
    step on a busy controller), `answering()` answers the worker's heartbeats (it is not lost, with 2 s of
    silence allowed) and keeps its other messages for `recv` after, in order. The register kept meanwhile
    routes commands once handed out, after the driver forgot the worker it restarted. Then, with nobody
    answering, the same worker finds the driver lost: the check above could fail."""
    import threading

    from toolkit.launch.coordinator import Coordinator
    from toolkit.transport.control import ControlClient, Heartbeat

    ctx = zmq.Context()
    coordinator = Coordinator(ctx, SECRET, "127.0.0.1")
    lost = threading.Event()
    beat = Heartbeat(ctx, SECRET, coordinator.address, "generator:0", 0.2, 2.0, lambda s: lost.set())
    worker = ControlClient(ctx, Codec(SECRET, "generator:0", accepts={"generator:0"}), coordinator.address)
    try:
        beat.start()
        with coordinator.answering():
            for kind in ("register", "ready", "synced"):
                worker.send(kind)
            time.sleep(6.0)
            assert not lost.is_set(), "the worker heard no pong while the driver waited"
        assert coordinator.status.get("generator:0") == {} and coordinator.silent(["generator:0"], 2.0) == []
        coordinator.forget("generator:0")  # (as a restart does, after the launcher started the new process)
        got = [coordinator.recv(5) for _ in range(3)]
        assert [(w, m.kind) for w, m in got] == [("generator:0", k) for k in ("register", "ready", "synced")]
        assert coordinator.recv(0.5) is None  # (heartbeats are answered, not handed out)
        coordinator.send("generator:0", "start")
        command = worker.recv(10)
        assert command is not None and command.kind == "start"
        assert lost.wait(60), "the worker never found the driver silent"  # (no `recv`, no `answering`)
    finally:
        beat.stop()
        worker.socket.close(linger=0)
        coordinator.close()
        ctx.term()


def test_an_interrupt_while_the_answering_thread_ends_waits_for_it(monkeypatch):
    """A Ctrl-C (or SIGTERM, which the driver turns into the same) that comes while `answering()` waits for
    its thread must not leave the thread on the socket: the driver's clean-up closes that socket next, and
    a ZeroMQ socket used by two threads at once can abort the process. Here the thread, in its poll, sends
    the interrupt once the driver waits (or after 5 s, to a driver that waits otherwise), then stays on
    the socket 1 s more."""
    import signal
    import threading

    from toolkit.launch import coordinator as module

    waiting, sent = threading.Event(), threading.Event()

    class Event(threading.Event):  # (the coordinator's: its first wait with a timeout is the driver's)
        def wait(self, timeout=None):
            if timeout is not None:
                waiting.set()
            return super().wait(timeout)

    class Socket:  # (the coordinator's socket, its poll held as described)
        def __init__(self, socket):
            self.socket = socket

        def poll(self, timeout_ms):
            if not sent.is_set():
                waiting.wait(5)
                sent.set()
                signal.pthread_kill(threading.main_thread().ident, signal.SIGUSR2)
                time.sleep(1.0)
            return 0

        def close(self, linger=None):
            self.socket.close(linger=linger)

    def interrupt(signum, frame):
        raise KeyboardInterrupt

    monkeypatch.setattr(module.threading, "Event", Event)
    previous = signal.signal(signal.SIGUSR2, interrupt)
    ctx = zmq.Context()
    coordinator = module.Coordinator(ctx, SECRET, "127.0.0.1")
    coordinator.socket = Socket(coordinator.socket)
    try:
        with pytest.raises(KeyboardInterrupt):
            with coordinator.answering():
                pass
        assert sent.is_set() and not any(t.name == "coordinator-answering" for t in threading.enumerate())
    finally:
        signal.signal(signal.SIGUSR2, previous)
        coordinator.close()
        ctx.term()


@pytest.mark.parametrize("receiver", ["inbox", "coordinator"])
def test_a_receive_ends_at_its_timeout_while_bad_frames_keep_coming(receiver, caplog):
    """A peer (another process) that holds the connection password, not the key, sends garbage without
    pause: the receive still returns None at its timeout (1 s), where it had looked at its deadline only
    when nothing was queued, and so waited as long as the flood went on (here up to 60 s). And the log
    holds a line per power of two of the drops, not one per drop (which filled a run's log)."""
    from toolkit.launch.coordinator import Coordinator

    ctx = zmq.Context()
    if receiver == "inbox":
        target = Inbox(ctx, Codec(SECRET, "scorer:0"), "127.0.0.1", hwm=1000)  # (a queue that seldom runs dry)
    else:
        target = Coordinator(ctx, SECRET, "127.0.0.1")
    script = textwrap.dedent(f"""
        import time, zmq
        from toolkit.transport.gate import enter
        ctx = zmq.Context()
        sock = ctx.socket(zmq.{"PUSH" if receiver == "inbox" else "DEALER"})
        sock.setsockopt(zmq.LINGER, 0)
        enter(sock, {target.codec.password!r})
        sock.connect({target.address!r})
        until = time.monotonic() + 60
        while time.monotonic() < until:
            sock.send_multipart([b"garbage", b"x", b"y"])
    """)
    flood = subprocess.Popen([sys.executable, "-c", script])
    try:
        while sum(target.rejected.values()) < 100:  # (the flood is on)
            assert target.recv(0.1) is None
        started = time.monotonic()
        assert target.recv(1.0) is None
        assert time.monotonic() - started < 30
        assert flood.poll() is None and target.rejected["malformed"] > 100  # (it went on all the while)
        drops = [r for r in caplog.records if r.getMessage().startswith("dropped a frame")]
        assert len(drops) == target.rejected["malformed"].bit_length(), (len(drops), target.rejected)
    finally:
        flood.kill()
        flood.wait(30)
        target.close()
        ctx.term()


@pytest.mark.parametrize("how", ["missing", "readable by the group", "too short"])
def test_a_secret_file_missing_open_to_others_or_short_is_a_config_error_that_names_it(tmp_path, how):
    """A run directory copied without its secret, or shared with a group (`chmod -R g+r`): a resume ended in
    a FileNotFoundError or PermissionError traceback; now a project error (printed without a traceback,
    exit 2) names the file and how to fix it."""
    path = tmp_path / "secret"
    path.write_bytes(new_secret()[: 8 if how == "too short" else 32])
    path.chmod(0o640 if how == "readable by the group" else 0o600)
    if how == "missing":
        path.unlink()
    with pytest.raises(ConfigError) as e:
        read_secret(path)
    assert str(path) in str(e.value) and "head -c 32 /dev/urandom" in str(e.value)
    assert ("chmod 600" in str(e.value)) == (how == "readable by the group")
    path.write_bytes(new_secret())
    path.chmod(0o600)
    assert len(read_secret(path)) == 32
