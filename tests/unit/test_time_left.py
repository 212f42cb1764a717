"""Before each step near a time limit, the driver asks whether another step, a checkpoint and the stop still
fit (`Supervisor._time_for_a_step`): a step that carried an in-run evaluation is not taken for a slow step,
and an evaluation out now counts toward the next one (the generators sample its prompts first)."""

from __future__ import annotations

import time

from tests.conftest import example, write_config
from toolkit.config import load_config
from toolkit.launch.driver import Driver


def _driver(tiny, tmp_path, left_s: float) -> Driver:
    """The real driver's estimate, with the state it keeps and nothing started: `left_s` seconds before the
    job's end, 18 held-out prompts evaluated greedily (64 samples a step)."""
    cfg = load_config(write_config(tmp_path, example("tiny-grpo.yaml", tiny, eval={"every_steps": 2},
                                                     data={"eval_fraction": 0.1}, slurm={"stop_margin_s": 10})))
    driver = Driver.__new__(Driver)
    driver.cfg, driver.history, driver.evaluating, driver.eval_prompts = cfg, [], {}, [None] * 18
    driver.end_time = time.time() + left_s
    driver.step = 2  # (the last step recorded)
    return driver


def test_a_step_that_carried_an_evaluation_is_not_taken_for_a_slow_step(tiny, tmp_path):
    ran = [{"step_s": 2.0}, {"step_s": 9.0, "eval_wall_s": 7.5}, {"step_s": 2.0, "checkpoint_s": 1.0}]
    # needs 2 s (the slowest of the last three steps, less the evaluation one carried) + 1 + 5 (a checkpoint)
    # + 10 (the margin) = 18 s
    assert _driver(tiny, tmp_path, 19.0)._time_for_a_step(ran)
    assert not _driver(tiny, tmp_path, 17.0)._time_for_a_step(ran)


def test_asynchronous_steps_already_out_count_toward_the_next_step(tiny, tmp_path):
    """With max_policy_lag 2 the prompts of two steps past the next are out, and the trainer trains those whose
    samples are in before it takes the checkpoint command: counted as one step (2 s) each, a time limit's
    checkpoint came too late for them."""
    ran = [{"step_s": 2.0}, {"step_s": 2.0, "checkpoint_s": 1.0}]
    driver = _driver(tiny, tmp_path, 19.0)
    assert driver._steps_out_beyond_the_next() == 0 and driver._time_for_a_step(ran)  # 2 + 1 + 5 + 10 = 18 s
    driver.cfg.rollout.max_policy_lag = 2
    assert driver._steps_out_beyond_the_next() == 2 and not driver._time_for_a_step(ran)  # 3 x 2 + 16 = 22 s
    driver.end_time = time.time() + 23.0
    assert driver._time_for_a_step(ran)
    driver.cfg.rollout.stale = "drop"  # (its prompts go out a step earlier)
    assert driver._steps_out_beyond_the_next() == 3 and not driver._time_for_a_step(ran)
    driver.step = driver.cfg.run.steps - 3  # (only one step is left past the next)
    assert driver._steps_out_beyond_the_next() == 1 and driver._time_for_a_step(ran)


def test_an_evaluation_out_now_counts_toward_the_next_step(tiny, tmp_path):
    ran = [{"step_s": 2.0, "generate_s": 1.0, "score_s": 0.6}, {"step_s": 9.0, "eval_wall_s": 7.5},
           {"step_s": 2.0}]
    driver = _driver(tiny, tmp_path, 19.0)
    assert driver._time_for_a_step(ran)  # 2 + 5 + 10 = 17 s
    driver.evaluating = {4: time.monotonic()}
    assert not driver._time_for_a_step(ran)  # + 7.5 s, the longest evaluation run: 24.5 s
    driver.end_time = time.time() + 25.0
    assert driver._time_for_a_step(ran)
    # before any evaluation ran: the last steps' generation and scoring, scaled to its 18 of a step's 64
    # samples: 1.6 x 18 / 64 = 0.45 s
    first = [{"step_s": 2.0, "generate_s": 1.0, "score_s": 0.6}]
    assert driver._evaluation_ahead_s(first) == 1.6 * 18 / 64


def test_evaluations_out_at_the_same_time_count_once_in_a_steps_evaluation_time():
    from toolkit.launch.driver import covered

    # the step started at 10; one evaluation went out before it (5..14), two overlapped (12..20, 13..18),
    # one was out later (25..27): 10..20 and 25..27
    assert covered([(12.0, 20.0), (5.0, 14.0), (13.0, 18.0), (25.0, 27.0)], 10.0) == 12.0
    assert covered([(1.0, 4.0)], 10.0) == 0.0 and covered([], 10.0) == 0.0


def test_a_stages_next_evaluation_counts_toward_its_next_step(tiny, tmp_path):
    """A supervised stage evaluates after every train.eval_every-th update and after the last, in the same
    step: its time was left out (step_s is the update alone), so a long evaluation ran into the time limit
    before the checkpoint."""
    from toolkit.launch.stage_driver import StageDriver

    stage = {"stage": "sft", "run": {"steps": 10}, "data": {"sources": [{"path": str(tiny / "pipeline.jsonl")}]},
             "model": {"base": str(tiny / "model")}, "train": {"eval_every": 4, "batch_size": 32},
             "slurm": {"stop_margin_s": 10}}
    driver = StageDriver.__new__(StageDriver)
    driver.cfg, driver.history, driver.steps = load_config(write_config(tmp_path, stage, "sft.yaml")), [], 10
    driver.trainer_ready = {"eval_rows": 48}
    driver.end_time = time.time() + 19.0
    ran = [{"step_s": 2.0}, {"step_s": 2.0, "eval_s": 6.0}, {"step_s": 2.0, "checkpoint_s": 1.0}]
    driver.step = 5  # (step 6 ran; step 7 has no evaluation): 2 + 1 + 5 + 10 = 18 s
    assert driver._evaluation_ahead_s(ran) == 0.0 and driver._time_for_a_step(ran)
    driver.step = 6  # step 8 evaluates: + 6 s, the longest evaluation so far
    assert driver._evaluation_ahead_s(ran) == 6.0 and not driver._time_for_a_step(ran)
    driver.step = 8  # step 10, the last, evaluates too
    assert driver._evaluation_ahead_s(ran) == 6.0
    # before any evaluation: the update's time scaled to the eval rows, a forward pass a third of an update
    assert driver._evaluation_ahead_s(ran[:1]) == 2.0 * 48 / 32 / 3
    driver.trainer_ready = {"eval_rows": 0}
    assert driver._evaluation_ahead_s(ran) == 0.0
