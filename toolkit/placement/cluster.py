"""A cluster as the planner sees it: nodes, devices, their rates, and fixed per-call costs.

A device is a GPU, or, on a node without GPUs, the whole node (all its cores). Rates are what a program
reaches, not datasheet peaks: `tools/calibrate.py` measures them on the machine it runs on and writes a
cluster file; the GPU files in templates/clusters/ start from datasheet figures times typical
efficiencies (a guess until calibrated on such a node).
"""

from __future__ import annotations

from pathlib import Path

from pydantic import Field, ValidationError

from toolkit.config.base import Section
from toolkit.config.load import parse_yaml
from toolkit.errors import ConfigError


class _Section(Section):
    """What a run config's sections refuse, a cluster file's refuse too: unknown keys, inf and nan, and true
    or false where a number goes (`gpus_per_node: yes` was 1 GPU)."""


class Device(_Section):
    memory_gb: float = Field(gt=0)
    """Memory of one device (GPU memory, or the node's memory when it has no GPU), in GB of 10^9 bytes."""
    flops: float = Field(gt=0)
    """Dense matmul FLOP/s reached in the model dtype."""
    memory_bandwidth: float = Field(gt=0)
    """Bytes/s reached reading memory (decode and optimizer steps are bound by it)."""
    host_optimizer: float = Field(default=7e7, gt=0)
    """Parameters/s the host's optimizer (DeepSpeed's CPU Adam) steps for one device's share, with
    `trainer.offload_optimizer` (GPU nodes: the node's cores are shared by its GPUs)."""
    generation_idle: float = Field(default=0.0, ge=0, lt=1)
    """The share of the device that generation leaves idle, for other work beside it: on a `shared`
    machine, the scoring and training of an asynchronous step (`rollout.max_policy_lag`) run in it. vLLM
    on CPU keeps only part of the cores busy; 0 assumes generation takes the whole device."""


class Links(_Section):
    intra_node: float = Field(gt=0)
    """Bytes/s between two devices of a node (NVLink; on CPU: between processes, through memory)."""
    inter_node: float = Field(gt=0)
    """Bytes/s between nodes (InfiniBand, Ethernet)."""
    host: float = Field(default=2.5e10, gt=0)
    """Bytes/s between one device and host memory, every device of the node at once (PCIe; what
    offloaded optimizer states and parameters travel over)."""
    latency_s: float = Field(default=1e-4, ge=0)
    """Seconds per collective or message on top of bytes / bandwidth."""


class Overheads(_Section):
    """Seconds a call costs besides its FLOPs and bytes (Python, kernel launches, sampling)."""

    decode_step_vllm: float = Field(ge=0)
    """One vLLM decode step of a batch."""
    decode_step_hf: float = Field(ge=0)
    """One transformers `generate` decode step of a batch."""
    decode_per_sequence_vllm: float = Field(default=0.0, ge=0)
    """Added per sequence of the batch and vLLM decode step (sampling, bookkeeping)."""
    decode_per_sequence_hf: float = Field(default=0.0, ge=0)
    """Added per sequence of the batch and transformers decode step."""
    forward_call: float = Field(ge=0)
    """One no-gradient forward of a batch (reference, old log-probs, values)."""
    train_micro_batch: float = Field(ge=0)
    """One DeepSpeed forward + backward of a micro-batch."""
    optimizer_step: float = Field(ge=0)
    """One optimizer step (besides reading the states)."""
    message: float = Field(ge=0)
    """One ZeroMQ message between workers (encode, MAC, decode)."""
    step: float = Field(ge=0)
    """The driver's own work per step (prompts, metrics, HDF5 commit)."""


class Cluster(_Section):
    name: str
    """What this file describes."""
    nodes: int = Field(ge=1)
    gpus_per_node: int = Field(default=0, ge=0)
    """0: CPU nodes; a node is then one device."""
    cpus_per_node: int | None = Field(default=None, ge=1)
    """CPU cores of a node that a job may use. `plan` (and `init`) give each worker of a GPU group its share
    (`cpus_per_worker`: the node's cores over the workers on it) where the config sets none: without it, a
    Slurm job gives each task one CPU (Slurm's default), which a trainer's data work, its CPU Adam under
    `offload_optimizer` and vLLM's scheduler then share. None: nothing written."""
    shared: bool = False
    """True when every node group runs on the same machine(s) (the local launcher): groups take turns on
    the devices instead of owning nodes of their own."""
    device: Device
    links: Links
    overheads: Overheads
    measured: str | None = None
    """Where the figures come from (calibration date and command), for the record."""

    @property
    def devices_per_node(self) -> int:
        return self.gpus_per_node or 1


def load_cluster(path: str | Path) -> Cluster:
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as e:
        raise ConfigError(f"{path}: cannot read the cluster file ({e.strerror})") from None
    except UnicodeDecodeError as e:
        raise ConfigError(f"{path}: not UTF-8 text (byte {e.start}: {e.object[e.start:e.start + 1]!r}); a cluster "
                          "file is a YAML file") from None
    data = parse_yaml(text, path)
    if not isinstance(data, dict):  # (an empty file: pydantic's words were ": Input should be a valid dictionary")
        raise ConfigError(f"{path}: not a cluster file: it holds {'nothing' if data is None else type(data).__name__}, "
                          "where a mapping of nodes, gpus_per_node, device, ... belongs; start from one of "
                          "templates/clusters/ (or write one with tools/calibrate.py)")
    try:
        return Cluster.model_validate(data)
    except ValidationError as e:
        problems = "; ".join(f"{'.'.join(map(str, err['loc']))}: {err['msg']}" for err in e.errors())
        raise ConfigError(f"{path}: invalid cluster file: {problems}") from None

