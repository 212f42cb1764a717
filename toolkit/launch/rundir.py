"""The run directory: resolved config, secret, logs, metrics, status; readable by its owner only.

    RUN_DIR/config.yaml     the resolved config (absolute paths, defaults filled in)
    RUN_DIR/secret          the per-run secret that authenticates every ZeroMQ frame (mode 600)
    RUN_DIR/logs/           driver.log and one log per worker (<group>-<rank>.log)
    RUN_DIR/metrics.jsonl   one JSON object per step
    RUN_DIR/status.json     state of the run and of every worker (rewritten atomically)
    RUN_DIR/job.json        the Slurm job (id, batch node, driver pid), for `status` and `cancel`
    RUN_DIR/driver.lock     locked (flock) while a local driver runs the directory: `resume` cannot start
                            a second one beside it; it names that driver (pid, node, start) for `cancel`
    RUN_DIR/job.lock        locked (flock) while a Slurm job's driver runs the directory: a second job of the
                            directory (`sbatch job.sbatch` twice) stops at start (`hold_job_lock`)
    RUN_DIR/slurm/          the batch script, Submitit's files and the job's own output
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shlex
import tempfile
from pathlib import Path

from toolkit.config import RunConfig, dump_config
from toolkit.errors import ConfigError
from toolkit.flock import take
from toolkit.newdir import check_new
from toolkit.transport.wire import new_secret


LOCK_WAIT_S = 1.0
"""How long a driver tries to lock its run directory before it takes it for another driver's: a process
that follows the run (`lock_held`, `eval --follow`) holds the lock a moment now and then."""


class RunDir:
    def __init__(self, path: str | os.PathLike):
        self.path = Path(path).resolve()
        self._lock = None  # (driver.lock, open and locked while this process runs the directory)

    config = property(lambda self: self.path / "config.yaml")
    secret = property(lambda self: self.path / "secret")
    logs = property(lambda self: self.path / "logs")
    metrics = property(lambda self: self.path / "metrics.jsonl")
    status = property(lambda self: self.path / "status.json")
    job = property(lambda self: self.path / "job.json")

    def create(self, cfg: RunConfig) -> "RunDir":
        """Make a new run directory for `cfg`; an existing run is never overwritten."""
        if self.config.exists():
            raise ConfigError(f"{self.path} already holds a run (config.yaml); continue it with `slurm-rlhf resume "
                              f"{shlex.quote(str(self.path))}`, or choose another --run-dir (or remove that directory)")
        check_new(self.path, f"--run-dir {self.path}", "run")
        self.private()
        self.logs.mkdir(exist_ok=True)
        self.write_atomic(self.config, dump_config(cfg))
        fd = os.open(self.secret, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(new_secret())
        return self

    def private(self) -> None:
        """What this process (and the processes it starts: workers, sbatch and so Slurm's output files) writes
        from now on is readable by this user alone, and so is the directory (made if missing), whatever the
        user's umask."""
        os.umask(0o077)
        self.path.mkdir(parents=True, exist_ok=True)
        if self.path.stat().st_uid == os.getuid():  # (another user's directory keeps its mode, as it must)
            self.path.chmod(0o700)

    def hold_lock(self) -> None:
        """Lock the directory for this process's lifetime (or until `release_lock`), and make what it writes
        there private; ConfigError if another process holds it. Where the file system has no locks, nothing
        is held."""
        if self._lock is not None:
            return
        self.private()  # (a resume runs with the user's umask, often 022, unless set here)
        if self._take("driver.lock") is False:
            pid = self.lock_holder().get("pid")
            raise ConfigError(f"{self.path} is still running: its local driver{f' (pid {pid})' if pid else ''} "
                              f"holds driver.lock; let it end, or stop it with `slurm-rlhf cancel {self.path}`, "
                              "then resume")

    def hold_job_lock(self) -> bool:
        """Lock job.lock for this process's lifetime: a Slurm job's driver, so that a second job of the same
        directory cannot run beside it. Whether it was taken (also where the file system has no locks:
        then nothing is held, and the job-state check of `batch` stands alone)."""
        return self._lock is not None or self._take("job.lock") is not False

    def _take(self, name: str) -> bool | None:
        """Lock RUN_DIR/`name` (flock) and keep it until this process ends or `release_lock`: True when taken,
        False when another process holds it, None where the file system has no locks (nothing is held)."""
        lock = os.fdopen(os.open(self.path / name, os.O_WRONLY | os.O_CREAT, 0o600), "w")
        try:
            taken = take(lock.fileno(), LOCK_WAIT_S, 0.05)
        except OSError:  # (no locks on this file system)
            lock.close()
            return None
        if not taken:
            lock.close()
            return False
        self._lock = lock
        if name == "driver.lock":  # (status.json names the driver only once its workers start: `lock_holder`)
            import psutil

            from toolkit.launch.env import node_name

            lock.truncate(0)
            lock.write(json.dumps({"pid": os.getpid(), "node": node_name(),
                                   "started": psutil.Process().create_time()}))
            lock.flush()
        return True

    def lock_holder(self) -> dict:
        """The local driver that holds driver.lock now, as it wrote it there as it took it ({pid, node, started}),
        or as status.json names it ({} if neither says). A driver writes status.json once its workers start,
        seconds to minutes after it took the lock; until then that file is missing or names the driver before
        it (`cancel` said there was none, or that it had ended, and the run went on)."""
        try:
            holder = json.loads((self.path / "driver.lock").read_text() or "{}")
        except (OSError, ValueError):
            holder = {}
        if isinstance(holder, dict) and holder.get("pid"):
            return holder
        return self.read_json(self.status).get("driver", {})

    def running_driver(self) -> dict:
        """The local driver that runs the directory now, as `lock_holder` gives it; {} while none holds the lock."""
        return self.lock_holder() if self.lock_held() else {}

    def lock_held(self) -> bool:
        """Whether a process holds the directory's lock (`hold_lock`: a local driver runs it now). It takes
        the lock shared for a moment to see: a driver starting just then tries again (`LOCK_WAIT_S`)."""
        try:
            probe = os.open(self.path / "driver.lock", os.O_RDONLY)
        except FileNotFoundError:
            return False
        try:
            fcntl.flock(probe, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        except OSError:  # (no locks on this file system: nothing is ever held)
            return False
        finally:
            os.close(probe)
        return False

    def release_lock(self) -> None:
        lock, self._lock = self._lock, None
        if lock is not None:
            lock.close()

    def rendered_only(self) -> bool:
        """Whether the directory holds a config that `render` wrote and nothing has run from: no job
        submitted, no status, no metrics, no committed experience or checkpoint."""
        started = (self.job, self.status, self.metrics, self.path / "manifest.jsonl", self.path / "experience",
                   self.path / "checkpoints")
        return self.config.exists() and not any(p.exists() for p in started)

    def rewrite_config(self, cfg: RunConfig) -> "RunDir":
        """Replace the config of a directory nothing has run from (the secret stays)."""
        self.private()
        self.write_atomic(self.config, dump_config(cfg))
        return self

    def log_file(self, worker_id: str) -> Path:
        return self.logs / f"{worker_id.replace(':', '-')}.log"

    def append_metrics(self, record: dict) -> None:
        from toolkit.store.manifest import append_jsonl

        append_jsonl(self.metrics, record)

    def write_status(self, status: dict) -> None:
        self.write_atomic(self.status, json.dumps(status, indent=1))

    def read_json(self, path: Path) -> dict:
        """A JSON file of the run directory ({} if it does not exist yet); ConfigError naming it where it holds
        no JSON object (it is written whole and renamed into place: cut or changed since, a full disk, an edit;
        `status` and `report` ended in a JSONDecodeError's traceback)."""
        try:
            raw = path.read_bytes()
        except FileNotFoundError:
            return {}
        try:
            data = json.loads(raw)
        except ValueError as e:  # (JSONDecodeError, UnicodeDecodeError)
            what = "empty" if not raw.strip() else f"not valid JSON ({e})"
        else:
            if isinstance(data, dict):
                return data
            what = f"not a JSON object (a {type(data).__name__})"
        raise ConfigError(f"{path}: {what}; slurm-rlhf writes it whole, so it was cut or changed since; move it "
                          "aside (the run's driver writes its state again when it runs: `slurm-rlhf resume`)")

    def update_job(self, **fields) -> None:
        self.write_atomic(self.job, json.dumps({**self.read_json(self.job), **fields}, indent=1))

    @staticmethod
    def write_atomic(path: Path, text: str) -> None:
        """Write `path` whole or not at all, through a temporary file of a name of its own in the same
        directory: two processes writing the file at once (two drivers, a driver and `cancel`) never
        replace or remove each other's temporary file (a fixed name crashed one of them)."""
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
        try:
            with os.fdopen(fd, "w") as f:
                f.write(text)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
            raise
