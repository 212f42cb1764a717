"""Worker entry point (`python -m toolkit.worker`): one OS process hosting the roles of one group rank.

Life of a worker: read the environment contract and the run's resolved config; register with the
coordinator (group, rank, node, pid, the address of its inbox); wait for `start` with the address book
of every worker; set up its role (load models, join process groups); report `ready`; serve data and
commands until `shutdown`. Any exception is reported to the coordinator as `failed` (with the
traceback's last lines) before the process exits non-zero.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import time
import traceback

log = logging.getLogger("toolkit.worker")


class Worker:
    def __init__(self, wenv, cfg):
        import zmq

        from toolkit.placement.plan import plan
        from toolkit.transport.control import ControlClient, Heartbeat
        from toolkit.transport.sockets import Inbox
        from toolkit.transport.wire import Codec, read_secret

        self.wenv, self.cfg = wenv, cfg
        self.id, self.rank = wenv.worker_id, wenv.rank
        self.groups = plan(cfg)
        self.group = next(g for g in self.groups if g.name == wenv.group)
        self.ctx = zmq.Context()
        secret = read_secret(wenv.secret_file)
        self.codec = Codec(secret, self.id)
        self.control = ControlClient(self.ctx, self.codec, wenv.control, self.id)
        t = cfg.transport
        self.heartbeat = Heartbeat(self.ctx, secret, wenv.control, self.id, t.heartbeat_interval_s,
                                   t.heartbeat_timeout_s, self._coordinator_lost)
        self.status = self.heartbeat.status
        has_inbox = self.group.receives_on_every_rank or self.rank == 0
        self.inbox = Inbox(self.ctx, self.codec, wenv.bind_host, t.max_inflight_messages) if has_inbox else None
        self.outbox = None
        self.book: dict = {}
        self.resume: dict | None = None

    def run(self) -> None:
        from toolkit.launch.env import node_name
        from toolkit.placement.plan import next_group
        from toolkit.roles import make_role
        from toolkit.transport.sockets import Outbox

        self.heartbeat.start()
        role = make_role(self)
        extra = role.prepare()
        self.status["phase"] = "registering"
        step = os.environ.get("SLURM_STEP_ID")
        self.control.send("register", group=self.group.name, rank=self.rank, pid=os.getpid(), node=node_name(),
                          inbox=self.inbox.address if self.inbox else None,
                          slurm_step=f"{os.environ.get('SLURM_JOB_ID')}.{step}" if step else None, **extra)
        start = self.wait_command("start", self.cfg.transport.startup_timeout_s)
        self.book = start.meta["book"]
        self.resume = start.meta.get("resume")
        target = next_group(self.groups, self.group)
        if target is not None:
            addresses = [self.book[w]["inbox"] for w in target.worker_ids() if self.book[w]["inbox"]]
            self.outbox = Outbox(self.ctx, self.codec, addresses, self.cfg.transport.max_inflight_messages)
        self.status["phase"] = "setup"
        role.setup()
        self.status["phase"] = "ready"
        self.control.send("ready", **role.ready_info())
        role.serve()
        role.close()
        self.control.send("bye")

    def wait_command(self, kind: str, timeout_s: float):
        """Block until the coordinator sends `kind` (a `shutdown` instead ends the worker)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            msg = self.control.recv(min(1.0, max(0.0, deadline - time.monotonic())))
            if msg is None:
                continue
            if msg.kind == kind:
                return msg
            if msg.kind == "shutdown":
                raise SystemExit(0)
            log.warning("ignored command %r while waiting for %r", msg.kind, kind)
        raise TimeoutError(f"no {kind!r} from the coordinator within {timeout_s:.0f} s")

    def next_event(self, timeout_s: float):
        """('command', msg) or ('data', msg) or None after `timeout_s`; commands first."""
        import zmq

        poller = zmq.Poller()
        poller.register(self.control.socket, zmq.POLLIN)
        if self.inbox is not None:
            poller.register(self.inbox.socket, zmq.POLLIN)
        ready = dict(poller.poll(int(timeout_s * 1000)))
        if self.control.socket in ready:
            msg = self.control.recv(0)
            if msg is not None:
                return "command", msg
        if self.inbox is not None and self.inbox.socket in ready:
            msg = self.inbox.recv(0)
            if msg is not None:
                return "data", msg
        return None

    def rejected_frames(self) -> int:
        return sum(self.control.rejected.values()) + (sum(self.inbox.rejected.values()) if self.inbox else 0)

    def _coordinator_lost(self, silent_s: float) -> None:
        log.error("no answer from the coordinator for %.0f s: the driver is gone; exiting", silent_s)
        _end_children()
        logging.shutdown()
        os._exit(3)


def _end_children() -> None:
    """Kill every process this worker started (vLLM engine or compile workers), depth first."""
    try:
        import psutil

        for child in psutil.Process().children(recursive=True):
            try:
                child.kill()
            except psutil.Error:
                pass
    except Exception:  # best effort while dying
        pass


def _on_sigterm(signum, frame):
    log.warning("got SIGTERM; exiting")
    _end_children()
    logging.shutdown()
    os._exit(128 + signum)


def main() -> None:
    from toolkit.launch.env import WorkerEnv
    from toolkit.log import setup_logging

    os.umask(0o077)
    # DeepSpeed's compiled ops live with the installation (tools/setup.sh builds them there), so two
    # environments never overwrite each other's builds.
    os.environ.setdefault("TORCH_EXTENSIONS_DIR", os.path.join(sys.prefix, "torch_extensions"))
    wenv = WorkerEnv.from_environ()
    setup_logging(wenv.worker_id)
    signal.signal(signal.SIGTERM, _on_sigterm)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the driver decides when workers stop
    code, worker = 0, None
    try:
        from toolkit.config import load_config

        cfg = load_config(os.path.join(wenv.run_dir, "config.yaml"))
        log.info("worker %s starting (pid %d)", wenv.worker_id, os.getpid())
        worker = Worker(wenv, cfg)
        if worker.group.cpus_per_worker or cfg.run.deterministic:
            import torch

            torch.set_num_threads(worker.group.cpus_per_worker or 1)
            if cfg.run.deterministic:
                torch.use_deterministic_algorithms(True, warn_only=True)
                # ... without filling every torch.empty with NaN: DeepSpeed allocates 500M-element
                # gradient buckets each micro-step (2 GB written per step, 40x slower training).
                torch.utils.deterministic.fill_uninitialized_memory = False
        worker.run()
        log.info("worker %s done", wenv.worker_id)
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 0
    except BaseException as e:
        code = 1
        log.error("worker %s failed:\n%s", wenv.worker_id, traceback.format_exc())
        if worker is not None:
            lines = traceback.format_exception(e)
            try:
                worker.control.send("failed", error=f"{type(e).__name__}: {e}", traceback="".join(lines[-6:]))
            except Exception:
                pass
    finally:
        if worker is not None:
            worker.heartbeat.stop()
            worker.control.close()  # lingers up to 2 s so the last event gets out
        sys.stdout.flush()
        sys.stderr.flush()
        _end_children()
        logging.shutdown()
        os._exit(code)


if __name__ == "__main__":
    main()
