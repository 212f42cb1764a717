"""KL coefficient control: fixed, or adaptive towards a target KL (Ziegler et al. 2019)."""

from __future__ import annotations

import math


class FixedKLController:
    """The coefficient never changes."""

    def __init__(self, coef: float):
        self.coef = coef

    def update(self, current_kl: float, n_samples: int) -> None:
        pass

    def state_dict(self) -> dict:
        return {"coef": self.coef}

    def load_state_dict(self, state: dict) -> None:
        """Nothing to restore: a fixed coefficient is the config's as it is at the resume (an edit of
        algorithm.kl.coef in RUN_DIR/config.yaml was silently undone by the checkpoint's)."""


class AdaptiveKLController(FixedKLController):
    """coef *= 1 + clip(kl / target - 1, -0.2, 0.2) * min(n_samples / horizon, 1), after each step: at most
    ±20% a step. (Ziegler's and TRL's factor, without the min, goes below 0 with a step of more than 5 x
    horizon samples, and the coefficient then rewards moving away from the reference.) A KL that is not a
    number (a step that diverged) leaves the coefficient as it was, where it made it NaN for good."""

    def __init__(self, coef: float, target: float, horizon: int):
        super().__init__(coef)
        self.target, self.horizon = target, horizon

    def load_state_dict(self, state: dict) -> None:
        """The coefficient where the controller had moved it (the config's is the initial one)."""
        self.coef = state["coef"]

    def update(self, current_kl: float, n_samples: int) -> None:
        if not math.isfinite(current_kl):
            return
        error = min(max(current_kl / self.target - 1.0, -0.2), 0.2)
        self.coef *= 1.0 + error * min(n_samples / self.horizon, 1.0)


def make_kl_controller(coef: float, adaptive: bool, target: float, horizon: int) -> FixedKLController:
    return AdaptiveKLController(coef, target, horizon) if adaptive else FixedKLController(coef)
