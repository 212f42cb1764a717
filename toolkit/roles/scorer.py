"""Scoring roles: the reference role adds reference log-probs, the reward role adds rewards.

Rewards are components, each weighted: rule-based functions named by import path (called per sample
with the prompt, the response and the prompt's other data fields) and Hugging Face
sequence-classification reward models (score of prompt + response). The trainer sees every component
and their weighted total.
"""

from __future__ import annotations

import logging
import math
import time

import numpy as np
import torch

from toolkit.config.schema import load_function
from toolkit.roles.base import Role
from toolkit.roles.modeling import gather_responses, pad_samples, sequence_logprobs, torch_dtype
from toolkit.roles.samples import SampleBatch

log = logging.getLogger(__name__)


class RewardFunctionError(RuntimeError):
    pass


class _Scoring(Role):
    """What both scoring roles share: timing, status, and offloading their models between uses."""

    @property
    def offload(self) -> bool:
        return self.cfg.placement.offload and self.device.type == "cuda" and len(self.worker.group.roles) > 1

    def _load(self, load):
        """`load(device)` -> model, kept in host memory between uses when the placement offloads."""
        return load(torch.device("cpu") if self.offload else self.device)

    def _models(self) -> list:
        return []

    def handle(self, batch: SampleBatch) -> SampleBatch:
        self.status.update(phase="scoring", step=batch.step)
        started = time.monotonic()
        if self.offload:
            for model in self._models():
                model.to(self.device)
        self.score(batch)
        if self.offload:
            for model in self._models():
                model.to("cpu")
            torch.cuda.empty_cache()
        batch.timings["score_s"] = batch.timings.get("score_s", 0.0) + time.monotonic() - started
        batch.timings.setdefault("scorer", self.worker.id)
        self.status["phase"] = "idle"
        return batch


class ReferenceRole(_Scoring):
    """Adds the reference model's log-probs of every response token."""

    def setup(self) -> None:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        cfg = self.cfg
        tokenizer = AutoTokenizer.from_pretrained(cfg.tokenizer_path)
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        self.reference = self._load(lambda device: AutoModelForCausalLM.from_pretrained(
            cfg.reference_path, dtype=torch_dtype(cfg.model.dtype)).to(device).eval())

    def _models(self) -> list:
        return [self.reference]

    def score(self, batch: SampleBatch) -> None:
        padded = pad_samples(batch, self.pad_id)
        ref = sequence_logprobs(self.reference, padded, self.cfg.rollout.temperature, self.cfg.model.forward_batch_size)
        batch.ref_logprobs = np.concatenate(gather_responses(ref, padded) or [np.zeros(0)]).astype(np.float32)


class RewardRole(_Scoring):
    """Adds every reward component: rule-based functions and reward models."""

    def setup(self) -> None:
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        cfg = self.cfg
        dtype = torch_dtype(cfg.model.dtype)
        self.functions = [(f.name, load_function(f.function), f.args, f.function) for f in cfg.reward.functions]
        self.reward_models = []
        for rm in cfg.reward.models:
            rm_tokenizer = AutoTokenizer.from_pretrained(rm.path)
            model = self._load(lambda device: AutoModelForSequenceClassification.from_pretrained(
                rm.path, dtype=dtype).to(device).eval())
            if model.config.num_labels != 1:
                raise ValueError(f"reward model {rm.path} has {model.config.num_labels} labels; a reward model needs 1")
            if model.config.pad_token_id is None:
                model.config.pad_token_id = rm_tokenizer.pad_token_id
            self.reward_models.append((rm.name, model, rm_tokenizer))
        self.names = [f.name for f in cfg.reward.functions] + [m.name for m in cfg.reward.models]
        self.weights = [f.weight for f in cfg.reward.functions] + [m.weight for m in cfg.reward.models]

    def _models(self) -> list:
        return [m for _, m, _ in self.reward_models]

    def score(self, batch: SampleBatch) -> None:
        columns = [self._call_function(f, batch) for f in self.functions]
        columns += [self._score_model(m, tok, batch) for _, m, tok in self.reward_models]
        batch.rewards = np.stack(columns, axis=1).astype(np.float32)
        batch.reward_names, batch.reward_weights = self.names, self.weights

    @staticmethod
    def _call_function(function, batch: SampleBatch) -> np.ndarray:
        name, fn, args, path = function
        out = np.zeros(len(batch), dtype=np.float64)
        for i in range(len(batch)):
            try:
                value = float(fn(prompt=batch.prompts[i], response=batch.responses[i], **batch.fields_[i], **args))
            except Exception as e:
                raise RewardFunctionError(
                    f"reward function {name!r} ({path}) failed on prompt id {int(batch.prompt_ids[i])}, "
                    f"sample {int(batch.sample_index[i])}: {type(e).__name__}: {e}") from e
            if not math.isfinite(value):
                raise RewardFunctionError(f"reward function {name!r} ({path}) returned {value} for prompt id "
                                          f"{int(batch.prompt_ids[i])}; rewards must be finite numbers")
            out[i] = value
        return out

    @torch.no_grad()
    def _score_model(self, model, tokenizer, batch: SampleBatch) -> np.ndarray:
        texts = [p + r for p, r in zip(batch.prompts, batch.responses)]
        scores = []
        size = self.cfg.model.forward_batch_size
        for start in range(0, len(texts), size):
            enc = tokenizer(texts[start: start + size], return_tensors="pt", padding=True, truncation=True,
                            max_length=self.cfg.rollout.max_prompt_tokens + self.cfg.rollout.max_new_tokens)
            logits = model(**{k: v.to(self.device) for k, v in enc.items() if k in ("input_ids", "attention_mask")}).logits
            scores.append(logits[:, 0].float().cpu().numpy())
        return np.concatenate(scores)
