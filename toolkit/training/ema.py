"""An exponential moving average of the actor's weights (DeepSpeed-Chat's `--enable_ema`).

After every RL step: ema = decay * ema + (1 - decay) * weights, in float32 on rank 0's host memory (one
more copy of the model there). It reads the full weights bucket by bucket as weight sync gathers them
(under ZeRO-3 every rank takes part in the gather; rank 0 keeps the average). It is saved with every
checkpoint (`ema.safetensors`, restored exactly on resume) and exported separately (`hf-ema/`).
"""

from __future__ import annotations

from pathlib import Path

import torch


class EMA:
    def __init__(self, decay: float):
        self.decay = decay
        self.weights: dict[str, torch.Tensor] = {}

    def update(self, names: list[str], tensors: list[torch.Tensor]) -> None:
        """Fold in the current full weights of `names` (the first call copies them)."""
        with torch.no_grad():
            for name, t in zip(names, tensors):
                current = t.detach().to("cpu", torch.float32)
                if name not in self.weights:
                    self.weights[name] = current.clone()
                else:
                    self.weights[name].mul_(self.decay).add_(current, alpha=1 - self.decay)

    def state_dict(self, dtype: torch.dtype) -> dict[str, torch.Tensor]:
        """The averaged weights in the model's dtype (for `save_pretrained`)."""
        return {name: t.to(dtype) for name, t in self.weights.items()}

    def save(self, path: Path) -> None:
        from safetensors.torch import save_file

        save_file(self.weights, str(path))

    def load(self, path: Path) -> None:
        from safetensors.torch import load_file

        self.weights = load_file(str(path))
