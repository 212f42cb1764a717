"""The test hook that holds a run's process at a named moment (toolkit/hold.py)."""

import os
import threading
import time

from toolkit import hold as hook


def test_a_process_holds_at_the_nth_moment_writes_its_pid_and_goes_on_once_the_file_is_gone(tmp_path, monkeypatch):
    monkeypatch.setenv(hook.ENV, "scoring,training@2")
    monkeypatch.setattr(hook, "_reached", {})
    hook.hold("training", tmp_path)  # the first time: not held
    assert hook.held_pid(tmp_path, "training@2") is None and not hook.held_file(tmp_path, "training").exists()
    held = threading.Thread(target=hook.hold, args=("training", tmp_path), daemon=True)
    held.start()
    deadline = time.monotonic() + 30
    while hook.held_pid(tmp_path, "training@2") is None:
        assert time.monotonic() < deadline, "the second time never held"
        time.sleep(0.01)
    assert hook.held_pid(tmp_path, "training") == os.getpid()
    held.join(0.3)
    assert held.is_alive()  # waits as long as the file is there
    hook.held_file(tmp_path, "training").unlink()
    held.join(10)
    assert not held.is_alive()
    hook.hold("training", tmp_path)  # the third time: not held
    hook.hold("generating", tmp_path)  # a moment not named
    assert not list(tmp_path.iterdir())


def test_a_held_file_still_empty_has_no_pid_yet(tmp_path):
    hook.held_file(tmp_path, "syncing").touch()
    assert hook.held_pid(tmp_path, "syncing@3") is None
    hook.held_file(tmp_path, "syncing").write_text("4321\n")
    assert hook.held_pid(tmp_path, "syncing@3") == 4321
