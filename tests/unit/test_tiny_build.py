"""Two processes that build the same tiny model set at once (two test workers, two jobs) build it once."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from toolkit import tiny
from toolkit.flock import flock_held


def _other_builder_holds(out: Path):
    """The flock another process building `out` would hold."""
    return flock_held(out.parent, 5, lambda: AssertionError("lock not free"))


def test_a_second_builder_waits_for_the_first_and_takes_its_build(tmp_path):
    out = tmp_path / "tiny-mistral"
    result = {}
    with _other_builder_holds(out):
        waiter = threading.Thread(target=lambda: result.update(path=tiny.build_family(out, "mistral")))
        waiter.start()
        waiter.join(1.0)
        assert waiter.is_alive(), "build_family did not wait for the builder holding the lock"
        # the first builder's result lands, as build_beside moves it in
        out.mkdir()
        (out / "BUILT").write_text(f"{tiny.LAYOUT_VERSION} mistral 0")
    waiter.join(60)
    assert not waiter.is_alive() and result["path"] == out
    assert [p.name for p in out.iterdir()] == ["BUILT"], "built a second time"
    assert [p.name for p in tmp_path.iterdir()] == ["tiny-mistral"], "something left beside it"


def test_a_builder_that_holds_the_lock_too_long_is_named(tmp_path, monkeypatch):
    out = tmp_path / "tiny"
    monkeypatch.setattr(tiny, "BUILD_WAIT_S", 0.5)
    with _other_builder_holds(out), pytest.raises(RuntimeError, match=r"another process to build .*fuser"):
        tiny.build_tiny(out)
    assert not out.exists()
