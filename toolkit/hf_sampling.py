"""transformers `generate` sampling as vLLM samples: each row from a seed of its own, and with nothing but
the settings given.

transformers samples a whole batch from the one global random stream, so a sample depends on the rows
beside it and on how the samples were cut into batches. `SeededDraw`, a logits processor, draws every
row's tokens itself: it takes the row's uniform numbers from the row's own seed (one stream of
`max_new_tokens` numbers, made once), picks the token whose interval of the cumulative distribution
(after temperature and top-p) holds that step's number, and leaves only that token possible, so greedy
decoding takes it (at temperature 0 it picks the likeliest). A row's sample is then the one it gets
alone, in any batch (up to float rounding of the batch's padding), and the global random state is not
touched. It also keeps the log-prob of each picked token under that distribution (what vLLM's
`processed_logprobs` give: the behaviour log-probs) and under the model.

transformers also fills every setting that a GenerationConfig leaves unset from the model's own
`generation_config`: its `eos_token_id` (so `rollout.ignore_eos` still stopped each row at its first
end-of-sequence token and padded the rest), and a `repetition_penalty` or `no_repeat_ngram_size`, which
would change what is sampled and its log-probs away from the trainer's. `as_given` hides the model's
own while we generate.

`sample` puts them together: one `generate` over a batch of prompts, each row from its own seed, cut at
the first token it stops at. The RL generator's transformers engine and `generate`/`chat` both sample so,
and stop where vLLM stops (`stop_ids`): at the tokenizer's end-of-sequence token and at every
`eos_token_id` of the model's own generation_config (Llama-3-Instruct's `<|eot_id|>`, Gemma-it's
`<end_of_turn>`); before, they ran on past the end of a turn to max_new_tokens there.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass

import torch


@dataclass
class Drawn:
    tokens: list[int]  # the response, with the end-of-sequence token where it ended with one
    finished: bool     # ended with the end-of-sequence token (not cut at max_new_tokens)
    drawn: list[float]  # each token's log-prob under the distribution it was drawn from (greedy: the model's)
    raw: list[float]    # each token's log-prob under the model (temperature 1, no top-p)


def stop_ids(tokenizer, model) -> list[int]:
    """The tokens a response ends at, as vLLM ends it: the tokenizer's end-of-sequence token, and every
    `eos_token_id` of the model's own generation_config."""
    ids = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    extra = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    ids += [extra] if isinstance(extra, int) else list(extra or [])
    return list(dict.fromkeys(ids))


@torch.no_grad()
def sample(model, device, prompts: list[list[int]], seeds: list[int], temperature: float, top_p: float,
           max_new_tokens: int, pad_id: int, stop: list[int]) -> list[Drawn]:
    """One response to each of `prompts` (token ids), row i drawn from `seeds[i]`, in one `generate` (the
    prompts padded on the left with `pad_id`). A row stops at the first of the tokens `stop` ([]: never,
    every row runs to `max_new_tokens`); only the settings given here apply (`as_given`)."""
    from transformers import GenerationConfig, LogitsProcessorList

    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):], mask[i, width - len(p):] = torch.tensor(p), 1
    # Greedy decoding picks each row's token, the only one `SeededDraw` leaves.
    config = GenerationConfig(do_sample=False, max_new_tokens=max_new_tokens, pad_token_id=pad_id,
                              eos_token_id=list(stop) or None, return_dict_in_generate=True)
    draw = SeededDraw(seeds, temperature, top_p, max_new_tokens)
    with as_given(model):
        out = model.generate(input_ids=ids.to(device), attention_mask=mask.to(device), generation_config=config,
                             logits_processor=LogitsProcessorList([draw]))
    drawn, raw = draw.drawn_logprobs().cpu(), draw.raw_logprobs().cpu()
    rows = []
    for i, row in enumerate(out.sequences[:, width:].tolist()):
        ends = [k for k, token in enumerate(row) if token in stop]  # (generate pads a finished row after it)
        finished = bool(ends)
        end = ends[0] + 1 if finished else len(row)
        rows.append(Drawn(row[:end], finished, drawn[i, :end].tolist(), raw[i, :end].tolist()))
    return rows


@contextmanager
def as_given(model: torch.nn.Module):
    """While in the block, every module of `model` with a `generation_config` (the model, and the one inside
    a peft wrapper) has a neutral one, so `generate` takes only the settings it is given."""
    from transformers import GenerationConfig

    saved = [(m, m.generation_config) for m in model.modules()
             if isinstance(getattr(m, "generation_config", None), GenerationConfig)]
    for m, _ in saved:
        m.generation_config = GenerationConfig()
    try:
        yield
    finally:
        for m, config in saved:
            m.generation_config = config


class SeededDraw:
    def __init__(self, seeds: list[int], temperature: float, top_p: float, max_new_tokens: int):
        """`seeds`: one per row of the batch, in order; `temperature` 0 is greedy (each row's likeliest token)."""
        self.uniforms = None if temperature == 0 else torch.stack(
            [torch.rand(max_new_tokens, generator=torch.Generator().manual_seed(seed)) for seed in seeds])
        self.temperature, self.top_p = temperature, top_p
        self.step = 0
        # [B] a step, float32 on the device: each picked token's log-prob under the model (`raw`), and under
        # the distribution it was drawn from (`drawn`; greedy: the model's). Kept here, one number a row, so
        # `generate` need not keep every step's logits (rows x vocabulary x steps).
        self.raw: list[torch.Tensor] = []
        self.drawn: list[torch.Tensor] = []

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        model = torch.log_softmax(scores.float(), dim=-1)
        drawn = None  # (greedy: the model's own, `raw` below)
        if self.uniforms is None:
            picks = model.argmax(-1, keepdim=True)
        else:
            probs = torch.softmax(scores.float() / self.temperature, dim=-1)
            if self.top_p < 1:  # keep the smallest set of the likeliest tokens whose mass reaches top_p
                ranked, order = probs.sort(dim=-1, descending=True)
                ranked[ranked.cumsum(-1) - ranked >= self.top_p] = 0
                probs = torch.zeros_like(probs).scatter_(-1, order, ranked)
            cumulative = probs.cumsum(-1)
            u = self.uniforms[:, self.step].to(probs.device)[:, None] * cumulative[:, -1:]
            picks = torch.searchsorted(cumulative, u, right=True).clamp_(max=probs.shape[-1] - 1)
            picks = torch.where(probs.gather(-1, picks) > 0, picks, probs.argmax(-1, keepdim=True))  # (never a 0 one)
            drawn = (probs.gather(-1, picks)[:, 0] / cumulative[:, -1]).log()
        raw = model.gather(-1, picks)[:, 0]
        self.raw.append(raw)
        self.drawn.append(raw if drawn is None else drawn)
        self.step += 1
        return torch.full_like(scores, float("-inf")).scatter_(-1, picks, 0.0)

    def drawn_logprobs(self) -> torch.Tensor:
        """float32 [B, steps]: each picked token's log-prob under the distribution it was drawn from."""
        return torch.stack(self.drawn, dim=1)

    def raw_logprobs(self) -> torch.Tensor:
        """float32 [B, steps]: each picked token's log-prob under the model (temperature 1, no top-p)."""
        return torch.stack(self.raw, dim=1)
