"""Driver of a supervised stage (`sft`, `rm`): the trainer ranks run the training loop themselves; the
driver watches them, writes each step's metrics and the progress line, and on SIGUSR1 asks rank 0 for a
checkpoint and a stop while one still fits before the time limit (the rest is the Supervisor's)."""

from __future__ import annotations

from toolkit.launch.supervisor import Supervisor


class StageDriver(Supervisor):
    def _loop(self, resume: dict, secret: bytes, records: list[dict]) -> None:
        self.steps, self.train_rows = self.trainer_ready["steps"], self.trainer_ready["train_rows"]
        first = self.trainer_ready["step"]
        self.step = first - 1
        self.echo(f"{self.cfg.stage}: {self.train_rows} training rows, "
                  f"{self.trainer_ready['eval_rows']} eval rows; steps {first + 1}..{self.steps} of "
                  f"{self.cfg.train.batch_size} rows")
        def stop() -> bool:
            return self.preempt and not self._time_for_a_step(records)

        for step in range(first, self.steps):
            if stop():
                break
            self.running_step = step
            # (a stop request is acted on at once: the ranks stop at their next step boundary)
            self._pump(lambda: step in self.trained or stop(), self.cfg.transport.step_timeout_s,
                       f"step {step + 1} to finish")
            if step not in self.trained:
                break
            records.append(self._record(step))
        self.running_step = None

    def _checkpoint_before_stopping(self) -> None:
        """Ask rank 0 to checkpoint at its next step boundary; the steps it finished meanwhile are recorded
        (and if that was the last one, the stage simply finished)."""
        self.coordinator.send(self.trainer_id, "checkpoint")
        self.echo(f"stopping at the ranks' next step boundary (SIGUSR1; the last step they reported: "
                  f"{self.step + 1}): saving a checkpoint")
        self._pump(lambda: self.checkpointed is not None or self.step + 1 + len(self.trained) >= self.steps,
                   self.cfg.transport.step_timeout_s, "the trainer's checkpoint")
        for step in sorted(self.trained):
            self._record(step)
        if self.checkpointed is not None:
            self.echo(f"checkpoint of step {self.checkpointed['version']} saved in "
                      f"{self.checkpointed['checkpoint_s']:.1f} s")

    def _evaluation_ahead_s(self, ran: list[dict]) -> float:
        """Seconds the next step takes longer for its evaluation, where it has one (every train.eval_every
        steps, and after the last): the longest so far; before any, the last steps' update scaled from their
        rows to the eval rows, a forward pass being about a third of an update. (The time-limit check left
        it out: a stage whose evaluation outlasted the margin was killed before its checkpoint.)"""
        following = self.step + 2  # (the next step's number: self.step is the last one reported, from 0)
        if not self.trainer_ready["eval_rows"] or (following % self.cfg.train.eval_every and following < self.steps):
            return 0.0
        walls = [r["eval_s"] for r in ran if r.get("eval_s")]
        if walls:
            return max(walls)
        update = max((r["step_s"] for r in ran[-3:]), default=30.0)
        return update * self.trainer_ready["eval_rows"] / self.cfg.train.batch_size / 3

    def progress_line(self, r: dict) -> str:
        line = f"step {r['step'] + 1:>3}/{self.steps}  loss {r['loss']:.4f}"
        if "accuracy" in r:
            line += f"  acc {r['accuracy']:.3f}  margin {r['margin']:+.3f}"
        line += f"  lr {r['lr']:.2e}  {r['tokens_per_s']:.0f} tok/s"
        if "eval_loss" in r:
            line += f"  eval loss {r['eval_loss']:.4f}"
        if "eval_ppl" in r:
            line += f" ppl {r['eval_ppl']:.2f}"
        if "eval_accuracy" in r:
            line += f" acc {r['eval_accuracy']:.3f} margin {r['eval_margin']:+.3f}"
        if r.get("checkpoint_s"):
            line += f"  ckpt {r['checkpoint_s']:.2f}s"
        return line
