"""The trainer ranks of a supervised stage (`sft`, `rm`): the whole training loop, on every rank.

A step takes the next `train.batch_size` rows of the stage's blended training order (a pure function of
the step, so a resume sees the same rows), each rank its contiguous share, in micro-batches; DeepSpeed
steps the optimizer after the last one. Every `train.eval_every` steps (and after the last) the eval
rows are scored; every `checkpoint.every_steps` (and after the last) a checkpoint is saved, with each
rank's random state, so a resumed run ends with the same weights as an uninterrupted one. After the
last step the model goes to RUN_DIR/export for the next stage of a pipeline.

Rank 0 reports each step's metrics to the driver (`trained`) and, at every step boundary, tells the
other ranks whether to go on or to checkpoint and stop (the driver asks before a time limit).
"""

from __future__ import annotations

import logging
import math
import time
from pathlib import Path

import torch

from toolkit.data.dataset import KIND, StageData
from toolkit.hold import hold
from toolkit.packing import inside
from toolkit.roles.base import Role
from toolkit.store import checkpoint
from toolkit.store.manifest import Manifest
from toolkit.training.export import exported
from toolkit.training.ranks import Ranks

log = logging.getLogger(__name__)

GO, STOP = 1, 0


class SupervisedRole(Role):
    def prepare(self) -> dict:
        self.ranks = Ranks(self.worker.rank, self.worker.group.workers)
        return self.ranks.prepare(self.worker.wenv.bind_host, self.cfg.transport.startup_timeout_s)

    def setup(self) -> None:
        from transformers import AutoTokenizer

        from toolkit.modeling import torch_dtype
        from toolkit.training.engine import build_engine

        cfg = self.cfg
        self.run_dir = Path(self.worker.wenv.run_dir)
        self.ranks.join(self.worker.book[self.worker.group.worker_ids()[0]]["store"], self.device,
                        cfg.transport.startup_timeout_s, cfg.transport.step_timeout_s)
        torch.manual_seed(cfg.run.seed)  # the same new weights (a score head) on every rank
        self.tokenizer = AutoTokenizer.from_pretrained(cfg.tokenizer_path)
        self.task = _task(cfg, self.tokenizer)
        self.data = StageData(cfg.data, cfg.stage, KIND[cfg.stage], cfg.run.seed)
        t = cfg.train
        self.steps = cfg.total_steps(self.data.train_rows)
        self.per_rank = t.batch_size // self.ranks.world
        accumulation = self.per_rank // t.micro_batch_size
        model = self.task.model(torch_dtype(cfg.model.dtype))
        self.engine = build_engine(model, t, t.lr, cfg.model.dtype, self.ranks.world, accumulation, self.steps,
                                   lora=t.lora)
        self.ranks.prove(cfg.transport.step_timeout_s)  # (DeepSpeed's group: before any gradient travels)
        torch.manual_seed(cfg.run.seed + 1 + self.ranks.rank)  # dropout: each rank its own stream
        self.step, self.checkpointed, self.extra_files = 0, -1, {}
        plan = self.worker.resume or {}
        if plan.get("checkpoint"):
            state = checkpoint.load(self.run_dir / plan["checkpoint"], {"model": self.engine}, self.ranks.rank)
            self.step = self.checkpointed = state["step"]
            log.info("loaded %s (step %d)", plan["checkpoint"], self.step)
        self.data.skip(self.step * t.batch_size)
        # Resumed after the last step's checkpoint but before the export: the loop only finishes. Decided
        # here, before any rank can have exported: a look at the file system after the loop would race
        # with rank 0's export (a rank that saw none would wait for a checkpoint no other rank makes).
        self.finish_pending = self.step == self.steps and not exported(self.run_dir, self.step)
        log.info("%s: %d training rows, %d eval rows, %d steps of %d rows on %d rank(s), starting at step %d",
                 cfg.stage, self.data.train_rows, len(self.data.eval), self.steps, t.batch_size, self.ranks.world,
                 self.step)

    def ready_info(self) -> dict:
        return {"steps": self.steps, "step": self.step, "train_rows": self.data.train_rows,
                "eval_rows": len(self.data.eval)}

    # ----- the loop -----------------------------------------------------------------------------

    def train_loop(self) -> None:
        """Every rank: train from the current step to the last (or until rank 0 says stop)."""
        cfg = self.cfg
        for step in range(self.step, self.steps):
            if self.ranks.rank == 0:
                hold("boundary", self.run_dir)
            code, _ = self.ranks.command(self._next_command() if self.ranks.rank == 0 else GO, step)
            if code == STOP:
                seconds, size_mb = self._checkpoint()
                if self.ranks.rank == 0:
                    self.worker.control.send("checkpointed", version=self.step, checkpoint_s=seconds,
                                             checkpoint_mb=size_mb)
                return
            metrics = self._train_step(step)
            self.step = step + 1
            last = self.step == self.steps
            if self.step % cfg.train.eval_every == 0 or last:
                metrics.update(self._evaluate())
            if self.step % cfg.checkpoint.every_steps == 0 and not last:
                metrics["checkpoint_s"], metrics["checkpoint_mb"] = self._checkpoint()
            if last:
                metrics["checkpoint_s"], metrics["checkpoint_mb"] = self._finish()
            if self.ranks.rank == 0:
                self.worker.control.send("trained", step=step, metrics=metrics)
        if self.finish_pending:
            self._finish()

    def _finish(self) -> tuple[float, float]:
        """After the last step (every rank): the reward statistics (rm), the last checkpoint, the export."""
        if self.cfg.stage == "rm":
            self.extra_files["reward_stats.json"] = self._reward_stats()
        self.checkpointed = -1  # (a checkpoint of this step without the statistics is replaced)
        seconds, size_mb = self._checkpoint()
        self._export()
        return seconds, size_mb

    def _next_command(self) -> int:
        """Rank 0: STOP when the driver asked for a checkpoint (e.g. the time limit is near), else GO."""
        while (msg := self.worker.control.recv(0)) is not None:
            if msg.kind == "checkpoint":
                return STOP
            log.warning("ignored command %r during training", msg.kind)
        return GO

    def _train_step(self, step: int) -> dict:
        """One optimizer step over this step's rows (this rank's share, in micro-batches)."""
        t = self.cfg.train
        self.status.update(phase="training", step=step)
        hold("training", self.run_dir)
        started = time.monotonic()
        rows = self.data.next(t.batch_size)[self.ranks.rank * self.per_rank: (self.ranks.rank + 1) * self.per_rank]
        sums: dict[str, float] = {"tokens": 0.0, "positions": 0.0, "cut_rows": 0.0}
        batches = [self.task.batch(rows[start: start + t.micro_batch_size], packing=t.packing)
                   for start in range(0, len(rows), t.micro_batch_size)]
        # Each micro-batch's mean loss weighs by its share of the step's targets over every rank (DeepSpeed
        # then averages the ranks): the step's loss is the mean over all its targets (SFT: response tokens),
        # whatever the micro-batches. (DeepSpeed's 1 / accumulation steps made it a mean of the micro-batches'
        # means: a response of 3 tokens weighed as much as one of 64, and micro_batch_size changed training.)
        lr = float(self.engine.get_lr()[0])  # (the rate this step trains with: after it the scheduler moves on)
        everywhere = self._sum({"targets": float(sum(b["targets"] for b in batches))})["targets"] or 1.0
        for batch in batches:
            with inside([self.engine], batch.get("packed")):  # (forward and backward; see toolkit.packing)
                loss, stats = self.task.loss(self.engine, batch, self.device)
                self.engine.backward(loss * (batch["targets"] * self.ranks.world / everywhere), scale_wrt_gas=False)
            self.engine.step()
            for k, v in {**stats, "tokens": batch["tokens"], "positions": batch["positions"],
                         "cut_rows": batch["cut_rows"]}.items():
                sums[k] = sums.get(k, 0.0) + v
        totals = self._sum(sums)
        seconds = time.monotonic() - started
        grad_norm = self.engine.get_global_grad_norm()
        # tokens: the real tokens the passes read (SFT: prompt and response, though only the response is a
        # target); positions: what the forward passes computed (padding included); cut_rows: rows (RM: pairs)
        # that train.max_tokens cut. step_s: the update alone (an evaluation's eval_s and a checkpoint's
        # checkpoint_s come after it)
        return {**self.task.summary(totals), "lr": lr,
                "grad_norm": None if grad_norm is None else float(grad_norm), "tokens": int(totals["tokens"]),
                "cut_rows": int(totals["cut_rows"]),
                "padding_frac": 1 - totals["tokens"] / max(totals["positions"], 1),
                "tokens_per_s": totals["tokens"] / max(seconds, 1e-9), "step_s": seconds}

    def _evaluate(self) -> dict:
        """The task's metrics over the eval rows (each rank scores its share), prefixed `eval_`."""
        if not self.data.eval:
            return {}
        self.status["phase"] = "evaluating"
        started = time.monotonic()
        sums: dict[str, float] = {}
        self.engine.eval()
        with torch.no_grad():
            for rows, counted in self._shares(self.data.eval, self.cfg.train.eval_batch_size):
                _, stats = self.task.loss(self.engine, self.task.batch(rows), self.device)
                for k, v in stats.items():
                    sums[k] = sums.get(k, 0.0) + (v if counted else 0.0)
        self.engine.train()
        return {**self.task.summary(self._sum(sums), "eval_"), "eval_s": time.monotonic() - started}

    def _shares(self, examples: list, size: int):
        """This rank's batches of `examples` as (rows, counted): the same number of batches on every rank,
        since under ZeRO-3 each forward pass needs every rank; a rank out of rows repeats one uncounted."""
        share = examples[self.ranks.rank::self.ranks.world]
        for b in range(math.ceil(math.ceil(len(examples) / self.ranks.world) / size)):
            rows = share[b * size: (b + 1) * size]
            yield (rows, True) if rows else (examples[:1], False)

    def _reward_stats(self) -> dict:
        """The trained reward's mean and std on the RL part's rows (both responses of each), or, if those
        have no responses, on the reward model's own eval (else training) pairs: for RL to normalise."""
        from toolkit.errors import ConfigError
        from toolkit.modeling import last_token_scores

        examples, source = None, None
        split = self.cfg.data.split
        if split is not None and split.rl > 0:
            try:
                rl = StageData(self.cfg.data, "rl", "pair", self.cfg.run.seed)
                examples, source = [e for part in rl.train for e in part][:1024], "rl part"
            except ConfigError:  # the RL part's rows have no responses
                pass
        if examples is None:
            examples, source = ((self.data.eval, "rm eval rows") if self.data.eval else
                                ([e for part in self.data.train for e in part], "rm rows"))
            examples = examples[:1024]
        self.engine.eval()
        sums = {"sum": 0.0, "squares": 0.0, "count": 0.0}
        for rows, counted in self._shares(examples, self.cfg.train.eval_batch_size):
            sequences = [self.task.sequence(ex.prompt, r) for ex in rows for r in (ex.chosen, ex.rejected)]
            scores = last_token_scores(self.engine.module, sequences, self.task.pad_id, len(sequences), self.device)
            if counted:
                sums = {"sum": sums["sum"] + float(scores.sum()), "squares": sums["squares"] + float((scores ** 2).sum()),
                        "count": sums["count"] + len(scores)}
        self.engine.train()
        totals = self._sum(sums)
        mean = totals["sum"] / max(totals["count"], 1)
        std = math.sqrt(max(totals["squares"] / max(totals["count"], 1) - mean ** 2, 0.0))
        return {"mean": mean, "std": std, "samples": int(totals["count"]), "rows": source}

    def _sum(self, values: dict[str, float]) -> dict[str, float]:
        """`values` summed over the ranks (same keys on every rank)."""
        keys = sorted(values)
        summed = self.ranks.sum(torch.tensor([values[k] for k in keys], dtype=torch.float64)).tolist()
        return dict(zip(keys, summed))

    # ----- checkpoints and export ---------------------------------------------------------------

    def _checkpoint(self) -> tuple[float, float]:
        if self.step == self.checkpointed:
            return 0.0, 0.0
        self.status["phase"] = "checkpointing"
        started = time.monotonic()
        size_mb = checkpoint.save(self.run_dir, self.step, {"model": self.engine},
                                  {"step": self.step, "layout": checkpoint.layout(self.cfg.train, self.ranks.world)},
                                  self.ranks.rank, self.ranks.barrier, self.cfg.checkpoint.keep, self._write_copies)
        self.checkpointed = self.step
        return time.monotonic() - started, size_mb

    def _write_copies(self, directory: Path) -> None:
        """The model in Hugging Face format (`hf/`): a causal LM, or the reward model (sequence classification)."""
        from toolkit.training.export import save_hf

        module = self.engine.module.model if self.cfg.stage == "rm" else self.engine.module
        save_hf(module, directory / "hf", str(self.cfg.tokenizer_path), self.ranks.rank,
                self.cfg.train.zero_stage == 3, extra_files=self.extra_files)

    def _export(self) -> None:
        if self.ranks.rank != 0:
            return
        from toolkit.training.export import publish

        publish(self.run_dir, checkpoint.directory_of(self.run_dir, self.step) / "hf")
        Manifest(self.run_dir).append({"kind": "export", "step": self.step, "dir": "export"})


def _task(cfg, tokenizer):
    if cfg.stage == "sft":
        from toolkit.training.sft import SFTTask

        return SFTTask(cfg, tokenizer)
    from toolkit.training.rm import RMTask

    return RMTask(cfg, tokenizer)
