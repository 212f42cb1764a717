"""The rendezvous store: torch.distributed's store calls, answered only to the run's own processes."""

from __future__ import annotations

import datetime
import threading
import time

import pytest
import torch
import torch.distributed as dist

from toolkit.transport.rendezvous import StoreError, connect_store, serve_store
from toolkit.transport.wire import new_secret

KEY = new_secret()


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


def test_get_and_wait_are_answered_when_the_key_comes(store):
    other = connect_store("127.0.0.1", store.port, 30, KEY)
    threading.Timer(0.3, lambda: store.set("late", b"here")).start()
    try:
        started = time.monotonic()
        assert other.get("late") == b"here"
        assert time.monotonic() - started >= 0.25
        other.wait(["late"])
    finally:
        other.close()


def test_a_missing_key_times_out_by_name(store):
    store.set_timeout(datetime.timedelta(seconds=0.5))
    with pytest.raises(StoreError, match=r"did not answer get never within 0.5 s"):
        store.get("never")
    with pytest.raises(RuntimeError, match=r"wait \['x', 'y'\]"):
        store.wait(["x", "y"], datetime.timedelta(seconds=0.3))
    store.set("after", b"1")  # (the store still answers after a timeout: late answers are skipped)
    assert store.get("after") == b"1"


def test_a_stranger_can_neither_read_nor_write(store):
    store.set("address", b"rank 0's")
    with pytest.raises(StoreError, match="refused this process's key"):
        connect_store("127.0.0.1", store.port, 1, new_secret())
    assert store.server.gate.refused["unauthenticated"] >= 1
    # torch's own TCPStore client (what a stranger would use against a TCPStore) gets nowhere either.
    with pytest.raises(Exception):
        stranger = dist.TCPStore("127.0.0.1", store.port, is_master=False, timeout=datetime.timedelta(seconds=1))
        stranger.set("address", b"the stranger's")
    assert store.get("address") == b"rank 0's" and store.num_keys() == 1


def test_a_gloo_group_forms_over_it(store):
    """Two ranks in threads of one process (gloo's constructor waits for its peers)."""
    out = {}

    def rank(r: int) -> None:
        s = store if r == 0 else connect_store("127.0.0.1", store.port, 30, KEY)
        group = dist.ProcessGroupGloo(dist.PrefixStore("g", s), r, 2, datetime.timedelta(seconds=30))
        t = torch.full((4,), float(r + 1))
        group.allreduce([t]).wait()
        out[r] = t.tolist()

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert out == {0: [3.0] * 4, 1: [3.0] * 4}
