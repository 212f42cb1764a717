"""Every connection of a gloo group proves the attempt's key (toolkit/transport/peers.py): real gloo groups
of two ranks (threads of this process), and a stranger that takes a rank's place on the wire."""

from __future__ import annotations

import datetime
import re
import select
import socket
import struct
import threading
import time

import pytest
import torch
import torch.distributed as dist

from toolkit.transport.peers import StrangerInGroup, prove_peers

KEY = b"k" * 32


def _group(store, rank: int, timeout_s: float, size: int = 2):
    return dist.ProcessGroupGloo(store, rank, size, datetime.timedelta(seconds=timeout_s))


def _all(store, keys, timeout_s: float = 30) -> dict:
    """The ranks of a gloo group over `store`, one per key of `keys`, each proving with its key:
    {rank: error or None}."""
    errors = {}

    def rank(r: int) -> None:
        try:
            group = _group(store, r, timeout_s, len(keys))
            prove_peers(group, r, len(keys), keys[r], "g", timeout_s)
            errors[r] = None
        except Exception as e:  # (reported to the test)
            errors[r] = e

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(len(keys))]
    [t.start() for t in threads]
    [t.join(120) for t in threads]
    return errors


@pytest.fixture
def loopback(monkeypatch):
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "lo")


def test_ranks_with_the_key_pass_and_one_without_it_is_named(loopback):
    assert _all(dist.HashStore(), [KEY, KEY]) == {0: None, 1: None}
    assert _all(dist.HashStore(), [KEY, KEY, KEY]) == {0: None, 1: None, 2: None}
    errors = _all(dist.HashStore(), [KEY, b"x" * 32])
    assert all(isinstance(e, StrangerInGroup) for e in errors.values()), errors
    assert "connection of rank 0 to rank 1 answered the check of the run's key wrongly" in str(errors[0])
    assert "connection of rank 1 to rank 0 answered the check of the run's key wrongly" in str(errors[1])
    errors = _all(dist.HashStore(), [KEY, KEY, b"x" * 32])  # (the others' pair checks out)
    assert all(isinstance(e, StrangerInGroup) for e in errors.values()), errors
    assert "connection of rank 0 to rank 2 answered" in str(errors[0])
    assert "connection of rank 1 to rank 2 answered" in str(errors[1])


def test_an_answer_binds_the_group_and_both_ranks():
    from toolkit.transport.peers import answer

    nonce = bytes(range(32))
    base = answer(KEY, "g", 1, 0, nonce)
    assert len({base, answer(KEY, "h", 1, 0, nonce), answer(KEY, "g", 0, 1, nonce),
                answer(b"y" * 32, "g", 1, 0, nonce), answer(KEY, "g", 1, 0, bytes(32))}) == 5


def _listening_port(value: bytes) -> int:
    """The port of rank 0's gloo listener in what it published on the store (a sockaddr_in on loopback)."""
    found = re.search(rb"\x02\x00(..)\x7f\x00\x00\x01", value, re.S)
    assert found, value.hex()
    return struct.unpack(">H", found.group(1))[0]


PREAMBLE = struct.Struct("<6Q")  # gloo's tcp message header: nbytes, opcode, slot, offset, length, roffset
SEND_UNBOUND, SEND_READY, RECV_READY = 1, 2, 3


def _stranger(sockets: list[socket.socket], until: threading.Thread, leave_after: int | None) -> bytes:
    """Speak gloo's pair protocol as the peer would, taking what is sent, sending nothing: say "ready" to
    each message announced and keep its bytes, until the thread `until` ends and its last bytes are read (at
    most 120 s), or until `leave_after` bytes came (then leave: it cannot answer). Every payload received."""
    buffers = {s: b"" for s in sockets}
    payload = b""
    deadline = time.monotonic() + 120
    while buffers and time.monotonic() < deadline:
        if leave_after is not None and len(payload) >= leave_after:
            break
        ended = not until.is_alive()  # (what it sent last may still be unread here: read on until 1 s is quiet)
        ready, _, _ = select.select(list(buffers), [], [], 1.0 if ended else 0.1)
        if ended and not ready:
            break
        for s in ready:
            chunk = s.recv(65536)
            if not chunk:
                del buffers[s]
                continue
            data = buffers[s] + chunk
            while len(data) >= PREAMBLE.size:
                nbytes, opcode, slot, offset, length, roffset = PREAMBLE.unpack_from(data)
                size = PREAMBLE.size + (length if opcode == SEND_UNBOUND else 0)
                if len(data) < size:
                    break
                if opcode == SEND_READY:
                    s.sendall(PREAMBLE.pack(PREAMBLE.size, RECV_READY, slot, 0, length, 0))
                payload += data[PREAMBLE.size:size]
                data = data[size:]
            buffers[s] = data
    for s in sockets:  # (gone: a rank still waiting on it fails at once)
        s.close()
    return payload


def _hijack_try(index: int, prove: bool) -> tuple[bytes, dict]:
    """Rank 0 forms its group first; a stranger (no key, no store) connects to its listener with the
    sequence numbers a peer would give, then rank 1 forms the group. Where rank 0 listens for the pair (its
    address sorts lower: about every other try), it takes the stranger's connection. Rank 0 then proves the
    peers (with `prove`) and broadcasts a marker. (what the stranger received, {rank: error or None})"""
    store = dist.PrefixStore(f"try{index}", dist.HashStore())
    errors, groups = {}, {}

    def rank(r: int) -> None:
        try:
            groups[r] = group = _group(store, r, 30)
            if prove:
                prove_peers(group, r, 2, KEY, "g", 30)
            group.broadcast(torch.full((8,), 1234.5) if r == 0 else torch.zeros(8), 0).wait(
                datetime.timedelta(seconds=30))
            errors[r] = None
        except Exception as e:  # (reported to the test, without the frames that hold the group)
            errors[r] = e
            while e is not None:
                e.__traceback__, e = None, e.__cause__ or e.__context__

    first = threading.Thread(target=rank, args=(0,))
    first.start()
    store.wait(["0/0"], datetime.timedelta(seconds=60))
    port = _listening_port(store.get("0/0"))
    strangers = []
    for seq in range(4):
        s = socket.create_connection(("127.0.0.1", port), timeout=10)
        s.sendall(struct.pack("<Q", seq))
        strangers.append(s)
    second = threading.Thread(target=rank, args=(1,))
    second.start()
    received = _stranger(strangers, first, leave_after=32 if prove else None)
    first.join(120)
    if received:  # (rank 0's listener closes with its group: rank 1's unread connection ends at once)
        groups.pop(0, None)
    second.join(120)  # (else rank 0's group stays until rank 1 has taken what it sent)
    return received, errors


def test_a_stranger_that_takes_a_ranks_place_is_refused_before_anything_is_sent(loopback):
    """Without the check the stranger receives rank 0's broadcast (the marker's bytes); with it, rank 0 is
    refused at the check, naming the rank, and the stranger gets only the check's 32 random bytes."""
    marker = struct.pack("<f", 1234.5) * 8
    seen = {False: 0, True: 0}
    for index in range(40):
        prove = seen[False] > 0
        received, errors = _hijack_try(index, prove)
        if not received:
            assert errors == {0: None, 1: None}, errors  # (rank 1 reached rank 0 first: nothing changed)
            continue
        seen[prove] += 1
        if not prove:
            assert received == marker  # the hole: rank 0's broadcast went to the stranger
            continue
        assert len(received) == 32 and marker not in received  # the challenge, nothing else
        assert isinstance(errors[0], StrangerInGroup), errors
        assert "rank 1 did not answer the check of the run's key over its connection to rank 0" in str(errors[0])
        assert isinstance(errors[1], StrangerInGroup), errors  # (its connection went unread)
        break
    assert seen == {False: 1, True: 1}, seen
