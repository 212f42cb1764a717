"""Parquet files (read in record batches with pyarrow; a row's index is its position in the file)."""

from __future__ import annotations

from typing import Iterator

from toolkit.data import Row
from toolkit.errors import ConfigError


def rows(path: str) -> Iterator[Row]:
    import pyarrow.parquet as pq

    try:
        file = pq.ParquetFile(path)
    except Exception as e:  # pyarrow raises several kinds for a file that is not Parquet
        raise ConfigError(f"{path}: not a readable Parquet file ({type(e).__name__}: {e})") from None
    index = 0
    for batch in file.iter_batches(batch_size=4096):
        for data in batch.to_pylist():
            yield Row(index, f"{path}: row {index + 1}", data)
            index += 1
