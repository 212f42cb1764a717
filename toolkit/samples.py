"""SampleBatch: the samples that stream generator -> scorer -> trainer, ragged and without padding, and
their one serialisation.

Token sequences of different lengths are stored flat with offsets (`prompt_offsets[i]:prompt_offsets[i+1]`
are sample i's prompt tokens), so a message carries exactly the tokens generated. The generator fills
tokens, behaviour log-probs and versions; the scorer adds reference log-probs and rewards.

A batch serialises one way: `parts()` gives (meta, arrays), a JSON-able dict (step, texts, data fields,
reward names and weights, timings) and its numpy arrays by field name; `from_parts` is the inverse. A
`samples` message on the wire, the batch trainer rank 0 shares with the other ranks, and the committed
HDF5 record all carry exactly these parts.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

KIND = "samples"
META = ("step", "prompts", "responses", "fields", "reward_names", "reward_weights", "timings", "eval_samples")


def ragged(seqs: list, dtype) -> tuple[np.ndarray, np.ndarray]:
    """Flatten a list of 1-D sequences into (values, offsets) with offsets[0] = 0."""
    lengths = np.fromiter((len(s) for s in seqs), dtype=np.int64, count=len(seqs))
    offsets = np.zeros(len(seqs) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    if not offsets[-1]:
        return np.zeros(0, dtype=dtype), offsets
    return np.concatenate([np.asarray(s, dtype=dtype) for s in seqs]), offsets


@dataclass
class SampleBatch:
    """Samples of one step (any subset of them); arrays are per sample unless flat (ragged)."""

    step: int
    prompt_ids: np.ndarray                 # int64 [n]: the prompt's row in the data (see data/dataset.py)
    group_index: np.ndarray                # int32 [n]: position of the prompt in its step (GRPO group)
    sample_index: np.ndarray               # int32 [n]: which of the group's samples
    policy_version: np.ndarray             # int32 [n]: weights that generated the sample
    prompt_tokens: np.ndarray              # int32 flat
    prompt_offsets: np.ndarray             # int64 [n+1]
    response_tokens: np.ndarray            # int32 flat
    response_offsets: np.ndarray           # int64 [n+1]
    behaviour_logprobs: np.ndarray         # float32 flat, aligned with response_tokens
    finished: np.ndarray                   # bool [n]: ended with EOS (not cut at max_new_tokens)
    prompts: list[str] = field(default_factory=list)
    responses: list[str] = field(default_factory=list)
    fields: list[dict] = field(default_factory=list)   # other fields of each prompt's data row
    ref_logprobs: np.ndarray | None = None  # float32 flat, aligned with response_tokens (scorer)
    rewards: np.ndarray | None = None       # float32 [n, len(reward_names)]: each component (scorer)
    reward_total: np.ndarray | None = None  # float32 [n]: weighted sum of the components, clipped (scorer)
    reward_names: list[str] = field(default_factory=list)
    reward_weights: list[float] = field(default_factory=list)
    timings: dict = field(default_factory=dict)   # seconds per stage and which worker spent them
    eval_samples: int = 0  # > 0: samples of an evaluation (eval.every_steps), not trained on: how many it has

    def __len__(self) -> int:
        return len(self.prompt_ids)

    @property
    def response_lengths(self) -> np.ndarray:
        return np.diff(self.response_offsets)

    def response(self, i: int) -> np.ndarray:
        return self.response_tokens[self.response_offsets[i]: self.response_offsets[i + 1]]

    def prompt(self, i: int) -> np.ndarray:
        return self.prompt_tokens[self.prompt_offsets[i]: self.prompt_offsets[i + 1]]

    # ----- the one serialisation ----------------------------------------------------------------

    def parts(self) -> tuple[dict, dict[str, np.ndarray]]:
        """(meta, arrays): every field, the JSON-able ones in `meta`, the arrays (those set) by name."""
        meta = {name: getattr(self, name) for name in META}
        arrays = {name: value for name, value in vars(self).items()
                  if name not in META and value is not None}
        return meta, arrays

    @classmethod
    def from_parts(cls, meta: dict, arrays: dict[str, np.ndarray]) -> "SampleBatch":
        return cls(**{name: meta[name] for name in META if name in meta}, **arrays)  # (records before eval_samples)

    def to_message(self, stage: str = "trainer") -> tuple[str, dict, dict]:
        """(kind, meta, arrays) for `Outbox.send`; `stage` is the role that takes the samples next."""
        meta, arrays = self.parts()
        return KIND, {**meta, "stage": stage}, arrays

    @classmethod
    def from_message(cls, msg) -> "SampleBatch":
        return cls.from_parts(msg.meta, msg.arrays)

    # ----- subsets --------------------------------------------------------------------------------

    @classmethod
    def concat(cls, batches: list["SampleBatch"]) -> "SampleBatch":
        """One batch holding all samples of `batches` (same step and reward components)."""
        first = batches[0]
        metas, arrays = zip(*(b.parts() for b in batches))
        joined = {}
        for name in arrays[0]:
            if not all(name in a for a in arrays):
                continue
            if name.endswith("_offsets"):
                out, base = [np.zeros(1, dtype=np.int64)], 0
                for a in arrays:
                    out.append(a[name][1:] + base)
                    base += a[name][-1]
                joined[name] = np.concatenate(out)
            else:
                joined[name] = np.concatenate([a[name] for a in arrays])
        meta = {**metas[0], "timings": {}}
        for key in ("prompts", "responses", "fields"):
            meta[key] = sum((m[key] for m in metas), [])
        assert all(b.step == first.step for b in batches)
        return cls.from_parts(meta, joined)

    def select(self, order: np.ndarray) -> "SampleBatch":
        """The samples at indices `order`, in that order."""
        meta, arrays = self.parts()
        out = {}
        for name, values in arrays.items():
            if name.endswith("_offsets"):
                continue
            offsets = arrays.get(RAGGED.get(name, ""))
            if offsets is None:
                out[name] = values[order]
            else:
                out[name], new_offsets = ragged([values[offsets[i]: offsets[i + 1]] for i in order], values.dtype)
                out[RAGGED[name]] = new_offsets
        meta = {**meta, "timings": dict(self.timings)}
        for key in ("prompts", "responses", "fields"):
            meta[key] = [meta[key][i] for i in order]
        return SampleBatch.from_parts(meta, out)


# Flat arrays and the offsets that cut them into samples.
RAGGED = {"prompt_tokens": "prompt_offsets", "response_tokens": "response_offsets",
          "behaviour_logprobs": "response_offsets", "ref_logprobs": "response_offsets"}
