"""The one place a DeepSpeed engine is built, for every stage (SFT, reward model, RL actor and critic), and
for a reference model sharded over the trainer's ranks (`inference_engine`).

What it reads from the config (`EngineSection` in config/base.py): the ZeRO stage, learning rate,
schedule, weight decay, gradient clipping, micro-batch size, the model's dtype (bf16/fp16 mixed
precision), and the memory switches: activation checkpointing, LoRA adapters (training/lora.py),
ZeRO-Offload of the optimizer (and under ZeRO-3 of the parameters) to host memory.

The optimizer is torch's AdamW (no C++ op to build, it works on every accelerator), except with
`offload_optimizer`: then DeepSpeed's CPU Adam, the vectorised C++ Adam that ZeRO-Offload was built
around (compiled on first use, or by tools/setup.sh; loaded through training/ops.py). Both are AdamW
with the same hyper-parameters.
"""

from __future__ import annotations

import gc
import logging
import math
import os

import torch


def lr_lambda(warmup_steps: int, schedule: str, total_steps: int | None, min_ratio: float):
    """Factor of the learning rate after `step` optimizer steps: linear warm-up, then constant or cosine
    down to `min_ratio` at `total_steps`."""
    def factor(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        if schedule == "constant" or not total_steps or total_steps <= warmup_steps:
            return 1.0
        progress = min(1.0, (step - warmup_steps) / (total_steps - warmup_steps))
        return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))
    return factor


DEEPSPEED_REDUCE_BUCKET = 500_000_000  # elements: DeepSpeed's default reduce_bucket_size
SHARD_ALL_ENV = "SLURM_RLHF_TEST_SHARD_ALL"
"""A test hook: with it set, a sharded scoring model (`inference_engine`) shards every parameter."""


def reduce_bucket_size(trainable: list[torch.nn.Parameter]) -> int:
    """ZeRO's gradient bucket, in elements: DeepSpeed's default, or the trainable parameters' count where
    that is smaller. ZeRO-1/2 allocate a bucket of this size for every micro-batch's backward pass (two
    with overlap_comm) and fill only as much of it as there are gradients; the default's 2 GB in fp32
    (500M elements) for a model of 26M parameters left the allocator's heap that large, and as its
    pages were handed out again to activations, they were touched one by one: the Separation trainer
    of tools/bench_trl.py grew by about 1 GB a step to 4.0 GB resident, against 2.1 GB with a bucket
    of the model's size (see the README's memory note). A bucket that holds every gradient reduces
    them in one collective, as the default does for any model under 500M parameters."""
    return max(1, min(DEEPSPEED_REDUCE_BUCKET, sum(p.numel() for p in trainable)))


def build_engine(model: torch.nn.Module, settings, lr: float, dtype: str, world: int, accumulation: int,
                 total_steps: int | None = None, lora=None):
    """A DeepSpeed engine training `model` on one of `world` data-parallel ranks. `settings` is an
    EngineSection; an optimizer step takes `accumulation` micro-batches of `settings.micro_batch_size`.
    With `lora` (a LoraSection) only adapters added to `model` train; `engine.module` is then the peft model.
    The ranks are those of torch.distributed's default group (`Ranks.join`)."""
    import deepspeed

    from toolkit.training.ops import load_ops

    load_ops(cpu_adam=settings.offload_optimizer)  # (before DeepSpeed loads them, see training/ops.py)
    for name in ("DeepSpeed", "deepspeed"):
        logging.getLogger(name).setLevel(logging.WARNING)
    if settings.gradient_checkpointing:  # (before the adapters: it is the base model's layers that recompute)
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if lora is not None:
        from toolkit.training.lora import add_adapters

        model = add_adapters(model, lora)
    trainable = [p for p in model.parameters() if p.requires_grad]
    zero = {"stage": settings.zero_stage, "reduce_bucket_size": reduce_bucket_size(trainable)}
    if settings.offload_optimizer:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": torch.cuda.is_available()}
    if settings.offload_params:
        zero["offload_param"] = {"device": "cpu", "pin_memory": torch.cuda.is_available()}
    config = {
        "train_micro_batch_size_per_gpu": settings.micro_batch_size,
        "gradient_accumulation_steps": accumulation,
        "train_batch_size": settings.micro_batch_size * accumulation * world,
        "gradient_clipping": settings.grad_clip,
        "zero_optimization": zero,
        "zero_allow_untested_optimizer": True,
        "bf16": {"enabled": dtype == "bfloat16"},
        "fp16": {"enabled": dtype == "float16"},
        "steps_per_print": 2**31 - 1,
        "wall_clock_breakdown": False,
    }
    if settings.offload_optimizer:
        from deepspeed.ops.adam import DeepSpeedCPUAdam

        optimizer = DeepSpeedCPUAdam(trainable, lr=lr, weight_decay=settings.weight_decay, adamw_mode=True)
    else:
        optimizer = torch.optim.AdamW(trainable, lr=lr, weight_decay=settings.weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lr_lambda(settings.warmup_steps, settings.lr_schedule, total_steps, settings.min_lr_ratio))
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, lr_scheduler=scheduler, config=config)
    from toolkit.training.lora import parameter_counts

    trained, total = parameter_counts(engine.module)
    switches = [f"LoRA rank {lora.rank}"] if lora is not None else []
    switches += [name for name, on in (("activation checkpointing", settings.gradient_checkpointing),
                                       ("optimizer offload (CPU Adam)", settings.offload_optimizer),
                                       ("parameter offload", settings.offload_params)) if on]
    logging.getLogger(__name__).info("%s: ZeRO-%d, %s of %s parameters trained%s", type(engine.module).__name__,
                                     settings.zero_stage, f"{trained:,}", f"{total:,}",
                                     "".join(f", {s}" for s in switches))
    return engine


def inference_engine(model: torch.nn.Module, dtype: str, world: int, offload_params: bool = False):
    """A DeepSpeed ZeRO-3 engine that only runs forward passes: a reference model sharded over the trainer's
    `world` ranks, as DeepSpeed-Chat and OpenRLHF hold theirs under ZeRO-3. Each rank keeps 1/world of
    the weights (in host memory with `offload_params`) and gathers a layer's at a time in each forward
    pass, a collective: every rank must make the same number of passes."""
    import deepspeed

    from toolkit.training.ops import load_ops

    load_ops()
    zero = {"stage": 3}
    if os.environ.get(SHARD_ALL_ENV):  # (DeepSpeed keeps a parameter under 1e5 elements whole on each rank:
        zero["stage3_param_persistence_threshold"] = 0  # every one of a tiny model's, which a test shards)
    if offload_params:
        zero["offload_param"] = {"device": "cpu", "pin_memory": torch.cuda.is_available()}
    config = {"train_micro_batch_size_per_gpu": 1, "train_batch_size": world, "zero_optimization": zero,
              "bf16": {"enabled": dtype == "bfloat16"}, "fp16": {"enabled": dtype == "float16"},
              "steps_per_print": 2**31 - 1, "wall_clock_breakdown": False}
    engine, *_ = deepspeed.initialize(model=model, config=config)
    engine.eval()
    return engine


def park(engine) -> bool:
    """Move what only training needs, the optimizer's states, its fp32 master weights and the gradient
    buffers, to host memory (DeepSpeed's `offload_states`), keeping the weights the model computes with:
    the trainer's state leaves the device while a generator on the same device runs (`placement.offload`).
    False where it does not: ZeRO-Offload keeps these in host memory already, and under ZeRO-3
    DeepSpeed moves them only for its FusedAdam (there use `trainer.offload_optimizer` and `offload_params`).
    On a CPU machine the same calls run and move nothing."""
    from deepspeed.runtime.zero.offload_config import OffloadStateTypeEnum as State

    if engine.zero_optimization_stage() not in (1, 2) or engine.zero_use_cpu_optimizer():
        return False
    # offload_states ends with a full gc.collect(), to free device memory held in reference cycles: on a CPU,
    # where nothing moves, that was all of its time (0.5-1.8 s a step, more than the update). There the
    # objects that exist are left out of it (unless something else froze objects already, as vLLM may).
    skip_collect = engine.device.type == "cpu" and gc.get_freeze_count() == 0
    if skip_collect:
        gc.freeze()
    try:
        engine.offload_states(include=[State.optim_states, State.hp_params, State.lp_grads],
                              pin_memory=torch.cuda.is_available())
    finally:
        if skip_collect:
            gc.unfreeze()
    return True


def unpark(engine) -> None:
    """Bring back what `park` moved, before the next update."""
    engine.reload_states()


def held_parameters(model: torch.nn.Module) -> int:
    """How many of `model`'s parameters this rank holds (under ZeRO-3 its partition of each)."""
    return sum(p.ds_tensor.numel() if hasattr(p, "ds_tensor") else p.numel() for p in model.parameters())
