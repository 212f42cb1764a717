"""Progress: plain lines with the time left where output is not a terminal, a live tqdm line on one."""

from __future__ import annotations

import io
import re

from toolkit.progress import Progress, duration, elapsed


def test_plain_lines_end_with_the_time_left_from_the_measured_step_time(monkeypatch):
    clock = iter([100.0, 102.0, 104.0, 110.0])
    monkeypatch.setattr("toolkit.progress.time.monotonic", lambda: next(clock))
    out = io.StringIO()
    p = Progress(out, live=False)
    for done in (1, 2, 3, 4):
        p.step(f"step {done}/4", done, 4, "reward 0.1")
    lines = out.getvalue().splitlines()
    # no estimate from one step; then (102-100)/1 * 2 steps left, (104-100)/2 * 1; none after the last
    assert lines == ["step 1/4", "step 2/4  eta 4s", "step 3/4  eta 2s", "step 4/4"]


def test_the_time_left_forgets_the_steps_before_a_worker_was_started_again(monkeypatch):
    clock = iter([100.0, 102.0, 160.0, 162.0, 164.0])  # (step 3 waited 58 s for a worker started again)
    monkeypatch.setattr("toolkit.progress.time.monotonic", lambda: next(clock))
    out = io.StringIO()
    p = Progress(out, live=False)
    for done in (1, 2, 3, 4, 5):
        if done == 3:
            p.restart_clock()
        p.step(f"step {done}/9", done, 9, "reward 0.1")
    # after the restart: no estimate from one step, then 2 s a step (not (164-100)/4 = 16 s)
    assert out.getvalue().splitlines()[2:] == ["step 3/9", "step 4/9  eta 10s", "step 5/9  eta 8s"]


def test_a_terminal_gets_one_live_line_below_the_step_lines():
    out = io.StringIO()
    p = Progress(out, live=True)
    p.step("step 1/5  reward 0.100", 1, 5, "reward 0.100")
    p.step("step 2/5  reward 0.200", 2, 5, "reward 0.200")
    p.advance(3, 5, "reward 0.300")  # (from a status file: no line of its own)
    p.close()
    text = out.getvalue()
    assert "step 1/5  reward 0.100\n" in text and "step 2/5  reward 0.200\n" in text
    assert "step 3/5" not in text
    assert re.search(r"3/5 \|.*\| reward 0\.300  eta \d+s", text), text


def test_durations_read_as_a_person_writes_them():
    assert [duration(s) for s in (5, 65, 3725)] == ["5s", "1m05s", "1h02m"]
    # (a run's closing line: seconds, and from an hour on the hours too, where 93784.2 s alone told little)
    assert [elapsed(s) for s in (42.44, 3599.9, 93784.2)] == ["42.4 s", "3599.9 s", "93784.2 s (26h03m)"]


def test_the_closing_line_covers_the_steps_of_every_attempt_after_a_trainer_restart():
    """run_attempts starts every worker again (a new driver) when the trainer is lost; the closing line
    took the last driver's steps alone, so after a restart from step 2's checkpoint its "first 5 steps
    run now" began at step 3. The steps of every attempt count, a step trained again once (its last).
    The drivers here are stand-ins that only hold what a driver's run ran."""
    from types import SimpleNamespace

    from toolkit.errors import TrainerLost
    from toolkit.launch.supervisor import run_attempts

    class StandIn:
        def __init__(self, steps, lost):
            self.steps, self.lost, self.preempt, self.records = steps, lost, False, []

        def run(self):
            for step in self.steps:
                self.records.append({"step": step, "reward_mean": float(step), "attempt": len(made)})
            if self.lost:
                raise TrainerLost("trainer lost")
            return self.records

    attempts = iter([StandIn([0, 1, 2, 3], True), StandIn([3, 4, 5], False)])  # (from step 2's checkpoint)
    made = []
    driver, records = run_attempts(SimpleNamespace(run=SimpleNamespace(max_trainer_restarts=2)),
                                   lambda: made.append(1) or next(attempts), echo=lambda line: None)
    assert driver.steps == [3, 4, 5]
    assert [(r["step"], r["attempt"]) for r in records] == [(0, 1), (1, 1), (2, 1), (3, 2), (4, 2), (5, 2)]


def test_the_time_left_forgets_the_steps_before_a_trainer_restart(monkeypatch):
    """run_attempts starts every worker again from the last checkpoint when the trainer is lost: the new
    workers' start-up (here 60 s) held the next step, and it was taken for the pace of the steps left: steps
    of under a second said eta 3m29s, then 1m52s, 1m03s... after a restart of 70 s (tiny-grpo, 8 steps, lag 2).
    The time left restarts its clock, as for a generator started again. The drivers are stand-ins that show
    their steps."""
    from types import SimpleNamespace

    from toolkit.errors import TrainerLost
    from toolkit.launch.supervisor import run_attempts

    clock = iter([100.0, 102.0, 104.0, 164.0, 166.0, 168.0])  # (steps 1-3, then 4-6 after the restart)
    monkeypatch.setattr("toolkit.progress.time.monotonic", lambda: next(clock))
    out = io.StringIO()
    progress = Progress(out, live=False)

    class StandIn:
        def __init__(self, steps, lost):
            self.steps, self.lost, self.preempt, self.records = steps, lost, False, []

        def run(self):
            for done in self.steps:
                progress.step(f"step {done}/9", done, 9, "reward 0.1")
            if self.lost:
                raise TrainerLost("trainer lost")

    attempts = iter([StandIn([1, 2, 3], True), StandIn([4, 5, 6], False)])
    run_attempts(SimpleNamespace(run=SimpleNamespace(max_trainer_restarts=2)), lambda: next(attempts), progress)
    lines = [line for line in out.getvalue().splitlines() if line.startswith("step")]
    # after the restart: no estimate from one step, then 2 s a step (not (166-100)/4 = 16.5 s a step)
    assert lines[3:] == ["step 4/9", "step 5/9  eta 8s", "step 6/9  eta 6s"], lines
