"""Trainer role: DeepSpeed actor (and critic for PPO) on data-parallel ranks; trains, then syncs weights.

Rank 0 receives scored samples until a step's experience batch is complete, sorts it (by prompt slot and
sample index, so arrival order never matters), broadcasts it to the other ranks over the trainer's
process group, and every rank trains on its shard. After the update the policy_version grows by one
and the full actor weights go to the generators: under ZeRO-3 all ranks gather each bucket
(GatheredParameters) and rank 0 broadcasts it over the weight-sync group.

Rank 0 hosts the run's TCPStore: the trainer group and the weight-sync group rendezvous on it.
"""

from __future__ import annotations

import collections
import datetime
import json
import logging
import os
import time

import numpy as np
import torch
import torch.distributed as dist

from toolkit.algorithms.kl_controller import make_kl_controller
from toolkit.placement.plan import group_of
from toolkit.roles.base import Role
from toolkit.roles.samples import SampleBatch
from toolkit.roles.update import make_experience, train_on
from toolkit.transport.rendezvous import connect_store, serve_store
from toolkit.weights.sync import WeightSender, form_group, gathered_buckets, manifest_of, plan_buckets

log = logging.getLogger(__name__)

TRAIN, STOP = 1, 0
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

        from toolkit.roles.modeling import CriticModel, torch_dtype

        cfg = self.cfg
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
        actor = AutoModelForCausalLM.from_pretrained(cfg.model.actor, dtype=dtype)
        self.actor = self._engine(deepspeed, actor, cfg.trainer.lr)
        self.critic = None
        if cfg.run.algorithm == "ppo":
            self.critic = self._engine(deepspeed, CriticModel(str(cfg.critic_path), dtype), cfg.trainer.critic_lr)
        k = cfg.algorithm.kl
        self.kl = make_kl_controller(k.coef, k.adaptive, k.target, k.horizon)
        self.version = 0
        self.status["policy_version"] = 0
        self.shuffle_rng = torch.Generator().manual_seed(cfg.run.seed)
        self.params = list(self.actor.module.named_parameters())
        self.manifest = manifest_of(self.params)
        bucket_bytes = int(cfg.trainer.weight_sync_bucket_mb * 2**20)
        self.buckets = plan_buckets(self.manifest, bucket_bytes)
        if self.rank == 0:
            generators = group_of(self.worker.groups, "generator")
            ranks_each = cfg.rollout.vllm.tensor_parallel_size if cfg.generation_backend == "vllm" else 1
            log.info("forming the weight-sync group with %d generator rank(s)", generators.workers * ranks_each)
            group = form_group(self.store, 0, 1 + generators.workers * ranks_each, timeout_s, self.device)
            self.sender = WeightSender(group, self.manifest, bucket_bytes, self.device)
        log.info("trainer rank %d/%d ready (ZeRO-%d, %d actor weights)", self.rank, self.world,
                 cfg.trainer.zero_stage, len(self.params))

    def _engine(self, deepspeed, model, lr: float):
        t = self.cfg.trainer
        per_rank = self.cfg.samples_per_step // self.world
        accumulation = per_rank // (t.micro_batch_size * t.updates_per_step)
        config = {
            "train_micro_batch_size_per_gpu": t.micro_batch_size,
            "gradient_accumulation_steps": accumulation,
            "train_batch_size": t.micro_batch_size * accumulation * self.world,
            "gradient_clipping": t.grad_clip,
            "zero_optimization": {"stage": t.zero_stage},
            # A torch optimizer: no C++ op to build, works on every accelerator.
            "zero_allow_untested_optimizer": True,
            "bf16": {"enabled": self.cfg.model.dtype == "bfloat16"},
            "fp16": {"enabled": self.cfg.model.dtype == "float16"},
            "steps_per_print": 2**31 - 1,
            "wall_clock_breakdown": False,
        }
        optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=t.weight_decay)
        engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
        return engine

    # ----- the loop -----------------------------------------------------------------------------

    def serve(self) -> None:
        if self.rank != 0:
            return self._follow()
        self.pending: list[SampleBatch] = []
        self.expected_step = 0
        super().serve()

    def on_data(self, msg) -> None:
        """Rank 0: collect samples until the step's experience batch is complete, then train on it."""
        if msg.kind != "samples":
            return super().on_data(msg)
        part = SampleBatch.from_message(msg)
        if part.step != self.expected_step:
            raise RuntimeError(f"got samples of step {part.step} while collecting step {self.expected_step}")
        self.pending.append(part)
        collected = sum(len(p) for p in self.pending)
        self.status.update(phase="collecting", step=self.expected_step, samples=collected)
        if collected >= self.cfg.samples_per_step:
            self._step(self.pending)
            self.pending, self.expected_step = [], self.expected_step + 1

    def on_shutdown(self) -> None:
        if self.rank == 0:
            self._command(STOP, -1)

    def _step(self, parts: list[SampleBatch]) -> None:
        batch = SampleBatch.concat(parts)
        if len(batch) != self.cfg.samples_per_step:
            raise RuntimeError(f"step {batch.step}: {len(batch)} samples, expected {self.cfg.samples_per_step}")
        batch = batch.select(np.lexsort((batch.sample_index, batch.group_index)))
        self._command(TRAIN, batch.step)
        self._share(batch)
        metrics = self._train(batch)
        metrics.update(_stage_seconds(parts, "generate_s", "generator"))
        metrics.update(_stage_seconds(parts, "score_s", "scorer"))
        metrics.update(_batch_metrics(batch))
        metrics["tokens_per_s"] = metrics["response_tokens"] / max(metrics["generate_s"], 1e-9)
        self.worker.control.send("weights_ready", step=batch.step, version=self.version)
        metrics["sync_s"], metrics["sync_mb"] = self._sync()
        metrics["rejected_frames"] = self.worker.rejected_frames()
        self.worker.control.send("trained", step=batch.step, version=self.version, metrics=metrics)
        self.status.update(phase="idle", policy_version=self.version)

    def _follow(self) -> None:
        """Ranks > 0: train on what rank 0 broadcasts until it says stop."""
        while True:
            command, step = self._command()
            if command == STOP:
                return
            batch = self._share(None, step)
            self._train(batch)
            self._sync()
            self.status.update(phase="idle", policy_version=self.version, step=step)

    def _train(self, batch: SampleBatch) -> dict:
        cfg = self.cfg
        self.status.update(phase="training", step=batch.step)
        started = time.monotonic()
        shard = np.array_split(np.arange(len(batch)), self.world)[self.rank]
        exp = make_experience(batch, shard, self.actor, self.critic, cfg, self.kl.coef, self.pad_id, self._sum)
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
                       kl_coef=self.kl.coef, grad_norm=_float(self.actor.get_global_grad_norm()))
        self.kl.update(kl_sum / samples, len(batch))
        self.version += 1
        metrics["train_s"] = time.monotonic() - started
        return metrics

    def _sync(self) -> tuple[float, float]:
        """Send the actor's full weights to the generators (rank 0); every rank gathers under ZeRO-3."""
        self.status["phase"] = "syncing"
        started = time.monotonic()
        zero3 = self.cfg.trainer.zero_stage == 3
        buckets = gathered_buckets([p for _, p in self.params], self.buckets, zero3)
        sent = 0
        if self.rank == 0:
            sent = self.sender.send(self.version, buckets)
        elif zero3:
            for _ in buckets:
                pass
        return time.monotonic() - started, sent / 2**20

    # ----- data-parallel communication -----------------------------------------------------------

    def _sum(self, t: torch.Tensor) -> torch.Tensor:
        if self.world > 1:
            t = t.clone()
            dist.all_reduce(t)
        return t

    def _command(self, command: int = STOP, step: int = -1) -> tuple[int, int]:
        t = torch.tensor([command, step], dtype=torch.int64)
        if self.world > 1:
            dist.broadcast(t, 0)
        return int(t[0]), int(t[1])

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
