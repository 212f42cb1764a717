"""What a reward function may return (`toolkit/roles/scorer.py`): finite numbers that float32 holds."""

from __future__ import annotations

import pytest

from tests.unit.test_samples_and_modeling import batch as make_batch
from toolkit.roles.scorer import RewardFunctionError, RewardRole


def reward_of(value):
    return RewardRole._call_function(("big", lambda prompt, response, **fields: value, {}, "m:big"), make_batch())


def test_a_reward_float32_cannot_hold_is_refused():
    """1e39 passed the check on the float64 value, became inf in the float32 rewards, and made the advantages
    of its group NaN (with PPO's or REINFORCE++'s whitening, the whole batch's)."""
    assert reward_of(3e38).tolist() == [3e38, 3e38] and reward_of(True).tolist() == [1.0, 1.0]
    for bad in (1e39, -1e39, float("nan"), None, "0.5"):
        with pytest.raises(RewardFunctionError, match=r"reward function 'big' \(m:big\) returned .* for prompt id 10, "
                                                      r"sample 0; rewards must be finite numbers .* within float32's "
                                                      r"range"):
            reward_of(bad)
