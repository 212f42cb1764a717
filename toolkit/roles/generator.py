"""Generator role: prompts in, sampled responses out (vLLM, or transformers as the fallback).

Each sample is drawn with its own seed, a hash of (run seed, step, prompt id, sample index), so what is
sampled does not depend on how prompts are batched or which generator worker got them. On `sync` the
generator joins the trainer's broadcast and reloads the new weights in place.
"""

from __future__ import annotations

import hashlib
import logging
import time

import numpy as np

from toolkit.placement.plan import group_of
from toolkit.data.tokens import cut_left, render_prompt
from toolkit.hold import hold
from toolkit.roles.base import Role
from toolkit.samples import SampleBatch, ragged
from toolkit.weights import probe
from toolkit.weights.sync import sync_group_name

log = logging.getLogger(__name__)


def sample_seed(run_seed: int, step: int, prompt_id: int, group_index: int, sample_index: int) -> int:
    """The seed of a sample: its own, whichever worker draws it and whatever else is in its batch. The group's
    place in the step is part of it: a prompt drawn twice in a step (a small source of a blend repeats, a
    file of fewer rows than prompts_per_step) got the same seeds twice, and its two groups were one sample
    set trained on twice."""
    key = f"{run_seed}:{step}:{prompt_id}:{group_index}:{sample_index}"
    return int.from_bytes(hashlib.blake2b(key.encode(), digest_size=4).digest(), "little") & 0x7FFFFFFF


class GeneratorRole(Role):
    def setup(self) -> None:
        from transformers import AutoTokenizer

        from toolkit.roles.engines import make_engine

        cfg = self.cfg
        self.tokenizer = AutoTokenizer.from_pretrained(cfg.tokenizer_path)
        self.truncated = 0
        trainer = self.worker.roles.get("trainer")
        if trainer is not None and cfg.generation_backend == "vllm":
            # vLLM in the trainer rank's process (an engine per rank): the trainer loads its weights into it in memory.
            from toolkit.roles.engines.vllm_engine import VllmEngine

            started = time.monotonic()
            self.engine = VllmEngine(cfg, self.device, beside_trainer=True)
            self.probe = trainer.layout.probe
            trainer.generator = self
            self.version = trainer.version  # (the trainer loads its weights before the first step: `begin`)
            log.info("generating with vLLM in the trainer's process, ready in %.1f s (policy_version %d; sleep "
                     "mode %s)", time.monotonic() - started, self.version, "on" if self.engine.sleeps else
                     "not available here")
            return
        if trainer is not None:
            # Hosted with the trainer: generate with the trainer's own actor (its tensors, no copy),
            # or under ZeRO-3 with a full copy the trainer refreshes after each update.
            from toolkit.roles.engines.hf_engine import HFEngine

            self.engine = HFEngine(cfg, self.device, model=trainer.generation_model())
            self.version = trainer.version
            trainer.generator = self
            log.info("generating with the trainer's actor in this worker (policy_version %d)", self.version)
            return
        backend = cfg.generation_backend
        hold("loading", self.worker.wenv.run_dir)
        log.info("starting the %s engine for %s", backend, cfg.model.actor)
        started = time.monotonic()
        self.engine = make_engine(backend, cfg, self.device)
        log.info("engine ready in %.1f s", time.monotonic() - started)
        self.version = 0
        self.status["policy_version"] = 0
        # Join this worker's weight-sync group, hosted by trainer rank 0: the engine's ranks are 1.. in it.
        host, port = self.worker.book[group_of(self.worker.groups, "trainer").worker_ids()[0]]["store"].rsplit(":", 1)
        if self.worker.generation:  # (the driver then asks the trainer to form the new group with us)
            self.worker.control.send("joining_sync", generation=self.worker.generation)
            hold("rejoining", self.worker.wenv.run_dir)
        joined = self.engine.join_weight_sync(host, int(port), 1, 1 + self.engine.ranks, cfg.transport.step_timeout_s,
                                              sync_group_name(self.worker.id, self.worker.generation))
        self.probe = joined["probe"]
        log.info("joined the weight-sync group (%d weights)%s", joined["weights"],
                 f"; {joined['engine_groups']} process group(s) of vLLM's own ranks proved the run's key"
                 if joined.get("engine_groups") else "")
        if self.worker.generation:
            # Started again in place of a worker that failed: the trainer sends the current weights into
            # the new group first, and no prompt is taken before they are in.
            self.on_command(self.worker.wait_command("sync", cfg.transport.step_timeout_s, lambda m: m.get("rejoin")))

    def holds(self, version: int, sync_s: float = 0.0, check_diff: float | None = None) -> None:
        """Now generating with `version` of the weights: tell the driver (and how well the sync checked)."""
        self.version = version
        self.status.update(phase="idle", policy_version=version)
        self.worker.control.send("synced", version=version, sync_s=sync_s, check_diff=check_diff)

    def handle(self, meta: dict):
        """The samples of the prompts in `meta`: one SampleBatch, or with `rollout.stream_groups` an iterator
        of SampleBatches of whole prompt groups, each sent on as soon as it is complete (`_stream`)."""
        step, texts = meta["step"], meta["prompts"]
        evaluation = meta.get("eval_samples", 0)  # (> 0: held-out prompts, sampled as eval.* says, not trained on)
        group_size = self.cfg.eval.n if evaluation else self.cfg.rollout.group_size
        # (the step, from 0, whose samples these are; an evaluation's: the step whose weights it samples)
        self.status.update(phase="evaluating" if evaluation else "generating", step=step - 1 if evaluation else step)
        hold("evaluating" if evaluation else "generating", self.worker.wenv.run_dir)
        prompts = self._tokenize(step, texts)
        per_prompt = lambda values: [v for v in values for _ in range(group_size)]  # noqa: E731
        samples = {"prompts": per_prompt(prompts), "prompt_ids": per_prompt(meta["prompt_ids"]),
                   "group_index": per_prompt(meta["group_index"]), "sample_index": list(range(group_size)) * len(prompts),
                   "texts": per_prompt(texts), "fields": per_prompt(meta["fields"])}
        samples["seeds"] = [sample_seed(self.cfg.run.seed, step, pid, g, k)
                            for pid, g, k in zip(samples["prompt_ids"], samples["group_index"], samples["sample_index"])]
        n = len(samples["prompts"])  # (sample i: of prompt i // group_size, its sample i % group_size)
        if self.streams and not evaluation:
            return self._stream(step, samples)
        started = time.monotonic()
        completions = self.engine.generate(samples["prompts"], samples["seeds"], self.cfg.eval if evaluation else None)
        batch = self._batch(step, samples, list(range(n)), completions, time.monotonic() - started)
        batch.eval_samples = evaluation
        self._generated(step, n, len(batch.response_tokens), batch.timings["generate_s"], evaluation=bool(evaluation))
        return batch

    @property
    def streams(self) -> bool:
        """Whether samples go on in parts: asked for, and vLLM on a worker without the trainer (beside the
        trainer the parts would be trained on in this process, and vLLM must sleep after the last)."""
        return bool(self.cfg.rollout.stream_groups) and hasattr(self.engine, "stream") and "trainer" not in self.worker.roles

    def _stream(self, step: int, samples: dict):
        """SampleBatches of at least `rollout.stream_groups` whole prompt groups (the last one: what is
        left), each as soon as its groups' samples have all finished. A part's `generate_s` is the engine's
        time since the part before, not the time spent sending it on, so a worker's parts add up to its
        generation time."""
        size, wanted = self.cfg.rollout.group_size, self.cfg.rollout.stream_groups
        done: dict = {}
        left = [size] * (len(samples["prompts"]) // size)  # (unfinished samples of each group)
        ready: list[int] = []  # samples of whole groups not sent yet
        total_s, tokens, parts = 0.0, 0, 0
        started = time.monotonic()
        for finished in self.engine.stream(samples["prompts"], samples["seeds"]):
            for i, completion in finished:
                done[i] = completion
                left[i // size] -= 1
                if left[i // size] == 0:
                    ready.extend(range(i // size * size, i // size * size + size))
            if ready and (len(ready) >= wanted * size or len(done) == len(samples["prompts"])):
                seconds, chosen = time.monotonic() - started, sorted(ready)
                part = self._batch(step, samples, chosen, [done[j] for j in chosen], seconds)
                total_s, tokens, parts, ready = total_s + seconds, tokens + len(part.response_tokens), parts + 1, []
                yield part
                started = time.monotonic()
        self._generated(step, len(done), tokens, total_s, parts)

    def _batch(self, step: int, samples: dict, chosen: list[int], completions: list, generate_s: float) -> SampleBatch:
        """The SampleBatch of samples `chosen` (positions in `samples`), whose completions are given."""
        pick = lambda key: [samples[key][i] for i in chosen]  # noqa: E731
        prompt_tokens, prompt_offsets = ragged(pick("prompts"), np.int32)
        response_tokens, response_offsets = ragged([c.tokens for c in completions], np.int32)
        behaviour, _ = ragged([c.logprobs for c in completions], np.float32)
        return SampleBatch(
            step=step, prompt_ids=np.asarray(pick("prompt_ids"), np.int64),
            group_index=np.asarray(pick("group_index"), np.int32), sample_index=np.asarray(pick("sample_index"), np.int32),
            policy_version=np.full(len(completions), self.version, np.int32), prompt_tokens=prompt_tokens,
            prompt_offsets=prompt_offsets, response_tokens=response_tokens, response_offsets=response_offsets,
            behaviour_logprobs=behaviour, finished=np.asarray([c.finished for c in completions], bool),
            prompts=pick("texts"), responses=[c.text for c in completions], fields=pick("fields"),
            timings={"generate_s": generate_s, "generator": self.worker.id})

    def _generated(self, step: int, samples: int, tokens: int, seconds: float, parts: int = 1,
                   evaluation: bool = False) -> None:
        """A step's samples have all gone: log it, and give the device back where vLLM sleeps (not after an
        evaluation: the next step's generation follows it)."""
        log.info("step %d: %d %ssamples, %d tokens in %.2f s%s", step, samples, "evaluation " * evaluation, tokens,
                 seconds, f" (sent on in {parts} parts)" if parts > 1 else "")
        if hasattr(self.engine, "sleep") and not evaluation:  # (vLLM in the trainer's process, on GPU: it gives
            self.engine.sleep()  # its memory back while the trainer works; a no-op anywhere else)
        self.status["phase"] = "idle"

    def on_command(self, msg) -> None:
        if msg.kind != "sync":
            return super().on_command(msg)
        self.status["phase"] = "syncing"
        started = time.monotonic()
        version, expected = self.engine.receive_weights()
        if version != msg.meta["version"]:
            raise RuntimeError(f"received weights of policy_version {version}, expected {msg.meta['version']}")
        sync_s = time.monotonic() - started
        self.holds(version, sync_s, self._check_sync(version, expected))

    def _check_sync(self, version: int, expected) -> float | None:
        """Mean |log-prob difference| to the trainer on the probe sequence (raises above the tolerance)."""
        r = self.cfg.rollout
        if not r.sync_check:
            return None
        actual = probe.engine_logprobs(self.engine, self.probe)
        return probe.check(expected, actual, self.cfg.sync_check_tolerance, version,
                           f"generator worker {self.worker.id} ({self.cfg.generation_backend})")

    def _tokenize(self, step: int, texts: list) -> list[list[int]]:
        """Token ids of each prompt (text or chat messages), cut from the left to rollout.max_prompt_tokens, a
        BOS token staying first (`cut_left`), with one warning for the prompts of a message, not one each (a
        data set of long prompts would fill the log)."""
        limit = self.cfg.rollout.max_prompt_tokens
        rendered = [render_prompt(self.tokenizer, t, self.cfg.data.chat_template) for t in texts]
        cut = [len(tokens) for tokens in rendered if len(tokens) > limit]
        if cut:
            self.truncated += len(cut)
            log.warning("step %d: %d of %d prompt(s) cut from the left to rollout.max_prompt_tokens %d (the longest "
                        "had %d tokens; %d cut so far)", step, len(cut), len(texts), limit, max(cut), self.truncated)
        return [cut_left(tokens, limit, self.tokenizer.bos_token_id) for tokens in rendered]

    def close(self) -> None:
        self.engine.close()
