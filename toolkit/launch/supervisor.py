"""Supervisor: what every stage's driver does besides its own loop. It starts the workers, hands out the
address book and the resume plan, watches their health, writes metrics and status, and stops them.

A stage's driver (driver.py for RL, stage_driver.py for SFT and the reward model) subclasses it and
writes `_loop`: what happens between "every worker is ready" and "shutdown". Between events the
supervisor checks that every worker process lives and heart-beats; any failure stops the run with an
error naming the worker (role and rank), its node and pid, and its log file, and every worker is
stopped. On SIGUSR1 (Slurm sends it before the time limit, and sometimes a minute early) the loop keeps
stepping while another step, a checkpoint and the stop still fit before the job's end time
(`_time_for_a_step`), then asks the trainer for a checkpoint, requeues the job (on Slurm) and stops: state
`preempted`. The launcher decides only how workers are spawned (local processes or Slurm steps).
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import signal
import time
from pathlib import Path
from typing import Callable

from toolkit.errors import ConfigError, Interrupted, RunError, TrainerLost, raise_interrupt
from toolkit.launch import env as E
from toolkit.launch import openmp
from toolkit.hold import hold
from toolkit.launch.curves import Curves
from toolkit.launch.env import node_name
from toolkit.launch.rundir import RunDir
from toolkit.placement.plan import group_of, plan
from toolkit.progress import Progress
from toolkit.store.manifest import Manifest, plan_resume, read_jsonl, set_aside
from toolkit.store.ownership import check_ours_alone
from toolkit.timeline import mark_restart

log = logging.getLogger("toolkit.driver")
STATUS_EVERY_S = 2.0  # status.json is rewritten this often while the run waits on its workers
REPORT_GRACE_S = 2.0  # on a failure, how long to look for its cause: a worker's last report, a peer's death


class Supervisor:
    unit = "step"  # what a checkpoint is counted in (RL: policy_version)

    def __init__(self, cfg, run_dir: RunDir, launcher, bind_host: str, echo: Callable = print):
        self.cfg, self.run_dir, self.launcher, self.bind_host, self.echo = cfg, run_dir, launcher, bind_host, echo
        self.groups = plan(cfg)
        self.worker_ids = [w for g in self.groups for w in g.worker_ids()]
        self.trainer_ids = group_of(self.groups, "trainer" if cfg.stage == "rl" else cfg.stage).worker_ids()
        self.trainer_id = self.trainer_ids[0]
        self.steps: int | None = getattr(cfg.run, "steps", None)  # (a supervised stage says it when ready)
        self.train_rows: int | None = None  # (a supervised stage's, which its steps follow from; said when ready)
        self.book: dict[str, dict] = {}
        self.inboxes: dict[str, str] = {}  # each worker's first inbox address (kept: a worker started again
        # listens there, where its peers send; it is in the book only until the worker is started again)
        self.ready: set[str] = set()
        self.trained: dict[int, dict] = {}  # metrics the trainer reported, by step, not written yet
        self.stopping = False
        self.state = "starting"
        self.step = -1  # the last step completed
        self.running_step: int | None = None
        self.error: str | None = None
        self.last_metrics: dict | None = None
        self._status_written = 0.0
        self.preempt = False
        self.history: list[dict] = []  # metrics of steps run before this attempt (a resume)
        self.curves = Curves(run_dir.path, cfg)
        self.end_time: float | None = None  # when the job will be killed (unix time), once known
        self.trainer_ready: dict = {}
        self.checkpointed: dict | None = None
        self.restarts = 0  # times this run was resumed (from the manifest)
        self.resume: dict = {}  # the resume plan the workers got (a worker started again gets it too)
        self.worker_restarts = 0  # workers started again in this attempt (run.max_worker_restarts)
        self.generation: dict[str, int] = {}  # times each worker was started again
        self.restarting: dict[str, float] = {}  # workers started again and not ready yet -> since when
        self.trainer_restarts = 0  # times the run was started again after its trainer was lost (run_attempts)
        self.requeue: Callable[[], None] | None = None  # on Slurm: put the job back in the queue (batch.py)
        self.attempt: str | None = None  # this start of the workers (its key: transport/wire.py attempt_secret)
        self.coordinator = None  # (made as the run starts, with its context)
        self.records: list[dict] = []  # the metrics of the steps this driver ran

    # ----- the run --------------------------------------------------------------------------------

    def run(self) -> list[dict]:
        """Run the stage; the metrics of the steps run now. State afterwards: finished or preempted (or an
        Interrupted / RunError is raised, with state interrupted / failed)."""
        import zmq

        from toolkit.launch.coordinator import Coordinator
        from toolkit.transport.wire import attempt_secret, read_secret

        self.attempt = secrets.token_hex(8)
        secret = attempt_secret(read_secret(self.run_dir.secret), self.attempt)
        self.ctx = zmq.Context()
        self.coordinator = Coordinator(self.ctx, secret, self.bind_host, self.cfg.transport.max_message_mb)
        # Our own handlers: a run started in the background of a script inherits SIGINT ignored, and
        # Python then installs no KeyboardInterrupt handler of its own.
        previous = {sig: signal.signal(sig, raise_interrupt) for sig in (signal.SIGINT, signal.SIGTERM)}
        previous[signal.SIGUSR1] = signal.signal(signal.SIGUSR1, self._on_usr1)
        records: list[dict] = self.records  # (kept on the driver: run_attempts reads them after a TrainerLost too)
        try:
            resume = self._plan_resume()
            self.curves.open()  # (W&B's slow start, before there are heartbeats to answer)
            self._start_workers(resume)
            self.state = "running"
            self._loop(resume, secret, records)
            stopped_early = self.step + 1 < self.steps
            if stopped_early:
                self._checkpoint_before_stopping()
                # (the steps the trainer finished meanwhile may be the last: asynchronously those already out)
                stopped_early = self.step + 1 < self.steps
            if stopped_early and self.requeue is not None:
                self._requeue()
            self._shutdown()
            self.state = "preempted" if stopped_early else "finished"
            return records
        except KeyboardInterrupt as e:
            self.state = "interrupted"
            signum = e.args[0] if e.args else signal.SIGINT
            raise Interrupted(f"interrupted ({signal.Signals(signum).name}): every worker was stopped",
                              128 + signum) from None
        except RunError as e:
            self.state, self.error = "failed", str(e)
            raise
        except Exception as e:  # (a defect of ours: status.json must not go on saying `running`)
            self.state, self.error = "failed", f"{type(e).__name__}: {e}"
            raise
        finally:
            for sig in (signal.SIGINT, signal.SIGTERM):  # a second Ctrl-C must not cut the clean-up short
                signal.signal(sig, signal.SIG_IGN)
            self.stopping = True
            self.launcher.stop(grace_s=5.0)
            self._write_status()
            self._close()
            self.curves.close()
            self.coordinator.close()
            self.ctx.term()
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    def _loop(self, resume: dict, secret: bytes, records: list[dict]) -> None:
        """The stage's steps, appending each step's metrics to `records` (until done or preempted)."""
        raise NotImplementedError

    def _close(self) -> None:
        """Close what `_loop` opened (sockets)."""

    def _start_workers(self, resume: dict) -> None:
        """Launch every worker, hand out the address book and the resume plan, and wait until all are ready."""
        t = self.cfg.transport
        hold("start-up", self.run_dir.path)
        self.launcher.start(self.groups, {E.RUN_DIR: str(self.run_dir.path), E.CONTROL: self.coordinator.address,
                                          E.SECRET_FILE: str(self.run_dir.secret), E.ATTEMPT: self.attempt,
                                          E.ALLOCATOR: self.cfg.run.allocator,
                                          E.FAST_MKL_ON_AMD: "1" if self.cfg.run.fast_mkl_on_amd else "0",
                                          **openmp.spin(self.cfg.run.openmp_spin)})
        self.echo(f"started {len(self.worker_ids)} workers ({', '.join(f'{g.name} x{g.workers}' for g in self.groups)})"
                  f"; logs in {self.run_dir.logs}")
        started = time.monotonic()
        self._pump(lambda: len(self.book) == len(self.worker_ids), t.startup_timeout_s, "every worker to register",
                   setting="transport.startup_timeout_s")
        self.resume = resume
        for worker_id in self.worker_ids:
            self.coordinator.send(worker_id, "start", book=self.book, resume=resume)
        # (a resume replays its committed batches in the trainer's setup, for as long as that takes: what
        # the limit bounds is start-up without progress, seen in the workers' heartbeats)
        self._pump(lambda: len(self.ready) == len(self.worker_ids), t.startup_timeout_s,
                   "every worker to load its models", progress=self._startup_progress,
                   setting="transport.startup_timeout_s")
        self.echo(f"all workers ready in {time.monotonic() - started:.1f} s")

    # ----- metrics --------------------------------------------------------------------------------

    def progress_line(self, record: dict) -> str:
        raise NotImplementedError

    def _record(self, step: int, **extra) -> dict:
        """Write the metrics of trained `step` (what the trainer reported, plus `extra`) and show them."""
        record = self._write_metrics({"step": step, **self.trained.pop(step), **extra})
        self.step = step
        self._show(record)
        self._write_status(last=record)
        return record

    def _show(self, record: dict) -> None:
        """A step's line; where `echo` is a Progress, its live line too."""
        line = self.progress_line(record)
        if isinstance(self.echo, Progress):
            key = "reward_mean" if "reward_mean" in record else "loss"
            self.echo.step(line, record["step"] + 1, self.steps, f"{key.split('_')[0]} {record[key]:.3f}")
        else:
            self.echo(line)

    def _write_metrics(self, record: dict) -> dict:
        """A step's metrics record, with the restarts so far and the time, to metrics.jsonl and to the
        TensorBoard curves (steps in order); returns what it wrote."""
        record = {**record, "restarts": self.restarts, "worker_restarts": self.worker_restarts, "time": time.time()}
        self.run_dir.append_metrics(record)
        self.curves.add(record)
        return record

    def _plan_resume(self) -> dict:
        """Resume from what the run directory holds (nothing, for a new run): the newest whole checkpoint
        and the committed experience after it; the trainer's part of the plan."""
        plan = plan_resume(self.run_dir.path)
        self.step = plan.next_step - 1  # (what status.json says if the data check fails)
        if plan.checkpoint:  # (before anything is recorded or set aside, or a worker starts)
            check_ours_alone(self.run_dir.path / plan.checkpoint["dir"])
            from toolkit.store.checkpoint import layout_problem  # (it imports torch)

            rl = self.cfg.stage == "rl"
            group = self.cfg.placement.name_with("actor") if rl else "trainer"
            problem = layout_problem(self.run_dir.path / plan.checkpoint["dir"],
                                     self.cfg.trainer if rl else self.cfg.train,
                                     self.cfg.placement.group_with("actor").workers, "trainer" if rl else "train",
                                     f"placement.{group}.workers")
            if problem:
                raise ConfigError(f"{self.run_dir.config}: {problem}")
        self._check_data()
        self._check_reward_code(plan.next_step)
        for problem in plan.problems:
            self.echo(f"resume: {problem}")
        moved = set_aside(self.run_dir.path, plan)
        if plan.checkpoint or plan.replay or moved or self.trainer_restarts:  # (restarted before a commit too)
            where = f"checkpoint {plan.checkpoint['dir']}" if plan.checkpoint else "the initial weights"
            replay = f", then training again on {len(plan.replay)} committed experience batch(es)" \
                if self.cfg.stage == "rl" and plan.replay else ""
            self.echo(f"resuming after step {plan.next_step}: {where} ({self.unit} {plan.start_version}){replay}"
                      + (f"; {len(moved)} later one(s) set aside in {moved[0].parent}" if moved else ""))
            Manifest(self.run_dir.path).append({
                "kind": "resume", "checkpoint": plan.checkpoint["dir"] if plan.checkpoint else None,
                "replay": [str(p.relative_to(self.run_dir.path)) for p in plan.replay], "next_step": plan.next_step,
                "set_aside": [str(p.relative_to(self.run_dir.path)) for p in moved], "problems": plan.problems})
        self.restarts = sum(1 for r in Manifest(self.run_dir.path).records() if r["kind"] == "resume")
        self._keep_metrics_before(plan.next_step)
        self.step = plan.next_step - 1
        return {"checkpoint": plan.checkpoint["dir"] if plan.checkpoint else None,
                "replay": [str(p) for p in plan.replay], "next_step": plan.next_step}

    def _check_data(self) -> None:
        """Record the data files and the settings that decide the draws at the run's first start; later, fail
        if any changed since (fingerprint.py)."""
        from toolkit.data.fingerprint import changes, draw_changes, draw_settings, fingerprint
        from toolkit.launch.pipeline import resume_target

        manifest = Manifest(self.run_dir.path)
        record = manifest.last("data") or {}
        then, draws_then = record.get("files"), record.get("draws")
        now, draws = fingerprint(self.cfg, then), draw_settings(self.cfg)
        changed = (changes(then, now) if then is not None else []) + (
            draw_changes(draws_then, draws) if draws_then is not None else [])
        if changed:
            raise RunError("the run's data changed since it started: " + "; ".join(changed) + ". Its next "
                           "steps would draw other rows than the order it began with (some twice, some never). "
                           "Put the data (and those settings in config.yaml) back as they were, or go on with them "
                           f"as they are now: slurm-rlhf resume {resume_target(self.run_dir.path)} --data-changed")
        if now != then or draws != draws_then:  # (the first start, a file touched but the same, or a run from
            manifest.append({"kind": "data", "files": now, "draws": draws})  # before the settings were recorded)

    def _check_reward_code(self, next_step: int) -> None:
        """Record the reward functions' files at the run's first start; later, say which changed since the
        last start, from which step the code as it is now scores, and record them again (sources.py)."""
        from toolkit.rewards.sources import changes, reward_sources

        manifest = Manifest(self.run_dir.path)
        then = (manifest.last("rewards") or {}).get("functions")
        now = reward_sources(self.cfg)
        for line in changes(then, now) if then is not None else []:
            self.echo(f"resume: the reward code changed since the last start: {line}; steps {next_step + 1} on are "
                      "scored by it as it is now")
        if now != then and (now or then):  # (the first start of a run with reward functions, or a change)
            manifest.append({"kind": "rewards", "functions": now, "from_step": next_step})

    def _keep_metrics_before(self, step: int) -> None:
        """Drop metrics of steps that will run again (and a line cut short by a crash, also what the disk held
        after it that is not even UTF-8: read_jsonl skips it; the resume ended in a UnicodeDecodeError)."""
        path = self.run_dir.metrics
        if not path.exists():
            return
        kept = [r for r in read_jsonl(path) if isinstance(r.get("step"), (int, float)) and r["step"] < step]
        self.run_dir.write_atomic(path, "".join(json.dumps(r) + "\n" for r in kept))  # (as append_jsonl writes)
        self.history.extend(kept)
        if self.history:  # (what `status` shows as the last step while the resume starts and replays)
            self.last_metrics = self.history[-1]

    # ----- stopping -------------------------------------------------------------------------------

    def _checkpoint_before_stopping(self) -> None:
        self.echo(f"stopping after step {self.step + 1} (SIGUSR1): saving a checkpoint")
        for worker_id in self.trainer_ids:  # ranks above 0 that also generate join rank 0's checkpoint
            self.coordinator.send(worker_id, "checkpoint")
        self._pump(lambda: self.checkpointed is not None, self.cfg.transport.step_timeout_s, "the trainer's checkpoint")
        self.echo(f"checkpoint of {self.unit} {self.checkpointed['version']} saved in "
                  f"{self.checkpointed['checkpoint_s']:.1f} s")
        for step in sorted(self.trained):  # asynchronous: steps whose samples were in before the stop
            self.records.append(self._record(step))

    def _requeue(self) -> None:
        """Put the job back in the queue as soon as the checkpoint is committed, before the workers are
        stopped: their stop can take longer than the time left on a busy machine, and a job that Slurm
        ends at its time limit is not requeued. The requeue itself ends this attempt (Slurm signals every
        step of the job: SIGTERM, then SIGKILL), so the status is written first and SIGTERM is expected."""
        self.state = "preempted"
        self._write_status()
        self.curves.close()
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        with self.coordinator.answering():
            self.requeue()

    def _on_usr1(self, signum, frame) -> None:
        # (Slurm is asked for the job's end after the step, not here: a query in a signal handler held
        # whatever the driver was doing, and a timeout raised out of it)
        self.preempt = True
        log.warning("SIGUSR1: the job ends soon; stopping once another step no longer fits")

    def _time_for_a_step(self, records: list[dict]) -> bool:
        """Another step (and those the trainer trains with it before a checkpoint), a checkpoint and the stop
        fit before the end (estimated from the last steps run, also by earlier attempts of the run)."""
        if self.end_time is None:
            with self.coordinator.answering():
                self.end_time = self.launcher.end_time() or time.time()
            log.warning("%.0f s are left before the job ends", self.end_time - time.time())
        ran = [r for r in [*self.history, *records] if "step_s" in r]
        step_s = max((r["step_s"] - r.get("eval_wall_s", 0.0) for r in ran[-3:]), default=30.0)
        step_s *= 1 + self._steps_out_beyond_the_next()
        step_s += self._evaluation_ahead_s(ran)
        checkpoint_s = max((r.get("checkpoint_s") or 0.0 for r in ran), default=0.0) + 5.0
        return time.time() + step_s + checkpoint_s + self.cfg.slurm.stop_margin_s < self.end_time

    def _evaluation_ahead_s(self, ran: list[dict]) -> float:
        """Seconds the next step may take longer for an evaluation (the RL driver's in-run evaluations)."""
        return 0.0

    def _steps_out_beyond_the_next(self) -> int:
        """Steps past the next that the trainer may train before it takes a checkpoint (the RL driver's
        asynchronous steps already out)."""
        return 0

    def _shutdown(self) -> None:
        self.stopping = True
        for worker_id in self.worker_ids:
            self.coordinator.send(worker_id, "shutdown")
        with self.coordinator.answering():  # (a worker that takes long to end must not think the driver gone)
            # A worker started again that has not registered yet gets no `shutdown` (nor is its register
            # handled now): the wait ends with those that got one.
            ended = self.launcher.wait(timeout_s=60, leaving_out=[w for w in self.restarting if w not in self.book])
        if not ended:
            log.warning("some workers did not exit within 60 s of shutdown; stopping them")

    # ----- events and health ----------------------------------------------------------------------

    def _pump(self, done: Callable[[], bool], timeout_s: float, waiting_for: str,
              progress: Callable[[], object] | None = None, setting: str = "transport.step_timeout_s") -> None:
        """Handle events until `done()`; fail after `timeout_s` (the config's `setting`), counted from the last
        change of `progress()` when that is given."""
        deadline = time.monotonic() + timeout_s
        last = progress() if progress else None
        while not done():
            if progress is not None and (now := progress()) != last:
                last, deadline = now, time.monotonic() + timeout_s
            if time.monotonic() > deadline:
                idle = " without progress" if progress else ""
                raise RunError(f"timed out after {timeout_s:.0f} s{idle} waiting for {waiting_for} ({setting} "
                               f"{timeout_s:g}: where a worker is slow rather than stuck, raise it in "
                               f"{self.run_dir.config} and resume)\n{self._who_is_where()}")
            self._pump_once(0.2)

    def _startup_progress(self) -> tuple:
        """What the workers' heartbeats say they are doing (a resume's replay advances its step)."""
        return tuple(sorted((w, s.get("phase"), s.get("step")) for w, s in self.coordinator.status.items()))

    def _pump_once(self, wait_s: float = 0.0) -> None:
        """Handle the control messages that arrived (waiting up to `wait_s` for one), then check health."""
        item = self.coordinator.recv(wait_s)
        while item is not None:
            self._handle(*item)
            item = self.coordinator.recv(0)
        self._between_events()
        self._check_health()
        if time.monotonic() - self._status_written > STATUS_EVERY_S:
            self._write_status()

    def _between_events(self) -> None:
        """What the stage does whenever the events that arrived are handled."""

    def _handle(self, worker_id: str, msg) -> None:
        m = msg.meta
        if worker_id not in self.worker_ids:
            log.warning("message %r from unknown worker %r ignored", msg.kind, worker_id)
        elif msg.kind == "register":
            self.book[worker_id] = {k: m.get(k) for k in ("group", "rank", "pid", "node", "inbox", "store")}
            if m.get("inbox"):
                self.inboxes.setdefault(worker_id, m["inbox"])
            # The launcher knows the step's real id (in a heterogeneous job, the component's job id).
            self.book[worker_id]["slurm_step"] = self.launcher.step_id(m.get("group", "")) or m.get("slurm_step")
            log.info("registered %s (pid %s on %s)", worker_id, m.get("pid"), m.get("node"))
            if worker_id in self.restarting:
                self.coordinator.send(worker_id, "start", book=self.book, resume=self.resume,
                                      generation=self.generation[worker_id])
        elif msg.kind == "ready":
            self.ready.add(worker_id)
            if worker_id == self.trainer_id:
                self.trainer_ready = m
            log.info("%s ready", worker_id)
            if self.restarting.pop(worker_id, None) is not None:
                self.echo(f"{self._describe(worker_id)} is back; the run goes on")
                if not self.restarting:  # (once for workers started again together: they lost the same work)
                    self._restarted(worker_id)
        elif msg.kind == "failed":
            dead = self._dead_peer(worker_id, REPORT_GRACE_S)
            if dead is not None:  # its peers fail in their collectives: the dead worker is the cause
                raise self._lost(dead.worker_id, f"{self._exited(dead)}\n(then {self._describe(worker_id)} failed: "
                                                 f"{m.get('error')})")
            raise RunError(self._failed(worker_id, m))
        elif msg.kind == "trained":
            self.trained[m["step"]] = m["metrics"]
        elif msg.kind == "checkpointed":
            self.checkpointed = m
        elif not self._handle_stage(worker_id, msg) and msg.kind != "bye":
            log.warning("unexpected %r from %s", msg.kind, worker_id)

    def _handle_stage(self, worker_id: str, msg) -> bool:
        """A message only this stage knows; True if it was one."""
        return False

    def _dead_peer(self, worker_id: str, wait_s: float):
        """A worker other than `worker_id` that died without a word (killed, out of memory, crashed: any exit
        but 0, and 1, which is a worker that raised and reports for itself), looked for during `wait_s`."""
        deadline = time.monotonic() + wait_s
        while True:
            for ended in self.launcher.poll():
                if ended.worker_id != worker_id and ended.code not in (0, 1):
                    return ended
            if time.monotonic() > deadline:
                return None
            time.sleep(0.1)

    def _last_report(self, worker_id: str, wait_s: float) -> dict | None:
        """The `failed` report of `worker_id`, which has just exited, if it sent one (a worker flushes its
        last event before it exits, so it is here or on its way). Other workers' reports meanwhile are
        left out: they follow from this exit. Other messages are handled."""
        deadline = time.monotonic() + wait_s
        while (left := deadline - time.monotonic()) > 0:
            item = self.coordinator.recv(left)
            if item is None:
                return None
            sender, msg = item
            if msg.kind == "failed":
                if sender == worker_id:
                    return msg.meta
            else:
                self._handle(sender, msg)
        return None

    def _failed(self, worker_id: str, report: dict) -> str:
        trace = report.get("traceback", "").rstrip()
        return (f"{self._describe(worker_id)} failed: {report.get('error')}\n" + (f"{trace}\n" if trace else "")
                + self._log_hint(worker_id))

    def _exited(self, ended) -> str:
        return f"{self._describe(ended.worker_id)} exited with {ended.describe()}\n{self._log_hint(ended.worker_id)}"

    def _check_health(self) -> None:
        for ended in self.launcher.poll():
            if self.stopping and ended.code == 0:
                continue
            report = self._last_report(ended.worker_id, REPORT_GRACE_S)  # says more than an exit code
            if report is not None:
                raise RunError(self._failed(ended.worker_id, report))
            if self._may_restart(ended.worker_id):
                self._restart(ended.worker_id, f"exited with {ended.describe()}")
                continue
            raise self._lost(ended.worker_id, self._exited(ended) + self._no_restart_left(ended.worker_id))
        limit = self.cfg.transport.heartbeat_timeout_s
        for worker_id, silent_s in self.coordinator.silent(self.worker_ids, limit):
            if worker_id in self.restarting and worker_id not in self.book:  # (started again: not registered yet)
                continue
            if self._may_restart(worker_id):
                self._restart(worker_id, f"sent no heartbeat for {silent_s:.0f} s (hung?)")
                continue
            raise self._lost(worker_id, f"{self._describe(worker_id)} sent no heartbeat for {silent_s:.0f} s "
                           f"(limit transport.heartbeat_timeout_s = {limit:g}); it is hung or its node is lost\n"
                           f"{self._log_hint(worker_id)}{self._no_restart_left(worker_id)}")
        limit = self.cfg.transport.startup_timeout_s
        for worker_id, since in self.restarting.items():
            if time.monotonic() - since > limit:
                raise RunError(f"{self._describe(worker_id)}, started again, was not ready within {limit:g} s "
                               f"(transport.startup_timeout_s)\n{self._log_hint(worker_id)}")

    # ----- starting one worker again --------------------------------------------------------------

    def _roles_of(self, worker_id: str) -> list[str]:
        return next(g for g in self.groups if g.name == worker_id.split(":")[0]).roles

    def _lost(self, worker_id: str, message: str) -> RunError:
        """The error for a worker that died or hung without a word: a worker with trainer ranks can be
        started again with all the others from the last checkpoint (`run_attempts`)."""
        roles = self._roles_of(worker_id)
        if "trainer" not in roles and self.cfg.stage not in roles:
            return RunError(message)
        limit = self.cfg.run.max_trainer_restarts
        if self.trainer_restarts < limit:
            return TrainerLost(message)
        return RunError(f"{message}\nthe run was not started again: {self.trainer_restarts} restart(s) of "
                        f"run.max_trainer_restarts {limit} used (raise it to allow more)")

    def _restartable(self, worker_id: str) -> bool:
        """A worker of an RL run that hosts no trainer (generators, scorers): it can be started again without
        the trainers (locally alone; on Slurm with the other tasks of its step)."""
        return self.cfg.stage == "rl" and "trainer" not in self._roles_of(worker_id)

    def _may_restart(self, worker_id: str) -> bool:
        """A restartable worker that died or hung is started again while the run is running and restarts
        are left."""
        return (self.state == "running" and not self.stopping and self._restartable(worker_id)
                and self.worker_restarts < self.cfg.run.max_worker_restarts)

    def _no_restart_left(self, worker_id: str) -> str:
        """Why a restartable worker was not started again: its restarts are used up."""
        if not self._restartable(worker_id) or self.worker_restarts < self.cfg.run.max_worker_restarts:
            return ""
        return (f"\nit was not started again: {self.worker_restarts} restart(s) of run.max_worker_restarts "
                f"{self.cfg.run.max_worker_restarts} used (raise it to allow more)")

    def _restart(self, worker_id: str, why: str) -> None:
        """Kill what is left of `worker_id` and start it again, listening where it did, with the workers the
        launcher starts again with it (on Slurm, the other tasks of its step); their start, their catching
        up and the work they lost follow as events (`_restarted`). One restart of the run's budget."""
        together = self.launcher.restarts_with(worker_id)
        others = [w for w in together if w != worker_id]
        self.worker_restarts += 1
        how = f"with the other task(s) of its step, {', '.join(others)}" if others else "alone"
        self.echo(f"{self._describe(worker_id)} {why}; starting it again {how} (restart {self.worker_restarts} "
                  f"of run.max_worker_restarts {self.cfg.run.max_worker_restarts})\n{self._log_hint(worker_id)}")
        ports = {int(w.split(":")[1]): int(self.inboxes[w].rsplit(":", 1)[1]) for w in together if w in self.inboxes}
        for w in together:  # (before the new processes start: their first phases come after)
            mark_restart(self.run_dir.path, w)
        with self.coordinator.answering():  # (the scancel of a hung step and its end can take a minute)
            self.launcher.restart(worker_id, E.inbox_ports(ports))
        if isinstance(self.echo, Progress):
            self.echo.restart_clock()  # (the step that waits for it is no measure of the steps left)
        for w in together:
            self.generation[w] = self.generation.get(w, 0) + 1
            self.book.pop(w, None)
            self.ready.discard(w)
            self.coordinator.forget(w)
            self.restarting[w] = time.monotonic()

    def _restarted(self, worker_id: str) -> None:
        """A worker started again is ready, the last of those started again (the stage redoes the work
        they lost)."""

    def _describe(self, worker_id: str) -> str:
        group, rank = worker_id.split(":")
        entry = self.book.get(worker_id)
        if entry:
            where = f"pid {entry['pid']} on node {entry['node']}"
            if entry.get("slurm_step"):
                where += f", Slurm step {entry['slurm_step']}"
        else:
            where = self.launcher.describe(worker_id)
        roles = next(g.roles for g in self.groups if g.name == group)
        if roles != (group,):  # (a group of several roles, or one named otherwise: Flattening's `all`)
            where += f"; roles {', '.join(roles)}"
        return f"{group} worker rank {rank} ({worker_id}, {where})"

    def _log_hint(self, worker_id: str, lines: int = 8) -> str:
        path = self.run_dir.log_file(worker_id)
        try:
            tail = path.read_text(errors="replace").splitlines()[-lines:]
        except OSError:
            tail = []
        shown = "".join(f"\n    | {line}" for line in tail)
        return f"log: {path}" + (f" (last lines:){shown}" if tail else "" if path.exists() else
                                 " (not written: the worker did not start)")

    def _who_is_where(self) -> str:
        rows = []
        for worker_id in self.worker_ids:
            status = self.coordinator.status.get(worker_id, {})
            rows.append(f"  {worker_id}: {status.get('phase', 'not registered')}"
                        + (f" step {status['step'] + 1}" if isinstance(status.get("step"), int) else "")
                        + (f", in {status['doing']}" if status.get("doing") else "")  # (a reward function)
                        + f" (log: {self.run_dir.log_file(worker_id)})")
        return "worker states:\n" + "\n".join(rows)

    def _worker_status(self) -> dict[str, dict]:
        """Every worker's entry of status.json: its address book entry, its last heartbeat's status, and
        when the driver last heard from it (unix time)."""
        wall = time.time() - time.monotonic()
        return {w: {**self.book.get(w, {}), **self.coordinator.status.get(w, {}),
                    **({"heard_unix": wall + self.coordinator.last_seen[w]} if w in self.coordinator.last_seen else {})}
                for w in self.worker_ids}

    def _write_status(self, last: dict | None = None) -> None:
        if last is not None:
            self.last_metrics = last
        workers = self._worker_status()
        if self.state not in ("starting", "running"):
            for w in workers.values():
                w["phase"], w["step"] = "ended", self.step
        status = {"state": self.state, "stage": self.cfg.stage, "step": self.step, "running_step": self.running_step,
                  "steps": self.steps, **({"train_rows": self.train_rows} if self.train_rows is not None else {}),
                  "launcher": self.launcher.name, "error": self.error, "attempt": self.attempt,
                  "driver": {"pid": os.getpid(), "node": node_name(), "started": _started(),
                             "rejected_frames": self._rejected_by_reason()}, "workers": workers,
                  "last_metrics": self.last_metrics, "worker_restarts": self.generation}
        self.run_dir.write_status(status)
        self._status_written = time.monotonic()

    def _rejected_by_reason(self) -> dict[str, int]:
        """What the coordinator dropped (frames, by reason) and refused (connections: transport/gate.py)."""
        if self.coordinator is None:
            return {}
        return dict(self.coordinator.rejected + self.coordinator.gate.refused)


def _started() -> float:
    """When this process started (seconds since the epoch, as psutil reads it): with the pid, it names
    the driver process, so `cancel` never signals another process that later got the same pid."""
    import psutil

    return psutil.Process().create_time()


def read_metrics(path: Path) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def run_attempts(cfg, make: Callable[[], Supervisor], echo: Callable = print) -> tuple[Supervisor, list[dict]]:
    """Run the stage with the driver `make()` builds; when a trainer rank dies or hangs, stop every worker
    and go on from the last checkpoint with a new driver, here (in the same allocation), up to
    run.max_trainer_restarts times. (The last driver, the metrics of the steps the attempts ran, each step's
    last.)"""
    driver, attempt, ran = None, 0, {}
    while True:
        preempt = driver is not None and driver.preempt  # (SIGUSR1 came before: the time is still short)
        driver = make()
        driver.preempt = driver.preempt or preempt
        driver.trainer_restarts = attempt  # (the driver raises TrainerLost only while restarts are left)
        try:
            driver.run()
            return driver, sorted({**ran, **{r["step"]: r for r in driver.records}}.values(), key=lambda r: r["step"])
        except TrainerLost as e:
            # (the steps an attempt ran count for the closing line; one trained again after it counts once)
            ran.update({r["step"]: r for r in driver.records})
            attempt += 1
            echo(f"{e}\nstarting every worker again from the last checkpoint (restart {attempt} of "
                 f"run.max_trainer_restarts {cfg.run.max_trainer_restarts})")
            if isinstance(echo, Progress):  # (the workers' new start holds the next step: no measure of the rest)
                echo.restart_clock()


def make_driver(cfg, run_dir: RunDir, launcher, bind_host: str, echo: Callable = print) -> Supervisor:
    """The driver of the config's stage."""
    if cfg.stage == "rl":
        from toolkit.launch.driver import Driver

        return Driver(cfg, run_dir, launcher, bind_host, echo)
    from toolkit.launch.stage_driver import StageDriver

    return StageDriver(cfg, run_dir, launcher, bind_host, echo)
