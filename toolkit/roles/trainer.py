"""Trainer role: DeepSpeed actor (and critic for PPO) on data-parallel ranks.

A step on rank 0: collect the step's scored samples, sort them (by prompt slot and sample index, so
arrival order never matters) and share them with the other ranks; every rank computes the experience
of its shard (old log-probs, values, advantages); rank 0 gathers it and commits the experience batch
to HDF5 (durable before anyone trains on it); every rank trains; the policy_version grows by one; the
full actor weights go to the generators (gathered bucket by bucket under ZeRO-3); every
`checkpoint.every_steps` a model checkpoint is saved.

On a resume (`start` carries the plan) the trainer loads the checkpoint and trains again on the
committed experience after it, from the stored tensors, before the first new step.

Rank 0 hosts the run's TCPStore: the trainer group and the weight-sync group rendezvous on it, and it
tells the other ranks what to do next with a broadcast command (train, checkpoint, sync, stop).
"""

from __future__ import annotations

import collections
import datetime
import json
import logging
import os
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from toolkit.algorithms.kl_controller import make_kl_controller
from toolkit.placement.plan import colocated, group_of
from toolkit.roles.base import Role
from toolkit.roles.modeling import gather_responses
from toolkit.roles.samples import SampleBatch
from toolkit.roles.update import experience_from_record, make_experience, train_on
from toolkit.store import checkpoint, experience
from toolkit.store.manifest import Manifest
from toolkit.transport.rendezvous import connect_store, serve_store
from toolkit.weights.hf_format import checkpoint_converter, identity
from toolkit.weights.probe import model_logprobs, probe_tokens
from toolkit.weights.sync import WeightSender, form_group, gathered_buckets, plan_layout

log = logging.getLogger(__name__)

STOP, TRAIN, CHECKPOINT, SYNC = 0, 1, 2, 3
# Arrays every trainer rank needs (the text stays on rank 0).
SHARED_ARRAYS = ("prompt_ids", "group_index", "sample_index", "policy_version", "prompt_tokens", "prompt_offsets",
                 "response_tokens", "response_offsets", "behaviour_logprobs", "finished", "ref_logprobs", "rewards")


class TrainerRole(Role):
    def prepare(self) -> dict:
        self.rank, self.world = self.worker.rank, self.worker.group.workers
        if self.rank != 0:
            return {}
        self.store = serve_store(self.worker.wenv.bind_host, self.cfg.transport.startup_timeout_s)
        return {"store": f"{self.worker.wenv.bind_host}:{self.store.port}"}

    def setup(self) -> None:
        import deepspeed
        from transformers import AutoModelForCausalLM, AutoTokenizer

        from toolkit.roles.modeling import CriticModel, torch_dtype, without_dropout

        cfg = self.cfg
        self.run_dir = Path(self.worker.wenv.run_dir)
        timeout_s = cfg.transport.step_timeout_s
        if self.rank != 0:
            host, port = self.worker.book[self.worker.group.worker_ids()[0]]["store"].rsplit(":", 1)
            self.store = connect_store(host, int(port), cfg.transport.startup_timeout_s)
        # DeepSpeed reads these; each worker sees only its own GPUs, so its local rank is 0.
        os.environ.update(RANK=str(self.rank), WORLD_SIZE=str(self.world), LOCAL_RANK="0")
        backend = "nccl" if self.device.type == "cuda" else "gloo"
        dist.init_process_group(backend, store=dist.PrefixStore("trainer", self.store), rank=self.rank,
                                world_size=self.world, timeout=datetime.timedelta(seconds=timeout_s))
        for name in ("DeepSpeed", "deepspeed"):
            logging.getLogger(name).setLevel(logging.WARNING)
        torch.manual_seed(cfg.run.seed)
        tokenizer = AutoTokenizer.from_pretrained(cfg.tokenizer_path)
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        dtype = torch_dtype(cfg.model.dtype)
        actor = AutoModelForCausalLM.from_pretrained(cfg.model.actor, dtype=dtype, **without_dropout(cfg.model.actor))
        self.engines = {"actor": deepspeed_engine(deepspeed, actor, cfg.trainer.lr, cfg, self.world)}
        if cfg.run.algorithm == "ppo":
            critic = CriticModel(str(cfg.critic_path), dtype)
            self.engines["critic"] = deepspeed_engine(deepspeed, critic, cfg.trainer.critic_lr, cfg, self.world)
        self.actor, self.critic = self.engines["actor"], self.engines.get("critic")
        k = cfg.algorithm.kl
        self.kl = make_kl_controller(k.coef, k.adaptive, k.target, k.horizon)
        self.version = 0
        self.checkpointed = -1
        self.shuffle_rng = torch.Generator().manual_seed(cfg.run.seed)
        self.params = list(self.actor.module.named_parameters())
        # vLLM loads the checkpoint format; the transformers engine loads the parameters as they are.
        convert = checkpoint_converter(self.actor.module) if cfg.generation_backend == "vllm" else identity
        self.layout = plan_layout(self.params, int(cfg.trainer.weight_sync_bucket_mb * 2**20),
                                  probe_tokens(min(len(tokenizer), actor.config.vocab_size), cfg.run.seed), convert)
        self.replayed = self._resume(self.worker.resume or {})
        self.status["policy_version"] = self.version
        self.generator = None  # the generator role, when this worker hosts one (it sets itself here)
        self.sender = None
        if self.rank == 0 and not colocated(self.worker.groups, "generator", "trainer"):
            generators = group_of(self.worker.groups, "generator")
            ranks_each = cfg.rollout.vllm.tensor_parallel_size if cfg.generation_backend == "vllm" else 1
            log.info("forming the weight-sync group with %d generator rank(s)", generators.workers * ranks_each)
            group = form_group(self.store, 0, 1 + generators.workers * ranks_each, timeout_s, self.device)
            self.sender = WeightSender(group, self.layout, self.device)
        log.info("trainer rank %d/%d ready (ZeRO-%d, %d actor weights, policy_version %d)", self.rank, self.world,
                 cfg.trainer.zero_stage, len(self.params), self.version)

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
            state = checkpoint.load(directory, self.engines)
            self.version = self.checkpointed = state["policy_version"]
            self.kl.load_state_dict(state["kl"])
            checkpoint.set_rng_state(state["shuffle_rng"], self.shuffle_rng)
            checkpoint.set_rng_state(state["torch_rng"])
            log.info("loaded %s (policy_version %d)", directory, self.version)
        replayed = []
        for path in plan.get("replay", []):
            record = experience.read(Path(path))
            batch = experience.batch_of(record)
            if abs(record["attrs"]["kl_coef"] - self.kl.coef) > 1e-12 or record["attrs"]["policy_version"] != self.version:
                log.warning("%s was trained from policy_version %s with kl_coef %s; replaying it at %s with %s",
                            path, record["attrs"]["policy_version"], record["attrs"]["kl_coef"], self.version,
                            self.kl.coef)
            metrics = self._learn(batch, record=record)
            metrics.update(_batch_metrics(batch), step=batch.step, policy_version=self.version, replayed=True)
            replayed.append(metrics)
            log.info("trained again on %s (policy_version now %d)", path, self.version)
        return replayed

    # ----- the loop -----------------------------------------------------------------------------

    def begin(self) -> None:
        """Before the first step (rank 0, and ranks above 0 that also generate): make the generators hold
        the trainer's weights (after a resume they still hold the initial ones)."""
        if self.generator is not None:
            self._load_local()
            self.generator.holds(self.version)
        elif self.rank == 0 and self.version > 0:
            self._command(SYNC)
            self.worker.control.send("weights_ready", step=-1, version=self.version)
            self._sync()
        self.pending: dict[int, list[SampleBatch]] = {}  # samples by step (later steps arrive early when async)
        self.dropped: dict[int, int] = {}
        self.expected_step = (self.worker.resume or {}).get("next_step", 0)

    def handle(self, part: SampleBatch) -> None:
        """Rank 0: collect samples until the next step's experience batch is complete, then train on it
        (and on the following steps' batches, if they are complete too)."""
        ahead = self.cfg.rollout.max_policy_lag + 1
        if not self.expected_step <= part.step <= self.expected_step + ahead:
            raise RuntimeError(f"got samples of step {part.step} while collecting step {self.expected_step} "
                               f"(rollout.max_policy_lag {ahead - 1} allows steps up to {self.expected_step + ahead})")
        part = self._drop_stale(part)
        if len(part):
            self.pending.setdefault(part.step, []).append(part)
        while self._collected(self.expected_step) >= self.cfg.samples_per_step:
            self._step(self.pending.pop(self.expected_step))
            self.expected_step += 1
        self.status.update(phase="collecting", step=self.expected_step, samples=self._collected(self.expected_step))

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

    def on_command(self, msg) -> None:
        if msg.kind != "checkpoint":  # the driver asks before stopping (e.g. the job's time is nearly up)
            return super().on_command(msg)
        if self.rank > 0:  # a rank that also generates: rank 0 is about to broadcast CHECKPOINT
            return self.follow(once=True)
        self._command(CHECKPOINT)
        seconds, size_mb = self._checkpoint()
        self.worker.control.send("checkpointed", version=self.version, checkpoint_s=seconds, checkpoint_mb=size_mb)

    def on_shutdown(self) -> None:
        if self.rank == 0:
            self._command(STOP)
        else:
            self.follow(once=True)

    def _step(self, parts: list[SampleBatch]) -> None:
        batch = SampleBatch.concat(parts)
        if len(batch) != self.cfg.samples_per_step:
            raise RuntimeError(f"step {batch.step}: {len(batch)} samples, expected {self.cfg.samples_per_step}")
        if self.version != batch.step:
            raise RuntimeError(f"step {batch.step} would train at policy_version {self.version}; they must be equal")
        batch = batch.select(np.lexsort((batch.sample_index, batch.group_index)))
        lag = self.version - batch.policy_version
        lags = {"policy_lag_mean": float(lag.mean()), "policy_lag_max": int(lag.max()),
                "dropped_samples": self.dropped.pop(batch.step, 0)}
        self._command(TRAIN, batch.step)
        self._share(batch)
        metrics = self._train_step(batch)
        metrics.update(_stage_seconds(parts, "generate_s", "generator"))
        metrics.update(_stage_seconds(parts, "score_s", "scorer"))
        metrics.update(_batch_metrics(batch), **lags)
        metrics["tokens_per_s"] = metrics["response_tokens"] / max(metrics["generate_s"], 1e-9)
        metrics["rejected_frames"] = self.worker.rejected_frames()
        self.worker.control.send("trained", step=batch.step, version=self.version, metrics=metrics)
        self.status.update(phase="idle", policy_version=self.version)

    def _train_step(self, batch: SampleBatch) -> dict:
        """Every rank: commit and train, send the weights on, and save a checkpoint when one is due."""
        metrics = self._learn(batch, commit=True)
        if self.rank == 0 and self.sender is not None:
            self.worker.control.send("weights_ready", step=batch.step, version=self.version)
        metrics["sync_s"], metrics["sync_mb"] = self._sync()
        if (batch.step + 1) % self.cfg.checkpoint.every_steps == 0 or batch.step + 1 == self.cfg.run.steps:
            metrics["checkpoint_s"], metrics["checkpoint_mb"] = self._checkpoint()
        return metrics

    def follow(self, once: bool = False) -> None:
        """Ranks above 0: do what rank 0 broadcasts until it says stop (or one command when `once`)."""
        while True:
            command, step = self._command()
            if command == TRAIN:
                self._train_step(self._share(None, step))
            elif command == CHECKPOINT:
                self._checkpoint()
            elif command == SYNC:
                self._sync()
            self.status.update(phase="idle", policy_version=self.version, step=step)
            if once or command == STOP:
                return

    def _learn(self, batch: SampleBatch, commit: bool = False, record: dict | None = None) -> dict:
        """One update from `batch`: its experience is computed (or taken from a committed `record`),
        committed first if asked, then trained on. Every rank calls this with the same batch."""
        cfg = self.cfg
        self.status.update(phase="training", step=batch.step)
        started = time.monotonic()
        shard = np.array_split(np.arange(len(batch)), self.world)[self.rank]
        if record is None:
            exp = make_experience(batch, shard, self.actor, self.critic, cfg, self.kl.coef, self.pad_id, self._sum)
        else:
            exp = experience_from_record(record, shard, self.pad_id)
        commit_s = self._commit(batch, exp) if commit else 0.0
        stats = train_on(exp, self.actor, self.critic, cfg, self.shuffle_rng)
        mask = exp.mask
        k1 = (exp.old_logprobs - exp.ref_logprobs) * mask
        totals = self._sum(torch.tensor([
            k1.sum(), mask.sum(), float(len(shard)),
            ((exp.behaviour_logprobs - exp.old_logprobs).abs() * mask).sum(),
            *[stats[k] for k in sorted(stats)]], dtype=torch.float64))
        kl_sum, tokens, samples, diff_sum = totals[:4].tolist()
        metrics = {k: v / self.world for k, v in zip(sorted(stats), totals[4:].tolist())}
        metrics.update(kl=kl_sum / tokens, kl_seq=kl_sum / samples, behaviour_logprob_diff=diff_sum / tokens,
                       kl_coef=self.kl.coef, grad_norm=_float(self.actor.get_global_grad_norm()), commit_s=commit_s)
        self.kl.update(kl_sum / samples, len(batch))
        self.version += 1
        metrics["train_s"] = time.monotonic() - started - commit_s
        return metrics

    def _commit(self, batch: SampleBatch, exp) -> float:
        """Commit the step's experience batch to HDF5 (rank 0 writes; all ranks wait for it); seconds taken."""
        started = time.monotonic()
        per_token = {"old_logprobs": exp.old_logprobs, "advantages": exp.advantages}
        if exp.values is not None:
            per_token.update(values=exp.values, returns=exp.returns)
        flat = {name: np.concatenate(gather_responses(t, exp.padded) or [np.zeros(0, np.float32)])
                for name, t in per_token.items()}
        full = self._gather_flat(flat)
        if self.rank == 0:
            record = experience.record_of(batch, full, batch.step, self.cfg.run.algorithm, self.version, self.kl.coef,
                                          (batch.step + 1) * self.cfg.rollout.prompts_per_step)
            path, digest, size = experience.commit(self.run_dir / "experience", batch.step, record)
            Manifest(self.run_dir).append({"kind": "experience", "step": batch.step,
                                           "file": str(path.relative_to(self.run_dir)), "sha256": digest,
                                           "bytes": size})
        self._barrier()  # nobody trains on a batch before it is durable
        return time.monotonic() - started

    def _checkpoint(self) -> tuple[float, float]:
        """Save a model checkpoint of the current policy_version (every rank); (seconds, MB)."""
        if self.version == self.checkpointed:
            return 0.0, 0.0
        self.status["phase"] = "checkpointing"
        started = time.monotonic()
        state = {"policy_version": self.version, "kl": self.kl.state_dict(),
                 "shuffle_rng": checkpoint.rng_state(self.shuffle_rng), "torch_rng": checkpoint.rng_state(),
                 "prompts_drawn": self.version * self.cfg.rollout.prompts_per_step}
        size_mb = checkpoint.save(self.run_dir, self.version, self.engines, state, str(self.cfg.tokenizer_path),
                                  self.rank, self.cfg.trainer.zero_stage == 3, self._barrier, self.cfg.checkpoint.keep)
        self.checkpointed = self.version
        return time.monotonic() - started, size_mb

    def _sync(self) -> tuple[float, float]:
        """Bring the generators the new weights: rank 0 broadcasts them to generators of their own, a
        generator in this worker takes them in memory. Every rank gathers under ZeRO-3. (seconds, MB sent)"""
        self.status["phase"] = "syncing"
        started = time.monotonic()
        if self.generator is not None:
            self._load_local()
            self.generator.holds(self.version, time.monotonic() - started)
            return time.monotonic() - started, 0.0
        zero3 = self.cfg.trainer.zero_stage == 3
        buckets = gathered_buckets([p for _, p in self.params], self.layout.sources, zero3)
        sent = 0
        if self.sender is not None or zero3:  # (under ZeRO-3 the probe's forward pass needs every rank)
            expected = model_logprobs(self.actor.module, self.layout.probe)
        if self.sender is not None:
            sent = self.sender.send(self.version, expected, buckets)
        elif zero3:
            for _ in buckets:
                pass
        return time.monotonic() - started, sent / 2**20

    def _load_local(self) -> None:
        """Under ZeRO-3, copy the gathered weights into this worker's generator (otherwise it generates
        with the actor's own tensors and nothing moves)."""
        if self.cfg.trainer.zero_stage != 3:
            return
        names = self.layout.names
        sources = self.layout.sources
        for index, tensors in zip(sources, gathered_buckets([p for _, p in self.params], sources, True)):
            self.generator.engine.load_weights((names[i], t) for i, t in zip(index, tensors))

    # ----- data-parallel communication -----------------------------------------------------------

    def _sum(self, t: torch.Tensor) -> torch.Tensor:
        if self.world > 1:
            t = t.clone()
            dist.all_reduce(t)
        return t

    def _barrier(self) -> None:
        if self.world > 1:
            dist.barrier()

    def _command(self, command: int = STOP, step: int = -1) -> tuple[int, int]:
        t = torch.tensor([command, step], dtype=torch.int64)
        if self.world > 1:
            dist.broadcast(t, 0)
        return int(t[0]), int(t[1])

    def _gather_flat(self, arrays: dict[str, np.ndarray]) -> dict[str, np.ndarray] | None:
        """Rank 0 gets each array concatenated over ranks in rank order (others get None)."""
        if self.world == 1:
            return arrays
        out = {}
        for name, array in arrays.items():
            local = torch.from_numpy(np.ascontiguousarray(array, dtype=np.float32))
            sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(self.world)]
            dist.all_gather(sizes, torch.tensor([local.numel()]))
            width = int(max(sizes))
            padded = torch.zeros(width, dtype=torch.float32)
            padded[: local.numel()] = local
            gathered = [torch.zeros(width, dtype=torch.float32) for _ in range(self.world)] if self.rank == 0 else None
            dist.gather(padded, gathered, dst=0)
            if self.rank == 0:
                out[name] = np.concatenate([g[: int(n)].numpy() for g, n in zip(gathered, sizes)])
        return out if self.rank == 0 else None

    def _share(self, batch: SampleBatch | None, step: int = 0) -> SampleBatch:
        """Rank 0's batch on every rank (arrays only; text stays on rank 0)."""
        if self.world == 1:
            return batch
        if self.rank == 0:
            arrays = {k: np.ascontiguousarray(getattr(batch, k)) for k in SHARED_ARRAYS}
            header = json.dumps({k: [a.dtype.str, list(a.shape)] for k, a in arrays.items()}).encode()
            length = torch.tensor([len(header)], dtype=torch.int64)
        else:
            length = torch.zeros(1, dtype=torch.int64)
        dist.broadcast(length, 0)
        raw = torch.frombuffer(bytearray(header), dtype=torch.uint8) if self.rank == 0 else \
            torch.zeros(int(length), dtype=torch.uint8)
        dist.broadcast(raw, 0)
        specs = json.loads(bytes(raw.numpy()).decode())
        received = {}
        for name, (dtype, shape) in specs.items():
            t = torch.from_numpy(arrays[name].copy()) if self.rank == 0 else \
                torch.from_numpy(np.zeros(shape, dtype=np.dtype(dtype)))
            dist.broadcast(t, 0)
            received[name] = t.numpy()
        if self.rank == 0:
            return batch
        cfg = self.cfg.reward
        n = len(received["prompt_ids"])
        return SampleBatch(step=step, prompts=[""] * n, responses=[""] * n, fields_=[{}] * n,
                           reward_names=[f.name for f in cfg.functions] + [m.name for m in cfg.models],
                           reward_weights=[f.weight for f in cfg.functions] + [m.weight for m in cfg.models],
                           **received)


def deepspeed_engine(deepspeed, model, lr: float, cfg, world: int):
    """A DeepSpeed engine for `model` on one of `world` data-parallel ranks, from the run config."""
    t = cfg.trainer
    per_rank = cfg.samples_per_step // world
    accumulation = per_rank // (t.micro_batch_size * t.updates_per_step)
    config = {
        "train_micro_batch_size_per_gpu": t.micro_batch_size,
        "gradient_accumulation_steps": accumulation,
        "train_batch_size": t.micro_batch_size * accumulation * world,
        "gradient_clipping": t.grad_clip,
        "zero_optimization": {"stage": t.zero_stage},
        # A torch optimizer: no C++ op to build, works on every accelerator.
        "zero_allow_untested_optimizer": True,
        "bf16": {"enabled": cfg.model.dtype == "bfloat16"},
        "fp16": {"enabled": cfg.model.dtype == "float16"},
        "steps_per_print": 2**31 - 1,
        "wall_clock_breakdown": False,
    }
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=t.weight_decay)
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    return engine


def _stage_seconds(parts: list[SampleBatch], key: str, who: str) -> dict:
    """Seconds of a pipeline stage: summed per worker (sequential), max over workers (parallel)."""
    per_worker = collections.defaultdict(float)
    for p in parts:
        per_worker[p.timings.get(who, "?")] += p.timings.get(key, 0.0)
    return {key: max(per_worker.values(), default=0.0)}


def _batch_metrics(batch: SampleBatch) -> dict:
    total = batch.total_reward
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
