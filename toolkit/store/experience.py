"""Experience batches in HDF5: one file per step, committed atomically before it is trained on.

Layout of experience/step-NNNNNN.h5 (schema 1), readable with plain h5py or `h5dump`:

    /                     attrs: schema_version, step, algorithm, policy_version, kl_coef,
                                 prompts_drawn, reward_names, reward_weights, created_unix
    /samples/*            one value per sample: prompt_id, group_index, sample_index, policy_version,
                          finished, prompt_length, response_length, reward_total
    /samples/rewards      [samples, components]: every reward component (names in the root attrs)
    /tokens/prompt, /tokens/prompt_offsets, /tokens/response, /tokens/response_offsets
                          ragged token ids: sample i is values[offsets[i]:offsets[i+1]]
    /response/*           one value per response token, aligned with /tokens/response: loss_mask,
                          behaviour_logprobs, ref_logprobs, old_logprobs, advantages, (PPO) values, returns
    /text/prompt, /text/response   UTF-8 strings, for reading the samples (NUL written as the 4
                          characters \x00, which HDF5 strings cannot hold; the token ids are exact)

A commit writes a temporary file, fsyncs it, renames it into place and fsyncs the directory, so a file
under its final name is always whole; its SHA-256 goes into the run manifest.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from pathlib import Path

import numpy as np

SCHEMA_VERSION = 1
PER_SAMPLE = ("prompt_id", "group_index", "sample_index", "policy_version", "finished", "prompt_length",
              "response_length", "reward_total")
PER_TOKEN = ("loss_mask", "behaviour_logprobs", "ref_logprobs", "old_logprobs", "advantages", "values", "returns")


def file_name(step: int) -> str:
    return f"step-{step:06d}.h5"


def sha256_of(path: Path, chunk: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def commit(directory: Path, step: int, record: dict) -> tuple[Path, str, int]:
    """Write `record` (see `record_of`) as the experience of `step`; return (path, sha256, bytes)."""
    import h5py

    directory.mkdir(parents=True, exist_ok=True)
    final = directory / file_name(step)
    tmp = directory / f".{final.name}.tmp"
    try:
        with h5py.File(tmp, "w") as f:
            for key, value in record["attrs"].items():
                f.attrs[key] = value
            for group in ("samples", "tokens", "response"):
                g = f.create_group(group)
                for name, array in record[group].items():
                    g.create_dataset(name, data=array)
            text = f.create_group("text")
            for name, strings in record["text"].items():
                text.create_dataset(name, data=[t.replace("\0", "\\x00") for t in strings],
                                    dtype=h5py.string_dtype())
        with open(tmp, "rb+") as fh:
            os.fsync(fh.fileno())
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    digest, size = sha256_of(tmp), tmp.stat().st_size
    os.replace(tmp, final)
    fsync_dir(directory)
    return final, digest, size


def record_of(batch, per_token: dict[str, np.ndarray], step: int, algorithm: str, policy_version: int,
              kl_coef: float, prompts_drawn: int) -> dict:
    """The HDF5 record of a scored SampleBatch plus the trainer's per-response-token arrays."""
    lengths = batch.response_lengths
    return {
        "attrs": {"schema_version": SCHEMA_VERSION, "step": step, "algorithm": algorithm,
                  "policy_version": policy_version, "kl_coef": kl_coef, "prompts_drawn": prompts_drawn,
                  "reward_names": json.dumps(batch.reward_names), "reward_weights": json.dumps(batch.reward_weights),
                  "created_unix": time.time()},
        "samples": {"prompt_id": batch.prompt_ids, "group_index": batch.group_index,
                    "sample_index": batch.sample_index, "policy_version": batch.policy_version,
                    "finished": batch.finished, "prompt_length": np.diff(batch.prompt_offsets).astype(np.int32),
                    "response_length": lengths.astype(np.int32), "reward_total": batch.total_reward.astype(np.float32),
                    "rewards": batch.rewards.astype(np.float32)},
        "tokens": {"prompt": batch.prompt_tokens, "prompt_offsets": batch.prompt_offsets,
                   "response": batch.response_tokens, "response_offsets": batch.response_offsets},
        "response": {"loss_mask": np.ones(int(lengths.sum()), np.uint8),
                     "behaviour_logprobs": batch.behaviour_logprobs, "ref_logprobs": batch.ref_logprobs,
                     **{k: v.astype(np.float32) for k, v in per_token.items()}},
        "text": {"prompt": list(batch.prompts), "response": list(batch.responses)},
    }


def read(path: Path) -> dict:
    """Every dataset and attribute of an experience file, as numpy arrays, lists and plain values."""
    import h5py

    with h5py.File(path, "r") as f:
        version = int(f.attrs.get("schema_version", -1))
        if version != SCHEMA_VERSION:
            raise ValueError(f"{path}: experience schema {version}, this version reads {SCHEMA_VERSION}")
        out = {"attrs": {k: (v.item() if hasattr(v, "item") else v) for k, v in f.attrs.items()}}
        for group in ("samples", "tokens", "response"):
            out[group] = {name: ds[()] for name, ds in f[group].items()}
        out["text"] = {name: [s.decode() if isinstance(s, bytes) else s for s in ds[()]]
                       for name, ds in f["text"].items()}
    for key in ("reward_names", "reward_weights"):
        out["attrs"][key] = json.loads(out["attrs"][key])
    return out


def batch_of(record: dict):
    """The SampleBatch (with rewards) a record was written from."""
    from toolkit.roles.samples import SampleBatch

    s, t, r, a = record["samples"], record["tokens"], record["response"], record["attrs"]
    return SampleBatch(step=int(a["step"]), prompt_ids=s["prompt_id"], group_index=s["group_index"],
                       sample_index=s["sample_index"], policy_version=s["policy_version"], prompt_tokens=t["prompt"],
                       prompt_offsets=t["prompt_offsets"], response_tokens=t["response"],
                       response_offsets=t["response_offsets"], behaviour_logprobs=r["behaviour_logprobs"],
                       finished=s["finished"], prompts=record["text"]["prompt"], responses=record["text"]["response"],
                       fields_=[{} for _ in s["prompt_id"]], ref_logprobs=r["ref_logprobs"], rewards=s["rewards"],
                       reward_names=a["reward_names"], reward_weights=a["reward_weights"])


def summary(path: Path) -> str:
    """What `slurm-rlhf inspect FILE` prints."""
    rec = read(path)
    a, s, r = rec["attrs"], rec["samples"], rec["response"]
    n, groups = len(s["prompt_id"]), len(np.unique(s["group_index"]))
    lengths = s["response_length"]
    lines = [f"{path}",
             f"schema {a['schema_version']}, step {a['step']}, {a['algorithm']}, trained from policy_version "
             f"{a['policy_version']}, kl_coef {a['kl_coef']:.4g}, prompts drawn so far {a['prompts_drawn']}",
             f"samples {n} ({groups} prompts x {n // max(groups, 1)}), sample policy_version "
             f"{s['policy_version'].min()}..{s['policy_version'].max()}, finished {s['finished'].mean():.0%}",
             f"response tokens {int(lengths.sum())}: length mean {lengths.mean():.1f}, min {lengths.min()}, "
             f"max {lengths.max()}; prompt length mean {s['prompt_length'].mean():.1f}",
             _stats("reward (total)", s["reward_total"])]
    for i, name in enumerate(a["reward_names"]):
        lines.append(_stats(f"reward {name} (weight {a['reward_weights'][i]:g})", s["rewards"][:, i]))
    lines.append(_stats("kl per token (old - ref)", r["old_logprobs"] - r["ref_logprobs"]))
    lines.append(_stats("advantage per token", r["advantages"]))
    if "values" in r:
        lines.append(_stats("value per token", r["values"]))
    first = rec["text"]["response"][0] if rec["text"]["response"] else ""
    lines.append(f"first sample: {rec['text']['prompt'][0]!r} -> {first[:80]!r}")
    return "\n".join(lines)


def _stats(label: str, x: np.ndarray) -> str:
    x = np.asarray(x, dtype=np.float64)
    if not x.size:
        return f"{label}: (none)"
    return f"{label}: mean {x.mean():.4g}, std {x.std():.4g}, min {x.min():.4g}, max {x.max():.4g}"
