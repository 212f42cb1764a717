"""JSON in UTF-8: JSON Lines, one object per line (blank lines are skipped; a row's index is its line number
- 1), or one JSON array of objects, as Alpaca-style `.json` files hold (a row's index is its position).
A file whose name ends in .gz is read through gzip, as HH-RLHF's `train.jsonl.gz` comes."""

from __future__ import annotations

import gzip
import json
import re
import zlib
from typing import Iterator

from toolkit.data import Row
from toolkit.errors import ConfigError

BOM = b"\xef\xbb\xbf"  # (a byte-order mark, as some Windows editors write: not part of the first row)
SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")  # (\ud800-\udfff: half of a character beyond U+FFFF)


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
        data = json.loads(line.rstrip("\r\n"))  # (with its line break, a cut line's error was at column 1 of the next)
    except json.JSONDecodeError as e:
        raise ConfigError(f"{path}:{number}: not valid JSON ({e.msg} at column {e.colno}); "
                          "each line must be one JSON object (or the file one JSON array of them)") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}:{number}: expected a JSON object, got {type(data).__name__}")
    if SURROGATE_ESCAPE.search(line):
        _check_surrogates(data, f"{path}:{number}")
    return Row(number - 1, f"{path}:{number}", data)


def _array_rows(raw: bytes, path: str) -> Iterator[Row]:
    try:
        text = _decode(raw.removeprefix(BOM), path, 1)
        items = json.loads(text)
    except json.JSONDecodeError as e:
        raise ConfigError(f"{path}:{e.lineno}: not valid JSON ({e.msg} at column {e.colno}); the file starts with "
                          "'[', so it must be one JSON array of objects") from None
    check = SURROGATE_ESCAPE.search(text) is not None
    for index, data in enumerate(items):
        if not isinstance(data, dict):
            raise ConfigError(f"{path}: item {index + 1} of the array: expected a JSON object, got "
                              f"{type(data).__name__}")
        if check:
            _check_surrogates(data, f"{path}: item {index + 1}")
        yield Row(index, f"{path}: item {index + 1}", data)


def _check_surrogates(value, where: str, field: str = "") -> None:
    """ConfigError naming the field of `value` whose text holds a lone surrogate: an escape such as \\ud83d
    without its other half (an emoji cut in two, as JavaScript's substring does), which JSON reads but no
    UTF-8 text holds (the split's hash, the tokenizer and the wire to the scorers failed on it with a
    UnicodeEncodeError that named no row)."""
    if isinstance(value, dict):
        for key, item in value.items():
            _check_surrogates(key, where, f"{field}.(key)" if field else "(key)")
            _check_surrogates(item, where, f"{field}.{key}" if field else key)
    elif isinstance(value, list):
        for i, item in enumerate(value):
            _check_surrogates(item, where, f"{field}[{i}]")
    elif isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as e:
            raise ConfigError(f"{where}: field {field!r} holds a lone surrogate ({ascii(value[e.start])} at character "
                              f"{e.start + 1}: half of a character, e.g. an emoji cut in two), which is no text; "
                              "remove that escape from the file, or give both halves of the pair") from None


def _decode(raw: bytes, path: str, first_line: int) -> str:
    """`raw` as text; ConfigError naming the line and byte where it is not UTF-8 (`raw` starts at `first_line`)."""
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        line = first_line + raw.count(b"\n", 0, e.start)
        column = e.start - (raw.rfind(b"\n", 0, e.start) + 1) + 1
        raise ConfigError(f"{path}:{line}: not UTF-8 (byte {raw[e.start]:#04x} at column {column}); save the file "
                          "as UTF-8") from None
