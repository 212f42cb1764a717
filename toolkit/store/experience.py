"""Experience batches in HDF5: one file per step, committed atomically before it is trained on.

Layout of experience/step-NNNNNN.h5 (schema 2), readable with plain h5py or `h5dump`:

    /                     attrs: schema_version, step, algorithm, policy_version (of the update it feeds),
                                 kl_coef, prompts_drawn, created_unix
    /meta                 the batch's meta as one JSON string: prompt and response texts, each prompt's
                          data fields, reward names and weights, step (see SampleBatch.parts)
    /samples/<name>       every array of the batch under its SampleBatch field name: per sample
                          (prompt_ids, group_index, sample_index, policy_version, finished, rewards
                          [samples, components], reward_total) and ragged token data (prompt_tokens with
                          prompt_offsets; response_tokens, behaviour_logprobs and ref_logprobs with
                          response_offsets: sample i is values[offsets[i]:offsets[i+1]])
    /experience/<name>    what the trainer computed, one value per response token, aligned with
                          /samples/response_tokens: advantages, old_logprobs (not for GRPO with one
                          update per batch: the update computes them itself), (PPO) values, returns

A commit writes a temporary file, fsyncs it, renames it into place and fsyncs the directory, so a file
under its final name is always whole; its checksum (toolkit/store/checksum.py) goes into the run
manifest.
"""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path

import numpy as np
import orjson

from toolkit.samples import SampleBatch
from toolkit.store import space
from toolkit.store.checksum import checksum_of

SCHEMA_VERSION = 2
# (as json.dumps: keys that are not strings become strings; numpy scalars are numbers)
JSON_OPTIONS = orjson.OPT_NON_STR_KEYS | orjson.OPT_SERIALIZE_NUMPY


def file_name(step: int) -> str:
    return f"step-{step:06d}.h5"


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class Writeback:
    """Starts the disk writing a file's dirty pages, without waiting, after each `every` bytes written
    (Linux `sync_file_range(SYNC_FILE_RANGE_WRITE)`), so that its fsync waits for the rest only. A commit
    of 7 MB took 8.6-9.0 ms with it and 10.1-10.4 ms without, of 52 MB 46-48 ms against 58-60 (medians of
    tools/bench_store.py, run alternately). Where the call does not exist, it does nothing."""

    _call = None  # libc's sync_file_range, looked up once (False: not there)
    START_WRITE = 2  # SYNC_FILE_RANGE_WRITE

    def __init__(self, fd: int, every: int = 1 << 20):
        self.fd, self.every, self.pending = fd, every, 0
        if Writeback._call is None:
            import ctypes

            call = getattr(ctypes.CDLL(None, use_errno=True), "sync_file_range", None)
            if call is not None:
                call.argtypes = [ctypes.c_int, ctypes.c_longlong, ctypes.c_longlong, ctypes.c_uint]
            Writeback._call = call or False

    def wrote(self, nbytes: int) -> None:
        self.pending += nbytes
        if self.pending >= self.every and Writeback._call:
            Writeback._call(self.fd, 0, 0, self.START_WRITE)  # (the whole file: pages under way are skipped)
            self.pending = 0


def record_of(batch: SampleBatch, per_token: dict[str, np.ndarray], algorithm: str, policy_version: int,
              kl_coef: float, prompts_drawn: int) -> dict:
    """The HDF5 record of a scored SampleBatch plus the trainer's per-response-token arrays."""
    meta, arrays = batch.parts()
    return {"attrs": {"schema_version": SCHEMA_VERSION, "step": batch.step, "algorithm": algorithm,
                      "policy_version": policy_version, "kl_coef": kl_coef, "prompts_drawn": prompts_drawn,
                      "created_unix": time.time()},
            "meta": meta, "samples": arrays,
            "experience": {k: np.asarray(v, dtype=np.float32) for k, v in per_token.items()}}


def commit(directory: Path, step: int, record: dict) -> tuple[Path, str, int]:
    """Write `record` (see `record_of`) as the experience of `step`; return (path, checksum, bytes).

    The disk starts writing each megabyte as soon as HDF5 has written it (`Writeback`), so the fsync
    at the end waits for the last part only; while it does, another thread reads the file back from the
    page cache for its checksum (fsync releases the GIL), which then costs nothing on top."""
    import h5py

    directory.mkdir(parents=True, exist_ok=True)
    final = directory / file_name(step)
    tmp = directory / f".{final.name}.tmp"
    digest: list[str] = []
    fd = -1
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)  # (h5py opens the same file)
        writeback = Writeback(fd)
        with h5py.File(tmp, "w") as f:
            _write(f, record, writeback)
        hasher = threading.Thread(target=lambda: digest.append(checksum_of(tmp, ours=True)), name="experience-checksum")
        hasher.start()
        try:
            os.fsync(fd)
        finally:
            hasher.join()
        if not digest:
            raise OSError(f"{tmp}: could not read the file back for its checksum")
    except BaseException as e:
        error = space.explain("experience file", final, e, directory.parent) if isinstance(e, Exception) else e
        tmp.unlink(missing_ok=True)
        if error is not e:
            raise error from e
        raise
    finally:
        if fd >= 0:
            os.close(fd)
    size = tmp.stat().st_size
    os.replace(tmp, final)
    fsync_dir(directory)
    return final, digest[0], size


def _write(f, record: dict, writeback: Writeback) -> None:
    """The record's attributes and datasets, through h5py's low-level calls: the same bytes as its
    `attrs[...] =`, `create_group` and `create_dataset(data=...)` write (contiguous, no times recorded;
    tests/unit/test_store.py compares them), in 1.0-1.6 ms less for a batch's 17 datasets here (those
    calls check and convert each array again)."""
    from h5py import h5a, h5d, h5g, h5p, h5s, h5t

    def array(parent, name: str, value: np.ndarray) -> None:
        value = np.asarray(value, order="C")  # (np.ascontiguousarray would make a 0-d array 1-d)
        space = h5s.create_simple(value.shape) if value.ndim else h5s.create(h5s.SCALAR)
        h5d.create(parent, name.encode(), h5t.py_create(value.dtype, logical=1), space, dcpl=dcpl).write(
            h5s.ALL, h5s.ALL, value)
        writeback.wrote(value.nbytes)

    dcpl = h5p.create(h5p.DATASET_CREATE)
    dcpl.set_obj_track_times(False)
    for key, value in record["attrs"].items():
        if isinstance(value, str):
            f.attrs[key] = value  # (a variable-length UTF-8 string, as h5py stores one)
        else:
            value = np.asarray(value)
            h5a.create(f.id, key.encode(), h5t.py_create(value.dtype, logical=1), h5s.create(h5s.SCALAR)).write(value)
    # One fixed-length string, viewed in place: h5dump shows it as text, and it writes far faster than a
    # variable-length one. (orjson: 5x faster than json on a batch's texts)
    meta = orjson.dumps(record["meta"], option=JSON_OPTIONS)
    array(f.id, "meta", np.frombuffer(meta, f"S{len(meta)}").reshape(()))
    for group in ("samples", "experience"):
        gid = h5g.create(f.id, group.encode())
        for name, value in record[group].items():
            array(gid, name, value)


def read(path: Path) -> dict:
    """Every dataset and attribute of an experience file: {attrs, meta, samples, experience}."""
    import h5py

    with h5py.File(path, "r") as f:
        version = int(f.attrs.get("schema_version", -1))
        if version != SCHEMA_VERSION:
            raise ValueError(f"{path}: experience schema {version}, this version reads {SCHEMA_VERSION}; resume the "
                             "run with the slurm-rlhf version that wrote it, or start a new run from its config")
        out = {"attrs": {k: (v.item() if hasattr(v, "item") else v) for k, v in f.attrs.items()}}
        raw = f["meta"][()]
        out["meta"] = json.loads(raw.decode() if isinstance(raw, bytes) else raw)
        for group in ("samples", "experience"):
            out[group] = {name: ds[()] for name, ds in f[group].items()}
    return out


def batch_of(record: dict) -> SampleBatch:
    """The SampleBatch (with rewards) a record was written from."""
    return SampleBatch.from_parts(record["meta"], record["samples"])


def summary(path: Path) -> str:
    """What `slurm-rlhf inspect FILE` prints."""
    rec = read(path)
    a, m, e = rec["attrs"], rec["meta"], rec["experience"]
    batch = batch_of(rec)
    n, groups = len(batch), len(np.unique(batch.group_index))
    lengths = batch.response_lengths
    lines = [f"{path}",
             f"schema {a['schema_version']}, step {a['step'] + 1} (named from 0: {a['step']}), {a['algorithm']}, "
             f"trained from policy_version "
             f"{a['policy_version']}, kl_coef {a['kl_coef']:.4g}, prompts drawn so far {a['prompts_drawn']}",
             f"samples {n} ({groups} prompts x {n // max(groups, 1)}), sample policy_version "
             f"{batch.policy_version.min()}..{batch.policy_version.max()}, finished {batch.finished.mean():.0%}",
             f"response tokens {int(lengths.sum())}: length mean {lengths.mean():.1f}, min {lengths.min()}, "
             f"max {lengths.max()}; prompt length mean {np.diff(batch.prompt_offsets).mean():.1f}",
             _stats("reward (total)", batch.reward_total)]
    for i, name in enumerate(m["reward_names"]):
        lines.append(_stats(f"reward {name} (weight {m['reward_weights'][i]:g})", batch.rewards[:, i]))
    old = e.get("old_logprobs", batch.behaviour_logprobs)  # (GRPO with one update stores none: the samplers')
    lines.append(_stats("kl per token (old - ref)" if "old_logprobs" in e else "kl per token (behaviour - ref)",
                        old - batch.ref_logprobs))
    lines.append(_stats("advantage per token", e["advantages"]))
    if "values" in e:
        lines.append(_stats("value per token", e["values"]))
    first = batch.responses[0] if batch.responses else ""
    lines.append(f"first sample: {batch.prompts[0]!r} -> {first[:80]!r}")
    return "\n".join(lines)


def _stats(label: str, x: np.ndarray) -> str:
    x = np.asarray(x, dtype=np.float64)
    if not x.size:
        return f"{label}: (none)"
    return f"{label}: mean {x.mean():.4g}, std {x.std():.4g}, min {x.min():.4g}, max {x.max():.4g}"
