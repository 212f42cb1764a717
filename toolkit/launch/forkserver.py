"""Fork server of the local launcher: workers start as forks of one process that has already imported what
every worker imports (torch, transformers, ZeroMQ, the worker's own modules), instead of each worker
importing it all again. On a machine with few cores those imports are most of a run's start-up: three
workers importing torch and transformers side by side cost about 3 x 5 s of CPU before any of them loads
a model.

The server is `python -m toolkit.launch.forkserver`, started by the local launcher with the run's
environment, in a session of its own (Ctrl-C reaches the driver, which decides when workers stop), and
it receives SIGTERM when the driver dies. It reads one JSON line per worker to start on stdin
({"worker", "env", "log"}) and writes JSON lines back: {"worker", "pid"} for each worker it started,
{"worker", "error"} for one it could not fork (at the process limit, or out of memory where the kernel does
not overcommit: the launcher then starts that worker as a fresh interpreter, and the server serves on), and
{"pid", "code"} for each that ended (code negative: killed by that signal, as `subprocess` reports it).
A worker forked here is what `python -m toolkit.worker` would be: a session of its own, SIGTERM when its
parent (this server) dies, stdin from /dev/null, stdout and stderr in its log, exactly the environment
it was given (with the server's allocator, which was preloaded before any import).

Used where it saves time: for a run with more workers than this machine has cores (with fewer, each
fresh interpreter imports on a core of its own, as fast as the server alone would, and a fork can only
come after the server's imports: a one-worker run took 0.7-2.6 s longer through the server). And only where
a fork inherits nothing a fresh interpreter would not have: on a machine without GPUs (a process that
has touched CUDA cannot be forked safely), and for a worker whose environment differs from the server's
only in what is read at run time (the launcher's SLURM_RLHF_* contract, GLOO_SOCKET_IFNAME,
OMP_NUM_THREADS). Elsewhere, and with SLURM_RLHF_FORK_SERVER=0, workers start as fresh interpreters, as
under Slurm; SLURM_RLHF_FORK_SERVER=1 uses the server whatever the number of cores.
"""

from __future__ import annotations

import ctypes
import importlib
import json
import os
import select
import signal
import subprocess
import sys
import threading
import time

SWITCH = "SLURM_RLHF_FORK_SERVER"  # 0: never; 1: also with as many cores as workers (not with GPUs)
# Read when used, not when imported: a worker's value may differ from the server's.
RUN_TIME_KEYS = ("GLOO_SOCKET_IFNAME", "OMP_NUM_THREADS")
# What every worker imports (the roles' own libraries, vLLM and DeepSpeed, are left to the roles).
PRELOAD = ("torch", "transformers", "transformers.modeling_utils", "transformers.models.auto.modeling_auto",
           "transformers.models.auto.tokenization_auto", "safetensors.torch", "zmq", "h5py", "toolkit.worker",
           "toolkit.config.load", "toolkit.transport.control", "toolkit.transport.sockets", "toolkit.roles")
# How long the launcher waits for the server to fork a worker (the first waits for the imports above).
SPAWN_TIMEOUT_S = 300.0
PR_SET_PDEATHSIG = 1


def die_with_parent() -> None:
    """SIGTERM this process when its parent dies (Linux' PR_SET_PDEATHSIG)."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    except OSError:
        pass


def usable(groups) -> bool:
    """Whether the local launcher starts these worker groups through a fork server on this machine: only
    when there are more workers than cores. Otherwise each fresh interpreter imports on a core of its own
    as fast as the server would alone, and a fork only comes after the server's imports."""
    switch = os.environ.get(SWITCH, "")
    if switch == "0" or any(g.gpus_per_worker for g in groups):
        return False
    if switch != "1" and sum(g.workers for g in groups) <= len(os.sched_getaffinity(0)):
        return False
    return not any(os.path.exists(dev) for dev in ("/dev/nvidiactl", "/dev/kfd"))  # (NVIDIA, AMD)


# ----- the launcher's side ----------------------------------------------------------------------------


class ForkServer:
    """The server as the local launcher sees it: ask it for a worker, learn when one ended."""

    def __init__(self, env: dict[str, str], log_path) -> None:
        self.env = env
        with open(log_path, "ab") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "toolkit.launch.forkserver"], env=env, stdin=subprocess.PIPE,
                stdout=subprocess.PIPE, stderr=log, start_new_session=True, preexec_fn=die_with_parent)
        self._cond = threading.Condition()
        self._answers: dict[str, dict] = {}  # worker -> the server's answer: {"pid"}, or {"error"} (no fork)
        self._codes: dict[int, int] = {}     # pid -> exit code, as the server reports
        self.gone = False                    # the server ended (its workers got SIGTERM with it)
        self.closed = False                  # the launcher ended it, or gave up on it
        threading.Thread(target=self._read, name="fork-server", daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            message = json.loads(line)
            with self._cond:
                if "code" in message:
                    self._codes[message["pid"]] = message["code"]
                else:
                    self._answers[message["worker"]] = message
                self._cond.notify_all()
        with self._cond:
            self.gone = True
            self._cond.notify_all()

    def fits(self, env: dict[str, str]) -> bool:
        """Whether a fork of the server would be the same worker as a fresh `python -m toolkit.worker`
        with environment `env`."""
        differ = {k for k in env.keys() | self.env.keys() if env.get(k) != self.env.get(k)}
        return all(k.startswith("SLURM_RLHF_") or k in RUN_TIME_KEYS for k in differ)

    def spawn(self, worker_id: str, env: dict[str, str], log_path) -> "Forked | None":
        """Worker `worker_id` forked by the server; None when the server cannot: it ended, it did not answer
        within SPAWN_TIMEOUT_S (then it is stopped, so that it starts nothing later), or its fork failed (then
        the worker's log says so)."""
        if self.gone or self.closed:
            return None
        with self._cond:
            self._answers.pop(worker_id, None)
        try:
            self.proc.stdin.write(json.dumps({"worker": worker_id, "env": env, "log": str(log_path)}).encode() + b"\n")
            self.proc.stdin.flush()
        except OSError:  # (it ended)
            return None
        with self._cond:
            self._cond.wait_for(lambda: worker_id in self._answers or self.gone, SPAWN_TIMEOUT_S)
            answer = self._answers.get(worker_id, {})
        if "error" in answer:
            with open(log_path, "a") as log:
                log.write(f"fork server: cannot fork worker {worker_id} ({answer['error']}); it starts as a fresh "
                          "interpreter\n")
            return None
        pid = answer.get("pid")
        if pid is None:
            self.close()
            return None
        return Forked(self, pid)

    def code(self, pid: int, timeout_s: float | None = 0.0) -> int | None:
        """Exit code of worker `pid` once it ended (waiting up to `timeout_s`, None: no limit); None while it runs."""
        with self._cond:
            self._cond.wait_for(lambda: pid in self._codes or self.gone, timeout_s)
            if pid in self._codes:
                return self._codes[pid]
        if self.gone:  # no one reports its end now: it got SIGTERM when the server died
            deadline = time.monotonic() + (timeout_s if timeout_s is not None else 1e9)
            while _alive(pid):
                if time.monotonic() >= deadline:
                    return None
                time.sleep(0.1)
            return self._codes.setdefault(pid, -signal.SIGTERM)
        return None

    def close(self) -> None:
        """End the server (its workers were stopped before) and reap it."""
        self.closed = True
        try:
            self.proc.stdin.close()
        except OSError:
            pass
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=10)


class Forked:
    """A worker started by the fork server, with what the launcher uses of `subprocess.Popen`."""

    def __init__(self, server: ForkServer, pid: int) -> None:
        self.server, self.pid, self.returncode = server, pid, None

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = self.server.code(self.pid)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            self.returncode = self.server.code(self.pid, timeout)
            if self.returncode is None:
                raise subprocess.TimeoutExpired(f"worker pid {self.pid}", timeout)
        return self.returncode


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


# ----- the server -------------------------------------------------------------------------------------


def serve() -> None:
    from toolkit.launch.openmp import wait_passively
    from toolkit.launch.preload import reexec_with_preloads

    reexec_with_preloads()  # (the workers inherit them: an allocator must be there before any import)
    wait_passively()  # (read when torch's OpenMP loads, in the imports below)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    replies = os.dup(1)
    os.dup2(2, 1)  # (whatever an import prints goes to the server's log, not into the replies)
    started = time.monotonic()
    print(f"fork server (pid {os.getpid()}): importing {', '.join(PRELOAD)}", file=sys.stderr, flush=True)
    for name in PRELOAD:
        try:
            importlib.import_module(name)
        except Exception as e:  # a worker that needs it fails on its own, with its own message
            print(f"fork server: importing {name} failed: {e!r}", file=sys.stderr, flush=True)
    print(f"fork server: ready in {time.monotonic() - started:.1f} s", file=sys.stderr, flush=True)
    children: set[int] = set()
    pending = b""
    while True:
        readable, _, _ = select.select([0], [], [], 0.1)
        _reap(children, replies)
        if not readable:
            continue
        chunk = os.read(0, 1 << 16)
        if not chunk:
            break  # the launcher is done (it stopped every worker first) or gone (SIGTERM follows)
        pending += chunk
        while b"\n" in pending:
            line, pending = pending.split(b"\n", 1)
            request = json.loads(line)
            try:
                pid = _fork_worker(request["env"], request["log"], replies)
            except OSError as e:  # (EAGAIN at the process limit; ENOMEM where the kernel does not overcommit)
                print(f"fork server: cannot fork worker {request['worker']}: {e!r}", file=sys.stderr, flush=True)
                _reply(replies, {"worker": request["worker"], "error": repr(e)})
                continue
            children.add(pid)
            _reply(replies, {"worker": request["worker"], "pid": pid})
    deadline = time.monotonic() + 10
    while children and time.monotonic() < deadline:
        _reap(children, replies)
        time.sleep(0.1)
    sys.stderr.flush()
    os._exit(0)  # (an interpreter's clean-up after torch takes seconds, and has nothing to clean here)


def _reply(fd: int, message: dict) -> None:
    try:
        os.write(fd, json.dumps(message).encode() + b"\n")
    except OSError:  # (the launcher is gone)
        pass


def _reap(children: set[int], replies: int) -> None:
    while children:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        children.discard(pid)
        _reply(replies, {"pid": pid, "code": os.waitstatus_to_exitcode(status)})


def _fork_worker(env: dict[str, str], log_path: str, replies: int) -> int:
    sys.stdout.flush()
    sys.stderr.flush()
    server = os.getpid()
    pid = os.fork()
    if pid:
        return pid
    try:  # (the worker, from here on)
        os.setsid()
        die_with_parent()
        if os.getppid() != server:  # (the server died before the line above)
            os._exit(128 + signal.SIGTERM)
        log = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.dup2(log, 1)
        os.dup2(log, 2)
        for fd in (log, null, replies):
            os.close(fd)
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        from toolkit.launch.preload import CHECKED

        threads = env.get("OMP_NUM_THREADS", "")
        if threads.isdigit() and int(threads) > 0 and threads != os.environ.get("OMP_NUM_THREADS"):
            import torch

            torch.set_num_threads(int(threads))
        inherited = {k: os.environ[k] for k in ("LD_PRELOAD", CHECKED) if k in os.environ}
        os.environ.clear()
        os.environ.update({**env, **inherited})
        from toolkit.worker import main

        main()  # (ends the process itself)
    except BaseException:
        import traceback

        traceback.print_exc()
        sys.stderr.flush()
    os._exit(1)


if __name__ == "__main__":
    serve()
