"""Data as users have it: one reader per format (jsonl.py, parquet.py, saved.py: `datasets` save_to_disk)
yielding the same rows; rows checked into examples of each stage's kind (examples.py); the seeded split
between stages and the weighted blend of sources (split.py, blend.py); one stage's rows (dataset.py);
tokens (tokens.py); and the RL prompt feeder (prompts.py)."""

from dataclasses import dataclass


@dataclass
class Row:
    index: int          # position in its source (a JSON Lines file: line number - 1)
    location: str       # where a person finds it: "file.jsonl:12", "data.parquet: row 12"
    data: dict
