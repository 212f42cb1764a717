"""JSON Lines: one JSON object per line (blank lines are skipped; a row's index is its line number - 1)."""

from __future__ import annotations

import json
from typing import Iterator

from toolkit.data import Row
from toolkit.errors import ConfigError


def rows(path: str) -> Iterator[Row]:
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                data = json.loads(line)
            except json.JSONDecodeError as e:
                raise ConfigError(f"{path}:{number}: not valid JSON ({e.msg} at column {e.colno}); "
                                  "each line must be one JSON object") from None
            if not isinstance(data, dict):
                raise ConfigError(f"{path}:{number}: expected a JSON object, got {type(data).__name__}")
            yield Row(number - 1, f"{path}:{number}", data)
