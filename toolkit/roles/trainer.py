"""Trainer role: DeepSpeed actor (and critic for PPO) on data-parallel ranks.

A step on rank 0: collect the step's scored samples, sort them (by prompt slot and sample index, so
arrival order never matters) and share them with the other ranks; every rank computes the experience
of its shard (old log-probs, values, advantages); rank 0 gathers it and commits the experience batch
to HDF5 (durable before anyone trains on it); every rank trains; the policy_version grows by one; the
full actor weights go to the generators (gathered bucket by bucket under ZeRO-3, folded into the EMA on
the way); every `checkpoint.every_steps` a model checkpoint is saved, and after the last step the actor
(and its EMA) is exported to RUN_DIR/export (export-ema).

On a resume (`start` carries the plan) the trainer loads the checkpoint and trains again on the
committed experience after it, from the stored tensors, before the first new step; a replay that passed a
step due a checkpoint ends with one.

Rank 0 hosts the run's rendezvous store: the trainer group and the weight-sync groups rendezvous on it,
and it tells the other ranks what to do next with a broadcast command (train, checkpoint, sync, stop).

The critic on ranks of its own (a node group hosting the critic alone, as OpenRLHF puts it on GPUs of
its own): the trainer's ranks are the actor's group's, then as many of the critic's group, and each
model trains over its own part of them. Critic rank A + r has the same shard as actor rank r: it
computes the values while the actor computes its log-probs, sends them to its actor rank, gets the
returns back, and trains on the same micro-batches in the same order, at the same time as the actor.
The step's results equal those of the critic on the actor's ranks.
"""

from __future__ import annotations

import collections
import logging
import os
import time
from pathlib import Path

import numpy as np
import torch

from toolkit.algorithms.kl_controller import make_kl_controller
from toolkit.hold import hold
from toolkit.modeling import critic_values, gather_responses, pad_samples
from toolkit.placement.plan import group_of, trainer_groups
from toolkit.roles.base import Role
from toolkit.roles.update import (PER_RANK, STATS, Experience, experience_from_record, make_experience, old_at_update,
                                  train_on)
from toolkit.samples import SampleBatch
from toolkit.store import checkpoint, experience
from toolkit.store.manifest import Manifest
from toolkit.training.export import exported
from toolkit.training.ranks import Ranks
from toolkit.weights.hf_format import checkpoint_converter, identity
from toolkit.weights.probe import model_logprobs, probe_tokens
from toolkit.weights.sync import WeightSender, arrived, form_group, gathered_buckets, plan_layout, sync_group_name

log = logging.getLogger(__name__)

STOP, TRAIN, CHECKPOINT, SYNC, EVALUATE = 0, 1, 2, 3, 4
REJOIN_CONNECT_S = 60.0
"""How long a generator started again may take to connect to its new weight-sync group once every one
of its ranks arrived there (seconds pass between the two only on a busy node): past it, rank 0 takes
it for one that ended in between, and goes on until the driver's next start of it comes."""


class TrainerRole(Role):
    def prepare(self) -> dict:
        groups = trainer_groups(self.worker.groups)  # (the actor's, then a critic's group of its own)
        names = [g.name for g in groups]
        before = sum(g.workers for g in groups[:names.index(self.worker.group.name)])
        self.ranks = Ranks(before + self.worker.rank, sum(g.workers for g in groups))
        self.rank, self.world = self.ranks.rank, self.ranks.world
        self.actor_ranks = groups[0].workers
        self.store_host = groups[0].worker_ids()[0]
        return self.ranks.prepare(self.worker.wenv.bind_host, self.cfg.transport.startup_timeout_s)

    def setup(self) -> None:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        from toolkit.modeling import ScoreModel, pretrained_kwargs, torch_dtype
        from toolkit.training.engine import build_engine
        from toolkit.training.lora import parameter_counts

        cfg = self.cfg
        self.run_dir = Path(self.worker.wenv.run_dir)
        timeout_s = cfg.transport.step_timeout_s
        # The data-parallel ranks of this rank's models: all of them, or with the critic on ranks of its
        # own, the actor's or the critic's part (rank r and actor_ranks + r are partners: the same shard).
        apart = self.world > self.actor_ranks
        self.ranks.join(self.worker.book[self.store_host]["store"], self.device, cfg.transport.startup_timeout_s,
                        timeout_s, split_at=self.actor_ranks if apart else None)
        self.dp = self.ranks.part
        self.partner = (self.rank + self.actor_ranks) % self.world if apart else None
        torch.manual_seed(cfg.run.seed)
        self.tokenizer = AutoTokenizer.from_pretrained(cfg.tokenizer_path)
        self.pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        dtype = torch_dtype(cfg.model.dtype)
        attention = cfg.model.attn_implementation
        t = cfg.trainer
        # (by token budget, the updates' boundaries are set as the micro-batches come: DeepSpeed's count is only
        # what its batch size is checked against, and the step's samples need not divide by micro_batch_size)
        accumulation = max(1, cfg.samples_per_step // self.dp.world // (t.micro_batch_size * t.updates_per_step))
        optimizer_steps = cfg.run.steps * cfg.algorithm.epochs * t.updates_per_step  # (a cosine schedule's length)
        hosted = self.worker.group.models
        self.engines = {}
        if "actor" in hosted:
            actor = AutoModelForCausalLM.from_pretrained(cfg.model.actor,
                                                         **pretrained_kwargs(cfg.model.actor, dtype, attention))
            self.engines["actor"] = build_engine(actor, t, t.lr, cfg.model.dtype, self.dp.world, accumulation,
                                                 optimizer_steps, lora=t.lora)
        if cfg.run.algorithm == "ppo" and "critic" in hosted:
            critic = ScoreModel(str(cfg.critic_path), dtype, attention=attention)
            self.engines["critic"] = build_engine(critic, t, t.critic_lr, cfg.model.dtype, self.dp.world, accumulation,
                                                  optimizer_steps)
        self.actor, self.critic = self.engines.get("actor"), self.engines.get("critic")
        self.ranks.prove(timeout_s)  # (DeepSpeed's group of the engines: before any gradient travels)
        k = cfg.algorithm.kl
        self.kl = make_kl_controller(k.coef, k.adaptive, k.target, k.horizon)
        self.version = 0
        self.checkpointed = -1
        self.parked = []  # the engines whose training state is in host memory while a generator runs (`_park`)
        self.shuffle_rng = torch.Generator().manual_seed(cfg.run.seed)
        self.params, self.deltas, self.layout, self.ptx, self.ema = [], [], None, None, None
        if self.actor is not None:
            self._actor_setup()
        self.replayed = self._resume(self.worker.resume or {})
        self.status["policy_version"] = self.version
        self.generator = None  # the generator role, when this worker hosts one (it sets itself here)
        self.sender = None
        self._said_copies = False  # (the first sync's log line on how its buckets were sent)
        if self.rank == 0 and not self.cfg.placement.generation_with_actor():
            generators = group_of(self.worker.groups, "generator").worker_ids()
            log.info("forming a weight-sync group with each of %d generator worker(s)", len(generators))
            self.sender = WeightSender(self.layout, self.device)
            for worker_id in generators:
                self._join_sync(worker_id, 0, timeout_s)
        self.status["trainable_parameters"] = sum(parameter_counts(e.module)[0] for e in self.engines.values())
        log.info("trainer rank %d/%d ready (%s, ZeRO-%d, %d actor weights, policy_version %d) on %s", self.rank,
                 self.world, " and ".join(self.engines), t.zero_stage, len(self.params), self.version, self.device)

    def _actor_setup(self) -> None:
        """What the ranks of the actor keep besides its engine: its weights as the generators take them, the
        PTX text and the EMA."""
        from toolkit.training.lora import plain_model, plain_weights

        cfg, t = self.cfg, self.cfg.trainer
        # The weights as the plain model holds them (with LoRA: the base model's names, adapters merged in).
        weights = plain_weights(self.actor.module)
        self.params = [(w.name, w.param) for w in weights]
        self.deltas = [w.delta for w in weights]
        # vLLM loads the checkpoint format; the transformers engine loads the parameters as they are.
        convert = checkpoint_converter(plain_model(self.actor.module)) if cfg.generation_backend == "vllm" else identity
        vocab = min(len(self.tokenizer), plain_model(self.actor.module).config.vocab_size)
        probe = probe_tokens(vocab, cfg.run.seed) if cfg.rollout.sync_check else []  # (none: nothing to compute)
        self.layout = plan_layout(self.params, int(t.weight_sync_bucket_mb * 2**20), probe, convert)
        self.ptx = self._ptx_text()
        if t.ema is not None:
            from toolkit.training.ema import EMA

            self.ema = EMA(t.ema)
            self._full_weights()  # the average starts from the initial weights

    def _ptx_text(self):
        """The PTX mixture's text on this rank, or None when it is off."""
        if not self.cfg.ptx.coef:
            return None
        from toolkit.training.ptx import PtxText

        t = self.cfg.trainer
        per_step = self.cfg.algorithm.epochs * self.cfg.samples_per_step // self.dp.world // t.micro_batch_size
        return PtxText(self.cfg.ptx, self.tokenizer, self.cfg.run.seed, t.micro_batch_size, per_step, self.dp.rank,
                       self.dp.world)

    def generation_model(self):
        """The module a generator in this worker generates with: the actor's own, unless ZeRO-3 splits it."""
        return None if self.cfg.trainer.zero_stage == 3 else self.actor.module

    def ready_info(self) -> dict:
        return {"version": self.version, "replayed": self.replayed}

    # ----- resume -------------------------------------------------------------------------------

    def _resume(self, plan: dict) -> list[dict]:
        """Load the plan's checkpoint, then train again on the committed experience after it (every rank)."""
        if plan.get("checkpoint"):
            directory = self.run_dir / plan["checkpoint"]
            state = checkpoint.load(directory, self.engines, self.rank)
            self.version = self.checkpointed = state["policy_version"]
            self.kl.load_state_dict(state["kl"])
            checkpoint.set_rng_state(state["shuffle_rng"], self.shuffle_rng)
            if self.ema is not None and not (directory / "ema.safetensors").exists():
                # (saved while trainer.ema was off: the average starts from the weights resumed, where loading
                # it ended the run in a FileNotFoundError; every rank folds them in, as ZeRO-3 gathers)
                log.warning("%s has no EMA (trainer.ema was off when it was saved): the average starts from its "
                            "weights", directory)
                self.ema.weights = {}
                self._full_weights()
            elif self.ema is not None and self.rank == 0:
                self.ema.load(directory / "ema.safetensors")
            log.info("loaded %s (policy_version %d)", directory, self.version)
        replayed = []
        pause_s = float(os.environ.get(REPLAY_PAUSE_ENV, 0))
        for path in plan.get("replay", []):
            # (heartbeats carry this: the driver's start-up timeout counts from the last progress)
            self.status.update(phase="replaying", step=self.version)  # (step s trains at policy_version s)
            time.sleep(pause_s)
            record = experience.read(Path(path))
            batch = experience.batch_of(record)
            if abs(record["attrs"]["kl_coef"] - self.kl.coef) > 1e-12 or record["attrs"]["policy_version"] != self.version:
                log.warning("%s was trained from policy_version %s with kl_coef %s; replaying it at %s with its "
                            "advantages and kl_coef as recorded (the KL controller is at %s)", path,
                            record["attrs"]["policy_version"], record["attrs"]["kl_coef"], self.version, self.kl.coef)
            metrics = self._learn(batch, record=record)
            if self.ema is not None:  # (the sync after each step folds it in; a replay has no sync)
                self._full_weights()
            metrics.update(_batch_metrics(batch), **_lags(batch, record["attrs"]["policy_version"]), step=batch.step,
                           policy_version=self.version, replayed=True)
            replayed.append(metrics)
            log.info("trained again on %s (policy_version now %d)", path, self.version)
        # A replay that passed a step due a checkpoint ends with one (of its last policy_version), so that a
        # second failure soon after does not train on the same batches again; one killed after the last
        # commit finishes the run's end.
        if any(self._checkpoint_due(m["step"]) for m in replayed):
            replayed[-1]["checkpoint_s"], replayed[-1]["checkpoint_mb"] = self._checkpoint()
            log.info("saved a checkpoint after the replay (policy_version %d)", self.version)
        if self.version == self.cfg.run.steps and (replayed or not exported(self.run_dir, self.version)):
            self._export()
        return replayed

    # ----- the loop -----------------------------------------------------------------------------

    def begin(self) -> None:
        """Before the first step (rank 0, and ranks above 0 that also generate): make the generators hold
        the trainer's weights (after a resume they still hold the initial ones)."""
        if self.generator is not None:
            self.generator.holds(self.version, check_diff=self.load_generator())
        elif self.rank == 0 and self.version > 0:
            self.ranks.command(SYNC)
            self.worker.control.send("weights_ready", step=-1, version=self.version, to=self.sender.names)
            self._sync(fold_ema=False)
        self.pending: dict[int, list[SampleBatch]] = {}  # samples by step (later steps arrive early when async)
        self.dropped: dict[int, int] = {}
        self.received: dict[int, set[int]] = {}  # sample groups in by step: a second copy is a duplicate
        self.duplicates: dict[int, int] = {}
        self.expected_step = (self.worker.resume or {}).get("next_step", 0)
        self.evaluations: dict[int, list[SampleBatch]] = {}  # an evaluation's samples by step, until all are in
        self.evaluated: set[int] = set()  # the steps whose evaluation this process wrote

    def handle(self, part: SampleBatch) -> None:
        """Rank 0: collect samples until the next step's experience batch is complete, then train on it
        (and on the following steps' batches, if they are complete too). An evaluation's samples go apart."""
        if part.eval_samples:
            return self._evaluated(part)
        ahead = self.cfg.rollout.max_policy_lag + 1
        if part.step > self.expected_step + ahead:
            raise RuntimeError(f"got samples of step {part.step} while collecting step {self.expected_step} "
                               f"(rollout.max_policy_lag {ahead - 1} allows steps up to {self.expected_step + ahead})")
        part = self._drop_stale(self._drop_duplicates(part))
        if len(part):
            self.received.setdefault(part.step, set()).update(int(i) for i in np.unique(part.group_index))
            self.pending.setdefault(part.step, []).append(part)
        while self._collected(self.expected_step) >= self.cfg.samples_per_step:
            self._step(self.pending.pop(self.expected_step))
            self.expected_step += 1
        self.status.update(phase="collecting", step=self.expected_step, samples=self._collected(self.expected_step))

    def _evaluated(self, part: SampleBatch) -> None:
        """Rank 0: gather the samples of an evaluation (eval.every_steps: held-out prompts, never trained on
        or committed); once all are in, write them as `slurm-rlhf eval` does (RUN_DIR/eval/in-run) and tell
        the driver. A sample group that comes twice (sent again after a restart) counts once."""
        from toolkit.use.evaluate import IN_RUN, summary_of, write_step

        if part.step in self.evaluated:  # (a copy sent again after a restart, come in after the rest)
            return
        seen = self._evaluation_groups(part.step)
        parts = self.evaluations.setdefault(part.step, [])
        parts.append(part.select(np.flatnonzero(~np.isin(part.group_index, list(seen)))))
        if sum(map(len, parts)) < part.eval_samples:
            return
        batch = SampleBatch.concat(self.evaluations.pop(part.step))
        self.evaluated.add(part.step)
        batch = batch.select(np.lexsort((batch.sample_index, batch.group_index)))
        e, seconds = self.cfg.eval, {**_stage_seconds(parts, "generate_s", "generator"),
                                     **_stage_seconds(parts, "score_s", "scorer")}
        if self.scores_evaluations:
            seconds["score_s"] = seconds.get("score_s", 0.0) + self._score_evaluation(batch)
        record = {"step": part.step, **summary_of(batch, e.n), "eval_s": round(sum(seconds.values()), 3),
                  **{k: round(v, 3) for k, v in seconds.items()},
                  "policy_version_min": int(batch.policy_version.min()),
                  "policy_version_max": int(batch.policy_version.max()),
                  "prompts": len(batch) // e.n, "n": e.n, "temperature": e.temperature, "top_p": e.top_p,
                  "max_new_tokens": self.cfg.rollout.max_new_tokens, "seed": self.cfg.run.seed, "ema": False,
                  "input": "held out (data.eval_fraction), in the run"}
        write_step(self.run_dir, IN_RUN, record, batch)
        self.worker.control.send("evaluated", step=part.step, record=record, components=batch.reward_names)

    @property
    def scores_evaluations(self) -> bool:
        """Whether the reward models score an in-run evaluation's samples on the trainer's ranks (they are
        `deferred`: each rank scores its shard at rank 0's EVALUATE, as in the training step). A rank above
        0 that also generates follows rank 0 once after its share of an evaluation's prompts then."""
        reward = self.worker.roles.get("reward")
        return reward is not None and reward.deferred

    def _score_evaluation(self, batch: SampleBatch) -> float:
        """Every rank, when `scores_evaluations`: the reward models' columns of an evaluation's samples,
        each rank of the actor's its shard, summed over them (rank 0 first hands every rank the batch, whose
        reward-model columns the scorer left empty). Seconds it took."""
        started, before = time.monotonic(), {k: self.status.get(k) for k in ("phase", "step")}
        self.status.update(phase="scoring", step=batch.step - 1)
        if self.rank == 0:
            self.ranks.command(EVALUATE, batch.step)
            self.ranks.share(*batch.parts())
        if self.actor is not None:  # (the critic's ranks, when apart, hold no reward model)
            self.worker.roles["reward"].complete(batch, self.dp.shard(len(batch)), self.dp.sum)
        self.status.update(before)
        return time.monotonic() - started

    def _evaluation_groups(self, step: int) -> set[int]:
        """The sample groups of the evaluation of `step` gathered so far (not yet written)."""
        return {int(g) for p in self.evaluations.get(step, []) for g in p.group_index}

    def _drop_duplicates(self, part: SampleBatch) -> SampleBatch:
        """Keep the first copy of each sample group: after a generator or scorer was started again, the
        driver has the prompts of unfinished steps generated again (with the same seeds, so any copy is
        the same samples), and some of them had already come in."""
        if part.step < self.expected_step:  # (a step trained already)
            duplicate = np.ones(len(part), bool)
        else:
            duplicate = np.isin(part.group_index, list(self.received.get(part.step, ())))
        if duplicate.any():
            at = max(part.step, self.expected_step)  # (counted in the metrics of a step still to come)
            self.duplicates[at] = self.duplicates.get(at, 0) + int(duplicate.sum())
            log.info("step %d: dropped %d sample(s) that came in before", part.step, int(duplicate.sum()))
        return part.select(np.flatnonzero(~duplicate))

    def _collected(self, step: int) -> int:
        return sum(len(p) for p in self.pending.get(step, []))

    def _drop_stale(self, part: SampleBatch) -> SampleBatch:
        """Samples of a step are trained at policy_version == step. In `drop` mode, groups generated by
        weights more than max_policy_lag older are dropped, and the driver has them generated again."""
        lag = part.step - part.policy_version
        limit = self.cfg.rollout.max_policy_lag
        if lag.max(initial=0) <= limit:
            return part
        if self.cfg.rollout.stale != "drop":
            raise RuntimeError(f"step {part.step}: samples from policy_version {int(part.policy_version.min())}, "
                               f"older than rollout.max_policy_lag {limit} allows (the driver should have waited)")
        stale = np.unique(part.group_index[lag > limit])
        dropped = np.isin(part.group_index, stale)  # whole groups: GRPO compares a sample with its group
        self.dropped[part.step] = self.dropped.get(part.step, 0) + int(dropped.sum())
        log.info("step %d: dropped %d group(s) generated by policy_version %d (lag %d > %d); generating them again",
                 part.step, len(stale), int(part.policy_version.min()), int(lag.max()), limit)
        self.worker.control.send("regenerate", step=part.step, group_index=[int(i) for i in stale])
        return part.select(np.flatnonzero(~dropped))

    def _sync_world(self) -> int:
        """The size of a weight-sync group: trainer rank 0 and the engine ranks of one generator worker."""
        return 1 + (self.cfg.rollout.vllm.tensor_parallel_size if self.cfg.generation_backend == "vllm" else 1)

    def _join_sync(self, worker_id: str, generation: int, timeout_s: float, connect_s: float | None = None) -> None:
        """Rank 0: form the weight-sync group with generator worker `worker_id` (started `generation`
        times again) and send it the layout; blocks until that worker's engine ranks join (`connect_s`:
        how long they may take, where they have arrived already: see `form_group`)."""
        name = sync_group_name(worker_id, generation)
        group = form_group(self.ranks.store, 0, self._sync_world(), timeout_s, self.device, name, connect_s)
        self.sender.add(worker_id, group, timeout_s)

    def _await_generator(self, worker_id: str, generation: int) -> int | None:
        """Rank 0: wait, still hearing the driver, until generator `worker_id` started again reaches its new
        weight-sync group; the generation that did, or None (timed out, or the run is stopping). One that
        dies while loading is started again by the driver, whose `join_sync` for the new start replaces the
        one awaited here: the dead one would never come, and waiting for it would stall the run."""
        deadline = time.monotonic() + self.cfg.transport.startup_timeout_s
        while not arrived(self.ranks.store, sync_group_name(worker_id, generation), self._sync_world()):
            if time.monotonic() > deadline:
                log.warning("generator %s (start %d) did not reach its weight-sync group within %.0f s "
                            "(transport.startup_timeout_s)", worker_id, generation,
                            self.cfg.transport.startup_timeout_s)
                return None
            msg = self.worker.control.recv(0.5)
            if msg is None:
                continue
            if msg.kind == "join_sync" and msg.meta["worker"] == worker_id:
                log.warning("generator %s (start %d) was started again before it joined; waiting for start %d",
                            worker_id, generation, msg.meta["generation"])
                generation = msg.meta["generation"]
                continue
            self.worker.later.append(msg)  # (the serve loop handles it next)
            if msg.kind == "shutdown":
                return None
        return generation

    def _rejoin(self, worker_id: str, generation: int) -> None:
        """Rank 0: a generator worker started again in place of one that failed: a new group with it, and
        the current weights sent into it alone (every rank gathers them under ZeRO-3)."""
        log.info("generator %s was started again: forming a new weight-sync group with it", worker_id)
        generation = self._await_generator(worker_id, generation)
        if generation is None:
            return
        try:
            self._join_sync(worker_id, generation, self.cfg.transport.startup_timeout_s, REJOIN_CONNECT_S)
        except RuntimeError as e:  # (it failed again while joining: the driver starts another)
            log.warning("generator %s did not join its new weight-sync group: %s", worker_id, e)
            return
        self.ranks.command(SYNC)
        self.worker.control.send("weights_ready", step=-1, version=self.version, to=[worker_id], rejoin=True)
        self._sync(fold_ema=False, to=[worker_id])

    def _missing(self, steps: list[list[int]], evals: list[list[int]]) -> None:
        """Rank 0, after a generator or scorer was started again: for each [step, prompts] not trained
        yet, the prompts whose sample groups have not come in (lost with the worker, or still on their
        way from another: those come twice then, and the second copy is dropped) go to the driver to be
        generated again; first those of each [step, held-out prompts] of an evaluation not written yet.
        The samples already in this worker's inbox are taken in first: commands come before samples, and
        asynchronously the samples of the steps ahead wait there while the trainer trains and rejoins the
        generator; they were reported missing, and whole steps were generated twice."""
        if "generator" not in self.worker.roles:  # (else the inbox holds prompts, which the loop hands out)
            while self.worker.inbox.socket.poll(0):
                if (msg := self.worker.inbox.recv(0)) is not None:
                    self.worker.run_stages(msg.meta["stage"], SampleBatch.from_message(msg))
        for step, prompts in evals:
            if step in self.evaluated:
                continue
            missing = sorted(set(range(prompts)) - self._evaluation_groups(step))
            log.info("evaluation of step %d: %d of %d held-out prompt(s) not in after a worker was started again",
                     step, len(missing), prompts)
            if missing:
                self.worker.control.send("regenerate", step=step, group_index=missing, lost=True, eval=True)
        for step, prompts in steps:
            if step < self.expected_step:
                continue
            missing = sorted(set(range(prompts)) - self.received.get(step, set()))
            log.info("step %d: %d of %d sample group(s) not in after a worker was started again%s", step,
                     len(missing), prompts, "; generating them again" if missing else "")
            if missing:
                self.worker.control.send("regenerate", step=step, group_index=missing, lost=True)

    def on_command(self, msg) -> None:
        if msg.kind == "join_sync":
            return self._rejoin(msg.meta["worker"], msg.meta["generation"])
        if msg.kind == "missing":
            return self._missing(msg.meta["steps"], msg.meta.get("evals", []))
        if msg.kind != "checkpoint":  # the driver asks before stopping (e.g. the job's time is nearly up)
            return super().on_command(msg)
        if self.rank > 0:  # a rank that also generates: rank 0 is about to broadcast CHECKPOINT
            return self.follow(once=True)
        self.ranks.command(CHECKPOINT)
        seconds, size_mb = self._checkpoint()
        self.worker.control.send("checkpointed", version=self.version, checkpoint_s=seconds, checkpoint_mb=size_mb)

    def on_shutdown(self) -> None:
        if self.rank == 0:
            self.ranks.command(STOP)
        else:
            self.follow(once=True)

    def _step(self, parts: list[SampleBatch]) -> None:
        batch = SampleBatch.concat(parts)
        if len(batch) != self.cfg.samples_per_step:
            raise RuntimeError(f"step {batch.step}: {len(batch)} samples, expected {self.cfg.samples_per_step}")
        if self.version != batch.step:
            raise RuntimeError(f"step {batch.step} would train at policy_version {self.version}; they must be equal")
        batch = batch.select(np.lexsort((batch.sample_index, batch.group_index)))
        lags = {**_lags(batch, self.version), "dropped_samples": self.dropped.pop(batch.step, 0),
                "duplicate_samples": self.duplicates.pop(batch.step, 0)}
        self.received.pop(batch.step, None)
        self.ranks.command(TRAIN, batch.step)
        self.ranks.share(*batch.parts())
        metrics = self._train_step(batch)
        metrics.update(_stage_seconds(parts, "generate_s", "generator"))
        metrics.update(_stage_seconds(parts, "score_s", "scorer"))
        metrics["score_s"] += self.deferred_score_s  # (scoring on the trainer ranks, when deferred)
        metrics.update(_batch_metrics(batch), **lags)
        metrics["tokens_per_s"] = metrics["response_tokens"] / max(metrics["generate_s"], 1e-9)
        metrics["rejected_frames"] = self.worker.rejected_frames()
        self.worker.control.send("trained", step=batch.step, version=self.version, metrics=metrics)
        self.status.update(phase="idle", policy_version=self.version)

    def _train_step(self, batch: SampleBatch) -> dict:
        """Every rank: commit and train, send the weights on, and save a checkpoint when one is due."""
        metrics = self._learn(batch, commit=True)
        if self.rank == 0 and self.sender is not None:
            self.worker.control.send("weights_ready", step=batch.step, version=self.version, to=self.sender.names)
        metrics["sync_s"], metrics["sync_mb"] = self._sync()
        if self._checkpoint_due(batch.step):
            metrics["checkpoint_s"], metrics["checkpoint_mb"] = self._checkpoint()
        if batch.step + 1 == self.cfg.run.steps:
            self._export()
        elif (park_s := self._park()) is not None:
            metrics["park_s"] = park_s
        return metrics

    def _checkpoint_due(self, step: int) -> bool:
        """Whether a checkpoint follows the update of `step`: each `checkpoint.every_steps`, and the last."""
        return (step + 1) % self.cfg.checkpoint.every_steps == 0 or step + 1 == self.cfg.run.steps

    def _park(self) -> float | None:
        """With `placement.offload` and a generator in this worker: the engines' optimizer states, master
        weights and gradients go to host memory until the next update (`_unpark`), so that generation has
        the device to itself (the weights it generates with stay). Seconds it took; None when it does not."""
        from toolkit.training.engine import park

        if not (self.cfg.placement.offload and self.generator is not None):
            return None
        self.status["phase"] = "parking"  # (a phase of its own: not a wait in `status` and the report's timeline)
        started = time.monotonic()
        self.parked = [engine for engine in self.engines.values() if park(engine)]
        return time.monotonic() - started

    def _unpark(self) -> None:
        from toolkit.training.engine import unpark

        for engine in self.parked:
            unpark(engine)
        self.parked = []

    def follow(self, once: bool = False) -> None:
        """Ranks above 0: do what rank 0 broadcasts until it says stop (or one command when `once`)."""
        while True:
            command, step = self.ranks.command()
            if command == TRAIN:
                self._train_step(SampleBatch.from_parts(*self.ranks.share(None, None)))
            elif command == CHECKPOINT:
                self._checkpoint()
            elif command == SYNC:
                self._sync(fold_ema=False)
            elif command == EVALUATE:
                self._score_evaluation(SampleBatch.from_parts(*self.ranks.share(None, None)))
            self.status.update(phase="idle", policy_version=self.version, step=step)
            if once or command == STOP:
                return

    def _learn(self, batch: SampleBatch, commit: bool = False, record: dict | None = None) -> dict:
        """One update from `batch`: its experience is computed (or taken from a committed `record`),
        committed first if asked, then trained on. Every rank calls this with the same batch."""
        cfg = self.cfg
        self.status.update(phase="training", step=batch.step)
        hold("training", self.run_dir)
        started = time.monotonic()
        self._unpark()
        shard = self.dp.shard(len(batch))
        # scoring roles of this worker that score on the trainer ranks (each rank its shard); none when a
        # resume trains again on a committed record (it holds the scores; those roles are not set up yet)
        deferred = {name: role for name in ("reference", "reward")
                    if (role := self.worker.roles.get(name)) is not None and role.deferred and record is None}
        reference, reward = deferred.get("reference"), deferred.get("reward")
        scored = sum(role.deferred_s for role in deferred.values())
        if record is not None:
            exp = experience_from_record(record, shard, self.pad_id)
        elif self.actor is None:  # the critic on ranks of its own
            exp = self._critic_experience(batch, shard)
        else:
            if reward is not None:
                reward.complete(batch, shard, self.dp.sum)
            exp = make_experience(batch, shard, self.actor, self._values, cfg, self.kl.coef, self.pad_id, self.dp.sum,
                                  reference.logprobs if reference else None)
            if self.critic is None and exp.returns is not None:  # (to the critic's rank of this shard)
                self.ranks.send(exp.returns, self.partner)
        commit_s = self._commit(batch, exp) if commit else 0.0
        ptx = None if self.ptx is None else (lambda i: self.ptx.batch(batch.step, i))
        # (the rate this step's first update trains with: after it the scheduler has moved on)
        lr = float(self.actor.get_lr()[0]) if self.actor is not None else None
        stats = train_on(exp, self.actor, self.critic, cfg, self.shuffle_rng, ptx, self.ranks.max, self.dp.sum,
                         self.dp.world)
        mask = exp.mask
        # What each rank adds up: the actor's ranks the policy's figures, the critic's the values'.
        policy = torch.zeros(6, dtype=torch.float64)
        if self.actor is not None:
            k1 = (exp.old_logprobs - exp.ref_logprobs) * mask
            advantages = exp.advantages * mask
            policy = torch.tensor([k1.sum(), mask.sum(), float(len(shard)),
                                   ((exp.behaviour_logprobs - exp.old_logprobs).abs() * mask).sum(),
                                   advantages.sum(), (advantages ** 2).sum()], dtype=torch.float64)
        ppo = cfg.run.algorithm == "ppo"
        values = [(exp.values * mask).sum(), (exp.returns * mask).sum()] if self.critic is not None else [0.0, 0.0]
        # (token means: weighted by each rank's tokens, so the step's are over every rank's response tokens)
        weight = {k: 1.0 if k in PER_RANK else stats.get("train_tokens", 0.0) for k in STATS}
        totals = self.ranks.sum(torch.cat([policy, torch.tensor([
            *values, float(reference is not None and record is None), float(reward is not None and record is None),
            *[stats.get(k, 0.0) * weight[k] for k in STATS], *[weight[k] if k in stats else 0.0 for k in STATS]],
            dtype=torch.float64)]))
        kl_sum, tokens, samples, diff_sum, adv_sum, adv_sq, value_sum, return_sum = totals[:8].tolist()
        sums, having = totals[10:10 + len(STATS)].tolist(), totals[10 + len(STATS):].tolist()
        metrics = {k: total / n for k, total, n in zip(STATS, sums, having) if n}  # (over the ranks having it)
        # (ranks that scored their shard with the reference, and with the reward models)
        for name, ranks in zip(("reference_ranks", "reward_ranks"), totals[8:10].tolist()):
            if ranks:
                metrics[name] = int(ranks)
        adv_mean = adv_sum / tokens  # (per response token, over every rank's samples)
        metrics.update(advantage_mean=adv_mean, advantage_std=max(adv_sq / tokens - adv_mean ** 2, 0.0) ** 0.5)
        if ppo:
            metrics.update(value_mean=value_sum / tokens, return_mean=return_sum / tokens)
        metrics.update(kl=kl_sum / tokens, kl_seq=kl_sum / samples, behaviour_logprob_diff=diff_sum / tokens,
                       kl_coef=self.kl.coef, commit_s=commit_s)
        if self.actor is not None:
            metrics.update(grad_norm=_float(self.actor.get_global_grad_norm()), lr=lr)
        self.kl.update(kl_sum / samples, len(batch))
        self.version += 1
        scored = sum(role.deferred_s for role in deferred.values()) - scored  # (this rank's scoring passes)
        metrics["train_s"] = time.monotonic() - started - commit_s - scored
        self.deferred_score_s = scored
        return metrics

    def _values(self, padded) -> torch.Tensor:
        """The critic's values of this rank's shard: its own forward pass, or what the critic's rank of the
        same shard computed (the critic on ranks of its own)."""
        if self.critic is not None:
            return critic_values(self.critic, padded, self.cfg.model.forward_batch_size, self.cfg.model.packing)
        return self.ranks.receive(padded.action_mask.shape, self.partner)

    def _critic_experience(self, batch: SampleBatch, shard: np.ndarray) -> Experience:
        """A critic rank's share of the experience: the values of its shard, which it sends to the actor's
        rank of that shard, and the returns that rank computes from them (GAE)."""
        padded = pad_samples(batch.select(shard), self.pad_id)
        values = critic_values(self.critic, padded, self.cfg.model.forward_batch_size, self.cfg.model.packing)
        self.ranks.send(values, self.partner)
        return Experience(padded, None, None, None, None, values, self.ranks.receive(values.shape, self.partner))

    def _commit(self, batch: SampleBatch, exp) -> float:
        """Commit the step's experience batch to HDF5 (rank 0 writes; all ranks wait for it); seconds taken.
        A critic rank of its own has nothing to add (its actor rank has the values and returns)."""
        started = time.monotonic()
        computed_ref = batch.ref_logprobs is None  # the trainer computed them (make_experience)
        names = ["advantages"]
        if not old_at_update(self.cfg):  # (else they are the training forward's own)
            names.append("old_logprobs")
        if self.cfg.run.algorithm == "ppo":
            names += ["values", "returns"]
        if computed_ref:
            names.append("ref_logprobs")
        empty = np.zeros(0, np.float32)
        flat = {name: empty if self.actor is None else
                np.concatenate(gather_responses(getattr(exp, name), exp.padded) or [empty]) for name in names}
        full = self.ranks.gather_flat(flat)
        if self.rank == 0:
            if computed_ref:
                batch.ref_logprobs = full.pop("ref_logprobs").astype(np.float32)
            record = experience.record_of(batch, full, self.cfg.run.algorithm, self.version, self.kl.coef,
                                          (batch.step + 1) * self.cfg.rollout.prompts_per_step)
            path, digest, size = experience.commit(self.run_dir / "experience", batch.step, record)
            Manifest(self.run_dir).append({"kind": "experience", "step": batch.step,
                                           "file": str(path.relative_to(self.run_dir)), "checksum": digest,
                                           "bytes": size})
        self.ranks.barrier()  # nobody trains on a batch before it is durable
        return time.monotonic() - started

    def _checkpoint(self) -> tuple[float, float]:
        """Save a model checkpoint of the current policy_version (every rank); (seconds, MB)."""
        if self.version == self.checkpointed:
            return 0.0, 0.0
        self._unpark()  # (a checkpoint asked for between steps: a time limit, a preemption)
        self.status["phase"] = "checkpointing"
        started = time.monotonic()
        state = {"policy_version": self.version, "kl": self.kl.state_dict(),
                 "shuffle_rng": checkpoint.rng_state(self.shuffle_rng),
                 "prompts_drawn": self.version * self.cfg.rollout.prompts_per_step,
                 "layout": checkpoint.layout(self.cfg.trainer, self.actor_ranks)}
        size_mb = checkpoint.save(self.run_dir, self.version, self.engines, state, self.rank, self.ranks.barrier,
                                  self.cfg.checkpoint.keep, self._write_copies)
        self.checkpointed = self.version
        return time.monotonic() - started, size_mb

    def _write_copies(self, directory: Path) -> None:
        """What a checkpoint holds besides DeepSpeed's files: the actor in Hugging Face format (`hf/`), and
        with an EMA its average (`ema.safetensors` to resume it, `hf-ema/` to use it)."""
        from toolkit.modeling import torch_dtype
        from toolkit.training.export import save_hf

        if self.actor is None:  # (the critic on ranks of its own)
            return
        zero3 = self.cfg.trainer.zero_stage == 3
        save_hf(self.actor.module, directory / "hf", str(self.cfg.tokenizer_path), self.rank, zero3)
        if self.ema is not None and self.rank == 0:
            self.ema.save(directory / "ema.safetensors")
            save_hf(self.actor.module, directory / "hf-ema", str(self.cfg.tokenizer_path), 0, zero3,
                    state_dict=self.ema.state_dict(torch_dtype(self.cfg.model.dtype)))

    def _export(self) -> None:
        """After the last step: the final actor (and its EMA) as RUN_DIR/export (export-ema), for the next stage."""
        if self.rank != 0:
            return
        from toolkit.training.export import publish, withdraw

        directory = checkpoint.directory_of(self.run_dir, self.version)
        publish(self.run_dir, directory / "hf")
        if self.ema is not None:
            publish(self.run_dir, directory / "hf-ema", "export-ema")
        elif (self.run_dir / "export-ema").exists():  # (an earlier end's average, the run resumed with trainer.ema
            withdraw(self.run_dir, "export-ema")     # off: it stood beside the new export as if of its step)
            log.warning("removed export-ema/, the EMA of an earlier end of this run: trainer.ema is off now")
        Manifest(self.run_dir).append({"kind": "export", "step": self.version, "dir": "export"})

    def _sync(self, fold_ema: bool = True, to: list[str] | None = None) -> tuple[float, float]:
        """Bring the generators the new weights: rank 0 broadcasts them to generators of their own, a
        generator in this worker takes them in memory. Every rank gathers under ZeRO-3; the EMA reads
        the same gathered buckets. (seconds, MB sent)"""
        if self.actor is None:  # (the critic on ranks of its own)
            return 0.0, 0.0
        self.status["phase"] = "syncing"
        hold("syncing", self.run_dir)
        started = time.monotonic()
        if self.generator is not None:
            if fold_ema and self.ema is not None:
                self._full_weights()
            check_diff = self.load_generator()
            self.generator.holds(self.version, time.monotonic() - started, check_diff)
            return time.monotonic() - started, 0.0
        zero3 = self.cfg.trainer.zero_stage == 3
        buckets = self._buckets(zero3)
        if fold_ema and self.ema is not None:
            buckets = self._folded(buckets)
        sent = 0

        def probe() -> torch.Tensor:
            return model_logprobs(self.actor.module, self.layout.probe)

        if self.sender is not None:
            sent = self.sender.send(self.version, buckets, probe, transient=zero3, to=to)
            if not self._said_copies:
                self._said_copies = True
                log.info("weight sync: %d of %d buckets sent from the trainer's own memory, %d copied to be sent",
                         len(self.layout.sources) - self.sender.copied, len(self.layout.sources),
                         self.sender.copied)
        else:
            for _ in buckets:
                pass
            if zero3 and self.layout.probe:  # (the probe's forward pass needs every ZeRO-3 rank, after the same gathers)
                probe()
        return time.monotonic() - started, sent / 2**20

    def _buckets(self, zero3: bool):
        """The full weights of each bucket of the layout, as the plain model holds them (adapters merged)."""
        return gathered_buckets([p for _, p in self.params], self.layout.sources, zero3, self.deltas)

    def _folded(self, buckets):
        """The buckets, each folded into the EMA on rank 0 on its way through."""
        for index, tensors in zip(self.layout.sources, buckets):
            if self.rank == 0:
                self.ema.update([self.layout.names[i] for i in index], tensors)
            yield tensors

    def _full_weights(self) -> None:
        """Fold the current weights into the EMA (every rank iterates: ZeRO-3 gathers)."""
        zero3 = self.cfg.trainer.zero_stage == 3
        for _ in self._folded(self._buckets(zero3)):
            pass

    def load_generator(self) -> float | None:
        """Bring this worker's generator the current weights. The transformers engine generates with the
        actor's own tensors, so nothing moves unless ZeRO-3 splits them (then the gathered weights are
        copied). vLLM in this process loads them in its checkpoint layout (as a broadcast would bring
        them) and the probe checks it; returns that check's difference (None when nothing was checked)."""
        zero3 = self.cfg.trainer.zero_stage == 3
        if self.cfg.generation_backend != "vllm":
            if zero3:
                names, sources = self.layout.names, self.layout.sources
                for index, tensors in zip(sources, self._buckets(True)):
                    self.generator.engine.load_weights((names[i], t) for i, t in zip(index, tensors))
            return None
        named = []
        for index, tensors in enumerate(self._buckets(zero3)):
            converted = self.layout.converted(index, tensors)
            # (under ZeRO-3 a bucket's gathered tensors are freed at the next one; vLLM may still hold them)
            named += [(name, t.detach().clone() if zero3 else t.detach())
                      for (name, _, _), t in zip(self.layout.wire[index], converted)]
        self.generator.engine.load_local(named)
        del named
        if not self.layout.probe:  # (the check is off)
            return None
        return self.generator._check_sync(self.version, model_logprobs(self.actor.module, self.layout.probe))


REPLAY_PAUSE_ENV = "SLURM_RLHF_TEST_REPLAY_PAUSE_S"
"""Tests only: seconds to wait before each replayed batch (a long resume without a long run)."""


def _stage_seconds(parts: list[SampleBatch], key: str, who: str) -> dict:
    """Seconds of a pipeline stage: summed per worker (sequential), max over workers (parallel)."""
    per_worker = collections.defaultdict(float)
    for p in parts:
        per_worker[p.timings.get(who, "?")] += p.timings.get(key, 0.0)
    return {key: max(per_worker.values(), default=0.0)}


def _lags(batch: SampleBatch, version: int) -> dict:
    """How many updates older than `version`, the policy the batch trains, its samples' weights were."""
    lag = version - batch.policy_version
    return {"policy_lag_mean": float(lag.mean()), "policy_lag_max": int(lag.max())}


def _batch_metrics(batch: SampleBatch) -> dict:
    total = batch.reward_total
    lengths = batch.response_lengths
    out = {"reward_mean": float(total.mean()), "reward_std": float(total.std()),
           "response_len_mean": float(lengths.mean()), "response_tokens": int(lengths.sum()),
           "finished_frac": float(batch.finished.mean()), "samples": len(batch),
           "policy_version_min": int(batch.policy_version.min())}
    for i, name in enumerate(batch.reward_names):
        out[f"reward/{name}"] = float(batch.rewards[:, i].mean())
    return out


def _float(x) -> float | None:
    if x is None:
        return None
    return float(x.item() if hasattr(x, "item") else x)
