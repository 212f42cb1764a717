"""Scoring roles: the reference role adds reference log-probs, the reward role adds rewards.

Rewards are components, each weighted: rule-based functions named by import path (called per sample
with the prompt, the response and the prompt's other data fields) and Hugging Face
sequence-classification reward models (the score at the last token of prompt + response, normalised by
the statistics the `rm` stage saved when asked). The trainer sees every component and their weighted
total, clipped to reward.clip.
"""

from __future__ import annotations

import json
import logging
import math
import time
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from toolkit.hold import hold
from toolkit.config.base import load_function
from toolkit.data.prompts import prompt_text
from toolkit.data.tokens import fit, render_prompt
from toolkit.modeling import (gather_responses, last_token_scores, pad_samples, pretrained_kwargs, sequence_logprobs,
                              torch_dtype)
from toolkit.rewards.bounded import CallTimeout, bounded
from toolkit.roles.base import Role
from toolkit.samples import SampleBatch

log = logging.getLogger(__name__)


class RewardFunctionError(RuntimeError):
    pass


FLOAT32_MAX = float(np.finfo(np.float32).max)


class _Scoring(Role):
    """What both scoring roles share: timing, status, offloading their models between uses, and scoring
    on the trainer's ranks instead (`deferred`)."""

    MODEL = ""  # what the placement calls this role's models (placement.layout.MODELS)

    @property
    def offload(self) -> bool:
        return (self.cfg.placement.offload and self.device.type == "cuda" and len(self.worker.group.roles) > 1
                and not self.sharded)  # (ZeRO-3 offloads a sharded model itself: trainer.offload_params)

    @property
    def deferred(self) -> bool:
        """Whether the trainer ranks score this role's models instead, in a trainer's group of several ranks:
        every rank scores its own shard of the step, in the training step (`update.make_experience`,
        `RewardRole.complete`), all at once, so that under ZeRO-3 the models can be sharded over them. (In a
        group that does not generate, samples reach trainer rank 0 alone, and scoring them here would leave
        the other ranks idle; with one rank, scoring each message on arrival overlaps the wait for the rest
        of the step.) See `placement.layout.on_trainer_ranks`."""
        from toolkit.placement.layout import scored_in_training_step

        group = self.worker.group
        return scored_in_training_step(group.models, self.MODEL, group.workers)

    @property
    def sharded(self) -> bool:
        """Deferred to a trainer of several ranks under ZeRO-3: the models are sharded over those ranks too
        (`training.engine.inference_engine`), 1/ranks of their weights on each."""
        return self.deferred and self.cfg.trainer.zero_stage == 3

    def _load(self, load):
        """`load(device)` -> model, kept in host memory between uses when the placement offloads, or a
        ZeRO-3 inference engine over the trainer's ranks when `sharded`."""
        from toolkit.training.engine import inference_engine

        if self.sharded:
            return inference_engine(load(self.device), self.cfg.model.dtype, self.worker.group.workers,
                                    self.cfg.trainer.offload_params)
        return load(torch.device("cpu") if self.offload else self.device)

    def _models(self) -> list:
        return []

    @contextmanager
    def _on_device(self):
        """The models on the device meanwhile (they go back to host memory afterwards when offloaded)."""
        if self.offload:
            for model in self._models():
                model.to(self.device)
        try:
            yield
        finally:
            if self.offload:
                for model in self._models():
                    model.to("cpu")
                torch.cuda.empty_cache()

    def setup(self) -> None:
        self.deferred_s = 0.0  # seconds of scoring on the trainer ranks (when `deferred`)

    def handle(self, batch: SampleBatch) -> SampleBatch:
        # (as the generator's: an evaluation's batch goes under the step whose weights it samples)
        self.status.update(phase="scoring", step=batch.step - 1 if batch.eval_samples else batch.step)
        hold("scoring", self.worker.wenv.run_dir)
        started = time.monotonic()
        with nullcontext() if self.deferred else self._on_device():  # (deferred: its models wait for `complete`)
            self.score(batch)
        batch.timings["score_s"] = batch.timings.get("score_s", 0.0) + time.monotonic() - started
        batch.timings.setdefault("scorer", self.worker.id)
        self.status["phase"] = "idle"
        return batch


class ReferenceRole(_Scoring):
    """Adds the reference model's log-probs of every response token."""

    MODEL = "reference"

    def setup(self) -> None:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        from toolkit.training.engine import held_parameters

        super().setup()
        cfg = self.cfg
        tokenizer = AutoTokenizer.from_pretrained(cfg.tokenizer_path)
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        kwargs = pretrained_kwargs(cfg.reference_path, torch_dtype(cfg.model.dtype), cfg.model.attn_implementation)
        self.reference = self._load(
            lambda device: AutoModelForCausalLM.from_pretrained(cfg.reference_path, **kwargs).to(device).eval())
        self.status["reference_parameters"] = held_parameters(self.reference)

    def _models(self) -> list:
        return [self.reference]

    def handle(self, batch: SampleBatch) -> SampleBatch:
        # (an evaluation's samples need only their rewards)
        return batch if self.deferred or batch.eval_samples else super().handle(batch)

    def logprobs(self, padded) -> torch.Tensor:
        """The reference log-probs of a padded shard of samples (for the trainer, when `deferred`); the
        seconds taken add up in `deferred_s`."""
        started = time.monotonic()
        with self._on_device():
            ref = sequence_logprobs(self.reference, padded, self.cfg.rollout.temperature,
                                    self.cfg.model.forward_batch_size, self.cfg.model.packing)
        self.deferred_s += time.monotonic() - started
        return ref

    def score(self, batch: SampleBatch) -> None:
        padded = pad_samples(batch, self.pad_id)
        ref = sequence_logprobs(self.reference, padded, self.cfg.rollout.temperature, self.cfg.model.forward_batch_size,
                                self.cfg.model.packing)
        batch.ref_logprobs = np.concatenate(gather_responses(ref, padded) or [np.zeros(0)]).astype(np.float32)


class RewardRole(_Scoring):
    """Adds every reward component (rule-based functions and reward models) and their weighted total.
    When `deferred`, the functions are computed here and the reward models' columns on the trainer ranks
    (`complete`)."""

    MODEL = "reward"

    def setup(self) -> None:
        from transformers import AutoTokenizer

        from toolkit.modeling import ScoreModel
        from toolkit.training.engine import held_parameters

        super().setup()
        cfg = self.cfg
        dtype = torch_dtype(cfg.model.dtype)
        actor_vocab = AutoTokenizer.from_pretrained(cfg.tokenizer_path).get_vocab()
        self.functions = [(f.name, bounded(load_function(f.function), f.timeout_s), f.args, f.function)
                          for f in cfg.reward.functions]
        self.reward_models = []
        for rm in cfg.reward.models:
            tokenizer = AutoTokenizer.from_pretrained(rm.path)

            def load(device, path=rm.path):  # (one label: ScoreModel loads one; validation refuses classifiers)
                return ScoreModel(path, dtype, attention=cfg.model.attn_implementation).to(device).eval()

            stats = json.loads((Path(rm.path) / "reward_stats.json").read_text()) if rm.normalize else None
            # The same vocabulary: score the generated tokens themselves, not a new tokenization of the text.
            self.reward_models.append(RewardModel(self._load(load), tokenizer, tokenizer.get_vocab() == actor_vocab,
                                                  stats, str(rm.path)))
        if self.reward_models:
            self.status["reward_model_parameters"] = sum(held_parameters(rm.model) for rm in self.reward_models)
        self.names = [f.name for f in cfg.reward.functions] + [m.name for m in cfg.reward.models]
        self.weights = [f.weight for f in cfg.reward.functions] + [m.weight for m in cfg.reward.models]

    @property
    def deferred(self) -> bool:
        return super().deferred and bool(self.cfg.reward.models)

    def _models(self) -> list:
        return [rm.model for rm in self.reward_models]

    def score(self, batch: SampleBatch) -> None:
        columns = [self._call_function(f, batch, self.status) for f in self.functions]
        if self.deferred:  # (the trainer ranks fill these in: `complete`)
            columns += [np.full(len(batch), np.nan) for _ in self.reward_models]
        else:
            columns += [self._score_model(rm, batch) for rm in self.reward_models]
        batch.rewards = np.stack(columns, axis=1).astype(np.float32)
        batch.reward_names, batch.reward_weights = self.names, self.weights
        self._total(batch)

    def complete(self, batch: SampleBatch, shard_index: np.ndarray,
                 all_reduce: Callable[[torch.Tensor], torch.Tensor]) -> None:
        """Every trainer rank, when `deferred`: the reward models' scores of this rank's shard of `batch`,
        summed over the ranks into the whole batch's columns (zeros elsewhere: the sum is exact), then the
        total. The seconds taken add up in `deferred_s`."""
        started = time.monotonic()
        shard = batch.select(shard_index)
        if self.sharded:  # (every rank as many forward passes, which ZeRO-3 gathers each layer for: the shards
            width = -(-len(batch) // self.worker.group.workers)  # of an evaluation may differ by one, or be empty)
            shard = batch.select(np.resize(shard_index if len(shard_index) else np.zeros(1, np.int64), width))
        first = len(self.functions)
        with self._on_device():
            for k, rm in enumerate(self.reward_models):
                column = torch.zeros(len(batch), dtype=torch.float64)
                scores = self._score_model(rm, shard)[:len(shard_index)]
                column[torch.from_numpy(shard_index)] = torch.from_numpy(scores).double()
                batch.rewards[:, first + k] = all_reduce(column).numpy()
        self._total(batch)
        self.deferred_s += time.monotonic() - started

    def _total(self, batch: SampleBatch) -> None:
        total = batch.rewards @ np.asarray(self.weights, dtype=np.float32)
        clip = self.cfg.reward.clip
        batch.reward_total = (np.clip(total, -clip, clip) if clip else total).astype(np.float32)

    @staticmethod
    def _call_function(function, batch: SampleBatch, status: dict | None = None) -> np.ndarray:
        """The function's reward of every sample; while it runs, `status["doing"]` (the worker's status, which
        its heartbeats carry to the driver) names it and the sample: a function that hangs without a
        `timeout_s` stops the run at transport.step_timeout_s, and the error then says which one and where."""
        name, fn, args, path = function
        out = np.zeros(len(batch), dtype=np.float64)
        status = {} if status is None else status
        for i in range(len(batch)):
            where = f"prompt id {int(batch.prompt_ids[i])}, sample {int(batch.sample_index[i])}"
            status["doing"] = f"reward function {name!r} ({path}) on {where}"
            try:
                given = fn(prompt=prompt_text(batch.prompts[i]), response=batch.responses[i], **batch.fields[i], **args)
            except CallTimeout as e:
                raise RewardFunctionError(
                    f"reward function {name!r} ({path}) gave no reward for {where}: {e}; make it return sooner, or "
                    "give it a larger timeout_s in reward.functions") from None
            except Exception as e:
                raise RewardFunctionError(
                    f"reward function {name!r} ({path}) failed on {where}: {type(e).__name__}: {e}") from e
            value = _number(given)
            if value is None or not math.isfinite(value) or abs(value) > FLOAT32_MAX:  # (rewards are float32)
                raise RewardFunctionError(f"reward function {name!r} ({path}) returned {given!r} for {where}; "
                                          f"rewards must be finite numbers (a float, an int or a bool) within "
                                          f"float32's range (±{FLOAT32_MAX:.3g})")
            out[i] = value
        status.pop("doing", None)
        return out

    def _score_model(self, rm: "RewardModel", batch: SampleBatch) -> np.ndarray:
        """The reward model's score at the last token of prompt + response, the prompt cut from the left
        to fit (the end of the response is what the reward judges), normalised when asked. A finished
        response ends with the reward model's end-of-sequence token, where the `rm` stage trained its reward
        (`response_ids`), whichever of the generator's stop tokens it ended at."""
        r = self.cfg.rollout
        eos = rm.tokenizer.eos_token_id
        sequences = []
        for i in range(len(batch)):
            if rm.same_vocab:
                prompt, response = batch.prompt(i).tolist(), batch.response(i).tolist()
                if batch.finished[i] and eos is not None and response and response[-1] != eos:
                    # (it stopped at another of the actor's stop tokens, e.g. Gemma-it's <end_of_turn> where the
                    # tokenizer's EOS is <eos>: read there, the reward came from a token the model never ended at)
                    response[-1] = eos
            else:
                prompt = render_prompt(rm.tokenizer, batch.prompts[i], self.cfg.data.chat_template)
                response = rm.tokenizer(batch.responses[i], add_special_tokens=False)["input_ids"]
                if batch.finished[i] and eos is not None:
                    response = [*response, eos]
            prompt, response = fit(prompt, response, r.max_prompt_tokens + r.max_new_tokens, keep="end",
                                   bos=rm.tokenizer.bos_token_id)  # (a BOS token stays first, as the generator's)
            sequences.append(prompt + response)
        pad = rm.tokenizer.pad_token_id if rm.tokenizer.pad_token_id is not None else 0
        scores = last_token_scores(rm.model, sequences, pad, self.cfg.model.forward_batch_size, self.device,
                                   self.cfg.model.packing).numpy()
        if rm.stats is not None:
            scores = (scores - rm.stats["mean"]) / max(rm.stats["std"], 1e-6)
        bad = np.flatnonzero(~np.isfinite(scores))
        if len(bad):  # (an fp16 model that overflowed, say: NaN advantages for its group, or the batch's)
            i = int(bad[0])
            raise RewardFunctionError(
                f"reward model {rm.path} scored {scores[i]} for prompt id {int(batch.prompt_ids[i])}, sample "
                f"{int(batch.sample_index[i])} ({len(bad)} of {len(scores)} samples not finite); in "
                f"{self.cfg.model.dtype}, a model whose scores overflow needs float32 (model.dtype)")
        return scores


def _number(value) -> float | None:
    """`value` as a float where it is a number (a Python or NumPy one, or a tensor of one element); None for
    anything else, text too (float() would read "0.5", and a function that returns text is mistaken)."""
    if isinstance(value, (str, bytes)) or value is None:
        return None
    try:
        return float(value)
    except Exception:  # (TypeError, ValueError; OverflowError: an int past float's range; RuntimeError: a
        return None    # tensor of more than one element)


@dataclass
class RewardModel:
    model: torch.nn.Module
    tokenizer: object
    same_vocab: bool          # the actor's vocabulary: the samples' token ids are scored as they are
    stats: dict | None        # {mean, std} of its rewards on the RL prompts, when it normalises
    path: str = ""            # its directory, for errors
