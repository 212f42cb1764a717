"""The run config: one YAML file per run, validated into these dataclasses before any process starts.

Relative paths are resolved against the directory of the config file. Unknown keys are errors.
"""

from __future__ import annotations

import importlib
import importlib.util
import re
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationInfo, model_validator

from toolkit.config.model_files import vllm_cpu_problem


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True, validate_default=True)


def _resolve(value: str | Path, info: ValidationInfo) -> Path:
    path = Path(str(value)).expanduser()
    base = (info.context or {}).get("base_dir")
    if not path.is_absolute() and base is not None:
        path = Path(base) / path
    return path.resolve()


def _model_dir(value: Any, info: ValidationInfo) -> str:
    path = _resolve(value, info)
    if not path.is_dir():
        raise ValueError(f"no such directory {str(path)!r}; give the path of a Hugging Face model directory")
    if not (path / "config.json").is_file():
        raise ValueError(f"{str(path)!r} has no config.json; give a Hugging Face model directory (save_pretrained)")
    return str(path)


def _existing_file(value: Any, info: ValidationInfo) -> str:
    path = _resolve(value, info)
    if not path.is_file():
        raise ValueError(f"no such file {str(path)!r}")
    return str(path)


def load_function(import_path: str):
    """Import `package.module:function` and return the callable; ValueError says what is wrong."""
    module_name, _, attr = import_path.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ValueError(
            f"cannot import module {module_name!r} of {import_path!r} ({e}); install it or add its folder to PYTHONPATH"
        ) from None
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise ValueError(f"module {module_name!r} has no function {attr!r}")
    return fn


ModelDir = Annotated[str, AfterValidator(_model_dir)]
ExistingFile = Annotated[str, AfterValidator(_existing_file)]
PositiveInt = Annotated[int, Field(ge=1)]
SYNC_CHECK_TOLERANCE = {"float32": 1e-3, "bfloat16": 5e-2, "float16": 5e-2}


class RunSection(Section):
    name: str = "run"
    """Name of the run (used for the default run directory `runs/<name>` and the Slurm job name)."""
    algorithm: Literal["grpo", "ppo"] = "grpo"
    """`grpo`: group-relative advantages, no critic. `ppo`: critic, GAE, clipped value loss."""
    steps: PositiveInt = 10
    """Number of steps (experience batches, each followed by one policy update and weight sync)."""
    seed: int = 0
    """Seed for prompt order, sampling and model initialisation."""
    deterministic: bool = False
    """Bitwise-repeatable runs: deterministic torch algorithms, fixed thread counts (cpus_per_worker, else
    1), no vLLM prefix cache. A resumed run then ends with the same weights as an uninterrupted one."""


class DataSection(Section):
    prompts: ExistingFile
    """JSON Lines file, one object per line with at least the `prompt_key` field; other fields are
    passed to rule-based reward functions as keyword arguments."""
    prompt_key: str = "prompt"
    """Field of each line that holds the prompt text."""
    shuffle: bool = True
    """Shuffle prompt order (seeded by `run.seed`) every pass over the file."""
    chat_template: bool = False
    """Wrap each prompt as a user message with the tokenizer's chat template."""


class ModelSection(Section):
    actor: ModelDir
    """Hugging Face causal-LM directory: the policy that is trained and that generators serve."""
    tokenizer: ModelDir | None = None
    """Tokenizer directory (default: `actor`)."""
    reference: ModelDir | None = None
    """Reference model for the KL penalty (default: `actor`)."""
    critic: ModelDir | None = None
    """PPO only: initial critic backbone; a value head is added (default: `actor`)."""
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    """Dtype for every model (weights and computation)."""
    forward_batch_size: PositiveInt = 16
    """Samples per no-gradient forward pass (reference and reward scores, old log-probs and values)."""


class VllmSection(Section):
    kv_cache_gb: float = Field(default=0.5, gt=0)
    """Memory for the KV cache of each generator worker, in GB (on CPU this is host memory)."""
    tensor_parallel_size: PositiveInt = 1
    """vLLM tensor-parallel size of each generator worker."""
    enforce_eager: bool = True
    """Skip torch.compile/graph capture: start in seconds instead of ~20 s (slower decode on GPU)."""


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
    """Sampling temperature (the trainer scores log-probs at the same temperature)."""
    top_p: float = Field(default=1.0, gt=0, le=1)
    """Nucleus sampling threshold."""
    backend: Literal["auto", "vllm", "hf"] = "auto"
    """`vllm`, `hf` (transformers `generate`, the fallback without vLLM), or `auto` (vllm if installed)."""
    vllm: VllmSection = VllmSection()
    """Settings of the vLLM engine."""
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


class RewardFunction(Section):
    function: str = Field(pattern=r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$")
    """Import path `package.module:function`; called as `function(prompt=..., response=..., **fields, **args)`
    and must return a number."""
    weight: float = 1.0
    """Weight of this component in the total reward."""
    name: str | None = None
    """Name of the component in metrics (default: the function name)."""
    args: dict[str, Any] = {}
    """Extra keyword arguments for the function."""

    @model_validator(mode="after")
    def _importable(self) -> "RewardFunction":
        load_function(self.function)
        if self.name is None:
            self.name = self.function.split(":")[1]
        return self


class RewardModel(Section):
    path: ModelDir
    """Hugging Face sequence-classification model with one label; its score of prompt+response."""
    weight: float = 1.0
    """Weight of this component in the total reward."""
    name: str | None = None
    """Name of the component in metrics (default: `rm<index>`)."""


class RewardSection(Section):
    functions: list[RewardFunction] = []
    """Rule-based reward functions."""
    models: list[RewardModel] = []
    """Reward models."""

    @model_validator(mode="after")
    def _named(self) -> "RewardSection":
        if not self.functions and not self.models:
            raise ValueError("no reward: give at least one entry in reward.functions or reward.models")
        for i, rm in enumerate(self.models):
            rm.name = rm.name or f"rm{i}"
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
    """Adaptive only: number of samples over which the coefficient moves by at most ±20%."""


class AlgorithmSection(Section):
    clip_eps: float = Field(default=0.2, gt=0)
    """PPO clip range of the policy ratio."""
    value_clip_eps: float = Field(default=0.2, gt=0)
    """PPO only: clip range of the value update."""
    gamma: float = Field(default=1.0, ge=0, le=1)
    """PPO only: discount."""
    lam: float = Field(default=0.95, ge=0, le=1)
    """PPO only: GAE lambda."""
    epochs: PositiveInt = 1
    """Passes over each experience batch."""
    normalize_advantages: bool = True
    """GRPO: divide by the group's standard deviation. PPO: whiten advantages over the batch."""
    kl: KLSection = KLSection()
    """KL to the reference model: a per-token reward penalty (PPO) or a loss term (GRPO, k3 estimator)."""
    behaviour_correction: Literal["auto", "on", "off"] = "auto"
    """Weight each token's policy loss by min(exp(old - behaviour log-prob), behaviour_weight_cap): the
    importance ratio between the policy at the update and the one that generated the sample (truncated).
    `auto`: on in asynchronous mode (rollout.max_policy_lag > 0), off otherwise."""
    behaviour_weight_cap: float = Field(default=2.0, gt=0)
    """Largest importance weight of the behaviour correction (truncated importance sampling)."""


class TrainerSection(Section):
    zero_stage: Literal[0, 1, 2, 3] = 2
    """DeepSpeed ZeRO stage for actor and critic."""
    lr: float = Field(default=1e-5, gt=0)
    """Actor learning rate (AdamW)."""
    critic_lr: float = Field(default=1e-5, gt=0)
    """PPO only: critic learning rate."""
    weight_decay: float = Field(default=0.0, ge=0)
    """AdamW weight decay."""
    grad_clip: float = Field(default=1.0, gt=0)
    """Gradient norm clip."""
    micro_batch_size: PositiveInt = 8
    """Samples per forward/backward on each trainer rank."""
    updates_per_step: PositiveInt = 1
    """Optimizer updates per epoch over an experience batch (mini-batches)."""
    weight_sync_bucket_mb: float = Field(default=64, gt=0)
    """Weights are broadcast to generators in buckets of about this size."""


class CheckpointSection(Section):
    every_steps: PositiveInt = 10
    """Save a model checkpoint after every this many steps (and after the last step). Experience batches
    are committed every step regardless, so a resume never regenerates what was committed."""
    keep: PositiveInt = 2
    """Model checkpoints kept (the newest); experience files are all kept."""


MODELS = ("generation", "reference", "reward", "actor", "critic")
"""The models a placement puts somewhere: the generation engine, the reference model, the rewards
(functions and reward models), the actor and the critic (PPO)."""

# Node groups of each preset placement (the order is the order of the node groups in the allocation).
PRESETS: dict[str, dict[str, tuple[str, ...]]] = {
    "separation": {"generator": ("generation",), "scorer": ("reference", "reward"), "trainer": ("actor", "critic")},
    "flattening": {"all": MODELS},
    "interleaving": {"trainer": ("actor", "critic", "generation"), "scorer": ("reference", "reward")},
    "colocate_actor_ref": {"generator": ("generation",), "reward": ("reward",),
                           "trainer": ("actor", "critic", "reference")},
    "colocate_critic_reward": {"generator": ("generation",), "reference": ("reference",),
                               "trainer": ("actor", "critic", "reward")},
    "colocate_all_models": {"generator": ("generation",), "trainer": ("actor", "critic", "reference", "reward")},
}


class GroupSection(Section):
    models: list[Literal[MODELS]] | None = None
    """Strategy `custom` only: the models this node group hosts (generation, reference, reward, actor,
    critic); every model in exactly one group. The presets set this themselves."""
    workers: PositiveInt = 1
    """Worker processes of this node group (Slurm tasks of its job step)."""
    nodes: PositiveInt = 1
    """Slurm: nodes of this node group; `workers` are spread evenly over them."""
    cpus_per_worker: PositiveInt | None = None
    """CPU threads of each worker (Slurm: --cpus-per-task; default: Slurm's, or all cores locally)."""
    gpus_per_worker: int = Field(default=0, ge=0)
    """GPUs of each worker (Slurm: --gpus-per-task)."""
    mem_gb: float | None = Field(default=None, gt=0)
    """Slurm: memory per node of this group, in GB (default: the partition's)."""
    partition: str | None = None
    """Slurm: partition of this group (default: `slurm.partition`)."""
    constraint: str | None = None
    """Slurm: node features this group needs (--constraint), e.g. `a100`."""
    env: dict[str, str] = {}
    """Extra environment variables for these workers."""

    @model_validator(mode="after")
    def _spread(self) -> "GroupSection":
        if self.workers % self.nodes:
            raise ValueError(f"workers ({self.workers}) must be a multiple of nodes ({self.nodes}): "
                             "each node of a group runs the same number of workers")
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
    (generator | trainer with every scoring model). `custom`: the groups you list, each with `models`."""
    offload: bool = False
    """GPU only: in a group hosting several models, move the models of other phases to host memory
    while a phase runs (scorer models during generation and training)."""

    @model_validator(mode="after")
    def _groups(self) -> "PlacementSection":
        groups = self.__pydantic_extra__
        if self.strategy == "custom":
            if not groups:
                raise ValueError("strategy custom needs node groups: placement.<name>: {models: [...], workers: ...}")
            where: dict[str, list[str]] = {}
            for name, g in groups.items():
                if not g.models:
                    raise ValueError(f"{name}.models: list the models of this group (any of "
                                     f"{', '.join(MODELS)})")
                for m in g.models:
                    where.setdefault(m, []).append(name)
            twice = {m: sorted(set(names)) for m, names in where.items() if len(names) > 1}
            if twice:
                raise ValueError("node groups overlap: " + "; ".join(f"{m} is in {', '.join(n)}" for m, n in twice.items())
                                 + "; put every model in exactly one group")
            missing = [m for m in MODELS if m not in where]
            if missing:
                raise ValueError(f"no node group hosts {', '.join(missing)}; add it to a group's models")
            if where["actor"] != where["critic"]:
                raise ValueError(f"actor (in {where['actor'][0]}) and critic (in {where['critic'][0]}) must share a "
                                 "group: the trainer trains both")
            return self
        preset = PRESETS[self.strategy]
        for name, g in groups.items():
            if name not in preset:
                raise ValueError(f"unknown node group {name!r}: strategy {self.strategy} has node groups "
                                 f"{', '.join(preset)}; name one of them (or use strategy custom)")
            if g.models is not None:
                raise ValueError(f"{name}.models is only for strategy custom ({self.strategy} places "
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

    def generation_with_actor(self) -> bool:
        """Whether generation shares the actor's workers (it then generates with the actor itself)."""
        return any("generation" in models and "actor" in models for _, models, _ in self.layout())


# sbatch options slurm-rlhf sets from the placement or needs for itself.
RESERVED_SBATCH = {"nodes", "ntasks", "ntasks-per-node", "cpus-per-task", "gpus", "gpus-per-task", "gpus-per-node",
                   "mem", "partition", "constraint", "account", "qos", "time", "job-name", "output", "error",
                   "open-mode", "hetjob", "signal", "array", "nodelist", "requeue"}


class SlurmSection(Section):
    partition: str | None = None
    """Partition of every node group that names none."""
    account: str | None = None
    """Account to charge (--account)."""
    qos: str | None = None
    """Quality of service (--qos)."""
    nodes: PositiveInt | None = None
    """Nodes you may use at most (e.g. your share of the cluster, or an allocation you already hold);
    a placement whose node groups need more is refused before anything is submitted."""
    time_min: PositiveInt = 60
    """Time limit of the allocation, in minutes."""
    job_name: str | None = None
    """Name of the Slurm job (default: `run.name`)."""
    heterogeneous: Literal["auto", "always", "never"] = "auto"
    """`auto`: a heterogeneous job when node groups need different partitions, node features or GPU
    counts, one allocation otherwise; `always`: one job component per node group; `never`: one."""
    setup: list[str] = []
    """Shell lines the batch script runs before the driver (e.g. `module load cuda`)."""
    sbatch: dict[str, str | int | float | bool] = {}
    """More sbatch options, e.g. `{mail-type: END, exclusive: true}` -> `#SBATCH --mail-type=END`."""
    python: str | None = None
    """Python on the compute nodes (default: the interpreter running `slurm-rlhf submit`)."""
    signal_lead_s: PositiveInt = 120
    """Seconds before the time limit at which the job is told (SIGUSR1) to checkpoint and requeue itself."""
    max_requeues: int = Field(default=5, ge=0)
    """How many times a job may requeue itself on reaching its time limit (0: never)."""

    @model_validator(mode="after")
    def _options(self) -> "SlurmSection":
        for key in self.sbatch:
            if not re.fullmatch(r"[a-z][a-z0-9-]*", key):
                raise ValueError(f"slurm.sbatch: {key!r} is not an sbatch option name (write e.g. mail-type)")
            if key in RESERVED_SBATCH:
                raise ValueError(f"slurm.sbatch: --{key} is set by slurm-rlhf; use the placement or slurm "
                                 "settings instead (placement.<group>.nodes/partition/..., slurm.time_min, ...)")
        return self


class TransportSection(Section):
    heartbeat_interval_s: float = Field(default=1.0, gt=0)
    """Workers and the coordinator exchange heartbeats this often."""
    heartbeat_timeout_s: float = Field(default=60.0, gt=0)
    """A worker silent this long is declared dead and the run stops."""
    startup_timeout_s: float = Field(default=600.0, gt=0)
    """Most time for every worker to register and load its models."""
    step_timeout_s: float = Field(default=1800.0, gt=0)
    """Most time for one step (generate, score, train, sync); also the timeout of every collective."""
    max_inflight_messages: PositiveInt = 8
    """Messages queued per data connection before the sender blocks (backpressure)."""
    bind_host: str | None = None
    """Address to bind sockets to (default: 127.0.0.1 for local runs, the node's address under Slurm)."""

    @model_validator(mode="after")
    def _heartbeats(self) -> "TransportSection":
        if self.heartbeat_timeout_s < 3 * self.heartbeat_interval_s:
            raise ValueError(
                f"heartbeat_timeout_s ({self.heartbeat_timeout_s}) must be at least 3 x heartbeat_interval_s "
                f"({self.heartbeat_interval_s})"
            )
        return self


class RunConfig(Section):
    run: RunSection = RunSection()
    """What to run."""
    data: DataSection
    """Prompts."""
    model: ModelSection
    """Models."""
    rollout: RolloutSection = RolloutSection()
    """Sampling."""
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
    slurm: SlurmSection = SlurmSection()
    """How `slurm-rlhf submit` and `render` ask Slurm for the allocation."""

    @model_validator(mode="after")
    def _consistent(self) -> "RunConfig":
        if self.run.algorithm == "grpo" and self.rollout.group_size < 2:
            raise ValueError(
                f"rollout.group_size is {self.rollout.group_size}; GRPO needs >= 2 samples per prompt "
                "to compare them (or set run.algorithm: ppo)"
            )
        trainers = self.placement.group_with("actor").workers
        per_update = self.trainer.micro_batch_size * trainers * self.trainer.updates_per_step
        if self.samples_per_step % per_update:
            raise ValueError(
                f"a step has {self.samples_per_step} samples (rollout.prompts_per_step {self.rollout.prompts_per_step}"
                f" x rollout.group_size {self.rollout.group_size}), not divisible by trainer.micro_batch_size "
                f"{self.trainer.micro_batch_size} x trainer workers {trainers} x "
                f"trainer.updates_per_step {self.trainer.updates_per_step} = {per_update}; change one of them"
            )
        layout = self.placement.layout()
        generators = self.placement.group_with("generation")
        if self.rollout.prompts_per_step < generators.workers:
            raise ValueError(f"rollout.prompts_per_step ({self.rollout.prompts_per_step}) is less than the generator "
                             f"workers ({generators.workers}); every generator needs a prompt each step")
        tp = self.rollout.vllm.tensor_parallel_size
        if generators.gpus_per_worker and generators.gpus_per_worker % tp:
            raise ValueError(f"rollout.vllm.tensor_parallel_size ({tp}) does not divide the GPUs of each generator "
                             f"worker ({generators.gpus_per_worker}); make the GPUs a multiple of it")
        need = sum(g.nodes for _, _, g in layout)
        if self.slurm.nodes is not None and need > self.slurm.nodes:
            raise ValueError(f"the node groups need {need} nodes (" + ", ".join(f"{name} {g.nodes}" for name, _, g in layout)
                             + f") but slurm.nodes allows {self.slurm.nodes}; use fewer nodes per group")
        if self.rollout.backend == "vllm" and self.placement.generation_with_actor():
            raise ValueError(f"rollout.backend is 'vllm', but placement.strategy {self.placement.strategy} puts generation "
                             "in the trainer's workers, which generate with the trainer's own actor (transformers); "
                             "use backend auto or hf, or a placement that gives generation its own node group")
        lag = self.rollout.max_policy_lag
        if lag and self.placement.generation_with_actor():
            raise ValueError(f"rollout.max_policy_lag is {lag} (asynchronous mode), but placement.strategy "
                             f"{self.placement.strategy} puts generation in the trainer's workers, which cannot "
                             "generate while they train; use separation (or another placement that gives "
                             "generation its own node group), or max_policy_lag 0")
        ahead = (lag + 2) * generators.workers
        if lag and self.transport.max_inflight_messages < ahead:
            raise ValueError(f"transport.max_inflight_messages ({self.transport.max_inflight_messages}) is less than "
                             f"the messages of the steps in flight with rollout.max_policy_lag {lag} and "
                             f"{generators.workers} generator worker(s): (lag + 2) x workers = {ahead}; raise it")
        if self.rollout.backend == "vllm" and importlib.util.find_spec("vllm") is None:
            raise ValueError("rollout.backend is 'vllm' but vLLM is not installed; install it or use backend: hf")
        if self.generation_backend == "vllm" and not generators.gpus_per_worker:
            problem = vllm_cpu_problem(self.model.actor)
            if problem:
                raise ValueError(f"model.actor: {problem}; use rollout.backend: hf, or give the generator node group "
                                 "GPUs (placement.<group>.gpus_per_worker)")
        return self

    @property
    def sync_check_tolerance(self) -> float:
        """`rollout.sync_check_tolerance`, or the default for `model.dtype` (`SYNC_CHECK_TOLERANCE`)."""
        return self.rollout.sync_check_tolerance or SYNC_CHECK_TOLERANCE[self.model.dtype]

    @property
    def samples_per_step(self) -> int:
        """Samples in one experience batch: `prompts_per_step * group_size`."""
        return self.rollout.prompts_per_step * self.rollout.group_size

    @property
    def behaviour_correction(self) -> bool:
        """Whether the policy loss is weighted by the (truncated) behaviour importance ratio."""
        setting = self.algorithm.behaviour_correction
        return self.rollout.max_policy_lag > 0 if setting == "auto" else setting == "on"

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
        if self.placement.generation_with_actor():
            return "hf"
        return "vllm" if importlib.util.find_spec("vllm") is not None else "hf"
