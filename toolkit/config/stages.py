"""The configs of the supervised stages: `sft` (fine-tune a causal LM on prompt/response rows) and `rm`
(train a reward model on prompt/chosen/rejected rows). They share every section with the RL run but its
RL ones: the same data, engine, placement (one node group of trainer ranks), checkpoints and Slurm."""

from __future__ import annotations

import math
from typing import Literal

from pydantic import Field, ValidationInfo, model_validator

from toolkit.config.base import (Allocator, Attention, CheckpointSection, EngineSection, GroupSection, ModelDir,
                                 PositiveInt, RunName, Section, Seed, SlurmSection, TransportSection, WandbSection,
                                 fp16_problem, model_files, packing_problem, pending_export)
from toolkit.config.data import DataSection
from toolkit.config.lora_targets import lora_target_problem
from toolkit.config.model_files import context_problem, head_problem, main_tokenizer_problem, packing_family_problem


class StageRunSection(Section):
    name: RunName = "stage"
    """Name of the run (the default run directory `runs/<name>` and the Slurm job name)."""
    steps: PositiveInt | None = None
    """Optimizer steps; none: `epochs` passes over the stage's training rows."""
    epochs: float = Field(default=1.0, gt=0)
    """Passes over the training rows when `steps` is not given (steps = ceil(epochs x rows / batch_size))."""
    seed: Seed = 0
    """Seed for row order, dropout and new weights (a reward model's score head)."""
    allocator: Allocator = "auto"
    """Memory allocator of the workers: `auto` takes tcmalloc, else jemalloc, where the node has it
    (libtcmalloc-minimal4, libjemalloc2), else glibc's malloc (`system`), which keeps the freed memory of
    training steps and so holds more memory (README: Speed against TRL)."""
    fast_mkl_on_amd: bool = True
    """On AMD CPUs, let Intel MKL, where torch does its CPU matrix products, take the kernels it takes on
    Intel CPUs (it checks the vendor and otherwise runs slower, generic ones): each worker preloads a
    one-function library built with the node's C compiler (launch/mkl_amd.py). CPU training and scoring
    about 2x faster on an AVX-512 EPYC, the same results within float rounding (README: MKL on AMD CPUs).
    No effect on other CPUs or on what runs on a GPU."""
    openmp_spin: int = Field(default=0, ge=0)
    """GOMP_SPINCOUNT of the workers: how many times a waiting OpenMP thread spins before it sleeps; 0: at
    once. As an RL run's `run.openmp_spin`: for workers that have their CPUs to themselves."""
    deterministic: bool = False
    """Bitwise-repeatable training: deterministic torch algorithms, fixed thread counts."""
    max_trainer_restarts: int = Field(default=2, ge=0)
    """A trainer rank that dies or hangs (no error of its own) stops every worker, and the run goes on from
    its last checkpoint at once, in the same process and (under Slurm) the same allocation: at most this
    many times per attempt of the run (0: the run stops instead)."""


class StageModelSection(Section):
    base: ModelDir
    """The model to start from: a causal LM for `sft`; for `rm` a causal LM (a score head is added) or a
    reward model (sequence classification, one label) to train further."""
    tokenizer: ModelDir | None = None
    """Tokenizer directory (default: `base`)."""
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    """Dtype of the weights and computation."""
    attn_implementation: Attention = "sdpa"
    """Attention implementation (transformers): `sdpa`, `eager`, or `flash_attention_2` (needs flash-attn)."""
    dropout: bool = True
    """Keep the model's own dropout while training (false: every dropout probability 0)."""


class TrainSection(EngineSection):
    """The engine's settings, and how a supervised stage batches and evaluates."""

    batch_size: PositiveInt = 32
    """Rows per optimizer step over all ranks (pairs for `rm`); a multiple of micro_batch_size x ranks."""
    max_tokens: PositiveInt = 512
    """Most tokens of prompt + response; longer rows lose the start of the prompt first, then the end of
    the response (sft) or its start (rm, whose score is read at the last token)."""
    eval_every: PositiveInt = 50
    """Evaluate on the eval rows (data.eval_fraction) every this many steps, and after the last one."""
    eval_batch_size: PositiveInt = 16
    """Rows per forward pass when evaluating."""
    packing: bool = False
    """SFT: pack a micro-batch's rows into one sequence, positions restarting at each row and each row's
    attention computed on its own (PyTorch's SDPA per row): no padding is computed. Only with
    `model.attn_implementation: sdpa`."""


class StagePlacementSection(Section):
    """The stage's one node group: its trainer ranks."""

    trainer: GroupSection = GroupSection()
    """Workers (data-parallel ranks), nodes and resources of the trainer node group."""

    def layout(self) -> list[tuple[str, tuple[str, ...], GroupSection]]:
        return [("trainer", ("trainee",), self.trainer)]

    def group_with(self, model: str) -> GroupSection:
        return self.trainer


class StageConfig(Section):
    run: StageRunSection = StageRunSection()
    """What to run."""
    data: DataSection
    """Rows (this stage uses its part of data.split)."""
    model: StageModelSection
    """The model to start from."""
    train: TrainSection = TrainSection()
    """DeepSpeed training, batches and evaluation."""
    placement: StagePlacementSection = StagePlacementSection()
    """The trainer node group."""
    transport: TransportSection = TransportSection()
    """ZeroMQ, heartbeats and timeouts."""
    checkpoint: CheckpointSection = CheckpointSection()
    """Model checkpoints."""
    wandb: WandbSection = WandbSection()
    """Weights & Biases (off unless a project is set)."""
    slurm: SlurmSection = SlurmSection()
    """How `slurm-rlhf submit` and `render` ask Slurm for the allocation."""

    @model_validator(mode="after")
    def _batches(self, info: ValidationInfo) -> "StageConfig":
        ranks = self.placement.trainer.workers
        per_step = self.train.micro_batch_size * ranks
        problem = self.train.packing and (
            packing_problem("train.packing", self.model.attn_implementation) or
            packing_family_problem(model_files(self.model.base, info), "model.base", "train.packing"))
        problem = problem or fp16_problem(self.model.dtype, "trainer", self.placement.trainer)
        if problem:
            raise ValueError(problem)
        trainer = self.placement.trainer
        if trainer.same_nodes_as is not None:
            raise ValueError(f"placement.trainer.same_nodes_as is {trainer.same_nodes_as!r}, but the {self.stage} "
                             "stage has one node group, its trainer; remove same_nodes_as")
        if self.slurm.nodes is not None and trainer.nodes > self.slurm.nodes:
            raise ValueError(f"placement.trainer.nodes is {trainer.nodes} but slurm.nodes allows {self.slurm.nodes}; "
                             "use fewer nodes")
        if self.train.packing and self.stage == "rm":
            raise ValueError("train.packing is for the sft stage; the rm stage reads each sequence's score at its "
                             "last token of padded rows: remove train.packing")
        if self.train.lora is not None and self.stage == "rm":
            raise ValueError("train.lora is for causal LMs (the sft stage and the RL actor); the rm stage trains "
                             "every weight of the reward model: remove train.lora")
        if self.train.lora is not None:
            problem = lora_target_problem(model_files(self.model.base, info), self.train.lora.target_modules,
                                          "train.lora.target_modules")
            if problem:
                raise ValueError(problem)
        problem = context_problem(model_files(self.model.base, info), self.train.max_tokens, "model.base",
                                  "train.max_tokens")
        if problem:
            raise ValueError(problem)
        # (sft: a causal LM; rm: either, a score head of one label)
        problem = head_problem(self.model.base, "model.base", "lm" if self.stage == "sft" else None)
        if problem:
            raise ValueError(problem)
        if not pending_export(self.tokenizer_path, info):
            problem = main_tokenizer_problem(self.tokenizer_path, "model.base", bool(self.model.tokenizer))
            if problem:
                raise ValueError(problem)
        if self.train.batch_size % per_step:
            raise ValueError(f"train.batch_size ({self.train.batch_size}) is not a multiple of train.micro_batch_size "
                             f"{self.train.micro_batch_size} x trainer workers {ranks} = {per_step}; change one of them")
        return self

    def hosts(self, model: str) -> bool:
        return True

    def total_steps(self, train_rows: int) -> int:
        """Optimizer steps of the stage: run.steps, else ceil(run.epochs x training rows / train.batch_size)."""
        return self.run.steps or max(1, math.ceil(self.run.epochs * train_rows / self.train.batch_size))

    @property
    def summary(self) -> str:
        steps = f"{self.run.steps} steps" if self.run.steps else f"{self.run.epochs:g} epoch(s)"
        return f"{self.stage}, {steps}"

    @property
    def tokenizer_path(self):
        from pathlib import Path

        return Path(self.model.tokenizer or self.model.base)


class SFTConfig(StageConfig):
    stage: Literal["sft"]
    """Supervised fine-tuning: the loss is on the response tokens only."""


class RMConfig(StageConfig):
    stage: Literal["rm"]
    """Reward-model training: pairwise loss -log sigmoid(r_chosen - r_rejected), reward read at the last
    token of the response."""
