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
    batches = file.iter_batches(batch_size=4096)
    while True:
        try:
            batch = next(batches, None)
        except Exception as e:  # (a damaged page: pyarrow's OSError, ArrowInvalid, ...)
            raise ConfigError(f"{path}: rows {index + 1} onwards cannot be read ({type(e).__name__}: {e}); the file "
                              "is damaged: write it again") from None
        if batch is None:
            return
        for data in batch.to_pylist():
            yield Row(index, f"{path}: row {index + 1}", present(data))
            index += 1


def present(data: dict) -> dict:
    """The row without its null fields: a column holds every row's field, null where the row has none (as
    pandas and pyarrow write a table of rows with different fields), and a field a row lacks is absent."""
    return {key: value for key, value in data.items() if value is not None}
