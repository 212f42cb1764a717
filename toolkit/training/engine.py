"""The one place a DeepSpeed engine is built, for every stage (SFT, reward model, RL actor and critic).

What it reads from the config (`EngineSection` in config/schema.py): the ZeRO stage, learning rate,
schedule, weight decay, gradient clipping, micro-batch size, and the model's dtype (bf16/fp16 mixed
precision). The optimizer is torch's AdamW: no C++ op to build, it works on every accelerator.
"""

from __future__ import annotations

import logging
import math

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


def build_engine(model: torch.nn.Module, settings, lr: float, dtype: str, world: int, accumulation: int,
                 total_steps: int | None = None):
    """A DeepSpeed engine training `model` on one of `world` data-parallel ranks. `settings` is an
    EngineSection; an optimizer step takes `accumulation` micro-batches of `settings.micro_batch_size`."""
    import deepspeed

    for name in ("DeepSpeed", "deepspeed"):
        logging.getLogger(name).setLevel(logging.WARNING)
    config = {
        "train_micro_batch_size_per_gpu": settings.micro_batch_size,
        "gradient_accumulation_steps": accumulation,
        "train_batch_size": settings.micro_batch_size * accumulation * world,
        "gradient_clipping": settings.grad_clip,
        "zero_optimization": {"stage": settings.zero_stage},
        "zero_allow_untested_optimizer": True,
        "bf16": {"enabled": dtype == "bfloat16"},
        "fp16": {"enabled": dtype == "float16"},
        "steps_per_print": 2**31 - 1,
        "wall_clock_breakdown": False,
    }
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=settings.weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lr_lambda(settings.warmup_steps, settings.lr_schedule, total_steps, settings.min_lr_ratio))
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, lr_scheduler=scheduler, config=config)
    return engine

