"""JSON Lines: one JSON object per line, in UTF-8 (blank lines are skipped; a row's index is its line number - 1)."""

from __future__ import annotations

import json
from typing import Iterator

from toolkit.data import Row
from toolkit.errors import ConfigError


def rows(path: str) -> Iterator[Row]:
    with open(path, "rb") as f:
        for number, raw in enumerate(f, start=1):
            try:  # (a byte-order mark, as some Windows editors write, is not part of the first row)
                line = raw.decode("utf-8-sig" if number == 1 else "utf-8")
            except UnicodeDecodeError as e:
                raise ConfigError(f"{path}:{number}: not UTF-8 (byte {raw[e.start]:#04x} at column {e.start + 1}); "
                                  "save the file as UTF-8") from None
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
