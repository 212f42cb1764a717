"""JSON in UTF-8: JSON Lines, one object per line (blank lines are skipped; a row's index is its line number
- 1), or one JSON array of objects, as Alpaca-style `.json` files hold (a row's index is its position).
A file whose name ends in .gz is read through gzip, as HH-RLHF's `train.jsonl.gz` comes."""

from __future__ import annotations

import gzip
import json
import zlib
from typing import Iterator

from toolkit.data import Row
from toolkit.errors import ConfigError

BOM = b"\xef\xbb\xbf"  # (a byte-order mark, as some Windows editors write: not part of the first row)


def rows(path: str) -> Iterator[Row]:
    try:
        with _open(path) as f:
            if f.read(1 << 16).removeprefix(BOM).lstrip().startswith(b"["):
                f.seek(0)
                yield from _array_rows(f.read(), path)
                return
            f.seek(0)
            for number, raw in enumerate(f, start=1):
                row = _line_row(raw.removeprefix(BOM) if number == 1 else raw, path, number)
                if row is not None:
                    yield row
    except (gzip.BadGzipFile, EOFError, zlib.error) as e:
        raise ConfigError(f"{path}: not a whole gzip file ({e}); compress it again, or name it without .gz if it "
                          "is plain text") from None


def _open(path: str):
    return gzip.open(path, "rb") if path.endswith(".gz") else open(path, "rb")


def _line_row(raw: bytes, path: str, number: int) -> Row | None:
    """The row of line `number` (None for a blank line)."""
    line = _decode(raw, path, number)
    if not line.strip():
        return None
    try:
        data = json.loads(line)
    except json.JSONDecodeError as e:
        raise ConfigError(f"{path}:{number}: not valid JSON ({e.msg} at column {e.colno}); "
                          "each line must be one JSON object (or the file one JSON array of them)") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}:{number}: expected a JSON object, got {type(data).__name__}")
    return Row(number - 1, f"{path}:{number}", data)


def _array_rows(raw: bytes, path: str) -> Iterator[Row]:
    try:
        items = json.loads(_decode(raw.removeprefix(BOM), path, 1))
    except json.JSONDecodeError as e:
        raise ConfigError(f"{path}:{e.lineno}: not valid JSON ({e.msg} at column {e.colno}); the file starts with "
                          "'[', so it must be one JSON array of objects") from None
    for index, data in enumerate(items):
        if not isinstance(data, dict):
            raise ConfigError(f"{path}: item {index + 1} of the array: expected a JSON object, got "
                              f"{type(data).__name__}")
        yield Row(index, f"{path}: item {index + 1}", data)


def _decode(raw: bytes, path: str, first_line: int) -> str:
    """`raw` as text; ConfigError naming the line and byte where it is not UTF-8 (`raw` starts at `first_line`)."""
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        line = first_line + raw.count(b"\n", 0, e.start)
        column = e.start - (raw.rfind(b"\n", 0, e.start) + 1) + 1
        raise ConfigError(f"{path}:{line}: not UTF-8 (byte {raw[e.start]:#04x} at column {column}); save the file "
                          "as UTF-8") from None
