"""Driver of an RL run: the prompt feeder, the step clock and the weight syncs (the rest is the Supervisor's).

Before the workers start, the driver plans a resume from the run manifest (a new run resumes from
nothing): the trainer gets the checkpoint to load and the committed experience to train on again, and
the prompt feeder skips what those steps drew.

A step, in the synchronous (on-policy) mode:
  1. the prompt feeder's next prompts go to the generators, split evenly, one message per worker;
  2. samples flow generators -> scorers -> trainer rank 0 over ZeroMQ (the driver is not in that path);
  3. the trainer trains and says `weights_ready`; the driver tells every generator to `sync`;
  4. the trainer broadcasts the weights; generators report `synced`, the trainer reports `trained`;
  5. the driver writes the step's metrics and starts the next step.
In asynchronous mode (`rollout.max_policy_lag` N > 0) the prompts of steps up to N ahead are already
out while a step trains, so generation overlaps training; the trainer drops samples older than N
(`stale: drop`) and the driver sends their prompts again.

With `eval.every_steps`, after each such step (and the last) the held-out prompts go to the generators
too, marked as an evaluation: they are sampled and scored as a step's are (no reference model), and
trainer rank 0 writes them apart (RUN_DIR/eval/in-run) and says `evaluated`; nothing is trained on them.
Synchronously they come before the next step's prompts, so they are sampled with the weights of the step
just trained; asynchronously, behind the steps already out (`policy_version_min/max` say with which).

What the driver prints names a step by its number in the progress line, from 1 (`step 3/5`: the third),
and an evaluation or a checkpoint by the steps trained before it (`eval step 3` after `step 3/5`); the
code and metrics.jsonl's `step` count from 0.
"""

from __future__ import annotations

import time

import numpy as np

from toolkit.data.prompts import PromptFeeder, read_prompts
from toolkit.launch.supervisor import Supervisor, read_metrics
from toolkit.placement.plan import group_of



def covered(spans: list[tuple[float, float]], start: float) -> float:
    """Seconds after `start` that at least one of `spans` (from, to) covers: evaluations out at the same
    time (async, one longer than eval.every_steps steps) count once."""
    total, reached = 0.0, start
    for begin, end in sorted(spans):
        if end > reached:
            total += end - max(begin, reached)
            reached = end
    return total

class Driver(Supervisor):
    unit = "policy_version"

    def __init__(self, cfg, run_dir, launcher, bind_host: str, echo=print):
        super().__init__(cfg, run_dir, launcher, bind_host, echo)
        self.generator_group = group_of(self.groups, "generator").name
        self.generator_ids = group_of(self.groups, "generator").worker_ids()
        # Generators with workers of their own get weights by broadcast when told to `sync`; a generator
        # in a trainer's worker gets them in memory and reports `synced` by itself.
        self.sync_ids = [] if cfg.placement.generation_with_actor() else self.generator_ids
        self.feeder = PromptFeeder(read_prompts(cfg.data, cfg.run.seed))
        self.synced: dict[str, int] = {}
        self.sync_checks: dict[int, float] = {}  # policy_version -> largest probe difference after its sync
        self.outbox = None  # the PUSH socket to the generators' inboxes, once they are known
        self.next_dispatch = 0  # the next step whose prompts go out
        self.in_flight: dict[int, list] = {}  # prompts of the steps sent and not yet trained
        self.regenerate: list[tuple[int, list[int]]] = []  # (step, prompt slots) the trainer dropped
        # The steps and evaluations out when a worker was started again: what it may have lost (`_restarted`)
        self.out_at_restart: tuple[set[int], set[int]] = (set(), set())
        self.sending = False
        self.last_done: float | None = None  # when the last step finished (this attempt)
        self.eval_prompts = []  # the prompts held out of training, when the run evaluates itself (eval.every_steps)
        if cfg.eval.every_steps:  # (data.dataset.check_data made sure there are some, before any process)
            from toolkit.use.evaluate import heldout_prompts

            self.eval_prompts = heldout_prompts(cfg)
        self.evaluating: dict[int, float] = {}  # step -> when its evaluation went out (not yet `evaluated`)
        self.evaluated_walls: list[tuple[float, float]] = []  # (went out, written) since the last step's record

    def _loop(self, resume: dict, secret: bytes, records: list[dict]) -> None:
        from toolkit.transport.sockets import Outbox
        from toolkit.transport.wire import Codec

        self._record_replayed()
        version = self.trainer_ready.get("version", 0)
        if version:  # (after a resume the generators get the trainer's weights first)
            self._pump(lambda: all(self.synced.get(g) == version for g in self.generator_ids),
                       self.cfg.transport.step_timeout_s, "the resumed weights to reach the generators")
        inboxes = [self.book[w]["inbox"] for w in self.generator_ids]
        with self.coordinator.answering():  # (the workers hear the driver while it connects)
            self.outbox = Outbox(self.ctx, Codec(secret, "driver", accepts=()), inboxes,
                                 self.cfg.transport.max_inflight_messages, to=self.generator_group,
                                 connect_timeout_s=self.cfg.transport.heartbeat_timeout_s / 2,
                                 max_message_mb=self.cfg.transport.max_message_mb)
        self.next_dispatch = resume["next_step"]
        self._evaluate_resumed(resume["next_step"])
        for step in range(resume["next_step"], self.cfg.run.steps):
            if self.preempt and not self._time_for_a_step(records):
                return  # (an evaluation still out is not waited for: the time limit is near; the resume makes it)
            records.append(self._step(step))
            if self._evaluates(step + 1):
                self._send_evaluation(step + 1)
        if self.evaluating:
            self._pump(lambda: not self.evaluating, self.cfg.transport.step_timeout_s,
                       f"the evaluation of step(s) {', '.join(map(str, sorted(self.evaluating)))}")

    def _close(self) -> None:
        if self.outbox is not None:
            self.outbox.close()

    def _plan_resume(self) -> dict:
        resume = super()._plan_resume()
        self.feeder.skip(resume["next_step"] * self.cfg.rollout.prompts_per_step)
        if (self.cfg.trainer.ema is not None and resume["checkpoint"]
                and not (self.run_dir.path / resume["checkpoint"] / "ema.safetensors").exists()):
            self.echo(f"trainer.ema: {resume['checkpoint']} has no EMA (trainer.ema was off when it was saved): "
                      "the average starts from its weights")
        return resume

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
                           cfg.transport.step_timeout_s, f"the generators to hold weights for step {s + 1}")
            self.in_flight[s] = self.feeder.next(cfg.rollout.prompts_per_step)
            self._send_prompts(s, list(range(len(self.in_flight[s]))))
            self.next_dispatch += 1
        version = step + 1
        # (at least: asynchronously a generator started again may rejoin with the weights of a later step, the
        # trainer having gone on without it; waiting for exactly these weights then waited for good)
        self._pump(lambda: step in self.trained and all(self.synced.get(g, -1) >= version for g in self.generator_ids),
                   cfg.transport.step_timeout_s, f"step {step + 1} to finish")
        self.in_flight.pop(step, None)
        self.last_done = time.monotonic()
        self.running_step = None
        # (the part of the step's wall time during which an evaluation was out: synchronously the generators
        # take its prompts before the step's, so the step after one carries it)
        evaluating = covered(self.evaluated_walls, started)
        self.evaluated_walls.clear()
        extra = {"eval_wall_s": evaluating} if evaluating else {}
        return self._record(step, step_s=self.last_done - started, **extra)

    def _record(self, step: int, **extra) -> dict:
        extra["policy_version"] = step + 1
        if step + 1 in self.sync_checks:
            extra["sync_check_diff"] = self.sync_checks.pop(step + 1)
        return super()._record(step, **extra)

    def progress_line(self, r: dict) -> str:
        return progress_line(r, self.cfg.run.steps)

    def _send_prompts(self, step: int, slots: list[int], prompts: list | None = None, **meta) -> None:
        """The prompts at positions `slots` of `step` (or of `prompts`, with `meta` added to each message),
        split evenly over the generators (one message each)."""
        prompts = self.in_flight[step] if prompts is None else prompts
        self.sending = True  # (no regeneration goes out from the health checks while the socket is full)
        try:
            for part in np.array_split(np.asarray(slots, dtype=np.int64), len(self.generator_ids)):
                if len(part) == 0:
                    continue
                chosen = [prompts[i] for i in part]
                self.outbox.send("prompts", {"step": step, **meta, "prompt_ids": [p.id for p in chosen],
                                             "group_index": [int(i) for i in part],
                                             "prompts": [p.prompt for p in chosen],
                                             "fields": [p.fields for p in chosen]},
                                 timeout_s=self.cfg.transport.step_timeout_s, while_blocked=self._pump_once)
        finally:
            self.sending = False

    def _evaluates(self, version: int) -> bool:
        """Whether the weights of `version` steps are evaluated: every eval.every_steps and the last."""
        every = self.cfg.eval.every_steps
        return bool(every) and version > 0 and (version % every == 0 or version == self.cfg.run.steps)

    def _evaluate_resumed(self, version: int) -> None:
        """On a resume: the evaluation of the resumed weights again, if it is due and its line is not in
        RUN_DIR/eval/in-run/summary.jsonl (the run stopped while it was out: a crash, the time limit). The
        trainer holds the very weights it was to sample, so it comes out as it would have. Those of earlier
        weights cannot be made again in the run; the driver names them."""
        if not self.cfg.eval.every_steps or version == 0:
            return
        from toolkit.use.evaluate import in_run_evaluations

        done = {r["step"] for r in in_run_evaluations(self.run_dir.path)}
        lost = [s for s in range(1, version) if s % self.cfg.eval.every_steps == 0 and s not in done]
        if lost:  # (many where eval.every_steps was set only now)
            named = ", ".join(map(str, lost[:5])) + (f", ... ({len(lost)} in all)" if len(lost) > 5 else "")
            self.echo(f"the evaluation of step(s) {named} did not finish before the run stopped and its weights "
                      f"are gone from the run; `slurm-rlhf eval {self.run_dir.path} --steps STEP,...` scores kept "
                      f"checkpoints")
        if self._evaluates(version) and version not in done:
            self.echo(f"evaluating step {version} again: the run stopped before its evaluation was written")
            self._send_evaluation(version)

    def _steps_out_beyond_the_next(self) -> int:
        """Asynchronously the prompts of up to `max_policy_lag` steps past the next are out (one more with
        `stale: drop`), and the trainer trains those whose samples are in before it takes the checkpoint
        command: counted as one step each (a step's time is the pace of the overlapped steps), so that a
        time limit's checkpoint still comes before the end with lag 2 or more."""
        lag = self.cfg.rollout.max_policy_lag
        ahead = lag + (1 if lag and self.cfg.rollout.stale == "drop" else 0)
        return max(0, min(ahead, self.cfg.run.steps - 2 - self.step))  # (self.step: the last one recorded)

    def _evaluation_ahead_s(self, ran: list[dict]) -> float:
        """Seconds the next step may take longer for the evaluation out now (the generators sample it first):
        the longest one run so far; before any, the last steps' generation and scoring, scaled to its
        samples."""
        if not self.evaluating:
            return 0.0
        walls = [r["eval_wall_s"] for r in ran if r.get("eval_wall_s")]
        if walls:
            return max(walls)
        step = max((r.get("generate_s", 0.0) + r.get("score_s", 0.0) for r in ran[-3:]), default=30.0)
        return step * len(self.eval_prompts) * self.cfg.eval.n / self.cfg.samples_per_step

    def _send_evaluation(self, step: int, slots: list[int] | None = None) -> None:
        """The held-out prompts (those at `slots`, else all), marked as an evaluation of the weights of `step`
        steps (eval.n samples each)."""
        self.evaluating.setdefault(step, time.monotonic())
        prompts = self.eval_prompts
        slots = list(range(len(prompts))) if slots is None else slots
        self._send_prompts(step, slots, prompts, eval_samples=len(prompts) * self.cfg.eval.n)

    def _between_events(self) -> None:
        """Send again the prompts whose samples the trainer misses: dropped as too old (asynchronous `drop`
        mode), or lost with a worker started again."""
        while self.regenerate and self.outbox is not None and not self.sending:
            step, slots, evaluation = self.regenerate.pop(0)
            if evaluation and step in self.evaluating:  # (not one written meanwhile)
                self._send_evaluation(step, slots)
            elif not evaluation and step in self.in_flight:  # (not a step trained meanwhile)
                self._send_prompts(step, slots)

    def _restart(self, worker_id: str, why: str) -> None:
        super()._restart(worker_id, why)
        # (the process lost has ended: what goes out from now on reaches the new one, or waits for it)
        self.out_at_restart[0].update(self.in_flight)
        self.out_at_restart[1].update(self.evaluating)

    def _restarted(self, worker_id: str) -> None:
        """A generator or scorer started again: the work it held is lost. The trainer says which sample
        groups of the steps not finished it still misses, and their prompts go out again (`regenerate`;
        the same seeds give the same samples, and the trainer keeps the first copy of a group that comes
        twice, one that a worker still held). Before, every prompt of those steps went out again.
        The same for an evaluation still out: its missing held-out prompts go out again, ahead of the
        steps' (synchronously no step trains before them, so they sample the weights it was sent for).
        Only the steps already out when the worker was started again can have lost work: asynchronously the
        next steps' prompts go out while it starts and loads (their samples reach it, or wait for it), and the
        trainer, asked before those came in, had each of those steps generated twice."""
        out_steps, out_evals = self.out_at_restart
        steps = sorted(s for s in self.in_flight if s in out_steps)
        evals = sorted(s for s in self.evaluating if s in out_evals)
        self.out_at_restart = (set(), set())
        if not steps and not evals:
            return
        self.coordinator.send(self.trainer_id, "missing", steps=[[s, len(self.in_flight[s])] for s in steps],
                              evals=[[s, len(self.eval_prompts)] for s in evals])
        what = [f"step(s) {', '.join(str(s + 1) for s in steps)}"] * bool(steps) + \
            [f"the evaluation of step(s) {', '.join(map(str, evals))}"] * bool(evals)
        self.echo(f"asking the trainer which samples of {' and '.join(what)} it still misses")

    def _record_replayed(self) -> None:
        """Metrics of steps trained again on a resume, for steps whose metrics were never written."""
        done = {r["step"] for r in read_metrics(self.run_dir.metrics)} if self.run_dir.metrics.exists() else set()
        for record in self.trainer_ready.get("replayed", []):
            if record["step"] not in done:
                self._write_metrics(record)
            self.last_metrics = record
            self.echo(f"replayed {progress_line(record, self.cfg.run.steps)}")

    def _handle_stage(self, worker_id: str, msg) -> bool:
        m = msg.meta
        if msg.kind == "weights_ready":
            # (to the generators the trainer sends to; a generator started again only once it rejoined)
            for g in m.get("to", self.sync_ids):
                if m.get("rejoin") or g not in self.restarting:
                    self.coordinator.send(g, "sync", version=m["version"], rejoin=bool(m.get("rejoin")))
        elif msg.kind == "joining_sync":  # a generator started again: the trainer forms a new group with it
            self.coordinator.send(self.trainer_id, "join_sync", worker=worker_id, generation=m["generation"])
        elif msg.kind == "synced":
            self.synced[worker_id] = m["version"]
            if m.get("check_diff") is not None:  # the worst generator's probe difference after this sync
                self.sync_checks[m["version"]] = max(self.sync_checks.get(m["version"], 0.0), m["check_diff"])
        elif msg.kind == "evaluated":
            from toolkit.use.evaluate import row_line

            sent, now = self.evaluating.pop(m["step"], None), time.monotonic()
            wall = f" ({now - sent:.1f} s after it went out)" if sent is not None else ""
            if sent is not None:
                self.evaluated_walls.append((sent, now))
            self.echo(f"eval {row_line(m['record'], m['components'])}{wall}")
            self.curves.add_evaluation(m["record"])
        elif msg.kind == "regenerate":
            evaluation = bool(m.get("eval"))
            self.regenerate.append((m["step"], m["group_index"], evaluation))
            if evaluation and m["step"] in self.evaluating:
                self.echo(f"sending {len(m['group_index'])} of the {len(self.eval_prompts)} held-out prompts of the "
                          f"evaluation of step {m['step']} again (their samples were lost)")
            elif m.get("lost") and m["step"] in self.in_flight:
                self.echo(f"sending {len(m['group_index'])} of the {len(self.in_flight[m['step']])} prompts of "
                          f"step {m['step'] + 1} again (their samples were lost)")
        else:
            return False
        return True

    def _worker_status(self) -> dict[str, dict]:
        workers = super()._worker_status()
        # What the driver knows for sure beats the last heartbeat: synced and trained versions.
        for w, version in self.synced.items():
            workers[w]["policy_version"] = version
        if self.last_metrics:  # trainer ranks update in lockstep
            for w in self.trainer_ids:
                workers[w]["policy_version"] = self.last_metrics["policy_version"]
        return workers


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
