"""Worker entry point (`python -m toolkit.worker`): one OS process hosting the roles of one group rank.

Life of a worker: read the environment contract and the run's resolved config; register with the
coordinator (group, rank, node, pid, the address of its inbox); wait for `start` with the address book
of every worker; set up its role (load models, join process groups); report `ready`; serve data and
commands until `shutdown` (a supervised stage's trainer ranks run their training loop instead, then
wait for `shutdown`). Any exception is reported to the coordinator as `failed` (with the
traceback's last lines) before the process exits non-zero.
"""

from __future__ import annotations

import collections
import logging
import os
import signal
import sys
import tempfile
import time
import traceback

from toolkit.hold import hold

log = logging.getLogger("toolkit.worker")


class Worker:
    def __init__(self, wenv, cfg):
        import zmq

        from toolkit.placement.plan import plan
        from toolkit.timeline import PhaseLog, timeline_file
        from toolkit.transport.control import ControlClient, Heartbeat
        from toolkit.transport.sockets import Inbox
        from toolkit.transport.wire import Codec, attempt_secret, read_secret

        self.wenv, self.cfg = wenv, cfg
        self.id, self.rank = wenv.worker_id, wenv.rank
        self.groups = plan(cfg)
        self.group = next(g for g in self.groups if g.name == wenv.group)
        self.ctx = zmq.Context()
        secret = attempt_secret(read_secret(wenv.secret_file), wenv.attempt)
        self.codec = Codec(secret, self.id, accepts={self.id, self.group.name})  # (its group: PUSH spreads)
        t = cfg.transport
        # Commands come to this process's own name (launch/coordinator.py), not to the worker's.
        self.control = ControlClient(self.ctx, Codec(secret, self.id, accepts=()), wenv.control, t.max_message_mb)
        self.heartbeat = Heartbeat(self.ctx, secret, wenv.control, self.id, t.heartbeat_interval_s,
                                   t.heartbeat_timeout_s, self._coordinator_lost)
        # (each phase change also goes to RUN_DIR/timeline/<worker>.jsonl, for the report)
        self.status = self.heartbeat.status = PhaseLog(timeline_file(wenv.run_dir, self.id))
        has_inbox = cfg.stage == "rl" and (self.rank == 0 or any(self.group.receives(r) for r in self.group.roles))
        self.inbox = Inbox(self.ctx, self.codec, wenv.bind_host, t.max_inflight_messages,
                           t.max_message_mb, wenv.inbox_port) if has_inbox else None
        if self.inbox is not None:
            log.info("%s listens on %s", self.id, self.inbox.address)
        self.outboxes: dict = {}
        self.book: dict = {}
        self.resume: dict | None = None
        self.generation = 0
        self.roles: dict = {}
        self.later: collections.deque = collections.deque()  # commands a role took while busy, handled next

    def run(self) -> None:
        from toolkit.launch.env import INBOX_PORT, node_name
        from toolkit.roles import make_role

        self.heartbeat.start()
        # The trainer first: a generator in the same worker generates with the trainer's actor.
        order = sorted(self.group.roles, key=lambda r: r != "trainer")
        self.roles = {role: make_role(self, role) for role in order}
        extra = {}
        for role in self.roles.values():
            extra.update(role.prepare())
        self.status["phase"] = "registering"
        if os.environ.get(INBOX_PORT):  # (a worker started again)
            hold("re-registering", self.wenv.run_dir)
        step = os.environ.get("SLURM_STEP_ID")
        self.control.send("register", group=self.group.name, rank=self.rank, pid=os.getpid(), node=node_name(),
                          inbox=self.inbox.address if self.inbox else None,
                          slurm_step=f"{os.environ.get('SLURM_JOB_ID')}.{step}" if step else None, **extra)
        hold("registered", self.wenv.run_dir)
        start = self.wait_command("start", self.cfg.transport.startup_timeout_s)
        self.book = start.meta["book"]
        self.resume = start.meta.get("resume")
        self.generation = start.meta.get("generation", 0)  # times this worker was started again in this run
        self.status["phase"] = "setup"
        for role in self.roles.values():
            role.setup()
        info = {}
        for role in self.roles.values():
            info.update(role.ready_info())
        self.status["phase"] = "ready"
        self.control.send("ready", **info)
        self.serve()
        self.status["phase"] = "done"
        for role in self.roles.values():
            role.close()
        self.control.send("bye")

    def close_sockets(self) -> None:
        """Close every socket of the main thread; the control socket lingers up to 2 s to send its last event."""
        for outbox in self.outboxes.values():
            outbox.close()
        if self.inbox is not None:
            self.inbox.close()
        self.control.close()

    def serve(self) -> None:
        """Handle commands and samples until `shutdown`. Trainer ranks above 0 follow trainer rank 0; in a
        worker that also generates, they do so once their share of the step has left."""
        from toolkit.samples import SampleBatch

        if self.cfg.stage != "rl":  # a supervised stage: its ranks run their own loop
            self.roles[self.cfg.stage].train_loop()
            self.wait_command("shutdown", self.cfg.transport.step_timeout_s)
            return
        trainer = self.roles.get("trainer")
        follower = trainer is not None and trainer.rank > 0  # (the trainer's ranks may span two groups)
        if follower and "generator" not in self.roles:
            return trainer.follow()
        if trainer is not None:
            trainer.begin()
        while True:
            event = self.next_event(1.0)
            if event is None:
                continue
            source, msg = event
            if source == "command":
                if msg.kind == "shutdown":
                    for role in self.roles.values():
                        role.on_shutdown()
                    return
                target = {"sync": "generator", "checkpoint": "trainer", "join_sync": "trainer",
                          "missing": "trainer"}.get(msg.kind)
                if target in self.roles:
                    self.roles[target].on_command(msg)
                else:
                    log.warning("ignored command %r", msg.kind)
            elif msg.kind == "prompts":
                self.run_stages("generator", msg.meta)
                # (an evaluation trains nothing; rank 0 has the ranks score it when the reward models are theirs)
                if follower and (not msg.meta.get("eval_samples") or trainer.scores_evaluations):
                    trainer.follow(once=True)
            else:
                self.run_stages(msg.meta["stage"], SampleBatch.from_message(msg))

    def run_stages(self, stage: str, payload) -> None:
        """Run `stage` and the stages after it that this worker hosts; send the result on to the next host."""
        from toolkit.placement.plan import next_stage
        from toolkit.samples import SampleBatch

        if stage not in self.roles:
            raise RuntimeError(f"got samples for {stage!r}, which worker {self.id} does not host")
        result = self.roles[stage].handle(payload)
        after = next_stage(self.groups, stage)
        # (a generator may send its samples on in parts, as they finish: rollout.stream_groups)
        for part in ([] if result is None else [result] if isinstance(result, SampleBatch) else result):
            if after is None:
                continue
            if after in self.roles and not (after == "trainer" and self.rank > 0):
                self.run_stages(after, part)
            else:
                self.outbox_for(after).send(*part.to_message(after), timeout_s=self.cfg.transport.step_timeout_s)

    def outbox_for(self, stage: str):
        """The PUSH socket to the workers that take samples for `stage` (every rank, or rank 0 only)."""
        from toolkit.placement.plan import group_of
        from toolkit.transport.sockets import Outbox

        target = group_of(self.groups, stage)
        ids = target.worker_ids() if target.receives(stage) else target.worker_ids()[:1]
        key = tuple(ids)
        if key not in self.outboxes:
            self.outboxes[key] = Outbox(self.ctx, self.codec, [self.book[w]["inbox"] for w in ids],
                                        self.cfg.transport.max_inflight_messages, to=target.name,
                                        max_message_mb=self.cfg.transport.max_message_mb)
        return self.outboxes[key]

    def wait_command(self, kind: str, timeout_s: float, wanted=lambda meta: True):
        """Block until the coordinator sends `kind` with `wanted(meta)` (a `shutdown` instead ends the worker)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            msg = self.control.recv(min(1.0, max(0.0, deadline - time.monotonic())))
            if msg is None:
                continue
            if msg.kind == kind and wanted(msg.meta):
                return msg
            if msg.kind == "shutdown":
                raise ShutDown()
            log.warning("ignored command %r while waiting for %r", msg.kind, kind)
        raise TimeoutError(f"no {kind!r} from the coordinator within {timeout_s:.0f} s")

    def next_event(self, timeout_s: float):
        """('command', msg) or ('data', msg) or None after `timeout_s`; commands first."""
        import zmq

        if self.later:
            return "command", self.later.popleft()

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
        # (heartbeats carry it to status.json; a refused connection never makes the inbox readable)
        self.status["rejected_frames"] = self.rejected_by_reason()
        return None

    def rejected_by_reason(self) -> dict[str, int]:
        """Frames this worker dropped, by reason (bad-mac, malformed, replay), and the connections its
        inbox refused (unauthenticated: transport/gate.py)."""
        if self.inbox is None:
            return dict(self.control.rejected)
        return dict(self.control.rejected + self.inbox.rejected + self.inbox.gate.refused)

    def rejected_frames(self) -> int:
        return sum(self.rejected_by_reason().values())

    def _coordinator_lost(self, silent_s: float) -> None:
        if self.heartbeat.refused_by:
            log.error("the coordinator at %s refused this worker's key: it belongs to another run or to an earlier "
                      "attempt of this one (a worker started by hand needs this attempt's SLURM_RLHF_ATTEMPT and "
                      "the run's secret file); exiting", self.heartbeat.refused_by)
        else:
            log.error("no answer from the coordinator for %.0f s: the driver is gone; exiting", silent_s)
        _leave()
        logging.shutdown()
        os._exit(3)


def _flush(ctx, timeout_s: float) -> None:
    """Let ZeroMQ send what is still queued (a last `failed` event) before the process ends: os._exit
    skips the context's own shutdown, which is where queued messages get out. Bounded: a socket that
    never closes cannot hold the exit."""
    import threading

    done = threading.Thread(target=ctx.term, name="zmq-flush", daemon=True)
    done.start()
    done.join(timeout_s)


def _leave() -> None:
    """Kill every process this worker started (vLLM engine or compile workers), wait for them (up to 5 s),
    then remove the worker's own temporary directory with what they left there (toolkit/tmpdir.py)."""
    from toolkit.tmpdir import remove_own

    try:
        import psutil

        children = psutil.Process().children(recursive=True)
        for child in children:
            try:
                child.kill()
            except psutil.Error:
                pass
        psutil.wait_procs(children, timeout=5)
    except Exception:  # best effort while dying
        pass
    remove_own()


class ShutDown(BaseException):
    """The driver said `shutdown` while the worker waited for another command: the worker's clean end
    (any SystemExit is code the worker ran ending it: a failure)."""


def _report_failure(worker, worker_id: str, error: BaseException) -> None:
    """Log the failure and tell the coordinator, with the end of the traceback (none for an error that
    says what happened and what to do: the log keeps it)."""
    from toolkit.errors import ToolkitError
    from toolkit.store.space import DiskFull

    lines = traceback.format_exception(error)
    log.error("worker %s failed:\n%s", worker_id, "".join(lines))
    told = isinstance(error, (ToolkitError, DiskFull))
    said = f"{type(error).__name__}: {error}"
    if isinstance(error, SystemExit):
        said = (f"SystemExit: {error.code if error.code not in (None, 0) else f'sys.exit({error.code!r})'} "
                "(code the worker ran ended it: a worker ends only when the driver says so)")
    if worker is not None:
        try:
            worker.control.send("failed", error=said, traceback="" if told else "".join(lines[-6:]))
        except Exception:
            pass


def _on_sigterm(signum, frame):
    log.warning("got SIGTERM; exiting")
    _leave()
    logging.shutdown()
    os._exit(128 + signum)


def main() -> None:
    from toolkit.launch import allocator, mkl_amd, openmp
    from toolkit.launch.preload import reexec_with_preloads

    # SIGUSR1 is the driver's (the time limit is near): a `scancel --signal=USR1 JOB` without -b reaches the
    # job steps too, and its default action killed every worker (exit 138) and used up a trainer restart.
    # Ignored from the start (and across the exec below); the driver decides when workers stop.
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)
    reexec_with_preloads()  # (before anything else: an allocator must be there from the start)
    from toolkit.launch.env import WorkerEnv, interface_of
    from toolkit.log import setup_logging
    from toolkit.tmpdir import make_own

    openmp.wait_passively()  # (a worker started by other means than the CLI's launchers, e.g. a user's sbatch script)
    os.umask(0o077)
    # DeepSpeed's compiled ops live with the installation (tools/setup.sh builds them there), so two
    # environments never overwrite each other's builds.
    os.environ.setdefault("TORCH_EXTENSIONS_DIR", os.path.join(sys.prefix, "torch_extensions"))
    wenv = WorkerEnv.from_environ()
    setup_logging(wenv.worker_id)
    interface = interface_of(wenv.bind_host)
    if interface:  # torch.distributed's gloo and NCCL sockets listen on the same interface as ZeroMQ's
        os.environ.setdefault("GLOO_SOCKET_IFNAME", interface)
        os.environ.setdefault("NCCL_SOCKET_IFNAME", interface)
    signal.signal(signal.SIGTERM, _on_sigterm)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the driver decides when workers stop
    code, worker = 0, None
    try:
        from toolkit.config import load_config

        tmp = make_own(f"{wenv.group}-{wenv.rank}")
        cfg = load_config(os.path.join(wenv.run_dir, "config.yaml"))
        log.info("worker %s starting (pid %d); %s", wenv.worker_id, os.getpid(), allocator.describe())
        mkl_line = mkl_amd.describe()  # (reads /proc/cpuinfo)
        if mkl_line:
            log.info(mkl_line)
        log.info("OpenMP threads wait: %s", openmp.describe())
        log.info("temporary files: %s", tmp or f"{tempfile.gettempdir()} (too deep for a directory of "
                 "its own: vLLM's sockets in it would pass the 107-byte limit)")
        worker = Worker(wenv, cfg)
        log.info("roles: %s", ", ".join(worker.group.roles))
        if worker.group.cpus_per_worker or cfg.run.deterministic:
            import torch

            torch.set_num_threads(worker.group.cpus_per_worker or 1)
            if cfg.run.deterministic:
                torch.use_deterministic_algorithms(True, warn_only=True)
                # ... without filling every torch.empty with NaN: DeepSpeed allocates a gradient bucket
                # each micro-step (with its default size, 2 GB written per step: 40x slower training).
                torch.utils.deterministic.fill_uninitialized_memory = False
        worker.run()
        log.info("worker %s done", wenv.worker_id)
    except ShutDown:
        log.info("worker %s told to shut down", wenv.worker_id)
    except BaseException as e:  # (SystemExit too, even sys.exit() of a reward function: the driver restarted
        # a worker that ended "cleanly" unasked, again and again, and said no cause)
        code = 1
        _report_failure(worker, wenv.worker_id, e)
    finally:
        if worker is not None:
            worker.heartbeat.stop()
            worker.close_sockets()
            _flush(worker.ctx, timeout_s=3.0)
        sys.stdout.flush()
        sys.stderr.flush()
        _leave()
        logging.shutdown()
        os._exit(code)


if __name__ == "__main__":
    main()
