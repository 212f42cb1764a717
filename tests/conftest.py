"""Shared fixtures: the tiny model set (built offline once), config writing, CLI runs, process checks."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]
# DeepSpeed's compiled ops: the cache tools/setup.sh fills (workers use it too).
os.environ.setdefault("TORCH_EXTENSIONS_DIR", os.path.join(sys.prefix, "torch_extensions"))
EXAMPLES = REPO / "templates" / "examples"


_CONFIG = None  # (pytest's config, for the hook below)


def pytest_addoption(parser) -> None:
    parser.addoption("--part", choices=("slurm", "rest"), default=None,
                     help="run only the tests marked slurm, or only the rest (tools/test.sh runs the two side by "
                          "side: the Slurm tests spend much of their time waiting on Slurm)")


def pytest_configure(config) -> None:
    global _CONFIG
    _CONFIG = config
    # A suite started in the background of a shell (tools/test.sh's Slurm part, or under `nohup ... &`) starts
    # with SIGINT ignored: take it back, so that SIGINT stops it with its fixtures torn down (runs ended,
    # jobs cancelled) rather than not at all.
    import signal

    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)


def pytest_collection_modifyitems(config, items) -> None:
    part = config.getoption("--part")
    if part is not None:
        keep = [item for item in items if (item.get_closest_marker("slurm") is not None) == (part == "slurm")]
        config.hook.pytest_deselected(items=[item for item in items if item not in keep])
        items[:] = keep
    if getattr(config.option, "dist", "no") == "loadfile":
        # pytest-xdist hands out whole files in this order (with --no-loadscope-reorder; tools/test.sh): the
        # files with the most tests that start real processes (tens of seconds each) first, so that the last
        # files handed out, while the other worker ends its own, are the short ones.
        files: dict[str, list] = {}
        for item in items:
            files.setdefault(item.nodeid.split("::")[0], []).append(item)
        heavy = {name: sum(item.get_closest_marker("integration") is not None for item in tests)
                 for name, tests in files.items()}
        items[:] = [item for name in sorted(files, key=lambda name: -heavy[name]) for item in files[name]]


@contextlib.contextmanager
def short_tmpdir():
    """A directory for a run's TMPDIR, short enough for the workers' own directories in it (vLLM's sockets
    there must stay under 107 bytes; pytest's tmp_path is deeper), removed after with what is left in it."""
    path = Path(tempfile.mkdtemp(prefix="srl-"))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def left_in(tmp: Path) -> list[str]:
    """What a run left in its TMPDIR `tmp`: everything but torch.compile's cache, which stays on purpose."""
    return [p.name for p in tmp.iterdir() if not p.name.startswith("torchinductor_")]


@pytest.fixture(scope="session", autouse=True)
def tmpdir_of_the_tests():
    """Every process that the tests start gets this test process's own TMPDIR, removed at the end: what
    the runs that tests kill with SIGKILL on purpose leave there (each worker's own directory) goes with
    it. This process's own temporary files (pytest's tmp_path) stay where they were."""
    given = os.environ.get("TMPDIR")
    tempfile.gettempdir()  # (this process's, fixed before TMPDIR changes)
    with short_tmpdir() as path:
        os.environ["TMPDIR"] = str(path)
        try:
            yield path
        finally:
            if given is None:
                del os.environ["TMPDIR"]
            else:
                os.environ["TMPDIR"] = given


@pytest.fixture(autouse=True)
def no_process_left_behind(request):
    """After each test, end every process of a run under its tmp_path that is still alive (a driver, by its
    command line; a worker or what it started, by SLURM_RLHF_RUN_DIR): a test that fails half-way must not
    leave processes that slow down or break the tests after it. Each is named on stderr."""
    yield
    tmp = request.node.funcargs.get("tmp_path")
    if tmp is None:
        return
    import signal

    import psutil

    mine, marker = os.getpgrp(), str(tmp)
    for proc in psutil.process_iter():
        try:
            if proc.pid == os.getpid() or not (marker in " ".join(proc.cmdline())
                                               or marker in proc.environ().get("SLURM_RLHF_RUN_DIR", "")):
                continue
            group = os.getpgid(proc.pid)
            print(f"\n{request.node.nodeid}: left process {proc.pid} ({' '.join(proc.cmdline())[:120]}); killed",
                  file=sys.stderr)
            if group != mine:
                os.killpg(group, signal.SIGKILL)
            else:
                proc.kill()
        except (psutil.Error, ProcessLookupError, PermissionError):
            pass


def pytest_runtest_logreport(report) -> None:
    """Print a failure's last lines the moment it happens, not only in the summary at the end: a CI run
    cut off by its time limit still says why its tests failed, and how long each took."""
    if not report.failed:
        return
    reporter = _CONFIG and _CONFIG.pluginmanager.get_plugin("terminalreporter")
    if reporter is None:
        return
    tail = report.longreprtext.splitlines()[-25:]
    reporter.write_line("")
    reporter.write_line(f"--- {report.when} of {report.nodeid} failed after {report.duration:.0f} s:")
    for line in tail:
        reporter.write_line(f"    {line}")


@pytest.fixture(scope="session")
def tiny() -> Path:
    """models/tiny: tiny Llama, tokenizer, reward model and prompts (seeded, built once)."""
    from toolkit.tiny import build_tiny

    return build_tiny(REPO / "models" / "tiny")


def two_generator_grpo(tiny: Path, directory: Path, name: str) -> Path:
    """The config of a deterministic 6-step GRPO run with two vLLM generator workers, messages of at most
    2 MB."""
    return write_config(directory, example("tiny-grpo.yaml", tiny, run={"steps": 6, "seed": 3, "deterministic": True,
                                                                        "name": name},
                                           placement={"generator": {"workers": 2}}, transport={"max_message_mb": 2}))


@pytest.fixture(scope="session")
def two_generator_run(tiny, tmp_path_factory) -> Path:
    """`two_generator_grpo` run in a directory whose path has a space and a quote: test_runs checks the run,
    test_hostile_frames runs it again under attack and compares."""
    tmp = tmp_path_factory.mktemp("two-generators")
    run_dir = tmp / "my runs" / "it's grpo"
    result = cli("run", two_generator_grpo(tiny, tmp, "quiet"), "--run-dir", run_dir)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "step   6/6" in result.stdout and "done in" in result.stdout
    return run_dir


def exact_grpo(tiny: Path, directory: Path, **sections) -> Path:
    """The config of a deterministic 6-step GRPO run: vLLM, seed 5, a checkpoint every 2 steps, an EMA of the
    actor, W&B offline; `sections` merged in."""
    return write_config(directory, example("tiny-grpo.yaml", tiny, run={"steps": 6, "name": "exact", "seed": 5,
                                                                        "deterministic": True},
                                           checkpoint={"every_steps": 2}, trainer={"ema": 0.9},
                                           wandb={"project": "resume-test", "mode": "offline"}, **sections))


@pytest.fixture(scope="session")
def exact_run(tiny, tmp_path_factory) -> Path:
    """An uninterrupted `exact_grpo` run: the baseline of test_resume's interrupted runs, and the Separation
    run that test_placement's Flattening run with vLLM is compared with (its first 5 steps)."""
    tmp = tmp_path_factory.mktemp("exact")
    result = cli("run", exact_grpo(tiny, tmp), "--run-dir", tmp / "run")
    assert result.returncode == 0, result.stdout + result.stderr
    return tmp / "run"


def write_config(directory: Path, data: dict, name: str = "run.yaml") -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / name
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def example(name: str, tiny: Path, **sections) -> dict:
    """An example config with absolute paths to the tiny set, sections overridden (merged one level deep)."""
    data = yaml.safe_load((EXAMPLES / name).read_text())
    data["data"]["prompts"] = str(tiny / "prompts.jsonl")
    data["model"]["actor"] = str(tiny / "model")
    for rm in data.get("reward", {}).get("models", []):
        rm["path"] = str(tiny / "reward_model")
    for key, value in sections.items():
        if isinstance(value, dict) and isinstance(data.get(key), dict):
            data[key] = {**data[key], **value}
        else:
            data[key] = value
    return data


def cli(*args, timeout: float = 600, env: dict | None = None, **kwargs) -> subprocess.CompletedProcess:
    """Run `slurm-rlhf ARGS` as a user would; returns the completed process (text output)."""
    return subprocess.run([sys.executable, "-m", "toolkit", *map(str, args)], capture_output=True, text=True,
                          timeout=timeout, cwd=kwargs.pop("cwd", REPO), env={**os.environ, **(env or {})}, **kwargs)


def alive(pids) -> list[int]:
    """Those of `pids` that are still running (zombies count as gone)."""
    import psutil

    out = []
    for pid in pids:
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                out.append(pid)
        except psutil.NoSuchProcess:
            pass
    return out


def worker_pids(run_dir: Path) -> dict[str, int]:
    """Each worker's pid, as the run's status.json lists it."""
    status = json.loads((run_dir / "status.json").read_text())
    return {w: entry["pid"] for w, entry in status["workers"].items() if entry.get("pid")}


def fork_server_pids(run_dir: Path) -> list[int]:
    """The pids of the local launcher's fork servers (toolkit/launch/forkserver.py) the run's attempts and
    resumes started, from their log."""
    log = run_dir / "logs" / "fork-server.log"
    return [int(pid) for pid in re.findall(r"fork server \(pid (\d+)\)", log.read_text())] if log.exists() else []


def assert_no_workers_left(run_dir: Path) -> None:
    """Every worker status.json lists, and the fork server that started them, has ended (within 15 s)."""
    pids = worker_pids(run_dir)
    assert pids, "status.json lists no workers"
    pids.update({f"fork server {i}": pid for i, pid in enumerate(fork_server_pids(run_dir))})
    deadline = time.monotonic() + 15
    while alive(pids.values()) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not alive(pids.values()), f"workers still running: {pids}"


def experience_commits(run_dir: Path) -> int:
    """Experience batches the run's manifest lists as committed."""
    path = run_dir / "manifest.jsonl"
    if not path.exists():
        return 0
    return sum('"kind": "experience"' in line for line in path.read_text().splitlines())


def assert_clean_logs(run_dir: Path) -> None:
    """A run that succeeded leaves no traceback in any log, and no warning of weights that failed to load."""
    for log in sorted((run_dir / "logs").glob("*.log")):
        text = log.read_text()
        assert "Traceback" not in text, f"{log}:\n{text[text.index('Traceback') - 500:][:3000]}"
        assert "Failed to load weights" not in text, log


def metric_lines(run_dir: Path) -> int:
    """Steps whose metrics the run has written."""
    path = run_dir / "metrics.jsonl"
    return len(path.read_text().splitlines()) if path.exists() else 0


def running(pid: int) -> bool:
    """Whether process `pid` runs (a zombie that nobody reaps has ended)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except FileNotFoundError:
        return False


def with_bos(tokenizer_dir: Path, out: Path):
    """The tokenizer of `tokenizer_dir` adding BOS to text, as Llama-3's, Gemma's and Mistral's do (the tiny one
    adds none), saved in `out` and loaded from there."""
    from tokenizers import Tokenizer, processors
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    from toolkit.tiny import CHAT_TEMPLATE

    tok = Tokenizer.from_file(str(Path(tokenizer_dir) / "tokenizer.json"))
    bos = [("<s>", tok.token_to_id("<s>"))]
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=bos)
    PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
                            padding_side="left", chat_template=CHAT_TEMPLATE).save_pretrained(out)
    return AutoTokenizer.from_pretrained(out)


@contextlib.contextmanager
def killed_at_exit(proc: subprocess.Popen):
    """Ends the block with `proc`'s process group (a run started in a session of its own) killed and reaped
    if the run still runs: a failed assertion or a timeout inside leaves no run behind."""
    import signal

    try:
        yield proc
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def start_held(config: Path, run_dir: Path, hold: str, stdout=subprocess.PIPE, timeout_s: float = 900,
               extra: list[str] = (), held_in: Path | None = None) -> tuple[subprocess.Popen, int]:
    """`slurm-rlhf run CONFIG` (with `extra` arguments) in a session of its own, its first process to reach
    `hold` (a moment of toolkit/hold.py, e.g. `training@3`) held there: (the driver's process, text output
    to `stdout`; the held process's pid) once it is held (in `held_in`, a pipeline's stage, else `run_dir`).
    The run is killed with its group if it never is."""
    import signal

    from toolkit.hold import ENV, held_pid

    proc = subprocess.Popen([sys.executable, "-m", "toolkit", "run", str(config), "--run-dir", str(run_dir), *extra],
                            cwd=REPO, stdout=stdout, stderr=subprocess.STDOUT, text=True, start_new_session=True,
                            env={**os.environ, ENV: hold})
    try:
        deadline = time.monotonic() + timeout_s
        while not (pid := held_pid(held_in or run_dir, hold)):
            assert proc.poll() is None and time.monotonic() < deadline, f"the run ended or stalled before {hold}"
            time.sleep(0.1)
    except BaseException:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        raise
    return proc, pid


def run_and_kill(config: Path, run_dir: Path, after_commits: int | None = None, timeout_s: float = 900,
                 until=None, hold: str | None = None) -> None:
    """Start `slurm-rlhf run CONFIG` and SIGKILL it (its process group and every worker's) right after its
    `after_commits`-th experience commit (or once `until()` holds), as a crash would. With `hold` (a
    moment of toolkit/hold.py, e.g. `training@7`) the run waits there until it is killed, so the kill
    lands at that moment however busy the machine is. `timeout_s` bounds a hang, not a pace: a run of the
    resume tests' size reached its kill after over 300 s on a machine that ran five other test runs."""
    import signal

    from toolkit.hold import ENV, held_file

    done = until or (lambda: experience_commits(run_dir) >= after_commits)
    if hold:  # (held there, and what `until` waits for written: the driver may lag behind the workers)
        held, then = held_file(run_dir, hold), done if until else (lambda: True)
        done = lambda: held.exists() and then()  # noqa: E731
    env = {**os.environ, ENV: hold} if hold else None
    proc = subprocess.Popen([sys.executable, "-m", "toolkit", "run", str(config), "--run-dir", str(run_dir)],
                            cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
                            env=env)
    with killed_at_exit(proc):
        deadline = time.monotonic() + timeout_s
        while not done():
            assert proc.poll() is None and time.monotonic() < deadline, "the run ended or stalled before the kill"
            time.sleep(0.05)
        workers = [w["pid"] for w in json.loads((run_dir / "status.json").read_text())["workers"].values()]
        for pgid in [proc.pid, *workers]:  # every worker leads its own process group
            try:
                os.killpg(pgid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        proc.wait(timeout=30)


def tensorboard_scalars(directory: Path) -> dict[str, dict[int, float]]:
    """{tag: {step: value}} of the event files under `directory`, read as TensorBoard reads them: files
    in the order they were written, a session START at step N dropping earlier values of steps >= N."""
    import struct

    from tensorboardX.proto.event_pb2 import Event, SessionLog

    scalars: dict[str, dict[int, float]] = {}
    for path in sorted(Path(directory).glob("events.out.tfevents.*")):  # (named by creation time)
        data, offset = path.read_bytes(), 0
        while offset < len(data):
            (length,) = struct.unpack_from("<Q", data, offset)
            event = Event.FromString(data[offset + 12: offset + 12 + length])
            offset += 12 + length + 4  # (length, its CRC, the record, its CRC)
            if event.HasField("session_log") and event.session_log.status == SessionLog.START:
                for values in scalars.values():
                    for step in [s for s in values if s >= event.step]:
                        del values[step]
            for value in event.summary.value:
                scalars.setdefault(value.tag, {})[event.step] = value.simple_value
    return scalars


def wandb_history(run_dir: Path) -> list[list[dict]]:
    """The history rows ({tag: value, "_step": step}) of every offline W&B run file under RUN_DIR/wandb, one
    list per file in the order written. The files are LevelDB-style logs (a 7-byte ':W&B' header, 32 KiB
    blocks of records [crc32, length, type] holding protobuf Records), read here as `wandb sync` reads them."""
    import struct

    from wandb.proto import wandb_internal_pb2 as pb

    runs = []
    for path in sorted(Path(run_dir).glob("wandb/offline-run-*/run-*.wandb")):
        data, pos, pending, rows = path.read_bytes(), 7, b"", []
        assert data[:4] == b":W&B", path
        while pos + 7 <= len(data):
            left = 32768 - pos % 32768
            crc, length, kind = struct.unpack("<IHB", data[pos:pos + 7]) if left >= 7 else (0, 0, 0)
            if kind == 0:  # the padding at a block's end
                pos += left
                continue
            chunk, pos = data[pos + 7:pos + 7 + length], pos + 7 + length
            pending = chunk if kind in (1, 2) else pending + chunk  # FULL, FIRST / MIDDLE, LAST
            if kind in (1, 4):
                record = pb.Record.FromString(pending)
                if record.WhichOneof("record_type") == "history":
                    rows.append({i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in record.history.item})
        runs.append(rows)
    return runs


@contextlib.contextmanager
def tmpfs(path: Path, size: str):
    """A tmpfs of `size` (e.g. "256m") mounted at `path` (made here; root only, else the test is skipped),
    unmounted after."""
    path.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size},mode=0700", "tmpfs", str(path)],
                             capture_output=True, text=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here (needs root): {mounted.stderr.strip()}")
    try:
        yield path
    finally:
        if subprocess.run(["umount", str(path)], capture_output=True).returncode != 0:
            subprocess.run(["umount", "-l", str(path)], capture_output=True)


@pytest.fixture
def small_disk(tmp_path):
    """A 256 MB tmpfs mounted under tmp_path."""
    with tmpfs(tmp_path / "disk", "256m") as disk:
        yield disk
