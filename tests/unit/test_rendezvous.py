"""The rendezvous store: torch.distributed's store calls, answered only to the run's own processes."""

from __future__ import annotations

import datetime
import gc
import threading
import time

import pytest
import torch
import torch.distributed as dist

from toolkit.transport.rendezvous import StoreError, connect_store, serve_store
from toolkit.transport.sockets import recv_valid
from toolkit.transport.wire import new_secret

KEY = new_secret()
STRANGER_ERRORS = (dist.DistError, TimeoutError)  # (TCPStore's "timed out" and "connection reset" kinds)


@pytest.fixture
def store():
    rank0 = serve_store("127.0.0.1", 30, KEY)
    yield rank0
    rank0.close()


def test_the_calls_torch_makes(store):
    other = connect_store("127.0.0.1", store.port, 30, KEY)
    try:
        store.set("a", b"\x00\x01")
        assert other.get("a") == b"\x00\x01"
        assert other.add("n", 2) == 2 and store.add("n", 3) == 5 and other.get("n") == b"5"
        assert other.check(["a", "n"]) and not other.check(["a", "absent"])
        assert store.compare_set("c", "", "first") == b"first"  # (absent, and `expected` empty: set)
        assert store.compare_set("c", "wrong", "second") == b"first"
        assert store.compare_set("c", "first", "second") == b"second"
        assert other.num_keys() == 3
        assert other.delete_key("c") and not other.delete_key("c") and store.num_keys() == 2
        prefixed = dist.PrefixStore("group", other)
        prefixed.set("k", "v")
        assert store.get("group/k") == b"v"
    finally:
        other.close()


def test_torchs_own_side_reaches_every_call(store):
    """torch's C++ side (here a PrefixStore's) calls some methods by their C++ names (getNumKeys,
    deleteKey) and asks for clones, which must outlive the Python reference torch never keeps."""
    prefixed = dist.PrefixStore("p", store)
    prefixed.set("a", b"1")
    assert prefixed.get("a") == b"1" and prefixed.add("n", 4) == 4 and prefixed.check(["a", "n"])
    prefixed.wait(["a"])
    assert prefixed.compare_set("c", b"", b"x") == b"x"
    prefixed.multi_set(["m1", "m2"], [b"1", b"2"])
    assert prefixed.multi_get(["m1", "m2"]) == [b"1", b"2"]
    assert prefixed.num_keys() == store.num_keys() == 5
    assert prefixed.delete_key("c") and not prefixed.delete_key("c")
    clone = prefixed.clone()
    gc.collect()
    clone.set("from-clone", b"2")
    assert store.get("p/from-clone") == b"2"


def test_a_closed_client_fails_by_name(store):
    """A group whose store client was closed (an engine's group of a trainer gone) fails by name."""
    client = connect_store("127.0.0.1", store.port, 30, KEY)
    prefixed = dist.PrefixStore("q", client)
    prefixed.set("a", b"1")
    client.close()
    with pytest.raises(RuntimeError, match="rendezvous store at tcp://127.0.0.1:[0-9]+ is closed"):
        prefixed.get("a")
    assert store.get("q/a") == b"1"


def test_a_malformed_request_is_answered_and_the_store_serves_on(store):
    """A client with the key but a bug (or a buggy version): every odd request gets an error reply naming
    what was wrong, and the store's thread goes on serving."""
    client = connect_store("127.0.0.1", store.port, 30, KEY)
    try:
        for op, meta, error in [
            ("set", {"key": ["x"], "value": b"1"}, "key must be a string"),
            ("set", {"key": "x", "value": "text"}, "value must be bytes"),
            ("get", {"key": {"a": 1}}, "key must be a string"),
            ("wait", {"keys": [["unhashable"]]}, "keys must be a list of strings"),
            ("add", {"key": "n", "n": 2**63}, "n must be a 64-bit integer"),
            ("check", {"keys": "ab"}, "keys must be a list of strings"),
            ("explode", {}, "unknown operation 'explode'"),
        ]:
            with pytest.raises(StoreError, match=f"rendezvous store: {op}: BadRequest: {error}"):
                client._call(op, **meta)
        client.add("n", 2**63 - 1)
        with pytest.raises(StoreError, match="n would leave 64 bits"):
            client.add("n", 1)
        assert client.get("n") == str(2**63 - 1).encode()  # (unchanged by the refused add)
        for meta in ({"id": 2**64 - 1}, {"id": 1.5}, {"timeout_s": float("inf")}):  # (past what the client sends)
            request = {"id": 9, "key": "n", "timeout_s": 1.0, **meta}
            client._socket.send_multipart(client._codec.encode("get", request, to="store"))
            reply = recv_valid(client._socket, client._codec, client.rejected, 10)
            assert reply is not None and "error" in reply.meta, meta
        assert store.server.is_alive() and client.get("n") == str(2**63 - 1).encode()
    finally:
        client.close()


def test_get_and_wait_are_answered_when_the_key_comes(store):
    other = connect_store("127.0.0.1", store.port, 30, KEY)
    started = time.monotonic()
    setter = threading.Timer(0.3, lambda: store.set("late", b"here"))
    setter.start()
    try:
        assert other.get("late") == b"here"
        assert time.monotonic() - started >= 0.29  # (answered when the key came, not before)
        other.wait(["late"])
    finally:
        setter.join(30)  # (its own reply may come after ours: the fixture must not close `store` before it)
        other.close()


def test_a_missing_key_times_out_by_name(store):
    store.set_timeout(datetime.timedelta(seconds=0.5))
    with pytest.raises(StoreError, match=r"did not answer get never within 0.5 s"):
        store.get("never")
    with pytest.raises(RuntimeError, match=r"wait \['x', 'y'\]"):
        store.wait(["x", "y"], datetime.timedelta(seconds=0.3))
    store.set_timeout(datetime.timedelta(seconds=30))
    store.set("after", b"1")  # (the store still answers after a timeout)
    assert store.get("after") == b"1"


def test_a_late_answer_is_not_taken_for_the_next(store):
    """A reply to an earlier request (here one sent raw, not awaited) does not answer the next call."""
    client = connect_store("127.0.0.1", store.port, 30, KEY)
    try:
        client._socket.send_multipart(client._codec.encode("get", {"id": 10**6, "key": "k", "timeout_s": 30.0},
                                                           to="store"))
        client.set("k", b"v")  # (its reply comes first, then the earlier get's)
        assert client.num_keys() == 1  # (not b"v", the get's late answer)
    finally:
        client.close()


def test_a_request_over_the_limit_fails_at_once_by_name(store):
    with pytest.raises(StoreError, match=r"set big: a request of [0-9]+ bytes, over the store's limit of 1048576"):
        store.set("big", b"x" * 2**20)
    store.set("small", b"x" * 1000)
    assert store.num_keys() == 1


def test_close_ends_clones_and_the_server(store):
    clone = store.clone()
    assert clone.num_keys() == 0
    store.close()
    with pytest.raises(StoreError, match="is closed"):
        clone.num_keys()
    assert not store.server.is_alive()
    store.close()  # (twice is fine: the fixture does it again)


def test_a_stranger_can_neither_read_nor_write(store):
    store.set("address", b"rank 0's")
    with pytest.raises(StoreError, match="refused this process's key"):
        connect_store("127.0.0.1", store.port, 1, new_secret())
    # said as soon as the server refuses, not after the call's whole timeout (a generator's: 1800 s)
    started = time.monotonic()
    with pytest.raises(StoreError, match="store at .* refused this process's key: it belongs to another run"):
        connect_store("127.0.0.1", store.port, 600, new_secret())
    assert time.monotonic() - started < 60
    assert store.server.gate.refused["unauthenticated"] >= 1
    # torch's own TCPStore client (what a stranger would use against a TCPStore) gets nowhere either.
    with pytest.raises(STRANGER_ERRORS):
        stranger = dist.TCPStore("127.0.0.1", store.port, is_master=False, timeout=datetime.timedelta(seconds=1))
        stranger.set("address", b"the stranger's")
    assert store.get("address") == b"rank 0's" and store.num_keys() == 1


def test_a_gloo_group_forms_over_it(store):
    """Two ranks in threads of one process (gloo's constructor waits for its peers)."""
    out, clients = {}, []

    def rank(r: int) -> None:
        s = store if r == 0 else connect_store("127.0.0.1", store.port, 30, KEY)
        clients.append(s)
        group = dist.ProcessGroupGloo(dist.PrefixStore("g", s), r, 2, datetime.timedelta(seconds=30))
        t = torch.full((4,), float(r + 1))
        group.allreduce([t]).wait()
        out[r] = t.tolist()

    threads = [threading.Thread(target=rank, args=(r,), daemon=True) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    for client in clients:
        if client is not store:
            client.close()
    assert out == {0: [3.0] * 4, 1: [3.0] * 4}
