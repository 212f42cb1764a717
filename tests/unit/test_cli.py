"""The command line: --help is instant and `import toolkit` pulls in no heavy library."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from tests.conftest import EXAMPLES, REPO, cli, running


def test_help_is_fast_and_light():
    started = time.monotonic()
    result = cli("--help", timeout=30)
    assert result.returncode == 0 and "run" in result.stdout and "validate" in result.stdout
    assert time.monotonic() - started < 5
    probe = ("import sys, toolkit, toolkit.cli, toolkit.config, toolkit.launch.driver, toolkit.transport.wire; "
             "print(sorted(m for m in ('torch', 'vllm', 'deepspeed', 'transformers') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr


def test_unknown_command_exits_2():
    result = cli("frobnicate", timeout=30)
    assert result.returncode == 2 and "invalid choice" in result.stderr


def test_cancel_never_signals_a_process_that_reused_the_drivers_pid(tmp_path):
    import psutil

    from toolkit.errors import RunError
    from toolkit.launch.env import node_name
    from toolkit.launch.jobs import cancel
    from toolkit.launch.rundir import RunDir

    other = subprocess.Popen(["sleep", "60"])  # a process that got the pid after the driver ended
    try:
        rd = RunDir(tmp_path / "run")
        rd.path.mkdir()
        born = psutil.Process(other.pid).create_time()
        rd.write_status({"state": "finished", "driver": {"pid": other.pid, "node": node_name(), "started": born - 600}})
        message = cancel(rd, timeout_s=5)
        assert "had already ended" in message and "left alone" in message
        assert other.poll() is None  # not signalled
        rd.write_status({"state": "running", "driver": {"pid": other.pid, "node": "n9", "started": born}})
        with pytest.raises(RunError, match="runs on node n9"):
            cancel(rd, timeout_s=5)
        assert other.poll() is None
        rd.write_status({"state": "running", "driver": {"pid": other.pid, "node": node_name(), "started": born}})
        assert "stopped the local driver" in cancel(rd, timeout_s=10)  # the recorded process itself: signalled
        assert other.wait(timeout=10) == -15
    finally:
        other.kill()
        other.wait()


def test_a_slurm_job_has_ended_in_the_states_slurm_gives_back():
    from toolkit.launch.jobs import ended

    for state in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY",
                  "UNKNOWN (no longer known to slurmctld)"):
        assert ended(state), state
    for state in ("PENDING", "RUNNING", "REQUEUED", "COMPLETING", "SUSPENDED", "?", ""):
        assert not ended(state), state


def test_a_controller_that_does_not_answer_is_not_a_job_that_ended(monkeypatch, tmp_path):
    """squeue and scontrol fail alike when slurmctld does not answer and when it no longer knows the job: the
    job counted as ended in both, so `resume` would start a second driver beside a running job, and `--wait`
    stopped following it. Only `Invalid job id` ends it now. The commands here are scripts on PATH."""
    from toolkit.launch.jobs import ended, live_job, slurm_job
    from toolkit.launch.rundir import RunDir

    monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ['PATH']}")
    rd = RunDir(tmp_path / "run")
    rd.path.mkdir()
    rd.update_job(job_id=7)
    for said, state in [("Unable to contact slurm controller (connect failure)", "UNREACHABLE (Slurm did not answer: "
                         "slurm_load_jobs error: Unable to contact slurm controller (connect failure))"),
                        ("Invalid job id specified", "UNKNOWN (no longer known to slurmctld)")]:
        for name in ("squeue", "scontrol"):
            (tmp_path / name).write_text(f"#!/bin/sh\necho 'slurm_load_jobs error: {said}' >&2\nexit 1\n")
            (tmp_path / name).chmod(0o700)
        assert slurm_job("7")["state"] == state
        assert ended(state) == state.startswith("UNKNOWN")
        assert live_job(rd) == (None if ended(state) else f"slurm job 7 is {state}")


def test_slurm_commands_missing_on_this_node_are_a_job_state_not_a_traceback(monkeypatch, tmp_path):
    """`status` of a run submitted elsewhere, on a node where Slurm is not in PATH: the job's state says so
    (before: FileNotFoundError from squeue); it has not ended, so `resume` starts no second driver."""
    from toolkit.launch.jobs import ended, running_steps, slurm_job

    monkeypatch.setenv("PATH", str(tmp_path))  # (no squeue, no scontrol)
    state = slurm_job("7")["state"]
    assert state.startswith("UNREACHABLE (Slurm did not answer: scontrol could not run here (No such file")
    assert "is Slurm in PATH on this node?" in state and not ended(state)
    assert running_steps("7") == set()


def holding(path) -> subprocess.Popen:
    """Another process holding an exclusive flock on `path` (a driver's lock), once it says `held`."""
    holds = ("import fcntl, os, sys, time; fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT); "
             "fcntl.flock(fd, fcntl.LOCK_EX); print('held', flush=True); time.sleep(60)")
    return subprocess.Popen([sys.executable, "-c", holds, str(path)], stdout=subprocess.PIPE, text=True)


def test_cancel_stops_a_local_driver_before_a_slurm_job_of_the_past(monkeypatch, tmp_path):
    """A run submitted once and then resumed here still names its old job in job.json: `cancel` scancelled
    that job, said so, and left the local driver running. scancel here is a script that says it was called."""
    import psutil

    from toolkit.launch.env import node_name
    from toolkit.launch.jobs import cancel
    from toolkit.launch.rundir import RunDir

    monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ['PATH']}")
    (tmp_path / "scancel").write_text(f"#!/bin/sh\ntouch {tmp_path / 'scancelled'}\n")
    (tmp_path / "scancel").chmod(0o700)
    rd = RunDir(tmp_path / "run")
    rd.path.mkdir()
    rd.update_job(job_id=12345)
    driver = holding(rd.path / "driver.lock")
    try:
        assert driver.stdout.readline() == "held\n"
        rd.write_status({"state": "running", "driver": {"pid": driver.pid, "node": node_name(),
                                                        "started": psutil.Process(driver.pid).create_time()}})
        assert "stopped the local driver" in cancel(rd, timeout_s=10)
        assert driver.wait(timeout=10) == -15 and not (tmp_path / "scancelled").exists()
    finally:
        driver.kill()
        driver.wait()


def test_tiny_replaces_nothing_of_the_users(tmp_path):
    (tmp_path / "prompts.jsonl").write_text("mine\n")
    result = cli("tiny", tmp_path, timeout=60)
    assert result.returncode == 2
    assert "is not empty; give a new or empty directory for the tiny model set" in result.stderr
    result = cli("tiny", tmp_path / "prompts.jsonl", timeout=60)
    assert result.returncode == 2 and "is a file" in result.stderr
    assert (tmp_path / "prompts.jsonl").read_text() == "mine\n" and os.listdir(tmp_path) == ["prompts.jsonl"]


def test_a_non_editable_install_renders_the_batch_script(tiny, tmp_path):
    """`pip install .` (not editable) carries the batch script's template, so `render` and `submit` work
    outside the source tree: before, the template lived in templates/, which is not packaged."""
    from tests.conftest import example, write_config

    target = tmp_path / "site"
    built = subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation",
                            "--target", str(target), str(REPO)], capture_output=True, text=True, timeout=300)
    assert built.returncode == 0, built.stdout + built.stderr
    assert (target / "toolkit" / "launch" / "sbatch.sh.tmpl").is_file()
    config = write_config(tmp_path / "config", example("tiny-grpo.yaml", tiny))
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    result = subprocess.run([sys.executable, "-m", "toolkit", "render", str(config), "--run-dir", str(tmp_path / "run")],
                            capture_output=True, text=True, timeout=120, cwd=elsewhere,
                            env={**os.environ, "PYTHONPATH": str(target)})
    assert result.returncode == 0, result.stdout + result.stderr
    script = (tmp_path / "run" / "slurm" / "job.sbatch").read_text()
    assert script.startswith("#!") and "#SBATCH" in script and str(target) not in result.stderr
    probe = subprocess.run([sys.executable, "-c", "import toolkit; print(toolkit.__file__)"], capture_output=True,
                           text=True, cwd=elsewhere, env={**os.environ, "PYTHONPATH": str(target)})
    assert probe.stdout.startswith(str(target))  # (the installed copy ran, not the source tree)
    # the console entry point, the version, and the optional extras a user picks from
    import tomllib

    version = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]
    shown = subprocess.run([str(target / "bin" / "slurm-rlhf"), "--version"], capture_output=True, text=True,
                           timeout=60, cwd=elsewhere, env={**os.environ, "PYTHONPATH": str(target)})
    assert shown.returncode == 0 and shown.stdout.strip() == f"slurm-rlhf {version}", shown.stdout + shown.stderr
    metadata = next(target.glob("slurm_rlhf-*.dist-info")) / "METADATA"
    extras = {line.split(":", 1)[1].strip() for line in metadata.read_text().splitlines()
              if line.startswith("Provides-Extra:")}
    assert {"cpu", "gpu", "dev", "wandb"} <= extras, extras


def test_every_dependency_in_pyproject_is_installed():
    """tools/setup.sh installs its own list of packages (torch first, DeepSpeed without build isolation):
    a dependency added to pyproject.toml but not there is caught here, not by a user's first run."""
    import importlib.metadata
    import re
    import tomllib

    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    names = [re.split(r"[<>=!~\[; ]", spec, maxsplit=1)[0] for spec in project["dependencies"]]
    missing = []
    for name in names:
        try:
            importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            missing.append(name)
    assert not missing, f"in pyproject.toml but not installed (add them to tools/setup.sh): {missing}"


@pytest.mark.parametrize("command", [["report"], ["export", "OUT"], ["generate", "--input", "x.jsonl"], ["inspect"],
                                     ["eval"]])
def test_a_pipeline_directory_is_named_with_its_stages(tmp_path, command):
    """`report`, `export`, `generate`, `inspect` and `eval` take one stage's run directory; given a pipeline's, they
    list its stages (eval said `not a run directory`)."""
    (tmp_path / "p").mkdir()
    (tmp_path / "p" / "pipeline.json").write_text("{}")
    for stage in ("sft", "rm", "rl"):
        (tmp_path / "p" / stage).mkdir()
        (tmp_path / "p" / stage / "config.yaml").write_text("stage: rl\n")
    args = [command[0], tmp_path / "p", *[tmp_path / a if a == "OUT" else a for a in command[1:]]]
    result = cli(*args, timeout=60)
    assert result.returncode == 2 and "is a pipeline directory" in result.stderr, result.stderr
    assert all(str(tmp_path / "p" / s) in result.stderr for s in ("sft", "rm", "rl"))


@pytest.mark.parametrize("flags, expected", [(["--wait"], "resume --wait follows a submitted job: add --submit"),
                                             (["--submit", "-v"], "resume --verbose is for a resume on this machine")])
def test_resume_refuses_flags_it_would_ignore(tmp_path, flags, expected):
    result = cli("resume", tmp_path, *flags, timeout=60)
    assert result.returncode == 2 and expected in result.stderr, result.stderr


def test_a_pipeline_whose_file_is_gone_says_that_resume_reads_it(tmp_path):
    """A pipeline resumes from the file it was started from; moved or removed, resume said only `cannot read
    config (No such file or directory)`, not why it reads that file or what to do."""
    source = tmp_path / "moved" / "pipeline.yaml"
    (tmp_path / "p").mkdir()
    (tmp_path / "p" / "pipeline.json").write_text(json.dumps({"name": "p", "source": str(source), "stages": ["sft"],
                                                              "overrides": [], "cwd": str(tmp_path)}))
    result = cli("resume", tmp_path / "p", timeout=60)
    assert result.returncode == 2, result.stderr
    assert f"{tmp_path / 'p'} was started from the pipeline file {source}, which is gone" in result.stderr
    assert "put it, or a copy of it, back at that path, then resume" in result.stderr


@pytest.mark.parametrize("command", ["eval", "generate"])
def test_several_greedy_samples_of_a_prompt_are_refused(tmp_path, command):
    """`eval --n 4` (greedy by default) sampled the same response 4 times and called it best of 4."""
    result = cli(command, tmp_path, "--input", tmp_path / "p.jsonl", "--n", "4", "--temperature", "0", timeout=60)
    assert result.returncode == 2, result.stderr
    assert "--n 4 with --temperature 0 (greedy): every sample of a prompt would be the same" in result.stderr


@pytest.mark.parametrize("command", ["eval", "generate"])
def test_a_temperature_vllm_would_raise_is_refused(tmp_path, command):
    """vLLM raises a temperature below 0.01 to 0.01 (a warning per request): `--temperature 0.005` sampled at
    0.01 with vLLM and at 0.005 with transformers, and `eval` recorded 0.005 either way."""
    result = cli(command, tmp_path, "--input", tmp_path / "p.jsonl", "--temperature", "0.005", timeout=60)
    assert result.returncode == 2, result.stderr
    assert "--temperature is 0.005; vLLM samples at no less than 0.01" in result.stderr


@pytest.mark.parametrize("command", ["run", "sft", "rm", "submit", "render"])
def test_an_empty_run_dir_is_refused(tmp_path, command):
    """`--run-dir ''` once fell back to runs/<run.name> without a word."""
    result = cli(command, tmp_path / "any.yaml", "--run-dir", "", cwd=tmp_path, timeout=60)
    assert result.returncode == 2 and "argument --run-dir: empty; give a directory" in result.stderr, result.stderr
    assert not (tmp_path / "runs").exists()


def test_inspect_of_a_file_that_is_not_experience_names_it(tmp_path):
    import h5py

    text, other = tmp_path / "prompts.jsonl", tmp_path / "other.h5"
    text.write_text('{"prompt": "a"}\n')
    with h5py.File(other, "w") as f:
        f.attrs["schema_version"] = 99
    for path, why in [(text, "file signature not found"), (other, "experience schema 99, this version reads")]:
        result = cli("inspect", path, timeout=60)
        assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
        assert f"{path}: not an experience file this version reads (" in result.stderr and why in result.stderr
        assert "experience/step-NNNNNN.h5" in result.stderr
    result = cli("inspect", tmp_path, timeout=60)  # (a directory, not a run's)
    assert result.returncode == 2 and f"{tmp_path} is not a run directory (no config.yaml)" in result.stderr


def test_a_run_directory_given_for_a_config_file_says_how_to_go_on(tmp_path):
    """`slurm-rlhf run runs/r1` (a run directory, where a config file goes) said `runs/r1: cannot read config
    (Is a directory)`: what was wrong, not what to do. It says now that the directory is a run's (or a
    pipeline's), how to continue it, and where its config is."""
    run, pipeline, empty = tmp_path / "r1", tmp_path / "p1", tmp_path / "empty"
    for directory in (run, pipeline, empty):
        directory.mkdir()
    (run / "config.yaml").write_text("run: {name: r1}\n")
    (pipeline / "pipeline.json").write_text("{}")
    for command in ("run", "validate", "render"):
        result = cli(command, run, timeout=60)
        assert result.returncode == 2 and result.stderr.strip() == (
            f"error: {run} is a run directory, not a config file; continue its run with `slurm-rlhf resume {run}`, "
            f"or give its config, {run / 'config.yaml'}"), result.stderr
    result = cli("run", pipeline, timeout=60)
    assert result.returncode == 2 and result.stderr.strip() == (
        f"error: {pipeline} is a pipeline directory, not a config file; continue its pipeline with `slurm-rlhf resume "
        f"{pipeline}`"), result.stderr
    result = cli("validate", empty, timeout=60)
    assert result.returncode == 2 and result.stderr.strip() == (
        f"error: {empty} is a directory, not a config file; give a run config (YAML), e.g. "
        "templates/examples/tiny-grpo.yaml"), result.stderr


def test_a_run_directory_that_holds_a_run_says_how_to_continue_it(tmp_path):
    """`slurm-rlhf run tiny-grpo.yaml` a second time (after a Ctrl-C, say) into runs/tiny-grpo said to choose
    another --run-dir or remove that directory, and nothing of resume: removing it loses the run's committed
    experience and checkpoints. The message gives the resume command first, as a pipeline's does."""
    from toolkit.errors import ConfigError
    from toolkit.launch.rundir import RunDir

    run = RunDir(tmp_path / "tiny grpo")
    run.path.mkdir()
    run.config.write_text("")
    with pytest.raises(ConfigError) as info:
        run.create(None)
    assert str(info.value) == (f"{run.path} already holds a run (config.yaml); continue it with `slurm-rlhf resume "
                               f"'{run.path}'`, or choose another --run-dir (or remove that directory)")


def test_what_a_command_wrote_is_named_by_its_absolute_path(tiny, tmp_path):
    """`init --out run.yaml` said `wrote run.yaml`, `plan --write planned.yaml` `wrote the best plan into
    planned.yaml` (and report, generate, tiny likewise), where export named its absolute path: one way, the
    absolute path, that a user can open from any folder."""
    result = cli("init", "--model", tiny / "model", "--out", "new/run.yaml", cwd=tmp_path, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith(f"wrote {tmp_path / 'new' / 'run.yaml'}: grpo on model"), result.stdout
    assert f"example prompts in {tmp_path / 'new' / 'prompts.example.jsonl'}: " in result.stdout
    result = cli("plan", "new/run.yaml", "--cluster", REPO / "templates" / "clusters" / "this-machine.yaml",
                 "--write", "planned.yaml", cwd=tmp_path, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.endswith(f"wrote the best plan into {tmp_path / 'planned.yaml'}\n"), result.stdout


def test_a_reader_that_leaves_ends_the_command_quietly():
    """`slurm-rlhf plan ... | head -1` once ended in a BrokenPipeError's traceback: now the command stops with
    the status of a Unix tool killed by SIGPIPE and prints nothing more."""
    proc = subprocess.Popen([sys.executable, "-m", "toolkit", "plan", "templates/examples/tiny-grpo.yaml",
                             "--cluster", "templates/clusters/2x8-h100.yaml"], cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    proc.stdout.close()  # (before it writes: its first write meets a pipe without a reader)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 141 and err == "", err


def test_status_says_restarts_of_a_whole_step_as_one_range():
    """A Slurm step of 8 generator tasks restarts whole: `status` says so in one range, not 8 entries; ranks
    are ordered as numbers (10 after 9), and a rank started again more often stands alone."""
    from toolkit.launch.jobs import restarts_text

    restarts = {f"generator:{r}": 1 for r in range(12)} | {"generator:9": 2, "scorer:0": 1}
    assert restarts_text(restarts) == ("generator:0-8 started again 1 time(s), generator:9 started again 2 time(s), "
                                       "generator:10-11 started again 1 time(s), scorer:0 started again 1 time(s)")
    assert restarts_text({"scorer:0": 3}) == "scorer:0 started again 3 time(s)"


def test_cancel_stops_a_driver_that_has_not_written_its_status_yet(tmp_path):
    """A driver writes status.json once its workers start, seconds to minutes after it took driver.lock (the
    data check, W&B, the fork server's imports: 10.6 s here). Meanwhile status.json is missing (a new run) or
    names the driver before it (a resume), and `cancel` said "neither a Slurm job nor a running local driver
    is recorded" (exit 1) or "the local driver (pid N) had already ended" (exit 0), and the run went on; a
    second `resume` named the dead driver as the holder, and `status` said "driver: not started yet" or the
state the last start ended in. The lock says who holds it."""
    from toolkit.errors import ConfigError
    from toolkit.launch.env import node_name
    from toolkit.launch.jobs import cancel, status_text
    from toolkit.launch.rundir import RunDir

    rd = RunDir(tmp_path / "run")
    rd.path.mkdir()
    before = subprocess.Popen(["true"])  # (the driver of the run's last start, ended)
    before.wait()
    starts = ("import sys, time; from toolkit.launch.rundir import RunDir; rd = RunDir(sys.argv[1]); rd.hold_lock(); "
              "print('held', flush=True); time.sleep(60)")
    for status in (None, {"state": "interrupted", "driver": {"pid": before.pid, "node": node_name(), "started": 0}}):
        if status is not None:
            rd.write_status(status)
        driver = subprocess.Popen([sys.executable, "-c", starts, str(rd.path)], stdout=subprocess.PIPE, text=True,
                                  env={**os.environ, "PYTHONPATH": str(REPO)})
        try:
            assert driver.stdout.readline() == "held\n"
            said = status_text(rd)
            assert (f"driver: starting (pid {driver.pid})" if status is None else
                    f"run state: starting again (driver pid {driver.pid}; its last start ended interrupted)") in said
            with pytest.raises(ConfigError, match=rf"its local driver \(pid {driver.pid}\) holds driver.lock"):
                RunDir(rd.path).hold_lock()
            assert cancel(rd, timeout_s=10) == f"stopped the local driver (pid {driver.pid}) and its workers"
            assert driver.wait(timeout=10) == -15
        finally:
            driver.kill()
            driver.wait()


def test_status_of_a_run_whose_driver_was_killed_says_so(tmp_path, monkeypatch):
    """Only a live driver writes status.json: after a SIGKILL it said `running` for good (and the report
    too). A local run whose lock no one holds, or a Slurm run whose job ended, says no driver runs it."""
    import fcntl

    from toolkit.launch.jobs import status_text
    from toolkit.launch.rundir import RunDir

    monkeypatch.setenv("PATH", str(tmp_path))  # (no Slurm here)
    run = RunDir(tmp_path / "run")
    run.path.mkdir()
    run.write_status({"state": "running", "step": 1, "steps": 6})
    said = status_text(run)
    assert ("run state: running, but no driver runs it: its local driver is gone (killed?); "
            f"`slurm-rlhf resume {run.path}` goes on, steps done: 2/6") in said, said
    lock = os.open(run.path / "driver.lock", os.O_WRONLY | os.O_CREAT, 0o600)  # (a live driver holds it)
    fcntl.flock(lock, fcntl.LOCK_EX)
    try:
        assert "run state: running, steps done: 2/6" in status_text(run)
    finally:
        os.close(lock)
    run.write_status({"state": "finished", "step": 5, "steps": 6})
    assert "run state: finished, steps done: 6/6" in status_text(run)


def test_pipeline_status_of_a_stage_whose_driver_was_killed_says_so(tmp_path, monkeypatch):
    """`status PIPELINE_DIR` said `starting` (or `running`) for good of a stage whose driver was killed, with
    no note, where `status` of the stage itself said no driver runs it; now the table says so too."""
    import fcntl
    import json

    from toolkit.launch.pipeline import PipelineDir, pipeline_status

    monkeypatch.setenv("PATH", str(tmp_path))  # (no Slurm here)
    pd = PipelineDir(tmp_path / "p")
    pd.path.mkdir()
    pd.file.write_text(json.dumps({"name": "p", "stages": ["sft", "rl"]}))
    for stage, status in (("sft", {"state": "finished", "step": 3, "steps": 4}),
                          ("rl", {"state": "starting", "step": -1, "steps": 6})):
        pd.stage(stage).path.mkdir()
        pd.stage(stage).write_status(status)
    rows = {line.split()[0]: line for line in pipeline_status(pd).splitlines()[2:]}
    assert rows["rl"].split()[1:5] == ["-", "-", "starting", "0/6"], rows
    assert rows["rl"].endswith(f"no driver runs it: its local driver is gone (killed?); `slurm-rlhf resume {pd.path}` "
                               "goes on"), rows
    assert "no driver" not in rows["sft"], rows
    lock = os.open(pd.path / "rl" / "driver.lock", os.O_WRONLY | os.O_CREAT, 0o600)  # (a live driver holds it)
    fcntl.flock(lock, fcntl.LOCK_EX)
    try:
        assert "no driver" not in pipeline_status(pd)
    finally:
        os.close(lock)


def test_a_driver_starting_while_a_follower_looks_at_its_lock_still_takes_it(tmp_path):
    """`eval --follow` sees whether a run goes by taking its driver.lock shared for a moment (`lock_held`);
    a driver starting just then waits that moment out (it was refused as "still running"). Once it holds
    the lock, a follower sees it held, and another driver is refused."""
    import fcntl
    import threading

    from toolkit.errors import ConfigError
    from toolkit.launch.rundir import RunDir

    run = RunDir(tmp_path / "run")
    run.path.mkdir()
    probe = os.open(run.path / "driver.lock", os.O_RDONLY | os.O_CREAT, 0o600)
    fcntl.flock(probe, fcntl.LOCK_SH)  # (a follower's look, held 0.3 s here)
    threading.Timer(0.3, os.close, (probe,)).start()
    assert RunDir(run.path).lock_held() is False  # (a shared holder is not a driver)
    run.hold_lock()
    try:
        assert RunDir(run.path).lock_held() is True
        with pytest.raises(ConfigError, match="is still running: its local driver"):
            RunDir(run.path).hold_lock()
    finally:
        run.release_lock()
    assert RunDir(run.path).lock_held() is False


def test_a_second_ctrl_c_while_the_command_exits_changes_nothing():
    """Ctrl-C twice: the first ends the command (130, "interrupted"); the second comes while the process
    exits (here in an exit hook, as a run's driver or vLLM's clean-up has). It once raised there, or killed
    the process by the signal after Python had put back the default handlers (a run's test saw -2 instead
    of 130); now it is ignored. The hook waits for the test, so no timing decides it."""
    code = ("import atexit, sys, time\n"
            "import toolkit.cli as c\n"
            "def slow(args):\n"
            "    print('ready', flush=True)\n"
            "    time.sleep(120)\n"
            "def hook():\n"
            "    print('exiting', flush=True)\n"
            "    sys.stdin.readline()\n"
            "c.cmd_tiny = slow\n"
            "atexit.register(hook)\n"
            "sys.argv = ['slurm-rlhf', 'tiny', 'none']\n"
            "sys.exit(c.main())\n")
    code, err = interrupted_twice(code, "exiting")
    assert code == 130 and err.strip() == "interrupted (SIGINT)", (code, err)


def interrupted_twice(code: str, then: str) -> tuple[int, str]:
    """Run Python `code`, which prints `ready` and then, once Ctrl-C came, `then` and waits for a line of input:
    SIGINT at each of the two, the line given half a second after the second; (exit code, its stderr)."""
    import signal

    proc = subprocess.Popen([sys.executable, "-c", code], cwd=REPO, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "ready"
        proc.send_signal(signal.SIGINT)
        assert proc.stdout.readline().strip() == then
        proc.send_signal(signal.SIGINT)
        time.sleep(0.5)  # (delivered or not by then, the outcome must be the same)
        _, err = proc.communicate("\n", timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    return proc.returncode, err


def test_a_tool_ended_by_sigterm_says_so_in_one_line_and_exits_143():
    """`kill` (or a job's time limit) of a benchmark printed a KeyboardInterrupt's traceback and exited 130, as
    if it had been Ctrl-C; a tool now ends as the CLI does: `interrupted (SIGTERM)`, 143, and its child gone.
    The signal goes once the tool's first search (a child process) runs, so no timing decides it."""
    import signal

    tool = subprocess.Popen([sys.executable, "tools/bench_planner.py", "--nodes", "1024", "--models", "70b"],
                            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    children = f"/proc/{tool.pid}/task/{tool.pid}/children"
    try:
        deadline = time.monotonic() + 120
        while not open(children).read().split() and tool.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        search = [int(p) for p in open(children).read().split()]
        assert search, tool.communicate()
        tool.send_signal(signal.SIGTERM)
        out, err = tool.communicate(timeout=60)
    finally:
        if tool.poll() is None:
            tool.kill()
    assert tool.returncode == 143 and err.strip() == "interrupted (SIGTERM)" and out == "", (tool.returncode, err)
    deadline = time.monotonic() + 10  # (killed, it may wait a moment as a zombie for init to reap it)
    while running(search[0]) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not running(search[0]), "the tool's search outlived it"


def test_a_second_ctrl_c_during_the_commands_clean_up_does_not_cut_it_short(tmp_path):
    """Ctrl-C twice, the second while the command cleans up after the first (generate's vLLM shutting down; or
    `timeout N slurm-rlhf ...` given Ctrl-C, which passes the SIGINT on to the command a second time): the second
    raised inside the clean-up, which printed a traceback and left the engine's `vllm_dist_*` file in TMPDIR.
    Now the clean-up runs to its end. The clean-up here waits for the test, so no timing decides it."""
    done = tmp_path / "cleaned"
    code = ("import sys, time\n"
            "import toolkit.cli as c\n"
            "def slow(args):\n"
            "    try:\n"
            "        print('ready', flush=True)\n"
            "        time.sleep(120)\n"
            "    finally:\n"
            "        print('cleaning', flush=True)\n"
            "        sys.stdin.readline()\n"
            f"        open({str(done)!r}, 'w').close()\n"
            "c.cmd_tiny = slow\n"
            "sys.argv = ['slurm-rlhf', 'tiny', 'none']\n"
            "sys.exit(c.main())\n")
    code, err = interrupted_twice(code, "cleaning")
    assert code == 130 and err.strip() == "interrupted (SIGINT)" and done.exists(), (code, err)


# A tool's run as a user starts it: what it said, and whether torch was imported by the time it exited.
TOOL_RUN = ("import runpy, sys\nsys.argv = sys.argv[1:]\ntry:\n    runpy.run_path(sys.argv[0], run_name='__main__')\n"
            "finally:\n    print('torch imported' if 'torch' in sys.modules else 'no torch')\n")


@pytest.mark.parametrize("tool, args, says", [
    ("bench_sync.py", ["--help"], None),
    ("bench_sync.py", ["--repeats", "0"], "--repeats 0: give 1 or more"),
    ("bench_scoring.py", ["--min-response", "10", "--max-response", "5"],
     "--max-response 5 is below --min-response 10"),
    ("bench_scoring.py", ["--batch", "0"], "--batch 0: give 1 or more"),
    ("bench_planner.py", ["--nodes", "abc"], "--nodes abc: 'abc' is not a number of nodes"),
    ("bench_planner.py", ["--models", "13b"], "--models 13b: no model 13b; the models are 70b, 7b"),
    ("bench_rl_batches.py", ["--rows", "0"], "--rows 0: give 1 or more"),
    ("bench_async.py", ["--steps", "2"], "--steps 2: 3 or more"),
    ("bench_trl.py", ["--steps", "0"], "--steps 0: 1 or more"),
    ("bench_stream.py", ["--groups", "0"], "--groups 0: 1 or more"),
])
def test_a_tool_refuses_bad_arguments_before_it_imports_torch(tool, args, says):
    """bench_sync's --help took 2 s (torch at the module's top); bad sizes, node counts and model names gave
    a traceback after the imports (or a search started): each is now argparse's error, exit 2, at once."""
    done = subprocess.run([sys.executable, "-c", TOOL_RUN, f"tools/{tool}", *args], cwd=REPO, capture_output=True,
                          text=True, timeout=60)
    assert done.stdout.rstrip().endswith("no torch"), done.stdout[-2000:] + done.stderr[-2000:]
    if says is None:
        assert done.returncode == 0 and "usage:" in done.stdout
    else:
        assert done.returncode == 2 and f"{tool}: error: {says}" in done.stderr, done.stderr[-2000:]


@pytest.mark.parametrize("text, what", [("", "empty"), ('{"state": "runn', "not valid JSON (Unterminated string"),
                                        ("[]", "not a JSON object (a list)")])
def test_a_damaged_status_file_is_named_by_status_and_report(tmp_path, text, what):
    """An empty or cut status.json (a full disk, an edit) ended `status` and `report` in a JSONDecodeError's
    traceback; now both name the file and what is wrong with it, and the report writes nothing."""
    import json

    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text("stage: rl\n")
    (run / "metrics.jsonl").write_text(json.dumps({"step": 0, "time": 1.0, "reward_mean": 0.5}) + "\n")
    (run / "status.json").write_text(text)
    for command in ("status", "report"):
        result = cli(command, run, timeout=60)
        assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
        assert f"{run / 'status.json'}: {what}" in result.stderr and "move it aside" in result.stderr, result.stderr
    assert not (run / "report").exists()


def test_a_run_without_a_checkpoint_names_the_setting_that_writes_them(tiny, tmp_path):
    """`export`, `generate` and `eval` of a run with no checkpoint: they named `checkpoint.every`, a key that
    does not exist, and eval said 'no checkpoint at step(s) (none); it has none yet'."""
    from tests.conftest import example, write_config

    run = tmp_path / "run"
    write_config(run, example("tiny-grpo.yaml", tiny), name="config.yaml")
    for command in (["export", run, tmp_path / "out"], ["generate", run, "--input", "x.jsonl"], ["eval", run]):
        result = cli(*command, timeout=120)
        assert result.returncode == 2, result.stderr
        assert (f"{run}: the run has no checkpoint yet (checkpoint.every_steps sets how often one is written)"
                in result.stderr), result.stderr
        assert "(none)" not in result.stderr


def _fake_slurm(tmp_path, monkeypatch, **scripts):
    """Slurm commands as scripts on PATH (a fake: the unit tests run without a cluster), each a shell body."""
    monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ['PATH']}")
    for name, body in scripts.items():
        (tmp_path / name).write_text(f"#!/bin/sh\n{body}\n")
        (tmp_path / name).chmod(0o700)


def test_a_second_job_of_a_run_directory_starts_no_second_driver(monkeypatch, tmp_path, capsys):
    """`sbatch job.sbatch` twice put two drivers on one run directory: one crashed on the other's temporary
    status file, job.json named the dead one, and `status`/`cancel` acted on the wrong job. The second job's
    driver now stops at once (exit 2) and writes nothing: while job.json names another live job, and while
    another driver holds job.lock. squeue here is a script that says job 7 runs."""
    from toolkit.launch.batch import main
    from toolkit.launch.rundir import RunDir

    _fake_slurm(tmp_path, monkeypatch, squeue="echo 'RUNNING|n1|1:00|None'")
    rd = RunDir(tmp_path / "run")
    rd.path.mkdir()
    rd.update_job(job_id=7, driver_pid=1234)
    monkeypatch.setenv("SLURM_JOB_ID", "8")
    assert main([str(rd.path)]) == 2
    err = capsys.readouterr().err
    assert f"{rd.path} is already run by slurm job 7 (RUNNING): job 8 starts no second driver" in err
    assert rd.read_json(rd.job) == {"job_id": 7, "driver_pid": 1234} and not rd.status.exists()
    driver = holding(rd.path / "job.lock")
    try:
        assert driver.stdout.readline() == "held\n"
        rd.update_job(job_id=8)  # (both started at once: job.json names this job, the other driver runs)
        assert main([str(rd.path)]) == 2
        assert "is already run by another slurm job, whose driver holds job.lock: job 8" in capsys.readouterr().err
    finally:
        driver.kill()
        driver.wait()


def test_status_writes_at_once_never_crash_on_each_others_temporary_file(tmp_path):
    """Two processes writing status.json at once (two drivers, once) shared one temporary name: one's
    os.replace found the file gone (FileNotFoundError) and its driver crashed."""
    import multiprocessing

    from toolkit.launch.rundir import RunDir

    rd = RunDir(tmp_path)
    ctx = multiprocessing.get_context("fork")
    writers = [ctx.Process(target=_write_status_often, args=(str(tmp_path), n)) for n in range(3)]
    for w in writers:
        w.start()
    for w in writers:
        w.join(60)
    assert [w.exitcode for w in writers] == [0, 0, 0]
    assert rd.read_json(rd.status)["writer"] in (0, 1, 2)
    assert [p.name for p in tmp_path.iterdir()] == ["status.json"]  # (no temporary file left)


def _write_status_often(path: str, n: int) -> None:
    from toolkit.launch.rundir import RunDir

    rd = RunDir(path)
    for i in range(300):
        rd.write_status({"writer": n, "i": i})


def test_a_requeue_puts_back_this_job_not_the_one_job_json_names(monkeypatch, tmp_path):
    from toolkit.launch.batch import requeue
    from toolkit.launch.rundir import RunDir

    _fake_slurm(tmp_path, monkeypatch, scontrol=f'echo "$@" > {tmp_path / "asked"}')
    rd = RunDir(tmp_path / "run")
    rd.path.mkdir()
    rd.update_job(job_id=7)
    monkeypatch.setenv("SLURM_JOB_ID", "8")
    requeue(rd, 3)
    assert (tmp_path / "asked").read_text() == "requeue 8\n"
    assert rd.read_json(rd.job) == {"job_id": 7, "requeues": 1}


def test_cancel_of_a_job_that_has_ended_says_so_and_cancels_nothing(monkeypatch, tmp_path):
    """`cancel` said "cancelled slurm job 7" of a job that had completed long before (or that Slurm no longer
    knew). squeue lists nothing here, scontrol says how the job ended, and scancel says it was called."""
    from toolkit.launch.jobs import cancel
    from toolkit.launch.rundir import RunDir

    _fake_slurm(tmp_path, monkeypatch, squeue="exit 0", scontrol="echo 'JobId=7 JobState=COMPLETED NodeList=n1'",
                scancel=f"touch {tmp_path / 'scancelled'}")
    rd = RunDir(tmp_path / "run")
    rd.path.mkdir()
    rd.update_job(job_id=7)
    assert cancel(rd, timeout_s=5) == "slurm job 7 had already ended (COMPLETED); nothing to cancel"
    (tmp_path / "scontrol").write_text("#!/bin/sh\necho 'slurm_load_jobs error: Invalid job id specified' >&2\n"
                                       "exit 1\n")
    assert cancel(rd, timeout_s=5) == ("slurm job 7 had already ended (UNKNOWN (no longer known to slurmctld)); "
                                       "nothing to cancel")
    assert not (tmp_path / "scancelled").exists()


def test_status_of_a_heterogeneous_job_and_of_a_requeued_one(monkeypatch, tmp_path):
    """A pending heterogeneous job showed `PENDING on ,,` (a row per component, none with nodes); one that
    had ended showed the last component's nodes only (scontrol's lines read into one dict); a run requeued
    once and not yet resumed read `resumed 0 time(s) ..., 1 of them after a Slurm requeue`. The Slurm
    commands are scripts on PATH here."""
    from toolkit.launch.jobs import slurm_job, status_text
    from toolkit.launch.rundir import RunDir

    _fake_slurm(tmp_path, monkeypatch, squeue="for i in 1 2 3; do echo 'PENDING||0:00|Resources'; done")
    assert slurm_job("7") == {"state": "PENDING", "nodes": "", "elapsed": "0:00", "reason": "Resources"}
    rd = RunDir(tmp_path / "run")
    rd.path.mkdir()
    (rd.path / "config.yaml").write_text("")
    rd.update_job(job_id=7, requeues=1)
    rd.write_status({"state": "running", "step": 3, "steps": 10})
    text = status_text(rd)
    assert "slurm job 7: PENDING, elapsed 0:00 (Resources)\n" in text
    assert ("restarts: slurm job requeued 1 time(s) by its driver at its time limit (the requeued job has not "
            "resumed yet)") in text
    lines = [f"JobId={7 + k} HetJobId=7 HetJobOffset={k} JobState=COMPLETED RunTime=00:01:0{k} Reason=None "
             f"NodeList={nodes}" for k, nodes in enumerate(["n1", "(null)", "n[3-4]"])]
    (tmp_path / "scontrol.out").write_text("\n".join(lines) + "\n")
    _fake_slurm(tmp_path, monkeypatch, squeue="exit 0", scontrol=f"cat {tmp_path / 'scontrol.out'}")
    assert slurm_job("7") == {"state": "COMPLETED", "nodes": "n1,n[3-4]", "elapsed": "00:01:00", "reason": "None"}


def test_ctrl_c_while_following_a_job_says_the_job_keeps_running(monkeypatch, tmp_path):
    """Ctrl-C on `submit --wait` printed `interrupted (SIGINT)`, as if the run had stopped; the job ran on.
    squeue here is a script that says the job runs; the Ctrl-C comes as the CLI's handler raises it."""
    import signal

    from toolkit.errors import Interrupted
    from toolkit.launch import jobs
    from toolkit.launch.rundir import RunDir

    _fake_slurm(tmp_path, monkeypatch, squeue="echo 'RUNNING|n1|0:05|None'")
    rd = RunDir(tmp_path / "run")
    rd.path.mkdir()

    def ctrl_c(seconds):
        raise KeyboardInterrupt(signal.SIGINT)

    monkeypatch.setattr(jobs.time, "sleep", ctrl_c)
    try:
        jobs.follow(rd, "7")
    except Interrupted as e:
        said = e
    except KeyboardInterrupt:  # (the CLI then said `interrupted (SIGINT)`)
        pytest.fail("follow let the Ctrl-C through: nothing says that the job keeps running")
    assert said.exit_code == 130
    assert str(said) == (f"stopped following (SIGINT); slurm job 7 keeps running: `slurm-rlhf status {rd.path}` "
                            f"shows it, `slurm-rlhf cancel {rd.path}` stops it")


def test_the_driver_makes_slurms_output_files_private(monkeypatch, tmp_path):
    """slurmstepd creates the job's output files with the umask `sbatch` was run with: after a hand-run sbatch
    under umask 022 the driver's output (tracebacks, config values) was readable by all. The driver makes
    them 600 at its start; here its start stops at once after that (the run's config is missing)."""
    from toolkit.launch.batch import main
    from toolkit.launch.rundir import RunDir

    rd = RunDir(tmp_path / "run")
    (rd.path / "slurm").mkdir(parents=True)
    rd.logs.mkdir()
    logs = [rd.path / "slurm" / f"9_0_log.{suffix}" for suffix in ("out", "err")]
    for log in logs:
        log.write_text("")
        log.chmod(0o644)
    rd.update_job(job_id=9)
    monkeypatch.setenv("SLURM_JOB_ID", "9")
    assert main([str(rd.path)]) != 0
    assert [oct(log.stat().st_mode & 0o777) for log in logs] == ["0o600", "0o600"]


@pytest.mark.parametrize("command", [("generate", "m", "--input", "p.jsonl", "--output", "o.jsonl"), ("chat", "m"),
                                     ("eval", "run"), ("tiny", "out")])
def test_a_seed_out_of_range_is_refused_before_anything_loads(command, tmp_path):
    command = (command[0], *(str(tmp_path / a) if not a.startswith("-") else a for a in command[1:]))
    for seed, says in (("-1", "-1 is out of range"), (str(2**32), f"{2**32} is out of range"),
                       ("1.5", "'1.5' is not a whole number")):
        result = cli(*command, "--seed", seed, timeout=30)
        assert result.returncode == 2 and says in result.stderr and "from 0 to 4294967295" in result.stderr, \
            result.stderr


@pytest.mark.parametrize("command, stage", [("run", "rl"), ("sft", "sft"), ("rm", "rm"), ("validate", "rl")])
def test_the_set_example_of_each_command_is_a_key_its_configs_take(tiny, tmp_path, command, stage):
    """`sft --help` and `rm --help` showed `--set rollout.group_size=8`, which every sft or rm config refuses
    (`unknown key 'rollout'`)."""
    import re

    from toolkit.cli import build_parser
    from toolkit.config.load import load_config

    sub = next(a for a in build_parser()._actions if a.dest == "command").choices[command]
    example = re.search(r"e\.g\. --set (\S+)", " ".join(sub.format_help().split())).group(1)
    config = tmp_path / f"{stage}.yaml"
    if stage == "rl":
        config.write_text((EXAMPLES / "tiny-grpo.yaml").read_text().replace("../../models/tiny", str(tiny)))
    else:
        config.write_text(f"stage: {stage}\nrun: {{steps: 2}}\ndata: {{sources: [{{path: {tiny}/pipeline.jsonl}}]}}\n"
                          f"model: {{base: {tiny}/model}}\n")
    key, _, value = example.partition("=")
    loaded = load_config(config, [example])
    section, field = key.split(".")
    assert getattr(getattr(loaded, section), field) == pytest.approx(float(value))


def test_a_pipeline_resumed_with_another_split_is_refused(tiny, tmp_path):
    """The split is decided once for every stage: after SFT started, a pipeline file whose data.split was
    changed gave the reward model and RL the new split (only a note said SFT kept its own), so they trained
    on prompts SFT had trained on (5 of the reward model's 34 in the tiny pipeline). Refused now; the same
    split goes on."""
    from toolkit.config.pipeline import load_pipeline
    from toolkit.errors import ConfigError
    from toolkit.launch.pipeline import PipelineDir, check_started
    from toolkit.store.manifest import Manifest

    pipeline = load_pipeline(EXAMPLES / "tiny-pipeline.yaml")
    pd = PipelineDir(tmp_path / "p").create(pipeline)
    sft = pipeline.configs(pd.path)[0]
    pd.stage("sft").create(sft)
    Manifest(pd.stage("sft").path).append({"kind": "start"})  # (the stage started)
    check_started(pipeline.configs(pd.path), pd)  # (the same split)
    changed = load_pipeline(EXAMPLES / "tiny-pipeline.yaml", ["data.split.seed=99"]).configs(pd.path)
    with pytest.raises(ConfigError) as info:
        check_started(changed, pd)
    assert "data.split is {'sft': 2.0, 'rm': 4.0, 'rl': 4.0, 'seed': 99} now, but stage sft started with " \
           "{'sft': 2.0, 'rm': 4.0, 'rl': 4.0, 'seed': 1234}" in str(info.value), str(info.value)
    assert "stage rm would train on rows of stage sft's part: put data.split back as it was" in str(info.value)


def test_a_failed_pipeline_stage_says_how_to_continue_the_pipeline(tiny, tmp_path):
    """A stage that failed (here: its worker did not register within transport.startup_timeout_s) named the
    stage and its log, but not the command that goes on: a resume of the pipeline's directory (a resume of
    the stage's own directory ends with that stage)."""
    result = cli("run", EXAMPLES / "tiny-pipeline.yaml", "--run-dir", tmp_path / "p", "--set",
                 "sft.transport.startup_timeout_s=1", timeout=120)
    assert result.returncode == 1, result.stdout + result.stderr
    assert f"pipeline stopped: stage sft failed ({tmp_path / 'p' / 'sft'}): timed out after 1 s" in result.stderr
    assert f"log: {tmp_path / 'p' / 'sft' / 'logs' / 'trainer-0.log'}" in result.stderr, result.stderr
    assert result.stderr.rstrip().endswith(f"continue the pipeline with: slurm-rlhf resume {tmp_path / 'p'}")


@pytest.mark.parametrize("flags", [[], ["--data-changed"]])
def test_a_submitted_stage_that_never_ran_takes_the_pipeline_file_as_it_is_now(tiny, tmp_path, flags):
    """`submit` writes every stage's config.yaml before its sbatch; a stage whose job never ran (an earlier
    stage failed, or it was cancelled) has not started, and a resume runs it as the pipeline file says now.
    It kept its submission's config.yaml: a learning rate changed in the file was not used, unsaid (with
    --data-changed too, whose record of the data made the stage look started)."""
    import yaml

    from toolkit.config.pipeline import load_pipeline
    from toolkit.launch.pipeline import PipelineDir

    overrides = ["sft.transport.startup_timeout_s=1"]  # (the stage fails at once: nothing trains in the test)
    pipeline = load_pipeline(EXAMPLES / "tiny-pipeline.yaml", overrides)
    pd = PipelineDir(tmp_path / "p").create(pipeline, overrides)
    for cfg in pipeline.configs(pd.path):
        pd.stage(cfg.stage).create(cfg)  # (as submit_pipeline does before each sbatch)
    made = json.loads(pd.file.read_text())
    pd.file.write_text(json.dumps({**made, "overrides": [*overrides, "sft.train.lr=0.0005"]}))  # (the file edited)
    result = cli("resume", pd.path, *flags, timeout=120)
    assert result.returncode == 1 and "pipeline stopped: stage sft failed" in result.stderr, result.stderr
    assert yaml.safe_load((pd.path / "sft" / "config.yaml").read_text())["train"]["lr"] == 0.0005


def test_a_finished_stage_is_not_said_to_take_an_edit_of_its_config(tiny, tmp_path, capsys):
    """A resume named the pipeline file's settings that a started stage does not follow with "to change them,
    edit RUN_DIR/config.yaml"; of a finished stage, that edit changed nothing (the pipeline skips it)."""
    import shutil

    from toolkit.config.pipeline import load_pipeline
    from toolkit.launch.pipeline import PipelineDir, check_started
    from toolkit.store.manifest import Manifest

    pipeline = load_pipeline(EXAMPLES / "tiny-pipeline.yaml")
    pd = PipelineDir(tmp_path / "p").create(pipeline)
    for cfg in pipeline.configs(pd.path)[:2]:  # sft finished, rm started
        rd = pd.stage(cfg.stage).create(cfg)
        Manifest(rd.path).append({"kind": "start"})
    pd.stage("sft").write_status({"state": "finished", "step": 54, "steps": 55})
    shutil.copytree(tiny / "model", pd.stage("sft").path / "export")  # (the model rm's config.yaml names)
    check_started(load_pipeline(EXAMPLES / "tiny-pipeline.yaml", ["sft.run.epochs=4", "rm.train.lr=0.01"]
                                ).configs(pd.path), pd)
    out = capsys.readouterr().out
    assert "the pipeline file now says otherwise for run.epochs (it finished, and is not run again: to run the " \
           "pipeline with them, start it anew in another --run-dir)" in out, out
    assert f"now says otherwise for train.lr (to change them, edit {pd.stage('rm').config})" in out, out


def test_a_started_stage_resubmitted_is_sized_by_its_own_config(tiny, tmp_path, monkeypatch):
    """`resume --submit` of a pipeline: a stage that started runs its config.yaml (the pipeline file's other
    settings are only named), but its job was sized from the pipeline file: 2 trainer tasks and 5 minutes
    for a driver that runs 1 worker with 240 (or too few tasks for the workers it starts)."""
    from toolkit.config.pipeline import load_pipeline
    from toolkit.launch.pipeline import PipelineDir, pipeline_jobs
    from toolkit.store.manifest import Manifest

    monkeypatch.setenv("PATH", str(tmp_path))  # (no Slurm here: sinfo is not asked)
    pipeline = load_pipeline(EXAMPLES / "tiny-pipeline.yaml", ["slurm.time_min=240"])
    pd = PipelineDir(tmp_path / "p").create(pipeline)
    sft = pipeline.configs(pd.path)[0]
    Manifest(pd.stage("sft").create(sft).path).append({"kind": "start"})  # (sft started, did not finish)
    edited = load_pipeline(EXAMPLES / "tiny-pipeline.yaml", ["slurm.time_min=5", "sft.placement.trainer.workers=2"])
    (cfg, allocation), *later = pipeline_jobs(edited.configs(pd.path), pd)
    assert cfg.stage == "sft" and cfg.slurm.time_min == 240 and cfg.placement.trainer.workers == 1
    assert [c.tasks_per_node for c in allocation.components] == [1]
    assert [c.slurm.time_min for c, _ in later] == [5, 5]  # (rm and rl have not started: the file as it is now)


def test_the_demo_script_answers_help_without_installing_or_running(tmp_path):
    """`bash tools/demo.sh --help` took `--help` for its run directory: it ran the setup and then a run into
    `$PWD/--help`. It now prints its usage, and refuses an option it does not know, before anything else."""
    helped = subprocess.run(["bash", str(REPO / "tools/demo.sh"), "--help"], cwd=tmp_path, capture_output=True,
                            text=True, timeout=60)
    assert helped.returncode == 0 and "bash tools/demo.sh [RUN_DIR]" in helped.stdout, helped.stdout + helped.stderr
    wrong = subprocess.run(["bash", str(REPO / "tools/demo.sh"), "--fast"], cwd=tmp_path, capture_output=True,
                           text=True, timeout=60)
    assert wrong.returncode == 2 and "demo.sh: unknown option --fast" in wrong.stderr, wrong.stderr
    assert list(tmp_path.iterdir()) == []
