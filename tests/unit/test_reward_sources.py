"""The reward functions' files as a run records them, and what a resume says changed (toolkit/rewards/sources.py).
(A real run resumed after its reward file was edited is in tests/integration/test_runs.py.)"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import toolkit.rewards.examples as examples
from toolkit.rewards.sources import changes, reward_sources
from toolkit.store.checksum import checksum_of


def config(*functions: str):
    return SimpleNamespace(reward=SimpleNamespace(functions=[SimpleNamespace(function=f) for f in functions]))


def test_each_reward_function_is_recorded_by_its_file_and_a_change_is_named(tmp_path):
    rewards = tmp_path / "rewards.py"
    rewards.write_text("def score(prompt, response, **fields):\n    return 1.0\n")
    cfg = config(f"{rewards}:score", "toolkit.rewards.examples:digit_ratio", "no_such_package.rewards:f")
    then = reward_sources(cfg)
    # a file as given; a module's file as the import system finds it; one that cannot be found is left out (the
    # scorer names it when it loads the function), nothing is run to find it
    assert then == {
        "reward.functions.0": {"function": f"{rewards}:score", "path": str(rewards), "bytes": 54,
                               "checksum": checksum_of(rewards)},
        "reward.functions.1": {"function": "toolkit.rewards.examples:digit_ratio", "path": examples.__file__,
                               "bytes": Path(examples.__file__).stat().st_size,
                               "checksum": checksum_of(Path(examples.__file__))}}
    assert reward_sources(cfg) == then and changes(then, reward_sources(cfg)) == []
    assert reward_sources(SimpleNamespace(stage="sft")) == {}  # (a stage without rewards)

    rewards.write_text("def score(prompt, response, **fields):\n    return 2.0\n")
    assert changes(then, reward_sources(cfg)) == [
        f"reward.functions.0 ({rewards}:score): {rewards} has other contents (54 bytes then, 54 now)"]

    moved = tmp_path / "other.py"
    moved.write_text(rewards.read_text())
    now = reward_sources(config(f"{moved}:score", "toolkit.rewards.examples:digit_ratio",
                                "toolkit.rewards.examples:mentions"))
    assert changes(then, now) == [
        f"reward.functions.0: {rewards}:score then, {moved}:score now",
        "reward.functions.2: none then, toolkit.rewards.examples:mentions now"]
    assert changes(now, reward_sources(config(f"{moved}:score"))) == [
        "reward.functions.1: toolkit.rewards.examples:digit_ratio then, none now",
        "reward.functions.2: toolkit.rewards.examples:mentions then, none now"]
