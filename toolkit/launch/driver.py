"""Driver: runs one RL run. Starts the workers, hands out addresses, clocks the steps, watches health.

Before the workers start, the driver plans a resume from the run manifest (a new run resumes from
nothing): the trainer gets the checkpoint to load and the committed experience to train on again, and
the prompt feeder skips what those steps drew. On SIGUSR1 (Slurm sends it before the time limit, and
sometimes a minute early) the driver keeps stepping while another step, a checkpoint and the stop still
fit before the job's end time, then asks the trainer for a checkpoint and stops: state `preempted`.

A step, in the synchronous (on-policy) mode:
  1. the prompt feeder's next prompts go to the generators, split evenly, one message per worker;
  2. samples flow generators -> scorers -> trainer rank 0 over ZeroMQ (the driver is not in that path);
  3. the trainer trains and says `weights_ready`; the driver tells every generator to `sync`;
  4. the trainer broadcasts the weights; generators report `synced`, the trainer reports `trained`;
  5. the driver writes the step's metrics and starts the next step.
In asynchronous mode (`rollout.max_policy_lag` N > 0) the prompts of steps up to N ahead are already
out while a step trains, so generation overlaps training; the trainer drops samples older than N
(`stale: drop`) and the driver sends their prompts again.
Between events the driver checks that every worker process lives and heart-beats; any failure stops the
run with an error naming the worker (role and rank), its node and pid, and its log file, and every
worker is stopped. The launcher decides only how workers are spawned (local processes or Slurm steps).
"""

from __future__ import annotations

import json
import logging
import os
import signal
import time
from pathlib import Path
from typing import Callable

import numpy as np

from toolkit.data.prompts import PromptFeeder, read_prompts
from toolkit.errors import Interrupted, RunError
from toolkit.launch import env as E
from toolkit.launch.env import node_name
from toolkit.launch.rundir import RunDir
from toolkit.placement.plan import colocated, group_of, plan
from toolkit.store.manifest import Manifest, plan_resume, set_aside

log = logging.getLogger("toolkit.driver")
STATUS_EVERY_S = 2.0  # status.json is rewritten this often while the run waits on its workers
STOP_MARGIN_S = 15.0  # kept free before the job's end for stopping the workers and requeueing
REPORT_GRACE_S = 2.0  # on a failure, how long to look for its cause: a worker's last report, a peer's death


class Driver:
    def __init__(self, cfg, run_dir: RunDir, launcher, bind_host: str, echo: Callable = print):
        self.cfg, self.run_dir, self.launcher, self.bind_host, self.echo = cfg, run_dir, launcher, bind_host, echo
        self.groups = plan(cfg)
        self.worker_ids = [w for g in self.groups for w in g.worker_ids()]
        self.generator_ids = group_of(self.groups, "generator").worker_ids()
        self.trainer_ids = group_of(self.groups, "trainer").worker_ids()
        self.trainer_id = self.trainer_ids[0]
        # Generators with workers of their own get weights by broadcast when told to `sync`; a generator
        # in a trainer's worker gets them in memory and reports `synced` by itself.
        self.sync_ids = [] if colocated(self.groups, "generator", "trainer") else self.generator_ids
        self.feeder = PromptFeeder(read_prompts(cfg.data.prompts, cfg.data.prompt_key), cfg.data.shuffle, cfg.run.seed)
        self.book: dict[str, dict] = {}
        self.ready: set[str] = set()
        self.synced: dict[str, int] = {}
        self.sync_checks: dict[int, float] = {}  # policy_version -> largest probe difference after its sync
        self.trained: dict[int, dict] = {}
        self.stopping = False
        self.state = "starting"
        self.step = -1  # the last step completed
        self.running_step: int | None = None
        self.error: str | None = None
        self.last_metrics: dict | None = None
        self._status_written = 0.0
        self.preempt = False
        self.history: list[dict] = []  # metrics of steps run before this attempt (a resume)
        self.end_time: float | None = None  # when the job will be killed (unix time), once known
        self.trainer_ready: dict = {}
        self.checkpointed: dict | None = None
        self.outbox = None  # the PUSH socket to the generators' inboxes, once they are known
        self.next_dispatch = 0  # the next step whose prompts go out
        self.in_flight: dict[int, list] = {}  # prompts of the steps sent and not yet trained
        self.regenerate: list[tuple[int, list[int]]] = []  # (step, prompt slots) the trainer dropped
        self.sending = False
        self.last_done: float | None = None  # when the last step finished (this attempt)

    # ----- the run --------------------------------------------------------------------------------

    def run(self) -> list[dict]:
        import zmq

        from toolkit.launch.coordinator import Coordinator
        from toolkit.transport.sockets import Outbox
        from toolkit.transport.wire import Codec, read_secret

        cfg, t = self.cfg, self.cfg.transport
        secret = read_secret(self.run_dir.secret)
        ctx = zmq.Context()
        self.coordinator = Coordinator(ctx, secret, self.bind_host)
        # Our own handlers: a run started in the background of a script inherits SIGINT ignored, and
        # Python then installs no KeyboardInterrupt handler of its own.
        previous = {sig: signal.signal(sig, _raise_interrupt) for sig in (signal.SIGINT, signal.SIGTERM)}
        previous[signal.SIGUSR1] = signal.signal(signal.SIGUSR1, self._on_usr1)
        records: list[dict] = []
        try:
            resume = self._plan_resume()
            self._start_workers(resume)
            self.state = "running"
            inboxes = [self.book[w]["inbox"] for w in self.generator_ids]
            self.outbox = Outbox(ctx, Codec(secret, "driver"), inboxes, t.max_inflight_messages)
            self.next_dispatch = resume["next_step"]
            for step in range(resume["next_step"], cfg.run.steps):
                if self.preempt and not self._time_for_a_step(records):
                    break
                records.append(self._step(step))
            stopped_early = self.step + 1 < cfg.run.steps
            if stopped_early:
                self._checkpoint_before_stopping()
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
        finally:
            for sig in (signal.SIGINT, signal.SIGTERM):  # a second Ctrl-C must not cut the clean-up short
                signal.signal(sig, signal.SIG_IGN)
            self.stopping = True
            self.launcher.stop(grace_s=5.0)
            self._write_status()
            if self.outbox is not None:
                self.outbox.close()
            self.coordinator.close()
            ctx.term()
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    def _start_workers(self, resume: dict) -> None:
        """Launch every worker, hand out the address book and the resume plan, and wait until all are ready
        (after a resume: until the generators hold the trainer's weights)."""
        t = self.cfg.transport
        self.launcher.start(self.groups, {E.RUN_DIR: str(self.run_dir.path), E.CONTROL: self.coordinator.address,
                                          E.SECRET_FILE: str(self.run_dir.secret)})
        self.echo(f"started {len(self.worker_ids)} workers ({', '.join(f'{g.name} x{g.workers}' for g in self.groups)})"
                  f"; logs in {self.run_dir.logs}")
        started = time.monotonic()
        self._pump(lambda: len(self.book) == len(self.worker_ids), t.startup_timeout_s, "every worker to register")
        for worker_id in self.worker_ids:
            self.coordinator.send(worker_id, "start", book=self.book, resume=resume)
        self._pump(lambda: len(self.ready) == len(self.worker_ids), t.startup_timeout_s,
                   "every worker to load its models")
        self.echo(f"all workers ready in {time.monotonic() - started:.1f} s")
        self._record_replayed()
        version = self.trainer_ready.get("version", 0)
        if version:
            self._pump(lambda: all(self.synced.get(g) == version for g in self.generator_ids),
                       t.step_timeout_s, "the resumed weights to reach the generators")

    def _step(self, step: int) -> dict:
        """Send the prompts of every step that may start now (only `step` when synchronous), then wait
        until `step` is trained and its weights reached the generators."""
        cfg = self.cfg
        self.running_step = step
        started = self.last_done or time.monotonic()  # (steps overlap when async: time from the last one)
        lag = cfg.rollout.max_policy_lag
        # Step s trains at policy_version s. Its prompts may go out once the generators hold weights
        # within `lag` of that (they sync in order and never fall behind a finished step); in `drop`
        # mode one step earlier: samples that turn out too old are dropped and generated again.
        horizon = step + lag + (1 if lag and cfg.rollout.stale == "drop" else 0)
        while self.next_dispatch <= min(horizon, cfg.run.steps - 1):
            s = self.next_dispatch
            if cfg.rollout.stale == "wait":
                self._pump(lambda: all(self.synced.get(g, 0) >= s - lag for g in self.generator_ids),
                           cfg.transport.step_timeout_s, f"the generators to hold weights for step {s}")
            self.in_flight[s] = self.feeder.next(cfg.rollout.prompts_per_step)
            self._send_prompts(s, list(range(len(self.in_flight[s]))))
            self.next_dispatch += 1
        version = step + 1
        self._pump(lambda: step in self.trained and all(self.synced.get(g) == version for g in self.generator_ids),
                   cfg.transport.step_timeout_s, f"step {step} to finish")
        self.in_flight.pop(step, None)
        self.last_done = time.monotonic()
        self.running_step = None
        return self._record(step, step_s=self.last_done - started)

    def _record(self, step: int, **extra) -> dict:
        """Write the metrics of trained `step` (what the trainer reported, plus `extra`) and show them."""
        record = {"step": step, "policy_version": step + 1, **self.trained.pop(step), **extra, "time": time.time()}
        if step + 1 in self.sync_checks:
            record["sync_check_diff"] = self.sync_checks.pop(step + 1)
        self.run_dir.append_metrics(record)
        self.step = step
        self.echo(progress_line(record, self.cfg.run.steps))
        self._write_status(last=record)
        return record

    def _send_prompts(self, step: int, slots: list[int]) -> None:
        """The prompts at positions `slots` of `step`, split evenly over the generators (one message each)."""
        prompts = self.in_flight[step]
        self.sending = True  # (no regeneration goes out from the health checks while the socket is full)
        try:
            for part in np.array_split(np.asarray(slots, dtype=np.int64), len(self.generator_ids)):
                if len(part) == 0:
                    continue
                chosen = [prompts[i] for i in part]
                self.outbox.send("prompts", {"step": step, "prompt_ids": [p.id for p in chosen],
                                             "group_index": [int(i) for i in part],
                                             "prompts": [p.text for p in chosen], "fields": [p.fields for p in chosen]},
                                 timeout_s=self.cfg.transport.step_timeout_s, while_blocked=self._pump_once)
        finally:
            self.sending = False

    def _send_regenerations(self) -> None:
        """Send again the prompts whose samples the trainer dropped as too old (asynchronous `drop` mode)."""
        while self.regenerate and self.outbox is not None and not self.sending:
            step, slots = self.regenerate.pop(0)
            self._send_prompts(step, slots)

    def _plan_resume(self) -> dict:
        """Resume from what the run directory holds (nothing, for a new run); the trainer's part of it."""
        plan = plan_resume(self.run_dir.path)
        for problem in plan.problems:
            self.echo(f"resume: {problem}")
        moved = set_aside(self.run_dir.path, plan)
        if plan.checkpoint or plan.replay or moved:
            where = f"checkpoint {plan.checkpoint['dir']}" if plan.checkpoint else "the initial weights"
            self.echo(f"resuming at step {plan.next_step}: {where} (policy_version {plan.start_version}), then "
                      f"training again on {len(plan.replay)} committed experience batch(es)"
                      + (f"; {len(moved)} later one(s) set aside in {moved[0].parent}" if moved else ""))
            Manifest(self.run_dir.path).append({
                "kind": "resume", "checkpoint": plan.checkpoint["dir"] if plan.checkpoint else None,
                "replay": [str(p.relative_to(self.run_dir.path)) for p in plan.replay], "next_step": plan.next_step,
                "set_aside": [str(p.relative_to(self.run_dir.path)) for p in moved], "problems": plan.problems})
        self._keep_metrics_before(plan.next_step)
        self.feeder.skip(plan.next_step * self.cfg.rollout.prompts_per_step)
        self.step = plan.next_step - 1
        return {"checkpoint": plan.checkpoint["dir"] if plan.checkpoint else None,
                "replay": [str(p) for p in plan.replay], "next_step": plan.next_step}

    def _keep_metrics_before(self, step: int) -> None:
        """Drop metrics of steps that will run again (and a line cut short by a crash)."""
        path = self.run_dir.metrics
        if not path.exists():
            return
        kept = []
        for line in path.read_text().splitlines():
            try:
                record = json.loads(line)
                if record["step"] < step:
                    kept.append(line + "\n")
                    self.history.append(record)
            except (json.JSONDecodeError, KeyError):
                pass
        self.run_dir.write_atomic(path, "".join(kept))

    def _record_replayed(self) -> None:
        """Metrics of steps trained again on a resume, for steps whose metrics were never written."""
        done = {r["step"] for r in read_metrics(self.run_dir.metrics)} if self.run_dir.metrics.exists() else set()
        for record in self.trainer_ready.get("replayed", []):
            if record["step"] not in done:
                self.run_dir.append_metrics({**record, "time": time.time()})
            self.last_metrics = record
            self.echo(f"replayed {progress_line(record, self.cfg.run.steps)}")

    def _checkpoint_before_stopping(self) -> None:
        self.echo(f"stopping after step {self.step + 1} (SIGUSR1): saving a checkpoint")
        for worker_id in self.trainer_ids:  # ranks above 0 that also generate join rank 0's checkpoint
            self.coordinator.send(worker_id, "checkpoint")
        self._pump(lambda: self.checkpointed is not None, self.cfg.transport.step_timeout_s, "the trainer's checkpoint")
        self.echo(f"checkpoint of policy_version {self.checkpointed['version']} saved in "
                  f"{self.checkpointed['checkpoint_s']:.1f} s")
        for step in sorted(self.trained):  # asynchronous: steps whose samples were in before the stop
            self._record(step)

    def _on_usr1(self, signum, frame) -> None:
        self.preempt = True
        if self.end_time is None:
            self.end_time = self.launcher.end_time() or time.time()
        log.warning("SIGUSR1: stopping while %.0f s are left before the job ends", self.end_time - time.time())

    def _time_for_a_step(self, records: list[dict]) -> bool:
        """Another step, a checkpoint and the stop fit before the end (estimated from the last steps run,
        also by earlier attempts of the run)."""
        if self.end_time is None:
            self.end_time = self.launcher.end_time() or time.time()
        ran = [r for r in [*self.history, *records] if "step_s" in r]
        step_s = max((r["step_s"] for r in ran[-3:]), default=30.0)
        checkpoint_s = max((r.get("checkpoint_s") or 0.0 for r in ran), default=0.0) + 5.0
        return time.time() + step_s + checkpoint_s + STOP_MARGIN_S < self.end_time

    def _shutdown(self) -> None:
        self.stopping = True
        for worker_id in self.worker_ids:
            self.coordinator.send(worker_id, "shutdown")
        if not self.launcher.wait(timeout_s=60):
            log.warning("some workers did not exit within 60 s of shutdown; stopping them")

    # ----- events and health ----------------------------------------------------------------------

    def _pump(self, done: Callable[[], bool], timeout_s: float, waiting_for: str) -> None:
        deadline = time.monotonic() + timeout_s
        while not done():
            if time.monotonic() > deadline:
                raise RunError(f"timed out after {timeout_s:.0f} s waiting for {waiting_for}\n{self._who_is_where()}")
            self._pump_once(0.2)

    def _pump_once(self, wait_s: float = 0.0) -> None:
        """Handle the control messages that arrived (waiting up to `wait_s` for one), then check health."""
        item = self.coordinator.recv(wait_s)
        while item is not None:
            self._handle(*item)
            item = self.coordinator.recv(0)
        self._send_regenerations()
        self._check_health()
        if time.monotonic() - self._status_written > STATUS_EVERY_S:
            self._write_status()

    def _handle(self, worker_id: str, msg) -> None:
        m = msg.meta
        if worker_id not in self.worker_ids:
            log.warning("message %r from unknown worker %r ignored", msg.kind, worker_id)
        elif msg.kind == "register":
            self.book[worker_id] = {k: m.get(k) for k in ("group", "rank", "pid", "node", "inbox", "store")}
            # The launcher knows the step's real id (in a heterogeneous job, the component's job id).
            self.book[worker_id]["slurm_step"] = self.launcher.step_id(m.get("group", "")) or m.get("slurm_step")
            log.info("registered %s (pid %s on %s)", worker_id, m.get("pid"), m.get("node"))
        elif msg.kind == "ready":
            self.ready.add(worker_id)
            if worker_id == self.trainer_id:
                self.trainer_ready = m
            log.info("%s ready", worker_id)
        elif msg.kind == "failed":
            dead = self._dead_peer(worker_id, REPORT_GRACE_S)
            if dead is not None:  # its peers fail in their collectives: the dead worker is the cause
                raise RunError(f"{self._exited(dead)}\n(then {self._describe(worker_id)} failed: {m.get('error')})")
            raise RunError(self._failed(worker_id, m))
        elif msg.kind == "weights_ready":
            for g in self.sync_ids:
                self.coordinator.send(g, "sync", version=m["version"])
        elif msg.kind == "synced":
            self.synced[worker_id] = m["version"]
            if m.get("check_diff") is not None:  # the worst generator's probe difference after this sync
                self.sync_checks[m["version"]] = max(self.sync_checks.get(m["version"], 0.0), m["check_diff"])
        elif msg.kind == "trained":
            self.trained[m["step"]] = m["metrics"]
        elif msg.kind == "regenerate":
            self.regenerate.append((m["step"], m["group_index"]))
        elif msg.kind == "checkpointed":
            self.checkpointed = m
        elif msg.kind != "bye":
            log.warning("unexpected %r from %s", msg.kind, worker_id)

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
        return (f"{self._describe(worker_id)} failed: {report.get('error')}\n"
                f"{report.get('traceback', '').rstrip()}\n{self._log_hint(worker_id)}")

    def _exited(self, ended) -> str:
        return f"{self._describe(ended.worker_id)} exited with {ended.describe()}\n{self._log_hint(ended.worker_id)}"

    def _check_health(self) -> None:
        for ended in self.launcher.poll():
            if self.stopping and ended.code == 0:
                continue
            report = self._last_report(ended.worker_id, REPORT_GRACE_S)  # says more than an exit code
            if report is not None:
                raise RunError(self._failed(ended.worker_id, report))
            raise RunError(self._exited(ended))
        limit = self.cfg.transport.heartbeat_timeout_s
        for worker_id, silent_s in self.coordinator.silent(self.worker_ids, limit):
            raise RunError(f"{self._describe(worker_id)} sent no heartbeat for {silent_s:.0f} s "
                           f"(limit transport.heartbeat_timeout_s = {limit:g}); it is hung or its node is lost\n"
                           f"{self._log_hint(worker_id)}")

    def _describe(self, worker_id: str) -> str:
        group, rank = worker_id.split(":")
        entry = self.book.get(worker_id)
        if entry:
            where = f"pid {entry['pid']} on node {entry['node']}"
            if entry.get("slurm_step"):
                where += f", Slurm step {entry['slurm_step']}"
        else:
            where = self.launcher.describe(worker_id)
        return f"{group} worker rank {rank} ({worker_id}, {where})"

    def _log_hint(self, worker_id: str, lines: int = 8) -> str:
        path = self.run_dir.log_file(worker_id)
        try:
            tail = path.read_text(errors="replace").splitlines()[-lines:]
        except OSError:
            tail = []
        shown = "".join(f"\n    | {line}" for line in tail)
        return f"log: {path}" + (f" (last lines:){shown}" if tail else "")

    def _who_is_where(self) -> str:
        rows = []
        for worker_id in self.worker_ids:
            status = self.coordinator.status.get(worker_id, {})
            rows.append(f"  {worker_id}: {status.get('phase', 'not registered')}"
                        + (f" step {status['step']}" if "step" in status else ""))
        return "worker states:\n" + "\n".join(rows)

    def _write_status(self, last: dict | None = None) -> None:
        if last is not None:
            self.last_metrics = last
        workers = {w: {**self.book.get(w, {}), **self.coordinator.status.get(w, {})} for w in self.worker_ids}
        # What the driver knows for sure beats the last heartbeat: synced and trained versions, and the end.
        for w, version in self.synced.items():
            workers[w]["policy_version"] = version
        if self.last_metrics:  # trainer ranks update in lockstep
            for w in self.trainer_ids:
                workers[w]["policy_version"] = self.last_metrics["policy_version"]
        if self.state not in ("starting", "running"):
            for w in workers.values():
                w["phase"], w["step"] = "ended", self.step
        status = {"state": self.state, "step": self.step, "running_step": self.running_step,
                  "steps": self.cfg.run.steps,
                  "launcher": self.launcher.name, "error": self.error,
                  "driver": {"pid": os.getpid(), "node": node_name()}, "workers": workers,
                  "last_metrics": self.last_metrics}
        self.run_dir.write_status(status)
        self._status_written = time.monotonic()


def progress_line(r: dict, steps: int) -> str:
    line = (f"step {r['step'] + 1:>3}/{steps}  v{r['policy_version']}  reward {r['reward_mean']:.3f}  "
            f"kl {r['kl']:+.4f}  loss {r['loss']:+.4f}")
    if "generate_s" in r:  # (a step trained again on a resume generated nothing)
        line += (f"  gen {r['generate_s']:.2f}s  score {r['score_s']:.2f}s  train {r['train_s']:.2f}s  "
                 f"sync {r['sync_s']:.2f}s  {r['tokens_per_s']:.0f} tok/s")
    if r.get("policy_lag_max"):  # asynchronous mode: how old the weights that generated the batch were
        line += f"  lag {r['policy_lag_mean']:.1f}/{r['policy_lag_max']}"
    if r.get("dropped_samples"):
        line += f"  dropped {r['dropped_samples']}"
    if r.get("checkpoint_s"):
        line += f"  ckpt {r['checkpoint_s']:.2f}s"
    return line


def _raise_interrupt(signum, frame):
    raise KeyboardInterrupt(signum)


def read_metrics(path: Path) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]
