"""Generation engines behind one interface: vLLM, and transformers `generate` as the fallback.

An engine turns token prompts into sampled responses with the log-probability of every sampled token
(under the sampling distribution, i.e. after temperature), and takes new weights in place.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Completion:
    tokens: list[int]
    logprobs: list[float]
    finished: bool          # ended with EOS, not cut at max_new_tokens
    text: str


def make_engine(backend: str, cfg, device):
    """The engine named by `backend` ('vllm' or 'hf') for run config `cfg`."""
    if backend == "vllm":
        from toolkit.roles.engines.vllm_engine import VllmEngine
        return VllmEngine(cfg, device)
    from toolkit.roles.engines.hf_engine import HFEngine
    return HFEngine(cfg, device)
