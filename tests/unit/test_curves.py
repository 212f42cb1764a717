"""TensorBoard curves: written by the driver, which loads no torch for them."""

from __future__ import annotations

import subprocess
import sys
import time

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


def test_a_resume_writes_again_the_step_a_killed_driver_had_not_written_to_its_curves(tmp_path):
    """A driver writes a step's record to metrics.jsonl, then its curves; tensorboardX writes them from a queue
    in a thread and its flush() does not wait, so a driver killed then (SIGKILL, a lost node) left the step in
    metrics.jsonl and not in TensorBoard, and the resume's purge started at its own first step: that step's
    curves were lost for good. The resume now writes again the newest step metrics.jsonl keeps."""
    from toolkit.launch.curves import Curves
    from toolkit.launch.rundir import RunDir

    run = RunDir(tmp_path)
    records = [{"step": s, "time": 1.0e9 + s, "loss": 0.5 - 0.1 * s, "train_s": 1.0 + s} for s in range(4)]
    first = Curves(tmp_path)
    for r in records[:2]:
        run.append_metrics(r)
        first.add(r)
    first.close()
    run.append_metrics(records[2])  # (killed here: in metrics.jsonl, not yet in its curves)
    time.sleep(1.1)  # (an event file is named by the second it is opened in: a resume's comes seconds later)
    second = Curves(tmp_path)  # (the resume: from step 3, as metrics.jsonl has steps 0-2)
    run.append_metrics(records[3])
    second.add(records[3])
    second.close()
    scalars = tensorboard_scalars(tmp_path / "tensorboard")
    assert sorted(scalars) == ["loss", "time/train_s"]
    assert sorted(scalars["loss"]) == [1, 2, 3, 4], scalars
    for r in records:
        assert abs(scalars["loss"][r["step"] + 1] - r["loss"]) < 1e-6
        assert abs(scalars["time/train_s"][r["step"] + 1] - r["train_s"]) < 1e-6
