"""Data sets written by Hugging Face `datasets` with `save_to_disk` (a directory of Arrow files). A
DatasetDict's `train` split is read, or the split the path points into (`DIR/test`)."""

from __future__ import annotations

from typing import Iterator

from toolkit.data import Row
from toolkit.data.parquet import present
from toolkit.errors import ConfigError


def rows(path: str) -> Iterator[Row]:
    import datasets

    try:
        loaded = datasets.load_from_disk(path)
    except Exception as e:  # FileNotFoundError, or datasets' own errors for other directories
        raise ConfigError(f"{path}: not a data set saved with datasets' save_to_disk ({type(e).__name__}: {e})") \
            from None
    if isinstance(loaded, datasets.DatasetDict):
        if "train" not in loaded:
            raise ConfigError(f"{path}: a DatasetDict without a 'train' split (splits: {', '.join(loaded)}); "
                              f"point data.sources[].path at one of them, e.g. {path}/{next(iter(loaded))}")
        path, loaded = f"{path}/train", loaded["train"]
    for index, data in enumerate(loaded):
        yield Row(index, f"{path}: row {index + 1}", present(data))
