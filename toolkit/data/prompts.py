"""The RL prompt feeder: the prompts of the RL part of the data, blended, with a resumable cursor.

A prompt's id is its row id (its line in a single JSON Lines file). With `shuffle`, each pass over a
source uses its own permutation seeded by (seed, pass), so the order is a pure function of the cursor.
"""

from __future__ import annotations

from toolkit.data.dataset import StageData
from toolkit.data.examples import Example


def read_prompts(data, seed: int) -> StageData:
    """The RL part's prompts of a data section (ConfigError naming the file and line of a bad row)."""
    return StageData(data, "rl", "prompt", seed)


class PromptFeeder:
    def __init__(self, data: StageData):
        self.data = data

    def next(self, n: int) -> list[Example]:
        """The next `n` prompts (a new pass over a source when it is used up)."""
        return self.data.next(n)

    def skip(self, draws: int) -> None:
        """Go to the cursor after `draws` prompts from the start."""
        self.data.skip(draws)


def prompt_text(prompt) -> str:
    """What a rule-based reward reads as the prompt: the text, or the last user message of chat messages."""
    if isinstance(prompt, str):
        return prompt
    users = [m["content"] for m in prompt if m["role"] == "user"]
    return users[-1] if users else prompt[-1]["content"]
