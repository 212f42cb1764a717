"""TensorBoard curves: written by the driver, which loads no torch for them."""

from __future__ import annotations

import subprocess
import sys

from tests.conftest import REPO, tensorboard_scalars

WRITE = """
import sys
from pathlib import Path
from toolkit.launch.curves import Curves
curves = Curves(Path(sys.argv[1]))
curves.open()
for step in (1, 2):
    curves.add({"step": step, "time": 1.0e9 + step, "reward": 0.25 * step, "train_s": 1.5, "tokens_per_s": 90.0,
                 "done": True})
curves.close()
print(sorted(m for m in sys.modules if m == "torch" or m.startswith("torch.")))
"""


def test_the_driver_writes_curves_without_loading_torch(tmp_path):
    out = subprocess.run([sys.executable, "-c", WRITE, str(tmp_path)], cwd=REPO, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"  # (torch alone takes about 250 MB in a process)
    scalars = tensorboard_scalars(tmp_path / "tensorboard")
    # (at the number of steps trained: metrics.jsonl's step 1 is the second, `step 2/N` in the progress line)
    assert scalars == {"reward": {2: 0.25, 3: 0.5}, "time/train_s": {2: 1.5, 3: 1.5},
                       "tokens_per_s": {2: 90.0, 3: 90.0}}  # (a rate, not a time)


def test_a_wandb_run_that_does_not_finish_holds_the_driver_a_bounded_time(tmp_path, caplog):
    """`finish()` of an online W&B run waits for its upload without a bound: a stalled network held the
    driver at its exit, and before its requeue, past the job's time limit. (A stand-in for the W&B run:
    its `finish` is what is bounded.)"""
    import threading
    import time
    from types import SimpleNamespace

    from toolkit.launch.curves import _finished

    stalled = threading.Event()
    for finish, expected in [(lambda: None, True), (lambda: stalled.wait(), False),
                             (lambda: (_ for _ in ()).throw(ConnectionError("offline")), False)]:
        start = time.monotonic()
        assert _finished(SimpleNamespace(finish=finish), timeout_s=0.5) is expected
        assert time.monotonic() - start < 30
    stalled.set()
    assert "still busy after 0 s" in caplog.text and "ConnectionError('offline')" in caplog.text
