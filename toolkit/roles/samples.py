"""SampleBatch: the samples that stream generator -> scorer -> trainer, ragged and without padding.

Token sequences of different lengths are stored flat with offsets (`prompt_offsets[i]:prompt_offsets[i+1]`
are sample i's prompt tokens), so a message carries exactly the tokens generated. The generator fills
tokens, behaviour log-probs and versions; the scorer adds reference log-probs and rewards.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields

import numpy as np

from toolkit.transport.wire import Message

KIND = "samples"


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
    prompt_ids: np.ndarray                 # int64 [n]: line of the prompt in the data file
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
    fields_: list[dict] = field(default_factory=list)   # other fields of each prompt's data line
    ref_logprobs: np.ndarray | None = None  # float32 flat, aligned with response_tokens (scorer)
    rewards: np.ndarray | None = None       # float32 [n, len(reward_names)] (scorer)
    reward_names: list[str] = field(default_factory=list)
    reward_weights: list[float] = field(default_factory=list)
    timings: dict = field(default_factory=dict)   # seconds per stage and which worker spent them

    def __len__(self) -> int:
        return len(self.prompt_ids)

    @property
    def response_lengths(self) -> np.ndarray:
        return np.diff(self.response_offsets)

    @property
    def total_reward(self) -> np.ndarray:
        """float32 [n]: weighted sum of the reward components."""
        return self.rewards @ np.asarray(self.reward_weights, dtype=np.float32)

    def response(self, i: int) -> np.ndarray:
        return self.response_tokens[self.response_offsets[i]: self.response_offsets[i + 1]]

    def prompt(self, i: int) -> np.ndarray:
        return self.prompt_tokens[self.prompt_offsets[i]: self.prompt_offsets[i + 1]]

    def to_message(self, stage: str = "trainer") -> tuple[str, dict, dict]:
        """(kind, meta, arrays) for `Outbox.send`; `stage` is the role that takes the samples next."""
        meta = {"stage": stage, "step": self.step, "prompts": self.prompts, "responses": self.responses,
                "fields": self.fields_,
                "reward_names": self.reward_names, "reward_weights": self.reward_weights, "timings": self.timings}
        arrays = {f.name: getattr(self, f.name) for f in fields(self)
                  if f.name not in meta and f.name != "fields_" and getattr(self, f.name) is not None}
        return KIND, meta, arrays

    @classmethod
    def from_message(cls, msg: Message) -> "SampleBatch":
        m = msg.meta
        return cls(step=m["step"], prompts=m["prompts"], responses=m["responses"], fields_=m["fields"],
                   reward_names=m["reward_names"], reward_weights=m["reward_weights"], timings=m["timings"],
                   **msg.arrays)

    @classmethod
    def concat(cls, batches: list["SampleBatch"]) -> "SampleBatch":
        """One batch holding all samples of `batches` (same step and reward components)."""
        first = batches[0]

        def flat(name):
            parts = [getattr(b, name) for b in batches]
            return None if any(p is None for p in parts) else np.concatenate(parts)

        def offsets(name):
            out, base = [np.zeros(1, dtype=np.int64)], 0
            for b in batches:
                o = getattr(b, name)
                out.append(o[1:] + base)
                base += o[-1]
            return np.concatenate(out)

        return cls(step=first.step, prompt_ids=flat("prompt_ids"), group_index=flat("group_index"),
                   sample_index=flat("sample_index"),
                   policy_version=flat("policy_version"), prompt_tokens=flat("prompt_tokens"),
                   prompt_offsets=offsets("prompt_offsets"), response_tokens=flat("response_tokens"),
                   response_offsets=offsets("response_offsets"), behaviour_logprobs=flat("behaviour_logprobs"),
                   finished=flat("finished"), prompts=sum((b.prompts for b in batches), []),
                   responses=sum((b.responses for b in batches), []), fields_=sum((b.fields_ for b in batches), []),
                   ref_logprobs=flat("ref_logprobs"), rewards=flat("rewards"), reward_names=first.reward_names,
                   reward_weights=first.reward_weights,
                   timings={})

    def select(self, order: np.ndarray) -> "SampleBatch":
        """The samples at indices `order`, in that order."""
        def take_ragged(values, offs):
            if values is None:
                return None, None
            return ragged([values[offs[i]: offs[i + 1]] for i in order], values.dtype)

        pt, po = take_ragged(self.prompt_tokens, self.prompt_offsets)
        rt, ro = take_ragged(self.response_tokens, self.response_offsets)
        bl, _ = take_ragged(self.behaviour_logprobs, self.response_offsets)
        rl, _ = take_ragged(self.ref_logprobs, self.response_offsets)
        return SampleBatch(step=self.step, prompt_ids=self.prompt_ids[order], group_index=self.group_index[order],
                           sample_index=self.sample_index[order],
                           policy_version=self.policy_version[order], prompt_tokens=pt, prompt_offsets=po,
                           response_tokens=rt, response_offsets=ro, behaviour_logprobs=bl,
                           finished=self.finished[order], prompts=[self.prompts[i] for i in order],
                           responses=[self.responses[i] for i in order], fields_=[self.fields_[i] for i in order],
                           ref_logprobs=rl, rewards=None if self.rewards is None else self.rewards[order],
                           reward_names=self.reward_names, reward_weights=self.reward_weights,
                           timings=dict(self.timings))
