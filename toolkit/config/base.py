"""What every stage's config shares: documented sections, path checks, node groups, the DeepSpeed engine's
settings, transport, checkpoints and Slurm. Relative paths resolve against the config file's directory."""

from __future__ import annotations

import functools
import importlib
import importlib.util
import ipaddress
import re
import types
import typing
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

from toolkit.config.model_files import config_json_problem
from toolkit.placement.layout import MODELS
from toolkit.seeds import seed_problem


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True, validate_default=True,
                              allow_inf_nan=False)  # (no setting is infinite or not a number)

    @field_validator("*", mode="before")
    @classmethod
    def _no_bool_as_number(cls, value: Any, info: ValidationInfo) -> Any:
        """pydantic's lax mode takes true as 1 and false as 0 where a number goes: `--set trainer.lr=true`
        trained at lr 1.0, `trainer.zero_stage=false` ran ZeRO-0. Strict mode is no cure: PyYAML reads `1e-6`
        as a string, which a float field must still take."""
        if isinstance(value, bool) and _number_not_bool(cls.model_fields[info.field_name].annotation):
            raise ValueError("a number goes here, not true or false (YAML reads true, false, yes, no, on and off as "
                             "booleans); write the number")
        return value


@functools.cache
def _number_not_bool(annotation: Any) -> bool:
    """Whether a field of type `annotation` takes a number (int, float, a Literal of numbers) but no bool."""
    def leaves(a: Any) -> list:
        if typing.get_origin(a) in (typing.Union, types.UnionType, typing.Annotated):
            return [leaf for arg in typing.get_args(a)[: 1 if typing.get_origin(a) is typing.Annotated else None]
                    for leaf in leaves(arg)]
        if typing.get_origin(a) is Literal:
            return [type(arg) for arg in typing.get_args(a)]
        return [a]

    found = leaves(annotation)
    return bool({int, float} & set(found)) and not {bool, Any} & set(found)


def _resolve(value: str | Path, info: ValidationInfo) -> Path:
    path = Path(str(value)).expanduser()
    base = (info.context or {}).get("base_dir")
    if not path.is_absolute() and base is not None:
        path = Path(base) / path
    return path.resolve()


def _pending(info: ValidationInfo) -> dict[str, str]:
    """{export of a pipeline's earlier stage, not written yet: the model directory that stage starts from}."""
    return (info.context or {}).get("pending_models", {})


def pending_export(path: str | Path, info: ValidationInfo) -> bool:
    """Whether `path` is the export of a pipeline's earlier stage, not written when the pipeline is validated."""
    return str(path) in _pending(info)


def _model_dir(value: Any, info: ValidationInfo) -> str:
    path = _resolve(value, info)
    if pending_export(path, info):  # nothing to read yet; the checks that need config.json use model_files
        return str(path)
    if not path.is_dir():
        raise ValueError(f"no such directory {str(path)!r}; give the path of a Hugging Face model directory")
    if not (path / "config.json").is_file():
        raise ValueError(f"{str(path)!r} has no config.json; give a Hugging Face model directory (save_pretrained)")
    problem = config_json_problem(path)
    if problem:
        raise ValueError(problem)
    return str(path)


def model_files(path: str, info: ValidationInfo) -> str:
    """The directory whose config.json describes the model at `path`: itself, or, for the export of a pipeline's
    earlier stage (not written yet), the model that stage starts from, whose architecture it keeps."""
    return _pending(info).get(path, path)


def _existing_file(value: Any, info: ValidationInfo) -> str:
    path = _resolve(value, info)
    if path.is_dir():
        raise ValueError(f"{str(path)!r} is a directory, not a file")
    if not path.is_file():
        raise ValueError(f"no such file {str(path)!r}")
    return str(path)


def _existing_path(value: Any, info: ValidationInfo) -> str:
    path = _resolve(value, info)
    if not path.exists():
        raise ValueError(f"no such file or directory {str(path)!r}")
    return str(path)


def load_function(import_path: str):
    """The callable at `package.module:function`, or at `/path/to/file.py:function`; ValueError says what is
    wrong."""
    where, attr, is_file = split_function(import_path)
    if is_file:
        module = _load_file(Path(where))
    else:
        try:
            module = importlib.import_module(where)
        except ImportError as e:
            raise ValueError(f"cannot import module {where!r} of {import_path!r} ({e}); install it, add its "
                             "folder to PYTHONPATH, or give the file: path/to/rewards.py:function") from None
        except (Exception, SystemExit) as e:  # (the module's own code failed as it was imported)
            raise ValueError(f"module {where!r} of {import_path!r} failed to import: {type(e).__name__}: {e}") \
                from None
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise ValueError(f"{'file' if is_file else 'module'} {where!r} has no function {attr!r}")
    return fn


def split_function(value: str) -> tuple[str, str, bool]:
    """(module or file, function name, whether it is a file) of `package.module:function` or
    `path/to/file.py:function` (the last `:` splits them)."""
    where, _, attr = value.rpartition(":")
    return where, attr, where.endswith(".py")


def _load_file(path: Path):
    """The module of a Python file, run once per process (under a name of its own: two files both called
    rewards.py are two modules)."""
    import hashlib
    import sys

    name = "slurm_rlhf_file_" + hashlib.sha256(str(path).encode()).hexdigest()[:16]
    if name in sys.modules:
        return sys.modules[name]
    if not path.is_file():
        raise ValueError(f"no such file {str(path)!r}")
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except (Exception, SystemExit) as e:  # (the user's code: a syntax error, an import it lacks, sys.exit, ...)
        raise ValueError(f"{path} failed to load: {type(e).__name__}: {e}") from None
    sys.modules[name] = module
    return module


def function_path(value: str, info: ValidationInfo) -> str:
    """`module:function` as given, or `file.py:function` with the file's path resolved against the config's
    folder (so the workers, wherever they start, load the same file)."""
    where, attr, is_file = split_function(value)
    if is_file:
        where = str(_resolve(where, info))
    elif not re.fullmatch(r"[A-Za-z_][\w.]*", where):
        where = ""
    if not where or not re.fullmatch(r"[A-Za-z_]\w*", attr):
        raise ValueError("give `package.module:function` (importable) or `path/to/file.py:function`")
    return f"{where}:{attr}"


def name_problem(name: str) -> str | None:
    """What is wrong with `name` as a run's (or pipeline's) name, the directory `runs/<name>`; None if nothing."""
    if not name.strip() or name in (".", "..") or "/" in name or "\0" in name:
        return ("the name is the run directory runs/<name>: one directory name, not empty, without '/' (e.g. "
                "my-run; --run-dir chooses another place)")
    return None


def _run_name(value: str) -> str:
    problem = name_problem(value)
    if problem:
        raise ValueError(problem)
    return value


def _one_line(value: str) -> str:
    if any(ord(c) < 32 or ord(c) == 127 for c in value):
        raise ValueError(f"{value!r} holds a control character (a line break?): it goes on one #SBATCH line of "
                         "the batch script; write it on one line")
    return value


def _seed(value: int) -> int:
    """A seed's bounds are those of vLLM's set_random_seed (numpy's): outside them a run failed only after its
    workers had started."""
    problem = seed_problem(value)
    if problem:
        raise ValueError(problem)
    return value


RunName = Annotated[str, AfterValidator(_run_name), AfterValidator(_one_line)]
OneLine = Annotated[str, AfterValidator(_one_line)]  # (a value of an #SBATCH line)
FunctionPath = Annotated[str, AfterValidator(function_path)]
ModelDir = Annotated[str, AfterValidator(_model_dir)]
ExistingFile = Annotated[str, AfterValidator(_existing_file)]
ExistingPath = Annotated[str, AfterValidator(_existing_path)]
PositiveInt = Annotated[int, Field(ge=1)]
Seed = Annotated[int, AfterValidator(_seed)]
Allocator = Literal["auto", "tcmalloc", "jemalloc", "system"]  # (run.allocator; toolkit/launch/allocator.py)
PATH_CHECKS = {_model_dir, _existing_file, _existing_path}  # (the checks of the fields that take a path)


class LoraSection(Section):
    """Low-rank adapters (LoRA, through peft): only the adapters train; the base weights stay frozen."""

    rank: PositiveInt = 8
    """Rank r of each adapter (A: r x in, B: out x r)."""
    alpha: float = Field(default=16.0, gt=0)
    """Scale: an adapter adds (alpha / rank) x B A to its weight."""
    dropout: float = Field(default=0.0, ge=0, lt=1)
    """Dropout on the adapters' input, for an sft stage (RL refuses any but 0: the trainer's log-probs must match
    the generator's)."""
    target_modules: list[str] | Literal["all-linear"] = "all-linear"
    """Names of the linear layers that get adapters (e.g. [q_proj, v_proj]), or `all-linear` (every linear
    layer but the output head)."""

    @field_validator("target_modules", mode="before")
    @classmethod
    def _names(cls, value: Any) -> Any:
        """One line for a value of neither kind (pydantic's union gave one per kind: `target_modules.list[str].0`
        and `target_modules.literal['all-linear']`)."""
        if value == "all-linear" or isinstance(value, list) and all(isinstance(name, str) for name in value):
            return value
        if isinstance(value, str):
            raise ValueError(f"a list of layer names goes here, even for one: [{value}]; or all-linear")
        if isinstance(value, list):
            i, name = next((i, name) for i, name in enumerate(value) if not isinstance(name, str))
            raise ValueError(f"item {i} is {name!r}, not a layer name; give names (e.g. [q_proj, v_proj]), or "
                             "all-linear")
        raise ValueError("give a list of layer names (e.g. [q_proj, v_proj]), or all-linear")


ATTENTION = Literal["sdpa", "eager", "flash_attention_2"]


def _attention(value: str) -> str:
    if value == "flash_attention_2" and importlib.util.find_spec("flash_attn") is None:
        raise ValueError("flash_attention_2 needs the flash-attn package (pip install flash-attn, on a machine "
                         "with CUDA); use sdpa, PyTorch's own fused attention, otherwise")
    return value


Attention = Annotated[ATTENTION, AfterValidator(_attention)]
"""The attention implementation transformers uses in every model a run trains or scores with."""


class EngineSection(Section):
    """Settings of the DeepSpeed engine every stage trains with (toolkit/training/engine.py)."""

    zero_stage: Literal[0, 1, 2, 3] = 2
    """DeepSpeed ZeRO stage: 0 plain data parallel; 1 optimizer states, 2 also gradients, 3 also weights
    partitioned over the ranks."""
    lr: float = Field(default=1e-5, gt=0)
    """Learning rate (AdamW)."""
    lr_schedule: Literal["constant", "cosine"] = "constant"
    """After the warm-up: `constant`, or `cosine` decay toward `min_lr_ratio` x lr, which it reaches just
    after the last optimizer step (RL: run.steps x algorithm.epochs x trainer.updates_per_step; sft and rm:
    the stage's steps), so the last step trains a little above it, as in Hugging Face's cosine schedule."""
    warmup_steps: int = Field(default=0, ge=0)
    """Optimizer steps of linear learning-rate warm-up."""
    min_lr_ratio: float = Field(default=0.0, ge=0, le=1)
    """Cosine schedule only: the rate the decay ends at, as a fraction of `lr`."""
    weight_decay: float = Field(default=0.0, ge=0)
    """AdamW weight decay."""
    grad_clip: float = Field(default=1.0, gt=0)
    """Gradient norm clip."""
    micro_batch_size: PositiveInt = 8
    """Samples per forward/backward on each trainer rank."""
    gradient_checkpointing: bool = False
    """Activation checkpointing: keep only each layer's input in the forward pass and recompute the rest
    in the backward pass (activation memory of one layer instead of all, for about a third more compute)."""
    offload_optimizer: bool = False
    """ZeRO-Offload: the fp32 master weights and Adam states live in host memory and DeepSpeed's CPU Adam
    updates them there (needs zero_stage >= 1). Frees 12 bytes per parameter on the device."""
    offload_params: bool = False
    """ZeRO-3 only: the parameters too live in host memory between uses (ZeRO-Infinity's CPU tier)."""
    lora: LoraSection | None = None
    """Train low-rank adapters instead of every weight (peft). None: full fine-tuning."""

    @model_validator(mode="after")
    def _memory(self) -> "EngineSection":
        if self.offload_optimizer and self.zero_stage == 0:
            raise ValueError("offload_optimizer needs zero_stage 1, 2 or 3 (ZeRO-Offload partitions what it "
                             "offloads); set zero_stage: 2")
        if self.offload_params and self.zero_stage != 3:
            raise ValueError(f"offload_params needs zero_stage 3 (only ZeRO-3 partitions the parameters); "
                             f"zero_stage is {self.zero_stage}")
        if self.lora is not None and self.zero_stage == 3:
            raise ValueError("lora with zero_stage 3 is not supported: the adapters are small, so use zero_stage 2 "
                             "(and offload_optimizer) instead")
        return self


class CheckpointSection(Section):
    every_steps: PositiveInt = 10
    """Save a model checkpoint after every this many steps (and after the last step). Experience batches
    are committed every step regardless, so a resume never regenerates what was committed."""
    keep: PositiveInt = 2
    """Model checkpoints kept (the newest); experience files are all kept."""


class WandbSection(Section):
    project: str | None = None
    """Weights & Biases project: set it to send every step's metrics to W&B too (beside TensorBoard and
    metrics.jsonl, which are always written). None: W&B is not used. Needs `pip install wandb`."""
    entity: str | None = None
    """W&B team or user (None: your default entity)."""
    mode: Literal["offline", "online"] = "offline"
    """offline: written under RUN_DIR/wandb, for `wandb sync RUN_DIR/wandb/offline-run-*` from a machine
    with internet access (compute nodes often have none); online: sent while the run goes."""
    tags: list[str] = []
    """Tags of the W&B run."""

    @model_validator(mode="after")
    def _installed(self) -> "WandbSection":
        if self.project is not None and importlib.util.find_spec("wandb") is None:
            raise ValueError("wandb.project is set, but the wandb package is not installed: pip install wandb "
                             "(or remove wandb.project)")
        return self


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
    partition: OneLine | None = None
    """Slurm: partition of this group (default: `slurm.partition`)."""
    constraint: OneLine | None = None
    """Slurm: node features this group needs (--constraint), e.g. `a100`."""
    env: dict[str, str] = {}
    """Extra environment variables for these workers."""
    same_nodes_as: str | None = None
    """Slurm: run on the nodes of that node group, beside its workers, instead of on nodes of its own: a
    node's GPUs split among roles, e.g. `generator: {same_nodes_as: trainer, workers: 4, gpus_per_worker: 1}`
    beside `trainer: {workers: 4, gpus_per_worker: 1}` on one 8-GPU node. Both groups need the same
    `nodes`; each job step then gets only the CPUs and GPUs it asks for (srun --exact), and memory: the
    `mem_gb` of each group (set it for all of them or none), or, in a job with memory per node (a
    DefMemPerNode), its share of it by the CPUs its workers take."""

    @model_validator(mode="after")
    def _spread(self) -> "GroupSection":
        for name in self.env:
            if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", name):
                raise ValueError(f"env: {name!r} is not an environment variable name (letters, digits and _, "
                                 "not starting with a digit)")
        if self.gpus_per_worker and "CUDA_VISIBLE_DEVICES" in self.env:  # (it was replaced without a word)
            raise ValueError(f"env: CUDA_VISIBLE_DEVICES would not be used: each worker of a group with "
                             f"gpus_per_worker gets its own GPUs, {self.gpus_per_worker} of those the driver's "
                             "CUDA_VISIBLE_DEVICES gives it (under Slurm, of the job step's); set it where you "
                             "start `slurm-rlhf run` instead, or remove it here")
        if self.workers % self.nodes:
            raise ValueError(f"workers ({self.workers}) must be a multiple of nodes ({self.nodes}): "
                             "each node of a group runs the same number of workers")
        return self


def slurm_minutes(text: str) -> int:
    """Minutes of a time in one of Slurm's --time formats (a part minute counted whole): minutes,
    minutes:seconds, hours:minutes:seconds, days-hours, days-hours:minutes, days-hours:minutes:seconds."""
    match = re.fullmatch(r"(?:(\d+)-)?(\d+)(?::(\d+))?(?::(\d+))?", text.strip())
    if not match:
        raise ValueError(f"slurm.time_min: {text!r} is not a time limit; write minutes (e.g. 120) or one of Slurm's "
                         "--time formats: \"2:00:00\" (hours:minutes:seconds), \"1-12\" (days-hours), \"90:30\" "
                         "(minutes:seconds)")
    days, *parts = match.groups()
    numbers = [int(p) for p in parts if p is not None]
    if days is not None:  # days-hours[:minutes[:seconds]]
        numbers += [0] * (3 - len(numbers))
        seconds = ((int(days) * 24 + numbers[0]) * 60 + numbers[1]) * 60 + numbers[2]
    elif len(numbers) == 3:  # hours:minutes:seconds
        seconds = (numbers[0] * 60 + numbers[1]) * 60 + numbers[2]
    else:  # minutes[:seconds]
        seconds = numbers[0] * 60 + (numbers[1] if len(numbers) == 2 else 0)
    return -(-seconds // 60)


# sbatch options slurm-rlhf sets from the placement or needs for itself.
RESERVED_SBATCH = {"nodes", "ntasks", "ntasks-per-node", "cpus-per-task", "gpus", "gpus-per-task", "gpus-per-node",
                   "mem", "partition", "constraint", "account", "qos", "time", "job-name", "output", "error",
                   "open-mode", "hetjob", "signal", "array", "nodelist", "requeue"}


def fp16_problem(dtype: str, name: str, group: GroupSection) -> str | None:
    """Why node group `name` cannot train in `dtype`, or None: DeepSpeed's fp16 mode (dynamic loss scaling)
    runs on GPUs only, and a trainer on CPUs would fail at start-up, after the other roles had started."""
    if dtype == "float16" and not group.gpus_per_worker:
        return (f"model.dtype is float16, but placement.{name} trains on CPUs (gpus_per_worker 0), where DeepSpeed "
                f"has no fp16 mode; use bfloat16 or float32, or give placement.{name}.gpus_per_worker")
    return None


def packing_problem(field: str, attention: str) -> str | None:
    """Why packing (`field`) cannot run with `model.attn_implementation` `attention`, or None: it computes each
    sample's attention with PyTorch's SDPA (toolkit/packing.py), so another implementation would not be used."""
    if attention == "sdpa":
        return None
    unwired = " (its packed path is not wired here yet)" if attention == "flash_attention_2" else ""
    return (f"{field} computes each sample's attention with PyTorch's SDPA, so model.attn_implementation {attention} "
            f"would not be used{unwired}; set {field}: false or model.attn_implementation: sdpa")


class SlurmSection(Section):
    partition: OneLine | None = None
    """Partition of every node group that names none."""
    account: OneLine | None = None
    """Account to charge (--account)."""
    qos: OneLine | None = None
    """Quality of service (--qos)."""
    nodes: PositiveInt | None = None
    """Nodes you may use at most (e.g. your share of the cluster, or an allocation you already hold);
    a placement whose node groups need more is refused before anything is submitted."""
    time_min: PositiveInt = 60
    """Time limit of the allocation, in minutes (`120`), or in one of Slurm's --time formats as a quoted
    string (`"2:00:00"`, `"1-12"`, `"90:30"`: minutes[:seconds], hours:minutes:seconds, days-hours[:minutes
    [:seconds]]), turned into minutes, a part minute counted whole."""
    job_name: OneLine | None = None
    """Name of the Slurm job (default: `run.name`)."""
    heterogeneous: Literal["auto", "always", "never"] = "auto"
    """`auto`: a heterogeneous job when node groups need different partitions, node features, GPU
    counts or memory (`mem_gb`: one job's --mem holds on all its nodes), one allocation otherwise;
    `always`: one job component per node set (a node group with `same_nodes_as` is in the component of the
    group it names); `never`: one."""
    setup: list[str] = []
    """Shell lines the batch script runs before the driver (e.g. `module load cuda`)."""
    sbatch: dict[str, str | int | float | bool] = {}
    """More sbatch options, e.g. `{mail-type: END, exclusive: true}` -> `#SBATCH --mail-type=END`. In a
    heterogeneous job, options of the job as a whole (mail-type, mail-user, dependency, begin, comment, ...:
    `toolkit.launch.sbatch.JOB_WIDE`) go in its first component, all others (exclusive, reservation, gres,
    ...) in every component."""
    python: str | None = None
    """Python on the compute nodes (default: the interpreter running `slurm-rlhf submit`)."""
    signal_lead_s: PositiveInt = 120
    """Seconds before the time limit at which the job is told (SIGUSR1) to checkpoint and requeue itself."""
    max_requeues: int = Field(default=5, ge=0)
    """How many times a job may requeue itself on reaching its time limit (0: never)."""
    stop_margin_s: float = Field(default=15.0, gt=0)
    """Seconds kept free before the time limit after the last step's checkpoint, for the requeue and the
    workers' stop: after SIGUSR1 the driver runs another step only if it, a checkpoint and this margin fit.
    Raise it where stopping takes long (a slow shared file system, many workers)."""

    @field_validator("time_min", mode="before")
    @classmethod
    def _slurm_time(cls, value):
        return slurm_minutes(value) if isinstance(value, str) and not value.strip().isdigit() else value

    @model_validator(mode="after")
    def _options(self) -> "SlurmSection":
        for key in self.sbatch:
            if not re.fullmatch(r"[a-z][a-z0-9-]*", key):
                raise ValueError(f"slurm.sbatch: {key!r} is not an sbatch option name (write e.g. mail-type)")
            if key in RESERVED_SBATCH:
                raise ValueError(f"slurm.sbatch: --{key} is set by slurm-rlhf; use the placement or slurm "
                                 "settings instead (placement.<group>.nodes/partition/..., slurm.time_min, ...)")
            if isinstance(self.sbatch[key], str):
                _one_line(self.sbatch[key])
        if self.signal_lead_s + self.stop_margin_s >= self.time_min * 60:
            raise ValueError(f"slurm.signal_lead_s ({self.signal_lead_s} s) and stop_margin_s ({self.stop_margin_s:g} s) "
                             f"do not fit in the time limit, slurm.time_min {self.time_min} min: the job would be "
                             "told to checkpoint and stop before it starts; raise time_min or lower signal_lead_s")
        return self


class TransportSection(Section):
    heartbeat_interval_s: float = Field(default=1.0, gt=0)
    """Workers and the coordinator exchange heartbeats this often."""
    heartbeat_timeout_s: float = Field(default=30.0, gt=0)
    """A worker silent this long is declared hung. In an RL run a generator or scorer is started again
    alone (run.max_worker_restarts); a trainer rank, and every worker of the sft and rm stages, restarts
    the run from its last checkpoint (run.max_trainer_restarts); when those are used up, the run stops."""
    startup_timeout_s: float = Field(default=600.0, gt=0)
    """Most time for every worker to register and load its models, without progress: a resume that
    replays many committed batches in the trainer's start-up reports each one, and each restarts the count."""
    step_timeout_s: float = Field(default=1800.0, gt=0)
    """Most time for one step (generate, score, train, sync); also the timeout of every collective."""
    max_inflight_messages: PositiveInt = 8
    """Messages queued per data connection before the sender blocks (backpressure)."""
    max_message_mb: float = Field(default=1024, gt=0)
    """Largest frame a socket accepts (ZeroMQ's MAXMSGSIZE, which bounds each frame of a message: its
    header, which holds the prompt and response texts of the samples it carries, its small arrays joined,
    or one larger array): a peer that sends a bigger one is disconnected before anything is buffered or
    hashed. Each message of a step must fit (a sender refuses one that does not, naming this setting). It
    also bounds what a peer without the run's key can make a process hold per connection, for the 10 s a
    handshake may take."""
    bind_host: str | None = None
    """Where sockets listen: an address, an interface name (e.g. ib0) or a network (e.g. 10.1.0.0/16),
    resolved on each node (default: 127.0.0.1 for local runs, each node's address under Slurm)."""

    @field_validator("bind_host")
    @classmethod
    def _one_interface(cls, value: str | None) -> str | None:
        try:
            unspecified = value == "*" or ipaddress.ip_address(value.strip("[]")).is_unspecified
        except (ValueError, AttributeError):
            unspecified = False
        if unspecified:
            raise ValueError(f"{value!r} listens on every interface of the node, where any host that reaches it can "
                             "connect; give the job's own interface: an address, an interface name (e.g. ib0) or a "
                             "network (e.g. 10.1.0.0/16), or leave bind_host out")
        return value

    @model_validator(mode="after")
    def _heartbeats(self) -> "TransportSection":
        if self.heartbeat_timeout_s < 3 * self.heartbeat_interval_s:
            raise ValueError(
                f"heartbeat_timeout_s ({self.heartbeat_timeout_s}) must be at least 3 x heartbeat_interval_s "
                f"({self.heartbeat_interval_s})"
            )
        return self


