"""The RL run config (stage `rl`): one YAML file per run, validated into these sections before any
process starts. The SFT and reward-model stages are in stages.py, the pieces every stage shares in base.py
and data.py. Relative paths are resolved against the directory of the config file. Unknown keys are errors.
"""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import ConfigDict, Field, ValidationInfo, model_validator

from toolkit.config.base import (MODELS, Allocator, Attention, CheckpointSection, EngineSection, FunctionPath,
                                 GroupSection, ModelDir, PositiveInt, RunName, Section, Seed, SlurmSection,
                                 TransportSection, WandbSection, fp16_problem, load_function, model_files,
                                 packing_problem, pending_export, split_function)
from toolkit.config.data import DataSection
from toolkit.config.lora_targets import lora_target_problem
from toolkit.config.model_files import (attention_heads, context_problem, head_problem, kv_cache_problem, kv_heads,
                                        main_tokenizer_problem, model_config, packing_family_problem,
                                        tokenizer_problem, tp_splits, vllm_cpu_problem, vocabulary_problem)
from toolkit.placement.layout import PRESETS, generation_with_actor, scored_in_training_step

SYNC_CHECK_TOLERANCE = {"float32": 1e-3, "bfloat16": 5e-2, "float16": 5e-2}


class RunSection(Section):
    name: RunName = "run"
    """Name of the run (used for the default run directory `runs/<name>` and the Slurm job name)."""
    algorithm: Literal["grpo", "ppo", "rloo", "reinforce_pp"] = "grpo"
    """`grpo`: group-relative advantages (KL in the loss). `ppo`: a critic, GAE, clipped value loss.
    `rloo`: REINFORCE leave-one-out, each sample's baseline the mean of the other samples of its prompt
    (KL-penalised sequence reward). `reinforce_pp`: REINFORCE++, per-token KL penalty in the reward,
    returns normalised over the whole batch, no critic. See algorithms/advantages.py."""
    steps: PositiveInt = 10
    """Number of steps (experience batches, each followed by one policy update and weight sync)."""
    seed: Seed = 0
    """Seed for prompt order, sampling and model initialisation."""
    max_worker_restarts: int = Field(default=3, ge=0)
    """A generator or scorer worker that dies or hangs (no heartbeat for transport.heartbeat_timeout_s)
    is started again alone (under Slurm with the other tasks of its srun step), at most this many times
    per attempt of the run (0: the run stops instead).
    It listens where its predecessor did, rejoins the weight sync and gets the current weights; the
    prompts whose samples the trainer still misses are generated again with the same seeds, and the
    trainer keeps the first copy of each sample group. A worker that reports an error of its own is not
    started again: the run stops and names the error. Under Slurm a worker is started again with the
    other tasks of its srun step, as a new step on the same nodes (one restart for the step)."""
    max_trainer_restarts: int = Field(default=2, ge=0)
    """A trainer rank that dies or hangs (no error of its own) stops every worker, and the run goes on from
    its last checkpoint at once, in the same process and (under Slurm) the same allocation: at most this
    many times per attempt of the run (0: the run stops instead)."""
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
    """How many times a waiting OpenMP thread of a worker (torch's CPU kernels, vLLM's on CPU, DeepSpeed's CPU
    Adam) checks for the rest of its team before it sleeps (GOMP_SPINCOUNT); 0: it sleeps at once
    (OMP_WAIT_POLICY=PASSIVE, every slurm-rlhf process's default). Spinning saves the wake-ups of the many
    small parallel regions of CPU work, but a spinning thread takes the CPU from any other busy process on
    its cores. Set it where each worker has its CPUs to itself (one worker per node, e.g. Flattening, with
    nothing else running there): on 2 cores a Flattening step of bench_trl's model took 8% less time with
    3000, and 23% more beside one busy process (30000: 2.6x; README: "OpenMP threads sleep while they
    wait"). No effect on GPU kernels; the environment's own GOMP_SPINCOUNT wins."""
    deterministic: bool = False
    """Bitwise-repeatable runs: deterministic torch algorithms, fixed thread counts (cpus_per_worker, else
    1), no vLLM prefix cache. A resumed run then ends with the same weights as an uninterrupted one."""


class ModelSection(Section):
    actor: ModelDir
    """Hugging Face causal-LM directory: the policy that is trained and that generators serve."""
    tokenizer: ModelDir | None = None
    """Tokenizer directory (default: `actor`)."""
    reference: ModelDir | None = None
    """Reference model for the KL penalty (default: `actor`)."""
    critic: ModelDir | None = None
    """PPO only: the critic's starting point: a reward model (its score head becomes the value head) or a
    causal LM (a new value head is added). Default: `actor`."""
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    """Dtype for every model (weights and computation)."""
    attn_implementation: Attention = "sdpa"
    """Attention of every model the trainer and scorers run (transformers): `sdpa` (PyTorch's fused
    attention), `eager` (plain matmuls), or `flash_attention_2` (needs flash-attn and a GPU)."""
    forward_batch_size: PositiveInt = 16
    """Samples per no-gradient forward pass (reference and reward scores, old log-probs and values)."""
    packing: bool = False
    """Pack the samples of each training micro-batch and of each no-gradient pass (the policy's, the
    reference's and the critic's log-probs and values, the reward models' scores) into one sequence:
    positions restart at each sample and each sample's attention is computed on its own (PyTorch's SDPA per
    sample), so no padding is computed. `trainer.micro_batch_tokens` then counts the samples' own tokens.
    Only with `attn_implementation: sdpa`, and not with `ptx.coef` > 0."""


LOWEST_TEMPERATURE = 0.01
"""vLLM raises a sampling temperature between 0 and this to this (with a warning per request), while
transformers samples and the trainer scores at the one configured: below it the engines differed and vLLM's
behaviour log-probs were not the trainer's."""


def temperature_problem(field: str, value: float, also: str = "") -> str | None:
    """Why `value` of sampling temperature `field` cannot be used (None: it can); `also`: what else uses it."""
    if 0 < value < LOWEST_TEMPERATURE:
        return (f"{field} is {value:g}; vLLM samples at no less than {LOWEST_TEMPERATURE:g} (it raises lower "
                f"temperatures to it), transformers at {value:g}{also}: set it to at least {LOWEST_TEMPERATURE:g}")
    return None


class VllmSection(Section):
    kv_cache_gb: float = Field(default=0.5, gt=0)
    """Memory for the KV cache of each tensor-parallel rank of a generator worker, in GiB (a worker with
    tensor_parallel_size N takes N times this; on CPU it is host memory)."""
    tensor_parallel_size: PositiveInt = 1
    """vLLM tensor-parallel size of each generator worker."""
    enforce_eager: bool = True
    """Skip torch.compile/graph capture: start in seconds instead of ~20 s (slower decode on GPU). On CPU,
    vLLM's small compiled helpers run eagerly too (TORCH_COMPILE_DISABLE=0 keeps compiling them)."""


class RolloutSection(Section):
    prompts_per_step: PositiveInt = 16
    """Prompts per step; each gives `group_size` samples."""
    group_size: PositiveInt = 4
    """Samples per prompt (GRPO compares a sample with the others of its group; needs >= 2)."""
    max_prompt_tokens: PositiveInt = 256
    """Longer prompts are cut from the left (and counted in the generator log)."""
    max_new_tokens: PositiveInt = 64
    """Most tokens a response may have."""
    temperature: float = Field(default=1.0, gt=0)
    """Sampling temperature (the trainer scores log-probs at the same temperature); at least 0.01, the lowest
    vLLM samples at."""
    top_p: float = Field(default=1.0, gt=0, le=1)
    """Nucleus sampling threshold."""
    ignore_eos: bool = False
    """Benchmarks: every response runs to max_new_tokens, past any end-of-sequence token (vLLM's
    ignore_eos), so that systems compared side by side do the same work."""
    backend: Literal["auto", "vllm", "hf"] = "auto"
    """`vllm`, `hf` (transformers `generate`, the fallback without vLLM), or `auto` (vllm if installed, else
    hf). Where generation shares the trainer's workers (flattening, interleaving) `vllm` runs vLLM in each
    trainer rank's process, for that rank's share of the prompts: the trainer loads its weights into vLLM in
    memory after each update, and on GPU vLLM sleeps (gives back its KV cache and weights) while the trainer
    works; `hf` generates with the trainer's own actor module (no second copy of the weights)."""
    vllm: VllmSection = VllmSection()
    """Settings of the vLLM engine."""
    generate_batch_size: PositiveInt | None = None
    """Transformers engine (`hf`): samples a worker generates at once (None: all of its samples). Smaller
    batches need less memory (their KV cache, and the scores kept for log-probs) and take more decode
    steps. vLLM batches by its KV cache (`vllm.kv_cache_gb`) instead."""
    stream_groups: Annotated[int, Field(ge=0)] = 0
    """vLLM generators on workers of their own: send the samples on in parts, each of at least this many
    prompt groups whose samples have all finished, as they finish, so that the scorers score them while
    the rest are generated (samples of different lengths finish at different decode steps). 0: all of a
    worker's samples in one message, once the last has finished. The samples are the same either way;
    the scores of a part are computed in batches of that part."""
    max_policy_lag: Annotated[int, Field(ge=0)] = 0
    """0: synchronous, on-policy (a step generates with the weights of the step before). N > 0: asynchronous;
    generation of the next N steps overlaps training, so a sample may come from weights up to N updates
    older than the ones it is trained at (needs generators on workers of their own)."""
    sync_check: bool = True
    """After every weight sync, each generator scores a probe sequence and compares its log-probs with the
    trainer's; a difference above `sync_check_tolerance` fails the run (a weight that did not arrive)."""
    sync_check_tolerance: float | None = Field(default=None, gt=0)
    """Largest mean |log-prob difference| the sync check accepts (default: 1e-3 in float32, 5e-2 in
    bfloat16 and float16, where vLLM's and transformers' kernels round differently)."""
    stale: Literal["wait", "drop"] = "wait"
    """Asynchronous mode: `wait` sends a step's prompts only when the generators hold weights within
    max_policy_lag of it; `drop` sends them one step earlier (the generators never wait for weights), drops
    the groups that turn out older than max_policy_lag and generates them again with newer weights."""

    @model_validator(mode="after")
    def _temperature_both_engines_use(self) -> "RolloutSection":
        problem = temperature_problem("rollout.temperature", self.temperature,
                                      f", and the trainer scores the samples at {self.temperature:g}")
        if problem:
            raise ValueError(problem)
        return self


class EvalSection(Section):
    every_steps: Annotated[int, Field(ge=0)] = 0
    """Evaluate in the run: after every this many steps (and after the last), the generators sample the
    prompts held out of training (data.eval_fraction) with the weights of that step, the run's rewards
    score them, and nothing is trained on them. Written to RUN_DIR/eval/in-run/ (as `slurm-rlhf eval`
    writes: summary.jsonl, each step's samples, TensorBoard `eval-in-run`) and drawn by `report`. 0: never
    (`slurm-rlhf eval` scores the checkpoints afterwards, or beside the run with --follow)."""
    n: PositiveInt = 1
    """Samples per held-out prompt (more than 1: the best of them is reported too)."""
    temperature: float = Field(default=0.0, ge=0)
    """Sampling temperature of the evaluation; 0: greedy, else at least 0.01 (the lowest vLLM samples at)."""
    top_p: float = Field(default=1.0, gt=0, le=1)
    """Nucleus sampling threshold of the evaluation (with temperature > 0)."""

    @model_validator(mode="after")
    def _samples_differ(self) -> "EvalSection":
        if self.n > 1 and self.temperature == 0:
            raise ValueError(f"eval.n is {self.n} with eval.temperature 0 (greedy): every sample of a prompt would "
                             "be the same, and best of n the mean; set eval.temperature (e.g. 0.7), or eval.n: 1")
        problem = temperature_problem("eval.temperature", self.temperature)
        if problem:
            raise ValueError(problem + " (or 0: greedy)")
        return self


class RewardFunction(Section):
    function: FunctionPath
    """`package.module:function` (installed, or on PYTHONPATH), or `path/to/file.py:function` (a file, relative to
    the config's folder); called as `function(prompt=..., response=..., **fields, **args)` and must return a
    number."""
    weight: float = 1.0
    """Weight of this component in the total reward."""
    name: str | None = None
    """Name of the component in metrics (default: the function name)."""
    args: dict[str, Any] = {}
    """Extra keyword arguments for the function."""
    timeout_s: float | None = Field(default=None, gt=0)
    """How long one call may take: a call that takes longer fails the run, naming the function and the
    sample (a judge stalled on a network call would otherwise hold the scorer until transport.step_timeout_s).
    The calls then run in a thread of their own; unset, in the scorer's main thread, where a function may
    set signal handlers (math_verify's own timeouts use SIGALRM, which fails in any other thread)."""

    @model_validator(mode="after")
    def _importable(self) -> "RewardFunction":
        load_function(self.function)
        if self.name is None:
            self.name = split_function(self.function)[1]
        return self


class RewardModel(Section):
    path: ModelDir
    """Hugging Face sequence-classification model with one label (e.g. the `rm` stage's export); the reward
    is its score at the last token of prompt + response (the prompt is cut from the left to fit)."""
    normalize: bool = False
    """Subtract the mean and divide by the std of this model's rewards, which the `rm` stage saves as
    reward_stats.json in its export: measured on the RL part's rows of data.split where they hold pairs,
    else on the rm stage's eval rows (else its training rows), at most 1024 pairs."""
    weight: float = 1.0
    """Weight of this component in the total reward."""
    name: str | None = None
    """Name of the component in metrics (default: `rm<index>`)."""


class RewardSection(Section):
    functions: list[RewardFunction] = []
    """Rule-based reward functions."""
    models: list[RewardModel] = []
    """Reward models."""
    clip: float | None = Field(default=None, gt=0)
    """Clip the total reward to [-clip, clip] (DeepSpeed-Chat's clip_reward_value); none: no clipping."""

    @model_validator(mode="after")
    def _named(self) -> "RewardSection":
        if not self.functions and not self.models:
            raise ValueError("no reward: give at least one entry in reward.functions or reward.models")
        for i, rm in enumerate(self.models):
            rm.name = rm.name or f"rm{i}"
            if rm.normalize and not (Path(rm.path) / "reward_stats.json").exists() and Path(rm.path).exists():
                raise ValueError(f"models[{i}].normalize: {rm.path} has no reward_stats.json (the `rm` stage writes "
                                 "it); train the reward model with slurm-rlhf rm, or set normalize: false")
        names = [c.name for c in [*self.functions, *self.models]]
        duplicated = sorted({n for n in names if names.count(n) > 1})
        if duplicated:
            raise ValueError(f"reward component names must differ; repeated: {duplicated} (set `name:`)")
        return self


class KLSection(Section):
    coef: float = Field(default=0.01, ge=0)
    """KL coefficient (initial value when adaptive)."""
    adaptive: bool = False
    """Adapt the coefficient towards `target` (Ziegler et al. 2019)."""
    target: float = Field(default=6.0, gt=0)
    """Adaptive only: target KL per sequence (sum over response tokens)."""
    horizon: PositiveInt = 10000
    """Adaptive only: number of samples over which the coefficient moves by at most ±20% (a step of more
    samples moves it by ±20% at most too)."""

    @model_validator(mode="after")
    def _adaptive_from_zero(self) -> "KLSection":
        if self.adaptive and self.coef == 0:
            raise ValueError("adaptive needs a starting coef above 0: the controller multiplies the coefficient "
                             "by at most 1.2 a step, so from 0 it stays 0 for good; set coef (e.g. 0.01), or "
                             "adaptive: false for no KL")
        return self


class AlgorithmSection(Section):
    clip_eps: float = Field(default=0.2, gt=0)
    """PPO clip range of the policy ratio."""
    value_clip_eps: float = Field(default=0.2, gt=0)
    """PPO only: clip range of the value update."""
    gamma: float = Field(default=1.0, ge=0, le=1)
    """PPO and REINFORCE++: discount."""
    lam: float = Field(default=0.95, ge=0, le=1)
    """PPO only: GAE lambda."""
    epochs: PositiveInt = 1
    """Passes over each experience batch."""
    normalize_advantages: bool = True
    """GRPO: divide by the group's standard deviation. PPO: whiten advantages over the batch. RLOO's
    advantages are not normalised and REINFORCE++ always whitens its returns over the batch (this setting
    changes neither)."""
    kl: KLSection = KLSection()
    """KL to the reference model: a per-token reward penalty (PPO, REINFORCE++), a penalty on each
    sequence's reward (RLOO), or a loss term (GRPO, k3 estimator)."""
    behaviour_correction: Literal["auto", "on", "off"] = "auto"
    """Weight each token's policy loss by min(exp(old - behaviour log-prob), behaviour_weight_cap): the
    importance ratio between the policy at the update and the one that generated the sample (truncated).
    `auto`: on in asynchronous mode (rollout.max_policy_lag > 0), off otherwise."""
    behaviour_weight_cap: float = Field(default=2.0, gt=0)
    """Largest importance weight of the behaviour correction (truncated importance sampling)."""


class TrainerSection(EngineSection):
    """DeepSpeed training of the actor (and critic): the engine's settings, and RL's own."""

    critic_lr: float = Field(default=1e-5, gt=0)
    """PPO only: critic learning rate."""
    ema: float | None = Field(default=None, gt=0, lt=1)
    """Keep an exponential moving average of the actor's weights with this decay (e.g. 0.992, as
    DeepSpeed-Chat); it is checkpointed, resumed exactly and exported as `export-ema/`. None: off. It is
    folded once per RL step (with the weight sync); DeepSpeed-Chat folds per optimizer step, so with k
    updates per step (updates_per_step x algorithm.epochs) its decay d is d^k here."""
    updates_per_step: PositiveInt = 1
    """Optimizer updates per epoch over an experience batch (mini-batches)."""
    weight_sync_bucket_mb: float = Field(default=16, gt=0)
    """Weights are broadcast to generators in buckets of about this size, one broadcast each; trainer rank
    0 keeps two send buffers of this size to pack them, and packs one while the other travels. 16 MB
    overlaps more of the packing than 64 did: `tools/bench_sync.py` over gloo gave 0.82-0.90 of a raw
    broadcast's throughput with 16 MB, 0.69-0.74 with 64 (alternating runs, lowest over its two models);
    a broadcast of 16 MB still runs near an NCCL link's bandwidth."""
    micro_batch_tokens: PositiveInt | None = None
    """Micro-batches by token budget instead of `micro_batch_size` rows each: a rank's samples of an update,
    longest first, fill micro-batches of at most this many tokens (rows x the longest sample, prompt
    included; with model.packing, the sum of the samples' tokens), so short samples are not padded to long
    ones and every micro-batch needs about the same memory. The loss is then the token mean over the
    update's samples. Must hold one whole sample (rollout.max_prompt_tokens + max_new_tokens); the samples of
    a step need not divide by `micro_batch_size` then. None: `micro_batch_size` rows each."""


class PtxSection(Section):
    """DeepSpeed-Chat's PTX mixture: a language-modelling loss on unsupervised text added to the RL loss."""

    coef: float = Field(default=0.0, ge=0)
    """Weight of the LM loss (DeepSpeed-Chat's unsup_coef, 27.8 there); 0: off."""
    data: DataSection | None = None
    """The text rows (`text_key` field, default `text`)."""
    max_tokens: PositiveInt = 256
    """Tokens of a text row trained on (longer rows are cut)."""

    @model_validator(mode="after")
    def _data(self) -> "PtxSection":
        if self.coef > 0 and self.data is None:
            raise ValueError("ptx.coef is above 0 but there is no ptx.data: give ptx.data.sources: [{path: ...}]")
        if self.data is not None and self.data.split is not None:
            raise ValueError("ptx.data.split: the PTX text is a corpus of its own, not split between the stages; "
                             "remove it")
        if self.data is not None and self.data.eval_fraction:
            raise ValueError("ptx.data.eval_fraction: nothing evaluates the PTX text; remove it")
        return self


class PlacementSection(Section):
    """Which node group hosts which model. Resources of each node group go under its name, e.g.
    `placement: {strategy: interleaving, trainer: {workers: 2}}`."""

    model_config = ConfigDict(extra="allow")
    __pydantic_extra__: dict[str, GroupSection] = Field(init=False)

    strategy: Literal["separation", "flattening", "interleaving", "colocate_actor_ref", "colocate_critic_reward",
                      "colocate_all_models", "custom"] = "separation"
    """`separation`: generator (generation), scorer (reference, reward) and trainer (actor, critic) node
    groups. `flattening`: one group `all` hosting every model; each worker runs the phases in turn.
    `interleaving`: trainer (actor, critic, generation) and scorer (reference, reward). OpenRLHF's
    switches: `colocate_actor_ref` (generator | reward | trainer with the reference),
    `colocate_critic_reward` (generator | reference | trainer with the rewards), `colocate_all_models`
    (generator | trainer with every scoring model). `custom`: the groups you list, each with `models`; a
    group may host the critic alone (PPO): trainer ranks of its own, as many as the actor's."""
    offload: bool = False
    """In a group hosting several models, move what another phase holds to host memory while a phase
    runs: the scorer models during generation and training (GPU only), and the trainer's optimizer
    states, fp32 master weights and gradients from the end of each update to the start of the next,
    while the generator runs (ZeRO-1/2; on a CPU machine these calls run but move nothing). With vLLM in
    the trainer's process on GPU, vLLM sleeps while the trainer works, whatever this says. `slurm-rlhf
    plan` (and `init`) weighs it on GPU clusters and writes what its plan uses."""

    @model_validator(mode="after")
    def _groups(self) -> "PlacementSection":
        groups = self.__pydantic_extra__
        if self.strategy == "custom":
            if not groups:
                raise ValueError("strategy custom needs node groups: placement.<name>: {models: [...], workers: ...}")
            where: dict[str, list[str]] = {}
            for name, g in groups.items():
                if not g.models:
                    raise ValueError(f"placement.{name}.models: list the models of this group (any of "
                                     f"{', '.join(MODELS)})")
                for m in g.models:
                    where.setdefault(m, []).append(name)
            twice = {m: sorted(set(names)) for m, names in where.items() if len(names) > 1}
            if twice:
                raise ValueError("node groups overlap: " + "; ".join(
                    f"{m} is in " + " and ".join(f"placement.{g}.models" for g in n) for m, n in twice.items())
                                 + "; put every model in exactly one group")  # (the fields named: their lines)
            missing = [m for m in MODELS if m not in where]
            if missing:
                raise ValueError(f"no node group hosts {', '.join(missing)}; add it to a group's models")
            critic = where["critic"][0]
            if where["actor"] != where["critic"] and list(groups[critic].models) != ["critic"]:
                raise ValueError(f"placement.{critic}.models: the critic in a node group apart from the actor's "
                                 f"({where['actor'][0]}) trains on trainer ranks of its own, so that group hosts "
                                 f"the critic alone; move {', '.join(m for m in groups[critic].models if m != 'critic')}"
                                 " to another group")
            return self
        preset = PRESETS[self.strategy]
        for name, g in groups.items():
            if name not in preset:
                raise ValueError(f"unknown node group {name!r}: strategy {self.strategy} has node groups "
                                 f"{', '.join(preset)}; name one of them (or use strategy custom)")
            if g.models is not None:
                raise ValueError(f"placement.{name}.models is only for strategy custom ({self.strategy} places "
                                 f"{', '.join(preset[name])} in {name})")
        return self

    def layout(self) -> list[tuple[str, tuple[str, ...], GroupSection]]:
        """(name, models, resources) of every node group, in allocation order."""
        groups = self.__pydantic_extra__
        if self.strategy == "custom":
            return [(name, tuple(g.models), g) for name, g in groups.items()]
        return [(name, models, groups.get(name) or GroupSection()) for name, models in PRESETS[self.strategy].items()]

    def group_with(self, model: str) -> GroupSection:
        """Resources of the node group hosting `model`."""
        return next(g for _, models, g in self.layout() if model in models)

    def name_with(self, model: str) -> str:
        """The name of the node group hosting `model` (as its section is named under `placement`)."""
        return next(name for name, models, _ in self.layout() if model in models)

    def generation_with_actor(self) -> bool:
        """Whether generation shares the actor's workers (it then generates with the actor itself)."""
        return generation_with_actor(models for _, models, _ in self.layout())


class RunConfig(Section):
    stage: Literal["rl"] = "rl"
    """The RL stage (`sft` and `rm` configs are in stages.py)."""
    run: RunSection = RunSection()
    """What to run."""
    data: DataSection
    """Prompts."""
    model: ModelSection
    """Models."""
    rollout: RolloutSection = RolloutSection()
    """Sampling."""
    eval: EvalSection = EvalSection()
    """Evaluation on held-out prompts during the run."""
    reward: RewardSection
    """Rewards."""
    algorithm: AlgorithmSection = AlgorithmSection()
    """Advantages and losses."""
    trainer: TrainerSection = TrainerSection()
    """DeepSpeed training."""
    placement: PlacementSection = PlacementSection()
    """Which workers run which roles."""
    transport: TransportSection = TransportSection()
    """ZeroMQ, heartbeats and timeouts."""
    checkpoint: CheckpointSection = CheckpointSection()
    """Model checkpoints (experience is committed every step)."""
    wandb: WandbSection = WandbSection()
    """Weights & Biases (off unless a project is set)."""
    slurm: SlurmSection = SlurmSection()
    """How `slurm-rlhf submit` and `render` ask Slurm for the allocation."""
    ptx: PtxSection = PtxSection()
    """A language-modelling loss on unsupervised text mixed into the RL loss."""

    @model_validator(mode="after")
    def _consistent(self, info: ValidationInfo) -> "RunConfig":
        if self.run.algorithm in ("grpo", "rloo") and self.rollout.group_size < 2:
            raise ValueError(
                f"rollout.group_size is {self.rollout.group_size}; {self.run.algorithm.upper()} needs >= 2 samples "
                "per prompt to compare them (or set run.algorithm: ppo or reinforce_pp)"
            )
        trainers = self.placement.group_with("actor").workers
        # (by token budget, micro-batches are cut from a rank's samples of an update whatever their number)
        rows = self.trainer.micro_batch_size if self.trainer.micro_batch_tokens is None else 1
        per_update = rows * trainers * self.trainer.updates_per_step
        if self.samples_per_step % per_update:
            by_rows = f"trainer.micro_batch_size {rows} x " if self.trainer.micro_batch_tokens is None else ""
            raise ValueError(
                f"a step has {self.samples_per_step} samples (rollout.prompts_per_step {self.rollout.prompts_per_step}"
                f" x rollout.group_size {self.rollout.group_size}), not divisible by {by_rows}trainer workers "
                f"{trainers} x trainer.updates_per_step {self.trainer.updates_per_step} = {per_update}; change one "
                "of them"
            )
        budget = self.trainer.micro_batch_tokens
        longest = self.rollout.max_prompt_tokens + self.rollout.max_new_tokens
        if budget is not None and budget < longest:
            raise ValueError(f"trainer.micro_batch_tokens is {budget}, less than one sample can have "
                             f"(rollout.max_prompt_tokens + max_new_tokens = {longest}); raise it to at least {longest}")
        for field, path in self.sequence_models():
            problem = context_problem(model_files(path, info), longest, field,
                                      "rollout.max_prompt_tokens + max_new_tokens")
            if problem:
                raise ValueError(problem)
        # Heads and tokenizers: a pipeline checks which stage's export a field names (pipeline.EXPORT_OF), and
        # an export holds its tokenizer.
        for field, path in self.sequence_models():
            wants = {"model.actor": "lm", "model.reference": "lm", "model.critic": None}.get(field, "score")
            pending = pending_export(path, info)
            problem = head_problem(path, field, wants) if not pending else None
            if wants == "score" and not pending:  # (a reward model reads the texts with its own tokenizer)
                problem = problem or tokenizer_problem(path, field)
            if field in ("model.reference", "model.critic"):  # (they read the actor's token ids)
                problem = problem or vocabulary_problem(model_files(self.tokenizer_path, info),
                                                        model_files(path, info), field)
            if problem:
                raise ValueError(problem)
        if not pending_export(self.tokenizer_path, info):
            problem = main_tokenizer_problem(self.tokenizer_path, "model.actor", bool(self.model.tokenizer))
            if problem:
                raise ValueError(problem)
        if self.ptx.coef > 0:
            problem = context_problem(model_files(self.model.actor, info), self.ptx.max_tokens, "model.actor",
                                      "ptx.max_tokens")
            if problem:
                raise ValueError(problem)
        if self.model.packing and self.ptx.coef > 0:
            raise ValueError("model.packing with ptx.coef > 0 is not supported (PTX text comes in padded rows); "
                             "remove one of them")
        problem = self.model.packing and packing_problem("model.packing", self.model.attn_implementation)
        for field, path in self.sequence_models() if self.model.packing else ():
            problem = problem or packing_family_problem(model_files(path, info), field, "model.packing")
        if problem:
            raise ValueError(problem)
        if budget is not None and self.ptx.coef > 0:
            raise ValueError("trainer.micro_batch_tokens with ptx.coef > 0 is not supported (PTX text comes in "
                             "micro_batch_size rows per micro-batch); remove one of them")
        layout = self.placement.layout()
        if self.trainer.lora is not None:
            if self.trainer.lora.dropout > 0:
                raise ValueError(f"trainer.lora.dropout is {self.trainer.lora.dropout}, but RL trains with dropout "
                                 "off (every dropout of the models is 0): with it, the trainer's log-probs of a sample "
                                 "differ from the generator's at random; set it to 0 or remove it (an sft stage's "
                                 "train.lora.dropout may stay)")
            problem = lora_target_problem(model_files(self.model.actor, info), self.trainer.lora.target_modules,
                                          "trainer.lora.target_modules")
            if problem:
                raise ValueError(problem)
            if self.model.reference and Path(self.model.reference) != Path(self.model.actor):
                raise ValueError("model.reference: with trainer.lora the reference model is the actor with its "
                                 "adapters disabled (no second copy); remove model.reference")
            idle = [name for name, models, _ in layout if not any(self.hosts(m) for m in models)]
            if idle:
                raise ValueError(f"node group {idle[0]!r} of placement.strategy {self.placement.strategy} hosts only "
                                 "the reference model, which with trainer.lora is the actor without its adapters, "
                                 "computed by the trainer; use a placement without a reference group of its own "
                                 "(e.g. separation)")
        if self.model.critic and not self.hosts("critic"):
            raise ValueError(f"model.critic is set, but run.algorithm {self.run.algorithm} has no critic (only ppo "
                             "has one); remove model.critic or set run.algorithm: ppo")
        critic, actor = self.placement.name_with("critic"), self.placement.name_with("actor")
        trainers_of = {actor: self.placement.group_with("actor")}
        if self.run.algorithm == "ppo":
            trainers_of[critic] = self.placement.group_with("critic")
        for problem in (fp16_problem(self.model.dtype, name, group) for name, group in trainers_of.items()):
            if problem:
                raise ValueError(problem)
        if critic != actor:
            if self.run.algorithm != "ppo":
                raise ValueError(f"placement.{critic} hosts the critic, but run.algorithm {self.run.algorithm} has "
                                 "none (only ppo); remove that node group and list critic with the actor")
            critics = self.placement.group_with("critic").workers
            if critics != trainers:
                raise ValueError(f"placement.{critic}.workers is {critics}, but the "
                                 f"actor's group {actor} has {trainers}: each critic rank pairs with an actor rank "
                                 f"(it computes the values of that rank's samples and trains on its returns); give "
                                 f"both groups the same workers")
        generators = self.placement.group_with("generation")
        if self.rollout.prompts_per_step < generators.workers:
            raise ValueError(f"rollout.prompts_per_step ({self.rollout.prompts_per_step}) is less than the generator "
                             f"workers ({generators.workers}); every generator needs a prompt each step")
        tp = self.rollout.vllm.tensor_parallel_size
        # (not where vLLM is only missing here: the job may run under another Python, slurm.python)
        if tp > 1 and self.rollout.backend == "hf":
            raise ValueError(f"rollout.vllm.tensor_parallel_size is {tp}, but generation does not use vLLM "
                             "(rollout.backend is 'hf'); remove it, or use rollout.backend: vllm")
        if generators.gpus_per_worker and generators.gpus_per_worker % tp:
            raise ValueError(f"rollout.vllm.tensor_parallel_size ({tp}) does not divide the GPUs of each generator "
                             f"worker ({generators.gpus_per_worker}); make the GPUs a multiple of it")
        if (tp > 1 and self.generation_backend == "vllm" and not generators.gpus_per_worker
                and generators.cpus_per_worker and generators.cpus_per_worker < tp):
            group = self.placement.name_with("generation")
            raise ValueError(f"rollout.vllm.tensor_parallel_size ({tp}) is more than the CPUs of each generator "
                             f"worker ({generators.cpus_per_worker}); on CPUs each rank needs one of its own: give "
                             f"placement.{group}.cpus_per_worker at least {tp}")
        config = model_config(model_files(self.model.actor, info))
        heads, kv = attention_heads(config), kv_heads(config)
        if tp > 1 and self.generation_backend == "vllm" and not tp_splits(heads, kv, tp):
            raise ValueError(f"rollout.vllm.tensor_parallel_size ({tp}) does not split the {heads} attention heads "
                             f"and {kv} key/value heads of model.actor; vLLM gives each rank as many of both (or "
                             "copies a key/value head on several): use a size that divides the heads and divides "
                             "or is a multiple of the key/value heads")
        sections = {name: g for name, _, g in layout}
        for name, g in sections.items():
            if g.same_nodes_as is None:
                continue
            host = sections.get(g.same_nodes_as)
            if host is None or g.same_nodes_as == name:
                raise ValueError(f"placement.{name}.same_nodes_as is {g.same_nodes_as!r}, not another node group of "
                                 f"this placement ({', '.join(n for n in sections if n != name)})")
            if host.same_nodes_as is not None:
                raise ValueError(f"placement.{name}.same_nodes_as names {g.same_nodes_as}, which runs on the nodes of "
                                 f"{host.same_nodes_as} itself; name {host.same_nodes_as}")
            if g.nodes != host.nodes:
                raise ValueError(f"placement.{name}.nodes is {g.nodes}, but it runs on the nodes of {g.same_nodes_as}, "
                                 f"which has {host.nodes}; give both the same nodes")
            if (g.partition, g.constraint) != (host.partition, host.constraint):
                raise ValueError(f"placement.{name} runs on the nodes of {g.same_nodes_as}, so it cannot ask for "
                                 f"another partition or constraint; remove {name}'s")
            if (g.mem_gb is None) != (host.mem_gb is None):  # (launch/allocation.py: step_mem_mb)
                asked, unasked = (name, g.same_nodes_as) if g.mem_gb else (g.same_nodes_as, name)
                raise ValueError(f"placement.{asked}.mem_gb is set and placement.{unasked}.mem_gb is not, but they "
                                 f"share nodes: the job asks Slurm for the sum of their mem_gb on each node, which "
                                 f"leaves {unasked} none where Slurm counts memory (each job step takes only what it "
                                 f"asks for there); give {unasked} mem_gb too, or neither")
        need = sum(g.nodes for _, _, g in layout if g.same_nodes_as is None)
        if self.slurm.nodes is not None and need > self.slurm.nodes:
            raise ValueError(f"the node groups need {need} nodes (" + ", ".join(
                f"{name} {g.nodes}" for name, _, g in layout if g.same_nodes_as is None)
                + f") but slurm.nodes allows {self.slurm.nodes}; use fewer nodes per group")
        lag = self.rollout.max_policy_lag
        if lag and self.placement.generation_with_actor():
            raise ValueError(f"rollout.max_policy_lag is {lag} (asynchronous mode), but placement.strategy "
                             f"{self.placement.strategy} puts generation in the trainer's workers, which cannot "
                             "generate while they train; use separation (or another placement that gives "
                             "generation its own node group), or max_policy_lag 0")
        if self.rollout.stale == "drop" and not lag:
            raise ValueError("rollout.stale is 'drop', which acts only in asynchronous mode, but "
                             "rollout.max_policy_lag is 0; set max_policy_lag > 0 or remove rollout.stale")
        # A generator that sends its samples on in parts (rollout.stream_groups) sends up to one message per
        # `stream_groups` prompt groups of its share of a step. The trainer reads none while it trains and
        # sends the weights on, and the weights wait for the generators: when the next step's parts fill
        # the queues, the generator waits in its send, the trainer in the sync (until step_timeout_s).
        groups = math.ceil(self.rollout.prompts_per_step / generators.workers)
        streams = self.rollout.stream_groups and self.generation_backend == "vllm"
        parts = math.ceil(groups / self.rollout.stream_groups) if streams else 1
        ahead = (lag + 2) * generators.workers * parts
        if lag and self.transport.max_inflight_messages < ahead:
            per_step = (f" x {parts} parts of a generator's step (rollout.stream_groups {self.rollout.stream_groups}"
                        f" of its {groups} prompt groups)") if parts > 1 else ""
            raise ValueError(f"transport.max_inflight_messages ({self.transport.max_inflight_messages}) is less than "
                             f"the messages of the steps in flight with rollout.max_policy_lag {lag} and "
                             f"{generators.workers} generator worker(s): (lag + 2) x workers{per_step} = {ahead}; "
                             "raise it" + (", or raise rollout.stream_groups (0: one message a step)" if parts > 1
                                           else ""))
        if self.rollout.backend == "vllm" and importlib.util.find_spec("vllm") is None:
            raise ValueError("rollout.backend is 'vllm' but vLLM is not installed; install it or use backend: hf")
        if self.eval.every_steps and not self.data.eval_fraction:
            raise ValueError(f"eval.every_steps is {self.eval.every_steps}, but data.eval_fraction is 0: no prompts "
                             "are held out of training to evaluate on; set data.eval_fraction (e.g. 0.05), or "
                             "eval.every_steps: 0")
        if self.generation_backend == "vllm":
            problem = kv_cache_problem(model_files(self.model.actor, info), longest, self.model.dtype, tp,
                                       self.rollout.vllm.kv_cache_gb)
            if problem:
                raise ValueError(problem)
        if self.generation_backend == "vllm" and not generators.gpus_per_worker:
            problem = vllm_cpu_problem(model_files(self.model.actor, info))
            if problem:
                raise ValueError(f"model.actor: {problem}; use rollout.backend: hf, or give the generator node group "
                                 "GPUs (placement.<group>.gpus_per_worker)")
        return self

    @property
    def sync_check_tolerance(self) -> float:
        """`rollout.sync_check_tolerance`, or the default for `model.dtype` (`SYNC_CHECK_TOLERANCE`)."""
        return self.rollout.sync_check_tolerance or SYNC_CHECK_TOLERANCE[self.model.dtype]

    def sequence_models(self) -> list[tuple[str, str]]:
        """(field, directory) of every model that runs over whole samples (prompt and response)."""
        models = [("model.actor", self.model.actor)]
        if self.model.reference and self.hosts("reference"):
            models.append(("model.reference", self.model.reference))
        if self.model.critic and self.hosts("critic"):
            models.append(("model.critic", self.model.critic))
        return models + [(f"reward.models.{i}.path", rm.path) for i, rm in enumerate(self.reward.models)]

    def hosts(self, model: str) -> bool:
        """Whether the run has `model` as a model of its own: only PPO has a critic; with LoRA the reference
        is the actor with its adapters disabled, computed in the trainer's workers."""
        if model == "critic":
            return self.run.algorithm == "ppo"
        return model != "reference" or self.trainer.lora is None

    @property
    def summary(self) -> str:
        return f"{self.run.algorithm}, {self.run.steps} steps"

    @property
    def samples_per_step(self) -> int:
        """Samples in one experience batch: `prompts_per_step * group_size`."""
        return self.rollout.prompts_per_step * self.rollout.group_size

    @property
    def evaluation_on_trainer_ranks(self) -> bool:
        """Whether the reward models score in-run evaluations on the actor's trainer ranks, each rank its
        shard (the reward role's `deferred`: they sit with the actor on a group of several ranks)."""
        return bool(self.reward.models) and any(scored_in_training_step(models, "reward", g.workers)
                                                for _, models, g in self.placement.layout())

    @property
    def behaviour_correction(self) -> bool:
        """Whether the policy loss is weighted by the (truncated) behaviour importance ratio."""
        setting = self.algorithm.behaviour_correction
        return self.rollout.max_policy_lag > 0 if setting == "auto" else setting == "on"

    @property
    def old_logprobs_at_update(self) -> bool:
        """Whether the old log-probs are the training forward's own, with no forward pass of their own:
        GRPO with one update per batch (one epoch, updates_per_step 1) and no behaviour correction (see
        toolkit/roles/update.py; the planner charges no such pass then)."""
        return (self.run.algorithm == "grpo" and self.algorithm.epochs == 1 and self.trainer.updates_per_step == 1
                and not self.behaviour_correction)

    @property
    def tokenizer_path(self) -> Path:
        """`model.tokenizer`, or the actor's directory."""
        return Path(self.model.tokenizer or self.model.actor)

    @property
    def reference_path(self) -> Path:
        """`model.reference`, or the actor's directory."""
        return Path(self.model.reference or self.model.actor)

    @property
    def critic_path(self) -> Path:
        """`model.critic`, or the actor's directory."""
        return Path(self.model.critic or self.model.actor)

    @property
    def generation_backend(self) -> str:
        """`rollout.backend` with `auto` resolved: vllm when it is installed, else hf."""
        if self.rollout.backend != "auto":
            return self.rollout.backend
        return "vllm" if importlib.util.find_spec("vllm") is not None else "hf"
