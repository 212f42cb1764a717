"""Reading a configured source with the reader of its format."""

from __future__ import annotations

from pathlib import Path

from toolkit.data import Row
from toolkit.errors import ConfigError

FORMATS = ("jsonl", "parquet", "datasets")


def format_of(path: str, declared: str = "auto") -> str:
    """The source's format: as declared, or from its name (a directory is a saved `datasets` data set)."""
    if declared != "auto":
        return declared
    p = Path(path)
    if p.is_dir():
        return "datasets"
    if p.suffix in (".jsonl", ".json", ".ndjson") or p.suffixes[-2:] in ([".jsonl", ".gz"], [".json", ".gz"]):
        return "jsonl"
    if p.suffix in (".parquet", ".pq"):
        return "parquet"
    raise ConfigError(f"{path}: cannot tell the format from the name; name it .jsonl (or .jsonl.gz) or .parquet, "
                      f"or set data.sources[].format to one of {', '.join(FORMATS)}")


def read_source(path: str, declared: str = "auto") -> list[Row]:
    """Every row of the source (ConfigError naming the file and line or row for a bad one)."""
    fmt = format_of(path, declared)
    if fmt == "jsonl":
        from toolkit.data.jsonl import rows
    elif fmt == "parquet":
        from toolkit.data.parquet import rows
    else:
        from toolkit.data.saved import rows
    out = list(rows(path))
    if not out:
        raise ConfigError(f"{path}: no rows in the file")
    return out
