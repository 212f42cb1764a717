"""Experience checkpoints and exact resume, with real processes.

A deterministic run of 2N = 6 steps (checkpoint every 2) is the baseline. The same run is killed with
SIGKILL (its whole process group and every worker's) once N + 1 = 4 experience batches are committed;
copies of that killed run are then resumed as they are, with a corrupted last experience file, and with a
damaged checkpoint. Each must end with the baseline's weights and per-step rewards; so must the same run
when one of its generator or scorer workers dies or hangs and is started again alone.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import h5py
import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from tests.conftest import (REPO, alive, assert_no_workers_left, cli, exact_grpo, example, killed_at_exit, left_in,
                            run_and_kill, start_held, tensorboard_scalars, wandb_history, write_config)
from tests.conftest import experience_commits as commits
from toolkit.store import experience

pytestmark = pytest.mark.integration
STEPS, KILL_AFTER = 6, 4  # (the steps of exact_grpo's run)


@pytest.fixture(scope="module")
def baseline(exact_run) -> Path:
    return exact_run


@pytest.fixture(scope="module")
def killed(tiny, tmp_path_factory) -> Path:
    """A run killed with SIGKILL in the weight sync after its KILL_AFTER-th step (never resumed): that
    step's experience is committed and trained on, the checkpoint after it not written yet."""
    tmp = tmp_path_factory.mktemp("killed")
    run_dir = tmp / "run"
    run_and_kill(exact_grpo(tiny, tmp), run_dir, hold=f"syncing@{KILL_AFTER}")
    assert commits(run_dir) == KILL_AFTER
    return run_dir


def resumed_copy(killed: Path, tmp_path: Path, damage=None) -> tuple[Path, subprocess.CompletedProcess]:
    run_dir = tmp_path / "run"
    shutil.copytree(killed, run_dir)
    if damage:
        damage(run_dir)
    result = cli("resume", run_dir, preexec_fn=lambda: os.umask(0o022))  # (a user's usual umask)
    assert result.returncode == 0, result.stdout + result.stderr
    return run_dir, result


def final_weights(run_dir: Path) -> dict[str, torch.Tensor]:
    return load_file(run_dir / "checkpoints" / f"step-{STEPS:06d}" / "hf" / "model.safetensors")


def assert_same_as_baseline(run_dir: Path, baseline: Path) -> float:
    a, b = final_weights(baseline), final_weights(run_dir)
    assert set(a) == set(b)
    diff = max((a[k] - b[k]).abs().max().item() for k in a)
    assert diff <= 1e-6, f"max abs difference of the actor weights {diff:.3g}"
    # the EMA of the actor too: saved with each checkpoint, folded in again for the replayed steps
    ema = [load_file(d / "export-ema" / "model.safetensors") for d in (baseline, run_dir)]
    ema_diff = max((ema[0][k] - ema[1][k]).abs().max().item() for k in ema[0])
    assert ema_diff <= 1e-6, f"max abs difference of the EMA weights {ema_diff:.3g}"
    rewards = [[r["reward_mean"] for r in map(json.loads, (d / "metrics.jsonl").read_text().splitlines())]
               for d in (baseline, run_dir)]
    assert len(rewards[0]) == STEPS and rewards[0] == rewards[1]
    for step in range(STEPS):  # the committed batches themselves hold the same samples and rewards
        x, y = (experience.read(d / "experience" / experience.file_name(step)) for d in (baseline, run_dir))
        assert np.array_equal(x["samples"]["response_tokens"], y["samples"]["response_tokens"])
        assert np.array_equal(x["samples"]["reward_total"], y["samples"]["reward_total"])
    return diff


def cut_metrics_line(run_dir: Path) -> None:
    """What a crash may leave at the end of metrics.jsonl: a line cut short, then bytes that are not even UTF-8
    (the resume ended in a UnicodeDecodeError there, where `status` and `report` skip such a line)."""
    with open(run_dir / "metrics.jsonl", "ab") as f:
        f.write(b'{"step": 99, "loss": 0.\xff\xfe\x00')


def test_resume_after_sigkill_ends_with_the_same_weights(baseline, killed, tmp_path):
    run_dir, result = resumed_copy(killed, tmp_path, damage=cut_metrics_line)
    n = commits(killed)
    assert (f"resuming after step {n}: checkpoint checkpoints/step-000002 (policy_version 2), then training again "
            f"on {n - 2} committed experience batch(es)") in result.stdout
    diff = assert_same_as_baseline(run_dir, baseline)
    print(f"max abs weight difference after resume: {diff:.3g}")
    # (b) from the HDF5 records: every step committed exactly once, no sample twice, none lost
    records = [r for r in map(json.loads, (run_dir / "manifest.jsonl").read_text().splitlines())]
    assert sorted(r["step"] for r in records if r["kind"] == "experience") == list(range(STEPS))
    resume = [r for r in records if r["kind"] == "resume"]
    assert len(resume) == 1 and resume[0]["replay"] == [f"experience/{experience.file_name(s)}" for s in range(2, n)]
    # the replay passed policy_version 4, due a checkpoint (every 2 steps): it ends with that checkpoint,
    # before any new step is committed, so that a second failure would not train on the same batches again
    after = records[records.index(resume[0]) + 1:]
    assert after[0]["kind"] == "checkpoint" and after[0]["step"] == n == 4, after[0]
    assert any(f"replayed step   {n}/{STEPS}  v{n}  " in line and "  ckpt " in line
               for line in result.stdout.splitlines()), result.stdout
    for step in range(STEPS):
        rec = experience.read(run_dir / "experience" / experience.file_name(step))
        s = rec["samples"]
        pairs = set(zip(s["group_index"].tolist(), s["sample_index"].tolist()))
        assert len(pairs) == len(s["prompt_ids"]) == 64
        assert set(s["policy_version"].tolist()) == {step}  # generated by the weights of that step
        base = experience.read(baseline / "experience" / experience.file_name(step))["samples"]
        assert np.array_equal(s["prompt_ids"], base["prompt_ids"])
    state = json.loads((run_dir / "checkpoints" / f"step-{STEPS:06d}" / "trainer_state.json").read_text())
    assert state["policy_version"] == STEPS  # one update per committed batch: none trained twice
    # (c) the TensorBoard curves go on across the resume, every step once, as in metrics.jsonl
    curves = tensorboard_scalars(run_dir / "tensorboard")
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == list(range(STEPS))  # (the cut line gone, every step once)
    assert len(list((run_dir / "tensorboard").glob("events.out.tfevents.*"))) == 2  # one file per attempt
    for name, tb_tag in (("reward_mean", "reward_mean"), ("loss", "loss"), ("train_s", "time/train_s"),
                         ("reward/digit_ratio", "reward/digit_ratio")):
        assert curves[tb_tag] == pytest.approx({m["step"] + 1: m[name] for m in metrics}, rel=1e-6), tb_tag
    # (d) and so do the W&B curves (offline), one W&B run continued: W&B holds what it is sent until its
    # run finishes, so the killed attempt's steps are lost there, and the resume sends them again first
    attempts = wandb_history(run_dir)
    assert len(attempts) == 2 and len({p.name.rsplit("-", 1)[1] for p in (run_dir / "wandb").glob("offline-run-*")}) == 1
    assert [row["_step"] for row in attempts[-1]] == list(range(1, STEPS + 1))  # (at the steps trained)
    for row in (row for rows in attempts for row in rows):
        m = metrics[row["_step"] - 1]
        assert row["reward_mean"] == pytest.approx(m["reward_mean"], rel=1e-6)
        assert row["time/train_s"] == pytest.approx(m["train_s"], rel=1e-6)
    assert (run_dir / "wandb" / "last-step").read_text() == str(STEPS)
    # W&B's staging directories: the killed driver left its two in the run directory, not in TMPDIR; the
    # resume removed them before it imported wandb, and its own at its exit
    left = sorted(p.name.rsplit("wandb-", 1)[-1] for p in (killed / "wandb" / "tmp").iterdir())
    assert left == ["artifacts", "media"], left
    assert list((run_dir / "wandb" / "tmp").iterdir()) == []
    # (e) the metrics and status count the restart
    assert metrics[0]["restarts"] == 0 and metrics[-1]["restarts"] == 1 and curves["restarts"][STEPS - 1] == 1
    assert "restarts: resumed 1 time(s) from its checkpoint and experience" in cli("status", run_dir).stdout
    # (f) what the resume wrote is this user's alone, though it was started with umask 022 (its TensorBoard
    # file and worker logs were 0644)
    shared = [f"{p.relative_to(run_dir)} {p.stat().st_mode & 0o777:o}" for p in [run_dir, *run_dir.rglob("*")]
              if not p.is_symlink() and p.stat().st_mode & 0o077]
    assert not shared, shared


def test_wandb_starts_before_the_workers(baseline):
    """W&B's import, service process and login take seconds. Done in the driver's event loop at the first
    step, on a busy machine they kept it from answering heartbeats for more than the 4 s run_with_faults
    allows, and every worker took the driver for dead. The driver starts W&B before any worker."""
    wandb_started = (baseline / "wandb" / "run-id").stat().st_mtime
    first_worker_phase = min(json.loads(path.read_text().splitlines()[0])["t"]
                          for path in (baseline / "timeline").glob("*.jsonl"))
    assert wandb_started < first_worker_phase


def flip_bytes(path: Path) -> None:
    data = bytearray(path.read_bytes())
    for i in range(len(data) // 2, len(data) // 2 + 64):
        data[i] ^= 0xFF
    path.write_bytes(bytes(data))


def test_corrupted_last_experience_is_generated_again(baseline, killed, tmp_path):
    last = commits(killed) - 1
    name = experience.file_name(last)
    run_dir, result = resumed_copy(killed, tmp_path, damage=lambda d: flip_bytes(d / "experience" / name))
    assert f"resume: experience/{name}: checksum mismatch (corrupted); steps from {last} on are generated again" \
        in result.stdout
    assert f"training again on {last - 2} committed experience batch(es); 1 later one(s) set aside" in result.stdout
    assert list((run_dir / "experience" / "set-aside").glob(f"*/{name}"))  # kept for the record, not used
    assert_same_as_baseline(run_dir, baseline)
    # `inspect RUN_DIR` lists what the run holds: each step's experience once (the manifest records the
    # corrupted step's file twice), and its checkpoints
    listing = cli("inspect", run_dir, timeout=60).stdout.splitlines()
    assert [line for line in listing if line.startswith("experience")] == [
        f"experience step {step + 1:>6}  experience/{experience.file_name(step)}" for step in range(STEPS)]
    held = [line.split()[-1] for line in listing if line.startswith("checkpoint")]
    assert held and all((run_dir / d).is_dir() for d in held), listing


def test_a_run_killed_between_its_last_checkpoint_and_its_export_exports_on_resume(baseline, tmp_path):
    """Killed after the last step's checkpoint and before the copy to RUN_DIR/export: the resume had nothing
    to train (that step is in the checkpoint) and ended as finished without the export the next stage reads
    (or with the one of an earlier end, had run.steps been raised)."""
    run_dir = tmp_path / "run"
    shutil.copytree(baseline, run_dir)
    for name in ("export", "export-ema"):
        shutil.rmtree(run_dir / name)
    manifest = run_dir / "manifest.jsonl"
    manifest.write_text("".join(line + "\n" for line in manifest.read_text().splitlines()
                                if json.loads(line)["kind"] != "export"))
    status = json.loads((run_dir / "status.json").read_text())
    (run_dir / "status.json").write_text(json.dumps({**status, "state": "running"}))  # (as a killed driver left it)
    result = cli("resume", run_dir)
    assert result.returncode == 0, result.stdout + result.stderr
    final = run_dir / "checkpoints" / f"step-{STEPS:06d}"
    for name, copy in (("export", "hf"), ("export-ema", "hf-ema")):
        assert (run_dir / name / "model.safetensors").read_bytes() == (final / copy / "model.safetensors").read_bytes()
    assert json.loads((run_dir / "status.json").read_text())["state"] == "finished"
    assert [r["step"] for r in map(json.loads, manifest.read_text().splitlines()) if r["kind"] == "export"] == [STEPS]


def test_a_run_resumed_further_with_its_ema_off_leaves_no_export_ema_of_its_earlier_end(baseline, tmp_path):
    """Resumed with run.steps raised and trainer.ema off: the new export is of the new last step, and the
    export-ema/ of the earlier end (step STEPS) stood beside it, unchanged, as if it were that step's average."""
    import yaml

    run_dir = tmp_path / "run"
    shutil.copytree(baseline, run_dir)
    config = yaml.safe_load((run_dir / "config.yaml").read_text())
    config["run"]["steps"] = STEPS + 1
    config["trainer"]["ema"] = None
    (run_dir / "config.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
    result = cli("resume", run_dir)
    assert result.returncode == 0, result.stdout + result.stderr
    final = run_dir / "checkpoints" / f"step-{STEPS + 1:06d}"
    assert (run_dir / "export" / "model.safetensors").read_bytes() == (final / "hf" / "model.safetensors").read_bytes()
    assert not (run_dir / "export-ema").exists()
    assert not list(run_dir.glob(".export-ema*"))


def test_damaged_checkpoint_falls_back_to_an_older_state(baseline, killed, tmp_path):
    def truncate(run_dir: Path) -> None:
        shard = next((run_dir / "checkpoints" / "step-000002" / "actor").rglob("*optim_states.pt"))
        shard.write_bytes(shard.read_bytes()[:100])

    run_dir, result = resumed_copy(killed, tmp_path, damage=truncate)
    assert "resume: checkpoint checkpoints/step-000002 is damaged" in result.stdout
    assert "truncated or overwritten" in result.stdout
    n = commits(killed)
    assert f"resuming after step {n}: the initial weights (policy_version 0), then training again on {n}" \
        in result.stdout
    assert_same_as_baseline(run_dir, baseline)


@pytest.mark.parametrize("how,submit", [("written by everyone", False), ("another user's", False),
                                        ("written by everyone", True)])
def test_a_checkpoint_that_someone_else_could_have_written_is_not_loaded(killed, tmp_path, how, submit):
    """DeepSpeed loads a checkpoint's files with pickle, which runs code: a resume from a checkpoint with a
    file that another user owns or that everyone may write is refused, naming the file and the fix, before
    anything is recorded or set aside or a worker starts; `resume --submit` refuses before it submits."""
    if how == "another user's" and os.getuid() != 0:
        pytest.skip("giving a file to another user needs root")
    run_dir = tmp_path / "run"
    shutil.copytree(killed, run_dir)
    newest = sorted((run_dir / "checkpoints").glob("step-*"))[-1]
    shard = next((newest / "actor").rglob("*optim_states.pt"))
    if how == "written by everyone":
        shard.chmod(0o666)
    else:
        os.chown(shard, 65534, 65534)
    manifest = (run_dir / "manifest.jsonl").read_text()

    def worker_logs() -> dict[str, int]:
        return {p.name: p.stat().st_size for p in (run_dir / "logs").glob("*.log")
                if p.name not in ("driver.log", "fork-server.log")}

    logs = worker_logs()
    assert logs
    job = (run_dir / "job.json").read_bytes() if (run_dir / "job.json").exists() else None
    result = cli("resume", run_dir, *(["--submit"] if submit else []), timeout=120)
    out = result.stdout + result.stderr
    assert result.returncode == 1, out
    why = "may be written by everyone (mode 666)" if how == "written by everyone" else \
        "belongs to another user (uid 65534)"
    assert f"{shard} {why}, and a checkpoint's files are loaded with pickle" in out, out
    assert (f"chmod -R go-w {run_dir}" if how == "written by everyone" else "copy it (the copy is yours)") in out
    assert (run_dir / "manifest.jsonl").read_text() == manifest  # (no resume recorded, nothing set aside)
    assert worker_logs() == logs  # (no worker started)
    assert ((run_dir / "job.json").read_bytes() if (run_dir / "job.json").exists() else None) == job, \
        "a job was submitted"


def test_experience_files_read_with_plain_tools(baseline):
    path = baseline / "experience" / experience.file_name(1)
    with h5py.File(path, "r") as f:  # plain h5py, no project code
        assert f.attrs["schema_version"] == 2 and f.attrs["step"] == 1
        n = len(f["samples/prompt_ids"])
        offsets = f["samples/response_offsets"][()]
        assert len(offsets) == n + 1
        assert offsets[-1] == len(f["samples/response_tokens"]) == len(f["experience/advantages"])
        assert f["samples/rewards"].shape == (n, 1) and len(json.loads(f["meta"][()])["responses"]) == n
    dump = subprocess.run(["h5dump", "-H", str(path)], capture_output=True, text=True)
    assert dump.returncode == 0 and 'GROUP "samples"' in dump.stdout and 'DATASET "advantages"' in dump.stdout
    out = cli("inspect", path, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "samples 64 (16 prompts x 4)" in out.stdout and "reward (total): mean" in out.stdout
    assert "kl per token (behaviour - ref)" in out.stdout  # (GRPO, one update: no old log-probs stored)
    assert "schema 2, step 2 (named from 0: 1), grpo, trained from policy_version 1" in out.stdout


def test_a_long_replay_is_not_taken_for_a_slow_start(tiny, tmp_path):
    """A resume that replays its committed batches for longer than transport.startup_timeout_s, each one
    well within it, goes on: the limit counts from the workers' last progress (each replayed batch is
    one). Before, the driver gave up "waiting for every worker to load its models". Meanwhile `status` has
    the last step's figures from before, and the trainer's step is the one it replays (it was its place in
    the replay: 0, 1, ... for steps 2, 3, ...)."""
    from toolkit.roles.trainer import REPLAY_PAUSE_ENV
    from toolkit.timeline import read_timelines

    data = example("tiny-grpo.yaml", tiny, run={"steps": 6, "name": "long-replay"}, checkpoint={"every_steps": 2},
                   transport={"startup_timeout_s": 20}, rollout={"backend": "hf"})
    run_dir = tmp_path / "run"
    run_and_kill(write_config(tmp_path, data), run_dir, after_commits=4)
    replays = commits(run_dir) - 2  # (after the checkpoint of step 2)
    assert 2 <= replays < 4
    resume = subprocess.Popen([sys.executable, "-m", "toolkit", "resume", str(run_dir)], cwd=REPO, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True,
                              env={**os.environ, REPLAY_PAUSE_ENV: "12"})  # 2 or 3 batches x 12 s: over 20 s
    with killed_at_exit(resume):
        deadline = time.monotonic() + 120
        while (status := json.loads((run_dir / "status.json").read_text()))["workers"].get(
                "trainer:0", {}).get("phase") != "replaying":
            assert resume.poll() is None and time.monotonic() < deadline
            time.sleep(0.2)
        kept = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
        assert status["last_metrics"] == kept[-1] and kept[-1]["step"] >= 1, (status["last_metrics"], kept)
        out, _ = resume.communicate(timeout=300)
    assert resume.returncode == 0, out
    log = (run_dir / "logs" / "trainer-0.log").read_text()
    assert log.count("trained again on") == replays
    replayed = [r["step"] for r in read_timelines(run_dir)["trainer-0"] if r["phase"] == "replaying"]
    assert replayed == list(range(2, 2 + replays)), replayed
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == list(range(6))


FAULT_SEED = int(os.environ.get("SLURM_RLHF_FAULT_SEED", "2026"))  # (set it to try other steps)
WHERE = {"generator": "generating", "scorer": "scoring", "trainer": "training"}
WHY = {signal.SIGKILL: "exited with signal SIGKILL", signal.SIGSTOP: "sent no heartbeat for"}
# Moments whose process is signalled only once a worker's log shows that the message it sent just before
# was received: ZeroMQ sends from a thread of its own, so a kill right after the send can lose the message.
# (A generator killed at "rejoining" whose joining_sync was lost is a case of its own: the trainer never
# hears of that start and forms its group with the next one. Here the trainer must have heard of it.)
HEARD = {"rejoining": ("trainer-0.log", "was started again: forming a new weight-sync group")}


def fault_moments(case: str, roles: tuple[str, ...]) -> list[str]:
    """For each role, the moment of its fault: its phase at a step drawn from FAULT_SEED and `case`."""
    rng = random.Random(f"{FAULT_SEED}/{case}")
    return [f"{WHERE[role]}@{rng.randint(1, STEPS)}" for role in roles]


def run_with_faults(baseline: Path, tiny, tmp_path: Path, faults: list[tuple[str, signal.Signals]], **sections
                    ) -> tuple[Path, str, list[int], dict]:
    """The baseline's run (with config `sections` changed), with the process that reaches each `moment` (of
    toolkit/hold.py) sent its signal there, in the order they are reached: (run dir, the run's output, the
    pids signalled, the worker pids before). The run must end as the uninterrupted baseline, every sample
    group once in its HDF5 files, and no process that a signalled worker had started may be left, nor the
    temporary directory of a signalled worker (killed with SIGKILL, by the test or by the launcher: the
    launcher removes it)."""
    import psutil

    from toolkit.hold import ENV, held_pid

    run_dir = tmp_path / "run"
    print(f"faults (SLURM_RLHF_FAULT_SEED={FAULT_SEED}): " + ", ".join(f"{how.name} at {m}" for m, how in faults))
    config = exact_grpo(tiny, tmp_path, transport={"heartbeat_interval_s": 0.5, "heartbeat_timeout_s": 4}, **sections)
    tmp = Path(tempfile.mkdtemp(prefix="srl-", dir=os.environ.get("TMPDIR")))  # (the run's TMPDIR, short)
    proc = subprocess.Popen([sys.executable, "-m", "toolkit", "run", str(config), "--run-dir", str(run_dir)], cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
                            env={**os.environ, ENV: ",".join(m for m, _ in faults), "TMPDIR": str(tmp)})
    victims, offspring, pids, left = [], [], {}, dict(faults)
    with killed_at_exit(proc):
        deadline = time.monotonic() + 300
        while left:
            held = {m: pid for m in left if (pid := held_pid(run_dir, m))}
            if not held:
                assert proc.poll() is None and time.monotonic() < deadline, f"the run ended or stalled before {left}"
                time.sleep(0.1)
                continue
            moment, victim = next(iter(held.items()))
            if moment.partition("@")[0] in HEARD:
                log, line = HEARD[moment.partition("@")[0]]
                while line not in (run_dir / "logs" / log).read_text():
                    assert proc.poll() is None and time.monotonic() < deadline, f"{log} never showed {line!r}"
                    time.sleep(0.1)
            workers = json.loads((run_dir / "status.json").read_text())["workers"]
            pids = pids or {w: e["pid"] for w, e in workers.items()}
            offspring += [child.pid for child in psutil.Process(victim).children(recursive=True)]
            os.kill(victim, left.pop(moment))
            victims.append(victim)
        out, _ = proc.communicate(timeout=600)
    assert proc.returncode == 0, out
    assert not alive(victims) and not alive(offspring), (victims, offspring)
    assert left_in(tmp) == [], left_in(tmp)
    shutil.rmtree(tmp)  # (and torch.compile's cache, kept there on purpose)
    assert_same_as_baseline(run_dir, baseline)
    for step in range(STEPS):  # 0 samples lost, 0 twice
        s = experience.read(run_dir / "experience" / experience.file_name(step))["samples"]
        pairs = set(zip(s["group_index"].tolist(), s["sample_index"].tolist()))
        assert len(pairs) == len(s["prompt_ids"]) == 64
    return run_dir, out, victims, pids


@pytest.mark.parametrize("signals, ranks, again", [((signal.SIGKILL, signal.SIGSTOP), 2, False),
                                                   ((signal.SIGSTOP, signal.SIGKILL), 1, True)],
                         ids=["generator-tp2-kill-scorer-stop", "generator-stop-and-again-scorer-kill"])
def test_dead_or_hung_workers_are_started_again_alone_and_the_run_ends_as_if_not(baseline, tiny, tmp_path, signals,
                                                                                ranks, again):
    """kill -9 or SIGSTOP (found by its missed heartbeats) of the vLLM generator and of the scorer, each at
    a step drawn from FAULT_SEED: the driver starts each worker again alone (the trainer keeps running), it
    rejoins, and the run ends as the uninterrupted baseline: the same weights, rewards and samples, every
    sample group once in the committed HDF5 files. In the first case the generator's vLLM is tensor-parallel
    over 2 ranks (rollout.vllm.tensor_parallel_size), each a process of its own bound to a CPU of its own,
    where the baseline's is one rank: the ranks end with their generator (none is left), the generator
    started again runs two again, and its samples are still the baseline's. In the second case the
    generator started again is killed too, after it asked for its new weight-sync group and before it
    joined: trainer rank 0 does not wait for the dead one (for transport.startup_timeout_s, 600 s) but for
    the next start, which joins."""
    from toolkit.roles.engines.vllm_engine import cpu_binding

    roles = ("generator", "scorer")
    faults = list(zip(fault_moments("-".join(s.name for s in signals), roles), signals))
    if again:
        faults.insert(1, ("rejoining", signal.SIGKILL))
    run_dir, out, victims, pids = run_with_faults(baseline, tiny, tmp_path, faults,
                                                  rollout={"vllm": {"tensor_parallel_size": ranks}})
    if ranks > 1:
        log = (run_dir / "logs" / "generator-0.log").read_text()
        binding = cpu_binding(ranks, sorted(os.sched_getaffinity(0)))  # ("0|1" on 2 cores)
        assert log.count(f"VLLM_CPU_OMP_THREADS_BIND={binding!r}") == 2, log  # (both starts)
        assert log.count(f"Worker_TP{ranks - 1} pid=") >= 2  # (vLLM names the lines of each rank's process)
        # (spawned, as on GPU nodes, where a fork cannot use CUDA: so this run checks that start too)
        assert log.count(f"vLLM's {ranks} tensor-parallel ranks started by spawn") == 2, log
    restarts = 2 + again
    assert out.count("starting it again alone (restart ") == restarts
    assert f"restart {restarts} of run.max_worker_restarts 3" in out
    for role, how in zip(roles, signals):
        victim = pids[f"{role}:0"]
        assert victim in victims
        assert f"{role} worker rank 0 ({role}:0, pid {victim} on node" in out and WHY[how] in out, out
        after = out.split(f"({role}:0, pid {victim} on node")[1]
        assert f"{role} worker rank 0 ({role}:0, pid " in after and "is back; the run goes on" in after
    log = (run_dir / "logs" / "trainer-0.log").read_text()
    waited = "generator generator:0 (start 1) was started again before it joined; waiting for start 2"
    assert (waited in log) == again, log
    assert "did not reach its weight-sync group" not in log and "did not join its new weight-sync group" not in log
    status = json.loads((run_dir / "status.json").read_text())
    assert status["workers"]["trainer:0"]["pid"] == pids["trainer:0"]  # the trainer was never started again
    assert {status["workers"][f"{r}:0"]["pid"] for r in roles}.isdisjoint(victims)
    assert status["worker_restarts"] == {"generator:0": 1 + again, "scorer:0": 1}
    said = f"restarts: generator:0 started again {1 + again} time(s), scorer:0 started again 1 time(s)"
    assert said in cli("status", run_dir).stdout
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    counts = [m["worker_restarts"] for m in metrics]
    assert counts[0] <= counts[-1] == restarts and counts == sorted(counts)
    assert all(m["restarts"] == 0 for m in metrics)  # (no resume)
    dropped = sum(m["duplicate_samples"] for m in metrics)
    assert dropped % 4 == 0  # (whole groups, if any)
    print(f"duplicate samples dropped: {dropped}")
    # Each worker's timeline says it was down from its restart until its new process registered: the report
    # does not draw the phase it died in up to then.
    from toolkit.report.plots import intervals
    from toolkit.timeline import read_timelines

    timelines = read_timelines(run_dir)
    for role in roles:
        rows = timelines[f"{role}-0"]
        downs = [i for i, r in enumerate(rows) if r["phase"] == "restarting"]
        assert len(downs) == status["worker_restarts"][f"{role}:0"], rows
        assert all(rows[i + 1]["phase"] == "registering" for i in downs), rows
        drawn = intervals(rows, rows[0]["t"], rows[-1]["t"])
        assert [p for p, *_ in drawn].count("restarting") == len(downs)
    assert not any(r["phase"] == "restarting" for r in timelines["trainer-0"])


def test_a_worker_started_again_twice_listens_where_it_did_and_a_hung_one_is_started_again(baseline, tiny, tmp_path):
    """The generator killed (-9) while it generates; the process started in its place killed before it
    registers; the next one stopped (SIGSTOP) after it registered, while it rejoins the weight sync. Each is
    started again, the last at its missed heartbeats (not after transport.startup_timeout_s, 600 s, as a
    worker started again was), and every one listens on the generator's first port: before, a worker whose
    replacement died before registering was started on a new port, where no prompt reached it (the run
    stalled for transport.step_timeout_s). The run ends as the uninterrupted baseline."""
    moment = fault_moments("twice", ("generator",))[0]
    faults = [(moment, signal.SIGKILL), ("re-registering", signal.SIGKILL), ("rejoining", signal.SIGSTOP)]
    run_dir, out, victims, pids = run_with_faults(baseline, tiny, tmp_path, faults)
    assert out.count("starting it again alone (restart ") == 3, out
    assert "sent no heartbeat for" in out and "restart 3 of run.max_worker_restarts 3" in out
    status = json.loads((run_dir / "status.json").read_text())
    assert status["worker_restarts"] == {"generator:0": 3}
    first = (run_dir / "logs" / "generator-0.log").read_text()
    inboxes = set(re.findall(r"generator:0 listens on (\S+)", first))
    assert inboxes == {status["workers"]["generator:0"]["inbox"]}, (inboxes, status["workers"]["generator:0"])


def test_a_worker_started_again_in_the_last_step_does_not_hold_the_runs_end(baseline, tiny, tmp_path):
    """The scorer killed while the trainer trains the last step: its replacement is not registered yet when
    the driver tells the workers to shut down, and the driver no longer waits 60 s for it (it never got
    the word) before it stops it."""
    from toolkit.hold import held_file

    run_dir = tmp_path / "run"
    hold = f"training@{STEPS}"
    proc, _ = start_held(exact_grpo(tiny, tmp_path), run_dir, hold)
    with killed_at_exit(proc):
        scorer = json.loads((run_dir / "status.json").read_text())["workers"]["scorer:0"]["pid"]
        os.kill(scorer, signal.SIGKILL)
        held_file(run_dir, hold).unlink()
        out, _ = proc.communicate(timeout=600)
    assert proc.returncode == 0, out
    assert f"scorer worker rank 0 (scorer:0, pid {scorer} on node" in out and "starting it again alone" in out
    assert "did not exit within 60 s of shutdown" not in out, out
    assert_same_as_baseline(run_dir, baseline)
    assert_no_workers_left(run_dir)


def test_a_generator_started_again_has_only_the_samples_the_trainer_misses_generated_again(tiny, tmp_path):
    """Two generator workers, one killed (-9) while it generates step 1, after the trainer took the other's
    samples of that step. Once it is back, the trainer says which sample groups it still misses, and only
    their prompts go out again: the other generator's groups are not generated twice (before, every
    prompt of the step went out again, and the trainer dropped the second copies as duplicates)."""
    config = write_config(tmp_path, example("tiny-grpo.yaml", tiny, run={"steps": 3, "name": "missing"},
                                            rollout={"backend": "hf"}, placement={"generator": {"workers": 2}},
                                            transport={"heartbeat_interval_s": 0.5, "heartbeat_timeout_s": 4}))
    run_dir = tmp_path / "run"
    proc, pid = start_held(config, run_dir, "generating@2")
    with killed_at_exit(proc):
        deadline = time.monotonic() + 300
        while not ((trainer := json.loads((run_dir / "status.json").read_text())["workers"]["trainer:0"]).get("step")
                   == 1 and trainer.get("samples")):  # (the other generator's part of step 1 is in)
            assert proc.poll() is None and time.monotonic() < deadline, "the other generator's samples never came"
            time.sleep(0.2)
        assert 0 < trainer["samples"] < 64
        print(f"the trainer holds {trainer['samples']} samples of step 1 when the generator is killed")
        os.kill(pid, signal.SIGKILL)
        out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, out
    assert "asking the trainer which samples of step(s) 2 it still misses" in out, out
    missing = 16 - trainer["samples"] // 4
    assert f"sending {missing} of the 16 prompts of step 2 again (their samples were lost)" in out, out
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [m["worker_restarts"] for m in metrics][-1] == 1
    assert sum(m["duplicate_samples"] for m in metrics) == 0  # (none generated twice)
    for step in range(3):
        s = experience.read(run_dir / "experience" / experience.file_name(step))["samples"]
        assert len(set(zip(s["group_index"].tolist(), s["sample_index"].tolist()))) == len(s["prompt_ids"]) == 64


def test_a_hung_trainer_then_a_dead_one_restart_every_worker_from_the_checkpoint_in_the_same_run(baseline, tiny,
                                                                                                tmp_path):
    """SIGSTOP of the trainer (found by its missed heartbeats) in its weight sync after step 1 or 2, then
    kill -9 of the trainer started again, in a later training step (each drawn from FAULT_SEED): each time
    every worker is stopped and started again by the same driver process, which resumes from the last
    checkpoint and the committed experience after it; the second time takes the last of
    run.max_trainer_restarts 2. The run ends as the uninterrupted baseline."""
    rng = random.Random(f"{FAULT_SEED}/trainer")
    hung = rng.randint(1, 2)  # (the first trainer's syncs: one after each step's update; its first checkpoint
    # (policy_version 2) comes after the second sync)
    killed = rng.randint(hung + 1, STEPS)  # (the trainer started again counts the batches it trains again too)
    faults = [(f"syncing@{hung}", signal.SIGSTOP), (f"training@{killed}", signal.SIGKILL)]
    run_dir, out, victims, pids = run_with_faults(baseline, tiny, tmp_path, faults)
    assert victims[0] == pids["trainer:0"] and len(set(victims)) == 2, (victims, pids)
    for victim, how in zip(victims, (signal.SIGSTOP, signal.SIGKILL)):
        assert f"trainer worker rank 0 (trainer:0, pid {victim} on node" in out and WHY[how] in out, out
    first, second = out.split("starting every worker again from the last checkpoint (restart ")[1:]
    assert first.startswith("1 of run.max_trainer_restarts 2)"), first
    assert second.startswith("2 of run.max_trainer_restarts 2)"), second
    assert "the initial weights (policy_version 0)" in first, first
    # The trainer started again checkpoints each second policy_version, at the end of its replay too (hung
    # in the sync after step 2, its replay reaches policy_version 2): the last before the training it was
    # killed in.
    version = max((v for v in range(hung, killed) if v % 2 == 0), default=0)
    assert (f"checkpoint checkpoints/step-{version:06d} (policy_version {version})" if version
            else "the initial weights (policy_version 0)") in second, second
    status = json.loads((run_dir / "status.json").read_text())
    assert status["state"] == "finished" and not set(victims) & {e["pid"] for e in status["workers"].values()}
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    restarts = [m["restarts"] for m in metrics]
    assert restarts == sorted(restarts) and restarts[-1] == 2, restarts


def test_a_full_disk_is_named_and_the_last_checkpoint_is_left_untouched(tiny, tmp_path, small_disk):
    """The run directory on a small tmpfs, filled up while step 3 trains (room left for its experience
    file, not for the checkpoint after it): the run fails with an error that names the checkpoint's path
    and the free space, leaves no half-written checkpoint, and the last good one is intact (every file's
    SHA-256 as the manifest recorded it)."""
    from toolkit.hold import held_file
    from toolkit.store.manifest import Manifest, checkpoint_files

    run_dir = small_disk / "run"
    proc, _ = start_held(exact_grpo(tiny, tmp_path), run_dir, "training@4")
    try:
        used = sum(p.stat().st_size for p in run_dir.rglob("*") if p.is_file())
        experience_bytes = max(r["bytes"] for r in Manifest(run_dir).records() if r["kind"] == "experience")
        filler = small_disk / "filler"
        with open(filler, "wb") as f:
            os.posix_fallocate(f.fileno(), 0, shutil.disk_usage(small_disk).free - 3 * experience_bytes - (256 << 10))
        held_file(run_dir, "training").unlink()
        out, _ = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    print(f"run directory {used / 2**20:.1f} MB at step 3; experience file {experience_bytes / 2**10:.0f} KB\n{out}")
    assert proc.returncode == 1, out
    path = run_dir / "checkpoints" / "step-000004"
    assert f"no space left to write the checkpoint {path} (" in out and " MB free there" in out, out
    assert f"then `slurm-rlhf resume {run_dir}` goes on from the last checkpoint\nlog: " in out
    assert not path.exists() and not list((run_dir / "checkpoints").glob(".*"))  # nothing half-written
    records = Manifest(run_dir).records()
    assert [r["step"] for r in records if r["kind"] == "experience"] == [0, 1, 2, 3]  # (step 3's fitted)
    last = [r for r in records if r["kind"] == "checkpoint"]
    assert [r["dir"] for r in last] == ["checkpoints/step-000002"]
    assert checkpoint_files(run_dir / last[0]["dir"]) == last[0]["files"]  # untouched, byte for byte
    status = json.loads((run_dir / "status.json").read_text())
    assert status["state"] == "failed" and f"no space left to write the checkpoint {path}" in status["error"]
