"""The planner's model of one synchronous step: memory per device and seconds per phase.

Pure arithmetic on shapes, counts and the cluster's rates; every term is one line below, so a case can
be checked by hand (tests/unit/test_cost.py does). Memory (bytes per device):
  trainer model   weights P*b / (W if ZeRO-3; 0 with offload_params), gradients T*b / (W if ZeRO>=2),
                  Adam states T*(8 + 4 if b<4 for fp32 master weights) / (W if ZeRO>=1; 0 with
                  offload_optimizer), T = P or, with LoRA, the adapters' parameters;
                  activations mb*L*layers*hidden*17*b, or with checkpointing mb*L*hidden*b*layers
                  + one layer's mb*L*hidden*17*b; logits mb*L*vocab*4*3 (a critic's values:
                  mb*L*4*3); by token budget (trainer.micro_batch_tokens) the budget for mb*L; with
                  PTX the actor's mb*L has mb*ptx.max_tokens more (its text rows, in the same backward).
                  A trainer that does not fit is told the fewest switches under which it would.
                  A critic on ranks of its own (a group hosting it alone): its group holds the critic's
                  share, the actor's group the actor's.
  vLLM generator  P*b/TP + its KV budget: rollout.vllm.kv_cache_gb, or (planned) 90% of the device
                  less the weights and the rest of its group; it holds floor(budget / (L * a rank's
                  KV bytes per token: max(1, kv_heads // TP) heads, as vLLM copies heads where TP
                  exceeds them)) sequences at once, and generates a worker's samples in waves
                  (vLLM in a trainer's process sleeps while the trainer works, on a GPU: its group
                  needs the trainer's state plus the larger of activations and weights + KV budget)
  transformers generate()  rollout.generate_batch_size samples at once, or (planned) as many as 90% of
                  the device has room for beside the rest of its group: their KV cache + one step's
                  scores (vocab * 4 * 2 each) + the log-probs it keeps (Lr * 4 each)
  scorer model    P*b + forward logits fbs*L*vocab*4*2 (a reward model: values, fbs*L*4*2); a reference
                  or reward model with the trainer under ZeRO-3 holds P*b/W (sharded over the trainer's
                  W ranks)
Time (seconds per step, phases one after the other; with max_policy_lag >= 1 and generators of their
own, the busiest group's seconds, as generation of the next steps overlaps training; on a shared machine,
generate + max(0, score + train - generation_idle * generate) + sync + transport):
  generate  waves * (2*P*n*Lp/(TP*F) + Lr * (max(2*P*n/(TP*F), (P*b/TP + a rank's KV)/B) + c_decode + c_seq*n)),
            n = the sequences of a wave (vLLM: what its KV cache holds; transformers: its batch)
  score     per scoring model: 2*P*n*L/F + calls * c_forward (n: samples of the busiest worker; a
            reference or reward model with the trainer: each trainer rank its shard)
  train     old log-probs (and values; with LoRA the reference's too, the actor without its adapters):
            2*P*n*L/F + calls * c_forward (GRPO with one update a step and one epoch takes its old
            log-probs from the training forward: none);
            forward+backward k*P*n*L*epochs/F + micro-batches * c_micro, k = 2 (forward) + 2 (gradients
            of the activations) + 2 (of the weights; 0 with LoRA, whose adapters are too small to count)
            + 2 with checkpointing (the forward pass again); PTX: k*P*mb*ptx.max_tokens per micro-batch;
            optimizer updates * (c_opt + state bytes / B); ZeRO traffic over the group's link;
            on GPUs, host memory: offload_optimizer, per update T/W parameters through the host's Adam
            (H params/s per device) and T*b/W bytes each way over the device's host link (PCIe);
            offload_params (ZeRO-3), per micro-batch P*b/W bytes over it for forward and backward each;
            a critic on ranks of its own trains at the same time as the actor: the slower group's seconds
            (on a shared machine, both), + its values and the returns, n*L*4 bytes each way between ranks
  sync      broadcast P*b over the link + reload P*b/B (a generator in the trainer's worker: nothing,
            or the ZeRO-3 gather and a copy)
  transport one message per generator worker per hop between groups
P counts every parameter for memory and bytes, and a mixture of experts' active ones for FLOPs.

Where this is a guess: activations (no flash-attention savings), TP communication in
vLLM (ignored), overlap of communication with compute (none assumed), response length (assumed to be
`max_new_tokens` unless given).
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from pathlib import Path

from toolkit.errors import ConfigError
from toolkit.placement.layout import Group, Layout, scored_in_training_step
from toolkit.placement.plan import ROLE_OF, WorkerGroup, group_of, several_roles, stages

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
GB = 1e9      # cluster files' memory_gb and the planner's reports: decimal gigabytes
GIB = 2**30   # rollout.vllm.kv_cache_gb: gibibytes, as the vLLM engine reads it (vllm_engine.py)


@dataclass(frozen=True)
class ModelShape:
    params: float
    layers: int
    hidden: int
    vocab: int
    kv_heads: int
    head_dim: int
    active_params: float | None = None  # a mixture of experts: what one token passes through (None: all)
    ffn: int | None = None              # the MLP's inner width (None: 4 x hidden)
    value_head: bool = False            # one output per token (critic, reward model), not the vocabulary
    heads: int | None = None            # attention (query) heads, where known: vLLM's TP size must divide them
    linears: tuple = ()                 # what LoRA may adapt (shapes.Linear); () : a Llama-like block's seven
    lm_head: float | None = None        # parameters of an output head of its own (0: tied; None: not known)
    score_inputs: int = 0               # a value head's inputs (score: hidden x 1; OPT: its projection's)

    @property
    def outputs(self) -> int:
        """What its head gives per token: a value, or a score per word of the vocabulary."""
        return 1 if self.value_head else self.vocab

    @property
    def active(self) -> float:
        """Parameters each token computes with (FLOPs); `params` is what memory holds."""
        return self.active_params if self.active_params is not None else self.params

    @classmethod
    def from_config(cls, path: str | Path) -> "ModelShape":
        """From a Hugging Face `config.json` (or its directory), counted for its family (shapes.py)."""
        from toolkit.config.model_files import attention_heads
        from toolkit.placement.shapes import count

        path = Path(path)
        file = path / "config.json" if path.is_dir() else path
        try:
            config = json.loads(file.read_text())
        except json.JSONDecodeError as e:
            raise ConfigError(f"{file}: not JSON (line {e.lineno}, column {e.colno}: {e.msg})") from None
        n = count(config, str(file))
        return cls(float(n.total), n.layers, n.hidden, n.vocab, n.kv_heads, n.head_dim, float(n.active), n.ffn,
                   heads=attention_heads(config), linears=n.linears, lm_head=float(n.lm_head),
                   score_inputs=n.score_inputs)

    @classmethod
    def from_params(cls, params: float, vocab: int = 32000) -> "ModelShape":
        """A guess of the shape of a Llama-like model of `params` parameters."""
        layers = 16 if params < 1.5e9 else 32 if params < 1.5e10 else 48 if params < 4e10 else 80
        hidden = int(math.sqrt(max(params - 2 * vocab * 1024, params / 2) / (12 * layers)) // 128 * 128) or 128
        return cls(float(params), layers, hidden, vocab, max(hidden // 128 // 4, 1), 128)

    def value_model(self) -> "ModelShape":
        """This model as a critic or reward model (transformers' ...ForSequenceClassification): no LM head
        of its own, a score head of hidden x 1 instead, one output per token. (A shape from a parameter
        count keeps its count.)"""
        if self.value_head or self.lm_head is None:
            return dataclasses.replace(self, value_head=True)
        less = self.lm_head - self.score_inputs
        return dataclasses.replace(self, params=self.params - less, value_head=True, lm_head=0.0,
                                   active_params=None if self.active_params is None else self.active_params - less)

    def kv_bytes_per_token(self, dtype_bytes: int) -> float:
        return 2 * self.layers * self.kv_heads * self.head_dim * dtype_bytes

    def vllm_kv_bytes_per_token(self, dtype_bytes: int, tp: int) -> float:
        """KV-cache bytes of a token on each of vLLM's `tp` ranks: its share of the key/value heads, or, with
        more ranks than heads, one head each (vLLM copies each head onto tp / kv_heads ranks)."""
        return 2 * self.layers * max(1, self.kv_heads // tp) * self.head_dim * dtype_bytes

    def lora_params(self, rank: int, targets: tuple[str, ...] | None = None) -> float:
        """Adapter parameters of LoRA of `rank` on the linear layers `targets` names (peft's target_modules;
        None: "all-linear", every linear layer of the blocks): rank x (inputs + outputs) of each, a
        mixture's experts each (shapes.Linear). A shape without its layers (from a parameter count): a
        Llama-like block's query, key, value and output projections and the gated MLP's three."""
        from toolkit.placement.shapes import Linear

        linears = self.linears
        if not linears:
            h, kv, ffn = self.hidden, self.kv_heads * self.head_dim, self.ffn or 4 * self.hidden
            q = self.heads * self.head_dim if self.heads else h
            linears = tuple(Linear(path, i, o, self.layers) for path, i, o in (
                ("self_attn.q_proj", h, q), ("self_attn.k_proj", h, kv), ("self_attn.v_proj", h, kv),
                ("self_attn.o_proj", q, h), ("mlp.gate_proj", h, ffn), ("mlp.up_proj", h, ffn),
                ("mlp.down_proj", ffn, h)))
        return float(sum(m.adapters(rank) for m in linears
                         if targets is None or any(m.named_by(t) for t in targets)))


@dataclass(frozen=True)
class Switches:
    """The trainer's memory switches (`trainer.*`), as the planner counts them."""

    checkpointing: bool = False         # gradient_checkpointing
    offload_optimizer: bool = False     # Adam states and master weights in host memory
    offload_params: bool = False        # ZeRO-3: the parameters too
    lora_rank: int | None = None        # only adapters train
    lora_targets: tuple[str, ...] | None = None  # the layers they adapt (trainer.lora.target_modules; None: all)

    def config(self) -> list[str]:
        """The config settings that turn these switches on."""
        return (["trainer.gradient_checkpointing: true"] * self.checkpointing
                + ["trainer.offload_optimizer: true"] * self.offload_optimizer
                + ["trainer.offload_params: true"] * self.offload_params
                + ([f"trainer.lora.rank: {self.lora_rank}"] if self.lora_rank else []))


@dataclass(frozen=True)
class Workload:
    actor: ModelShape
    reference: ModelShape | None       # None: the run has none (trainer.lora: the actor without its adapters,
                                       # whose forward the trainer runs); other systems' LoRA runs may have one
    critic: ModelShape | None          # PPO only
    reward_models: tuple[ModelShape, ...]
    samples: int                       # per step
    prompts: int                       # per step (each generator worker needs one)
    prompt_tokens: float               # mean per sample
    response_tokens: float             # mean per sample
    longest_prompt_tokens: float | None = None  # memory: a batch of the longest prompts must fit (None: the mean)
    max_model_len: int | None = None   # vLLM's context (rollout.max_prompt_tokens + max_new_tokens), which its
                                       # KV cache must hold once to start (at least the longest sample)
    dtype_bytes: int = 4
    forward_batch_size: int = 16
    updates_per_step: int = 1
    epochs: int = 1
    switches: Switches = Switches()
    kv_cache_gb: float | None = None   # vLLM's KV-cache budget per device (GiB); None: what the weights leave
    generate_batch: int | None = 0     # transformers: samples generated at once (0: all; None: what fits)
    max_policy_lag: int = 0            # >= 1: generation of the next steps overlaps training (async)
    micro_batch_tokens: int | None = None  # trainer.micro_batch_tokens: micro-batches of this many tokens at most
    ptx_tokens: int = 0                # PTX (ptx.coef > 0): tokens of each text row (ptx.max_tokens) an actor
                                       # micro-batch of mb rows adds mb of
    old_logprobs_forward: bool = True  # False: the training forward's own (GRPO, one update a step, one epoch)
    backend: str = "auto"              # rollout.backend: vllm or hf fixes the engine plans generate with

    def __post_init__(self):
        # the critic and reward models end in a value head (no LM head): one output per token
        if self.critic is not None:
            object.__setattr__(self, "critic", self.critic.value_model())
        object.__setattr__(self, "reward_models", tuple(m.value_model() for m in self.reward_models))

    @property
    def tokens(self) -> float:
        return self.prompt_tokens + self.response_tokens

    @property
    def longest_tokens(self) -> float:
        """A sample of the longest prompt and a response of the mean length (`max_new_tokens` unless given):
        what a padded batch's rows take, and what the longest batch packs per row."""
        longest = self.prompt_tokens if self.longest_prompt_tokens is None else self.longest_prompt_tokens
        return longest + self.response_tokens


@dataclass
class Estimate:
    memory: dict[str, float] = field(default_factory=dict)    # bytes per device, per group
    phases: dict[str, float] = field(default_factory=dict)    # seconds per step
    short: list[str] = field(default_factory=list)            # why it does not fit
    kv_cache_gb: float = 0.0                                  # a vLLM engine's KV cache per device (GiB)
    generate_batch: int = 0                                   # transformers: samples generated at once
    overlapped_s: float | None = None                         # async: the busiest group's seconds a step

    @property
    def step_s(self) -> float:
        """The phases one after the other, or, when generation overlaps training (max_policy_lag >= 1),
        the busiest group's share of them."""
        return self.overlapped_s if self.overlapped_s is not None else sum(self.phases.values())

    @property
    def fits(self) -> bool:
        return not self.short


def trained_models(w: Workload, hosted: tuple[str, ...] = ("actor", "critic")) -> list[tuple[ModelShape, bool]]:
    """The models a trainer group hosting `hosted` (`Group.trains`) trains, each with whether LoRA
    (`trainer.lora`) applies to it: the actor's alone; the critic trains whole, as in DeepSpeed-Chat
    (`--actor_lora_dim`) and OpenRLHF."""
    return ([(w.actor, True)] * ("actor" in hosted)
            + ([(w.critic, False)] if w.critic is not None and "critic" in hosted else []))


def scoring_models(w: Workload) -> tuple[tuple[str, list[ModelShape]], ...]:
    """The scoring roles with the models each holds: the reference (none with LoRA, where the trainer runs
    the actor without its adapters instead) and the reward role's reward models (maybe none: functions)."""
    return (("reference", [w.reference]),) * (w.reference is not None) + (("reward", list(w.reward_models)),)


def switches_of(sw: Switches, lora: bool) -> Switches:
    """The switches as a model with (`lora`) or without LoRA has them."""
    return sw if lora or sw.lora_rank is None else dataclasses.replace(sw, lora_rank=None, lora_targets=None)


def trained_params(m: ModelShape, sw: Switches) -> float:
    """Parameters that get gradients and optimizer states: all of them, or with LoRA the adapters'."""
    return m.lora_params(sw.lora_rank, sw.lora_targets) if sw.lora_rank else m.params


def trainer_memory(m: ModelShape, w: Workload, world: int, zero: int, micro_batch: int,
                   switches: Switches | None = None) -> float:
    sw = switches if switches is not None else w.switches
    b = w.dtype_bytes
    trained = trained_params(m, sw)
    weights = 0.0 if sw.offload_params and zero == 3 else m.params * b / (world if zero == 3 else 1)
    grads = trained * b / (world if zero >= 2 else 1)
    adam = 0.0 if sw.offload_optimizer and zero >= 1 else optimizer_bytes(m, w, world, zero, sw)
    tokens = micro_batch_tokens(w, micro_batch)
    if not m.value_head:  # the actor: PTX text rows beside each micro-batch, held until their one backward
        tokens += micro_batch * w.ptx_tokens
    layer = tokens * m.hidden * 17 * b  # what one layer keeps for its backward pass
    # checkpointing keeps each layer's input, and one layer's activations while it is recomputed
    activations = tokens * m.hidden * b * m.layers + layer if sw.checkpointing else layer * m.layers
    logits = tokens * m.outputs * 4 * 3
    return weights + grads + adam + activations + logits


def micro_batch_tokens(w: Workload, micro_batch: int) -> float:
    """Tokens of the largest training micro-batch: `micro_batch` rows of the longest sample (padded, each
    row is as long as the micro-batch's longest; packed, a micro-batch of the longest prompts holds as
    many), or, by token budget (trainer.micro_batch_tokens), the budget (rows x their longest sample fill
    it; 0 rows: none)."""
    if w.micro_batch_tokens is not None:
        return float(w.micro_batch_tokens) if micro_batch else 0.0
    return micro_batch * w.longest_tokens


def micro_batches_of(w: Workload, samples: float, micro_batch: int) -> int:
    """Micro-batches a trainer rank runs a step over its `samples`: of `micro_batch` rows, or, by token
    budget, of as many samples as the budget holds, in each update (the samples' mean length: no padding)."""
    if w.micro_batch_tokens is None:
        return math.ceil(samples / micro_batch) * w.epochs
    per_update = samples / w.updates_per_step
    return math.ceil(per_update * w.tokens / w.micro_batch_tokens) * w.updates_per_step * w.epochs


# Tried in this order on a trainer that does not fit, each with those before it: what to suggest.
REMEDIES = (Switches(checkpointing=True), Switches(checkpointing=True, offload_optimizer=True),
            Switches(checkpointing=True, offload_optimizer=True, lora_rank=16))


def remedy(models: list[tuple[ModelShape, bool]], w: Workload, world: int, zero: int, micro_batch: int,
           others: float, usable: float) -> str:
    """The fewest trainer switches (beyond those already on) under which `models` (`trained_models`) fit
    next to `others`."""
    on = w.switches
    for r in REMEDIES:
        sw = Switches(r.checkpointing or on.checkpointing, (r.offload_optimizer and zero >= 1) or on.offload_optimizer,
                      on.offload_params, on.lora_rank or r.lora_rank, on.lora_targets)
        if sw == on:
            continue
        need = others + sum(trainer_memory(m, w, world, zero, micro_batch, switches_of(sw, lora)) for m, lora in models)
        if need <= usable:
            new = [c for c in sw.config() if c not in on.config()]
            return f"; fits with {', '.join(new)} ({need / GB:.1f} GB)"
    return "; no trainer memory switch is enough: more devices per group, a smaller micro-batch or a smaller model"


def host_s(m: ModelShape, w: Workload, cluster, world: int, zero: int, updates: int, micro_batches: int,
           sw: Switches) -> float:
    """Seconds a trainer rank spends with host memory a step (GPUs only: on a CPU the host is the device).
    offload_optimizer: each update sends the rank's share of the gradients to the host, steps them
    there (DeepSpeed's CPU Adam) and brings the parameters back; offload_params (ZeRO-3): each forward
    and each backward pass of a micro-batch fetches the rank's share of the weights."""
    if not cluster.gpus_per_node:
        return 0.0
    b, host = w.dtype_bytes, cluster.links.host
    trained = trained_params(m, sw)
    seconds = 0.0
    if sw.offload_optimizer and zero >= 1:
        seconds += updates * (trained / world / cluster.device.host_optimizer + 2 * trained * b / world / host)
    if sw.offload_params and zero == 3:
        seconds += micro_batches * 2 * m.params * b / world / host
    return seconds


def optimizer_bytes(m: ModelShape, w: Workload, world: int, zero: int, sw: Switches) -> float:
    """Adam's two fp32 states of each trained parameter, and its fp32 master weight where training is in
    16 bits, on one rank (partitioned under ZeRO-1 and up)."""
    return trained_params(m, sw) * (8 + (4 if w.dtype_bytes < 4 else 0)) / (world if zero >= 1 else 1)


def parked_bytes(w: Workload, models: list[tuple[ModelShape, bool]], world: int, zero: int) -> float:
    """What `placement.offload` moves to host memory from the end of an update to the start of the next on
    a rank that trains `models` (`trained_models`) and also generates (`training.engine.park`), under
    ZeRO-1/2 without ZeRO-Offload (which keeps it in host memory already); 0 otherwise. The optimizer's
    states and master weights: on the H200 a bf16 model's parking freed 12 bytes a weight, no gradients
    (they are not kept between updates; the memory at rest still counts them, on the safe side)."""
    if zero not in (1, 2) or w.switches.offload_optimizer:
        return 0.0
    return sum(optimizer_bytes(m, w, world, zero, switches_of(w.switches, lora)) for m, lora in models)


def offloads(g: Group, s: Layout, cluster) -> bool:
    """Whether `placement.offload` moves models of group `g` to host memory between its phases: on GPUs,
    in a group hosting several roles (on a CPU the host is the device: the calls move nothing)."""
    return s.offload and bool(cluster.gpus_per_node) and several_roles(g.models)


def forward_memory(m: ModelShape, w: Workload, shards: int = 1) -> float:
    """A scoring model's weights (over `shards` ZeRO-3 ranks) and the logits of its largest forward batch
    (of the longest samples)."""
    return m.params * w.dtype_bytes / shards + w.forward_batch_size * w.longest_tokens * m.outputs * 4 * 2


def kv_budget(w: Workload, device_gb: float, tp: int) -> float:
    """Bytes of KV cache a vLLM engine has per device: `rollout.vllm.kv_cache_gb`, or, when the planner
    sets it (None), 90% of the device less the engine's share of the weights."""
    if w.kv_cache_gb is not None:
        return w.kv_cache_gb * GIB
    return max(0.0, 0.9 * device_gb * GB - w.actor.params * w.dtype_bytes / tp)


def concurrency(w: Workload, budget: float, tp: int) -> int:
    """Sequences a vLLM engine generates at once: as many whole sequences as each rank's KV budget holds."""
    return int(budget // (w.tokens * w.actor.vllm_kv_bytes_per_token(w.dtype_bytes, tp)))


def hf_sample_bytes(w: Workload, tp: int) -> float:
    """What transformers' generate() holds per sample of a batch: its KV cache (every row as long as the
    batch's longest prompt: its prompts are padded to it), one step's scores (fp32 logits and their
    softmax: the sampler draws from them and keeps the drawn token's log-prob alone) and those log-probs."""
    return (w.longest_tokens * w.actor.kv_bytes_per_token(w.dtype_bytes) / tp + w.actor.vocab * 4 * 2
            + w.response_tokens * 4)


def generation_memory(w: Workload, batch: int, tp: int, own_weights: bool, budget: float | None = None) -> float:
    """A vLLM engine (`budget` given): its weights over TP plus its KV budget. Transformers' generate()
    with `batch` samples at once, plus a copy of the weights when it has one of its own (ZeRO-3
    gathers them)."""
    if budget is not None:
        return w.actor.params * w.dtype_bytes / tp + budget
    weights = w.actor.params * w.dtype_bytes / tp if own_weights else 0.0
    return weights + batch * hf_sample_bytes(w, tp)


def engines(g: Group, tp: int) -> int:
    """The generation engines of group `g` at TP size `tp`: its workers when it has engines of its own
    (each `tp` GPUs wide); where it generates with the actor's weights, its ranks in groups of `tp`. Our
    runtime gathers the actor's whole weights on each rank (the planner plans TP 1 there); DeepSpeed-Chat's
    Hybrid Engine splits them over `--inference_tp_size` ranks (tests/fixtures/published_runs.yaml)."""
    return g.workers if g.own_engine else max(1, g.workers // tp)


@dataclass(frozen=True)
class GroupMemory:
    """What one group needs per device (`need`), and what goes with it: for a group that trains, its
    models and what the rest of the group needs beside them (`trained`, for `remedy`); for one that
    generates, vLLM's KV cache per device or the transformers batch; `short`: why it cannot generate;
    `moves`: whether placement.offload moves anything of it to host memory (with offload on)."""

    need: float
    trained: tuple | None = None
    kv_cache_gb: float | None = None
    generate_batch: int | None = None
    short: str | None = None
    moves: bool = False


def group_memory(g: Group, s: Layout, w: Workload, cluster) -> GroupMemory:
    """Memory per device of group `g` of setting `s` (its models share its devices). It depends on the
    group and the setting's ZeRO stage, micro-batch, TP size, engine and offload alone, so the planner
    computes it once for each."""
    name, models, workers = g.name, g.models, g.workers
    need = idle = parked = 0.0  # idle: what the trainer keeps between updates (no activations)
    shapes = trainer_need = None
    kv_cache_gb = generate_batch = short = None
    # placement.offload: each phase has the device to itself, but for the trainer's weights (and its
    # gradients, as counted at rest) and sharded scoring models, so the peak is the largest phase's
    # (without it, everything is there at once)
    moves = offloads(g, s, cluster)
    if g.trains:
        shapes = trained_models(w, g.trains)
        need += sum(trainer_memory(m, w, workers, s.zero_stage, s.micro_batch, switches_of(w.switches, lora))
                    for m, lora in shapes)
        idle = sum(trainer_memory(m, w, workers, s.zero_stage, 0, switches_of(w.switches, lora))
                   for m, lora in shapes) - need
        trainer_need = need
        if moves and "generation" in models:
            parked = parked_bytes(w, shapes, workers, s.zero_stage)
    # (with the trainer under ZeRO-3, sharded over its ranks: the scoring roles' `sharded`; offloading
    # leaves those on the device, and moves the others there for their own phase only)
    scoring = []  # (what each scoring role moved to host memory needs in its phase, the trainer's state then)
    for role, shapes_of in scoring_models(w):
        if role in models:
            deferred = scored_in_training_step(models, role, workers)  # (in the training step, state back)
            sharded = deferred and s.zero_stage == 3
            role_need = sum(forward_memory(m, w, workers if sharded else 1) for m in shapes_of)
            if moves and not sharded:
                scoring.append((role_need, idle - (0.0 if deferred else parked)))
            else:
                need += role_need
    peak = max([need] + [need + state + role_need for role_need, state in scoring])
    if "generation" in models:  # (last: a vLLM engine's KV cache gets what the rest of the group leaves)
        own = g.own_engine or s.zero_stage == 3
        tp = s.tensor_parallel
        # vLLM in the trainer's process sleeps (gives back weights and KV cache) while the trainer
        # works, on a GPU: it shares the device with the trainer's state between updates only (less what
        # placement.offload parks in host memory meanwhile).
        asleep = s.generation_engine == "vllm" and not g.own_engine and not cluster.shared
        phased = moves or asleep
        beside = need + idle - parked if phased else need
        if s.generation_engine == "vllm":
            budget = kv_budget(w, cluster.device.memory_gb - beside / GB, tp)
            kv_cache_gb = budget / GIB
            context = max(w.max_model_len or 0, w.longest_tokens)  # (--prompt-tokens may say longer)
            if budget < context * w.actor.vllm_kv_bytes_per_token(w.dtype_bytes, tp):  # (vLLM refuses to start)
                short = (f"{name}: vLLM's KV cache of {budget / GIB:.1f} GiB per device holds no whole "
                         f"sequence of {context:.0f} tokens; raise rollout.vllm.kv_cache_gb or the TP size")
            batch = 0
        else:  # transformers: rollout.generate_batch_size, or (planned) as many as the device has room for
            budget, per = None, math.ceil(w.samples / engines(g, tp))
            room = 0.9 * cluster.device.memory_gb * GB - beside - (w.actor.params * w.dtype_bytes / tp if own else 0)
            fits = max(1, int(room // hf_sample_bytes(w, tp)))
            batch = min(per, fits if w.generate_batch is None else w.generate_batch or per)
            generate_batch = batch
        generating = beside + generation_memory(w, batch, tp, own, budget)
        peak = max(peak, generating) if phased else generating
    return GroupMemory(peak, None if shapes is None else (shapes, peak - trainer_need), kv_cache_gb, generate_batch,
                       short, bool(scoring) or parked > 0)


def estimate(s: Layout, w: Workload, cluster, memory=group_memory) -> Estimate:
    """Memory per device of each group, and seconds of each phase of one step, for setting `s`
    (`memory`: `group_memory`, or what remembers it)."""
    e = Estimate()
    dev, links, o = cluster.device, cluster.links, cluster.overheads
    b = w.dtype_bytes

    # Memory per device, group by group (a group's models share its devices).
    trained = {}  # group name: (the models it trains, what the rest of the group needs)
    for g in s.groups:
        m = memory(g, s, w, cluster)
        e.memory[g.name] = m.need
        if m.trained is not None:
            trained[g.name] = m.trained
        if m.kv_cache_gb is not None:
            e.kv_cache_gb = m.kv_cache_gb
        if m.generate_batch is not None:
            e.generate_batch = m.generate_batch
        if m.short:
            e.short.append(m.short)

    def fix(name: str, usable_here: float, others_extra: float = 0.0) -> str:
        if name not in trained:
            return ""
        shapes, others = trained[name]
        workers = next(g.workers for g in s.groups if g.name == name)
        return remedy(shapes, w, workers, s.zero_stage, s.micro_batch, others + others_extra, usable_here)

    usable = dev.memory_gb * GB
    if cluster.shared:  # every group on the same machine: their memory adds up
        total = sum(e.memory.values())
        if total > usable * cluster.nodes:
            hint = next((fix(n, usable, total - e.memory[n]) for n in trained), "")
            e.short.append(f"all groups need {total / GB:.1f} GB on a machine of {dev.memory_gb:g} GB "
                           f"({(total - usable) / GB:.1f} GB short){hint}")
    else:
        for g in s.groups:
            if e.memory[g.name] > usable:
                e.short.append(f"{g.name} ({', '.join(g.models)}) needs {e.memory[g.name] / GB:.1f} GB per device, "
                               f"has {dev.memory_gb:g} GB ({(e.memory[g.name] - usable) / GB:.1f} GB short)"
                               + fix(g.name, usable))

    def share(workers: int) -> float:
        """The fraction of a device one worker of a phase gets (on a shared machine, workers split it)."""
        return 1.0 / workers if cluster.shared else 1.0

    def link(nodes: int) -> float:
        return links.intra_node if nodes == 1 or cluster.shared else links.inter_node

    # Generation.
    generator = s.group("generation")
    g_nodes, g_workers = generator.nodes, generator.workers
    own_engine = generator.own_engine
    tp = s.tensor_parallel
    per = math.ceil(w.samples / engines(generator, tp))
    f, bw = dev.flops * share(g_workers), dev.memory_bandwidth * share(g_workers)
    P = w.actor.active  # (FLOPs; the weights read per decode step are all of them: w.actor.params)
    if s.generation_engine == "vllm":  # (its own worker's, or in the trainer's process: rollout.backend vllm)
        c_decode, c_sequence = o.decode_step_vllm, o.decode_per_sequence_vllm
        batch = max(1, min(per, concurrency(w, e.kv_cache_gb * GIB, tp)))  # in waves of what its KV cache holds
    else:
        c_decode, c_sequence = o.decode_step_hf, o.decode_per_sequence_hf
        batch = max(1, e.generate_batch)  # (transformers: rollout.generate_batch_size at once)
    # (the KV cache each rank reads a decode step: vLLM's share of the heads, at least one head)
    per_rank = (w.actor.vllm_kv_bytes_per_token(b, tp) if s.generation_engine == "vllm"
                else w.actor.kv_bytes_per_token(b) / tp)
    kv = batch * (w.prompt_tokens + w.response_tokens / 2) * per_rank
    decode_step = max(2 * P * batch / (tp * f), (w.actor.params * b / tp + kv) / bw)
    e.phases["generate"] = math.ceil(per / batch) * (2 * P * batch * w.prompt_tokens / (tp * f)
                                                     + w.response_tokens * (decode_step + c_decode + c_sequence * batch))

    # Scoring: each scoring model on the workers that run it (see placement.plan.stages).
    def forward_s(m: ModelShape, n: int, workers: int) -> float:
        calls = math.ceil(n / w.forward_batch_size)
        return 2 * m.active * n * w.tokens / (dev.flops * share(workers)) + calls * o.forward_call

    busy = {g.name: 0.0 for g in s.groups}  # seconds each group works a step (for the overlap of async mode)
    each = math.ceil(w.samples / g_workers)  # what each generating worker sends on
    for model, shapes in scoring_models(w):
        group, sharded = s.group(model), False
        if s.together(model, "generation"):
            n, workers, calls = each, g_workers, 1         # right after generation, on each worker
        elif scored_in_training_step(group.models, model, group.workers):
            workers = s.group("actor").workers             # every trainer rank its shard (the roles' `deferred`)
            n, calls = math.ceil(w.samples / workers), 1
            sharded = s.zero_stage == 3
        elif s.together(model, "actor"):
            n, workers, calls = w.samples, 1, g_workers    # on trainer rank 0
        else:
            workers = s.workers(model)
            calls = math.ceil(g_workers / workers)         # messages shared round-robin
            n = calls * each
        busy[group.name] += sum(forward_s(m, n, workers) for m in shapes)
        if offloads(group, s, cluster) and not sharded and shapes:  # to the device and back for each call
            busy[group.name] += calls * 2 * sum(m.params for m in shapes) * b / links.host
    e.phases["score"] = sum(busy.values())

    # Training: each trainer group its models over its ranks. A critic on ranks of its own trains while
    # the actor does (on a machine they share, they share its cores), its values and the returns crossing
    # between paired ranks.
    t_nodes, t_workers = s.group("actor").nodes, s.group("actor").workers
    n = w.samples / t_workers
    f = dev.flops * share(t_workers)
    bw = dev.memory_bandwidth * share(t_workers)
    updates = w.updates_per_step * w.epochs
    micro_batches = micro_batches_of(w, n, s.micro_batch)
    trains = {}
    for g in s.trainers:
        train = sum(forward_s(m, math.ceil(n), t_workers) for m, _ in trained_models(w, g.trains)
                    if m.value_head or w.old_logprobs_forward)  # (the critic's values; the actor's old log-probs)
        if w.reference is None and "actor" in g.trains:  # LoRA: the reference's log-probs, adapters disabled
            train += forward_s(w.actor, math.ceil(n), t_workers)
        for m, lora in trained_models(w, g.trains):
            sw = switches_of(w.switches, lora)
            passes = 2 + 2 + (0 if sw.lora_rank else 2) + (2 if sw.checkpointing else 0)  # FLOPs per parameter and token
            train += passes * m.active * n * w.tokens * w.epochs / f + micro_batches * o.train_micro_batch
            if not m.value_head:  # PTX: each micro-batch's text rows, forward and backward with it
                train += passes * m.active * micro_batches * s.micro_batch * w.ptx_tokens / f
            state = trainer_memory(m, w, t_workers, s.zero_stage, 0, sw)
            train += updates * (o.optimizer_step + state / bw)
            train += host_s(m, w, cluster, t_workers, s.zero_stage, updates, micro_batches, sw)
            if t_workers > 1:
                ring = (t_workers - 1) / t_workers
                # each update reduces the gradients and gathers the updated weights: the trained ones (LoRA's
                # adapters alone); ZeRO-3 also gathers every weight, frozen ones too, for each pass
                volume = 2 * trained_params(m, sw) * b * ring * updates
                if s.zero_stage == 3:
                    volume += 2 * m.params * b * ring * micro_batches
                train += volume / link(t_nodes) + links.latency_s * micro_batches
        if offloads(g, s, cluster) and "generation" in g.models:  # parked while it generates, and back
            train += 2 * parked_bytes(w, trained_models(w, g.trains), t_workers, s.zero_stage) / links.host
        trains[g.name] = train
    e.phases["train"] = sum(trains.values()) if cluster.shared else max(trains.values())
    if s.critic_apart:  # each critic rank sends its shard's values (fp32 per token) and gets the returns back
        pair = links.intra_node if s.same_nodes("actor", "critic") else link(2)
        e.phases["train"] += 2 * (math.ceil(n) * w.tokens * 4 / pair + links.latency_s)

    # Weight sync.
    sent = w.actor.params * b
    gather = sent * (t_workers - 1) / t_workers / link(t_nodes) if s.zero_stage == 3 and t_workers > 1 else 0.0
    if not own_engine:
        e.phases["sync"] = gather + (sent / bw if s.zero_stage == 3 else 0.0)
    else:
        # (a generator on the trainer's one node gets the weights over the node's own links)
        apart = 1 if s.same_nodes("generation", "actor") else 2
        e.phases["sync"] = gather + sent / link(max(g_nodes, apart)) + links.latency_s + sent / dev.memory_bandwidth

    # Transport: one message per generator worker over each hop between groups, and the driver's work.
    hops = _hops(s)
    sample_bytes = w.samples * w.tokens * 12
    e.phases["transport"] = hops * (g_workers * o.message + sample_bytes / links.intra_node) + o.step

    # Asynchronous mode (its own generators, max_policy_lag >= 1): the next steps' generation and scoring
    # run while the trainer trains, so a step takes what its busiest group does (the weight sync holds
    # both the generator and the trainer). On one shared machine the groups take turns on its devices,
    # except for the share that generation leaves idle (device.generation_idle): scoring and training
    # fill that first, and what does not fit in it comes on top of generation.
    if w.max_policy_lag >= 1 and own_engine:
        p = e.phases
        if cluster.shared:
            rest = p["score"] + p["train"]
            e.overlapped_s = (p["generate"] + max(0.0, rest - dev.generation_idle * p["generate"])
                              + p["sync"] + p["transport"])
        else:
            busy[generator.name] += p["generate"] + p["sync"]
            for g in s.trainers:  # (the critic's ranks apart take no part in the sync)
                busy[g.name] += p["train"] + (p["sync"] if "actor" in g.models else 0.0)
            e.overlapped_s = max(busy.values()) + p["transport"]
    return e


def _hops(s: Layout) -> int:
    """Times the step's samples change group between generation and the trainer (placement.plan.stages)."""
    groups = [WorkerGroup(g.name, tuple(dict.fromkeys(ROLE_OF[m] for m in g.models)), g.workers, models=g.models)
              for g in s.groups]
    hosts = [group_of(groups, role).name for role in stages(groups)]
    return sum(a != b for a, b in zip(hosts, hosts[1:]))
