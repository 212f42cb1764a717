"""KL coefficient control: fixed, or adaptive towards a target KL (Ziegler et al. 2019)."""

from __future__ import annotations


class FixedKLController:
    """The coefficient never changes."""

    def __init__(self, coef: float):
        self.coef = coef

    def update(self, current_kl: float, n_samples: int) -> None:
        pass

    def state_dict(self) -> dict:
        return {"coef": self.coef}

    def load_state_dict(self, state: dict) -> None:
        self.coef = state["coef"]


class AdaptiveKLController(FixedKLController):
    """coef *= 1 + clip(kl / target - 1, -0.2, 0.2) * n_samples / horizon, after each step."""

    def __init__(self, coef: float, target: float, horizon: int):
        super().__init__(coef)
        self.target, self.horizon = target, horizon

    def update(self, current_kl: float, n_samples: int) -> None:
        error = min(max(current_kl / self.target - 1.0, -0.2), 0.2)
        self.coef *= 1.0 + error * n_samples / self.horizon


def make_kl_controller(coef: float, adaptive: bool, target: float, horizon: int) -> FixedKLController:
    return AdaptiveKLController(coef, target, horizon) if adaptive else FixedKLController(coef)
