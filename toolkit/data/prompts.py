"""Prompt feeder: reads a JSON Lines prompt file, hands out prompts per step, and has a resumable cursor.

A prompt's id is its line index (0-based) in the file. With `shuffle`, each pass over the file (epoch)
uses its own permutation seeded by (seed, epoch), so the order is a pure function of the cursor.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass

from toolkit.errors import ConfigError


@dataclass
class Prompt:
    id: int
    text: str
    fields: dict


def read_prompts(path: str, prompt_key: str) -> list[Prompt]:
    """Every prompt of the file; a bad line raises ConfigError naming file, line and fix."""
    prompts = []
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise ConfigError(f"{path}:{number}: not valid JSON ({e.msg} at column {e.colno}); "
                                  "each line must be one JSON object") from None
            if not isinstance(row, dict):
                raise ConfigError(f"{path}:{number}: expected a JSON object, got {type(row).__name__}")
            text = row.pop(prompt_key, None)
            if not isinstance(text, str) or not text:
                raise ConfigError(f"{path}:{number}: no non-empty string field {prompt_key!r} "
                                  f"(fields: {sorted(row)}); set data.prompt_key to the field holding the prompt")
            prompts.append(Prompt(number - 1, text, row))
    if not prompts:
        raise ConfigError(f"{path}: no prompts in the file")
    return prompts


class PromptFeeder:
    def __init__(self, prompts: list[Prompt], shuffle: bool, seed: int):
        self.prompts, self.shuffle, self.seed = prompts, shuffle, seed
        self.epoch, self.position = 0, 0
        self._order = self._permutation(0)

    def _permutation(self, epoch: int) -> list[int]:
        order = list(range(len(self.prompts)))
        if self.shuffle:
            random.Random(f"{self.seed}:{epoch}").shuffle(order)
        return order

    def next(self, n: int) -> list[Prompt]:
        """The next `n` prompts, starting a new epoch when the file is used up."""
        out = []
        while len(out) < n:
            if self.position == len(self._order):
                self.epoch, self.position = self.epoch + 1, 0
                self._order = self._permutation(self.epoch)
            out.append(self.prompts[self._order[self.position]])
            self.position += 1
        return out

    def skip(self, draws: int) -> None:
        """Go to the cursor after `draws` prompts from the start (every epoch is one pass over the file)."""
        self.epoch, self.position = divmod(draws, len(self.prompts))
        self._order = self._permutation(self.epoch)

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "position": self.position}

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self.position = state["epoch"], state["position"]
        self._order = self._permutation(self.epoch)
