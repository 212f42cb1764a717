"""Reward-model training: the model, its micro-batches of pairs and its loss (the loop is supervised.py's).

The model is a sequence classifier with one label, read at the last token of prompt + response (the
end-of-sequence token: the DeepSpeed-Chat / OpenRLHF convention). The loss is -log sigmoid(r_chosen -
r_rejected); the metrics are the pairs' accuracy and mean margin. After training, the reward's mean and
std are saved with the model (reward_stats.json), so RL can normalise it.
"""

from __future__ import annotations

import torch

from toolkit.algorithms.supervised import pairwise_loss
from toolkit.data.tokens import fit, render_prompt, response_ids
from toolkit.modeling import right_pad


class RMTask:

    def __init__(self, cfg, tokenizer):
        self.cfg, self.tokenizer = cfg, tokenizer
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0

    def model(self, dtype: torch.dtype):
        from toolkit.modeling import ScoreModel

        return ScoreModel(self.cfg.model.base, dtype, self.cfg.model.dropout, self.cfg.model.attn_implementation)

    def sequence(self, prompt, response: str) -> list[int]:
        """prompt + response + EOS, the prompt cut from the left (then the response's start) to fit."""
        return self._cut(prompt, response)[0]

    def _cut(self, prompt, response: str) -> tuple[list[int], bool]:
        """`sequence`, and whether train.max_tokens cut it."""
        prompt_ids = render_prompt(self.tokenizer, prompt, self.cfg.data.chat_template)
        ids = response_ids(self.tokenizer, response)
        p, r = fit(prompt_ids, ids, self.cfg.train.max_tokens, keep="end", bos=self.tokenizer.bos_token_id)
        return p + r, len(p) + len(r) < len(prompt_ids) + len(ids)

    def batch(self, examples, packing: bool = False) -> dict:
        """Chosen sequences first, then rejected, right-padded: one forward pass for both (`targets`: the
        pairs its loss is a mean over; `cut_rows`: the pairs train.max_tokens cut)."""
        chosen = [self._cut(ex.prompt, ex.chosen) for ex in examples]
        rejected = [self._cut(ex.prompt, ex.rejected) for ex in examples]
        ids, attention = right_pad([seq for seq, _ in chosen + rejected], self.pad_id)
        return {"input_ids": ids, "attention_mask": attention, "last": attention.sum(1) - 1,
                "tokens": int(attention.sum()), "positions": ids.numel(), "targets": len(examples),
                "cut_rows": sum(a or b for (_, a), (_, b) in zip(chosen, rejected))}

    def loss(self, model, batch: dict, device) -> tuple[torch.Tensor, dict[str, float]]:
        scores = model(batch["input_ids"].to(device), batch["attention_mask"].to(device))
        rewards = scores[torch.arange(len(scores), device=scores.device), batch["last"].to(device)]
        n = len(rewards) // 2
        loss, stats = pairwise_loss(rewards[:n], rewards[n:])
        return loss, {"loss_sum": float(loss) * n, "correct": float(stats["accuracy"]) * n,
                      "margin_sum": float(stats["margin"]) * n, "pairs": float(n)}

    @staticmethod
    def summary(sums: dict[str, float], prefix: str = "") -> dict[str, float]:
        pairs = max(sums["pairs"], 1)
        return {f"{prefix}loss": sums["loss_sum"] / pairs, f"{prefix}accuracy": sums["correct"] / pairs,
                f"{prefix}margin": sums["margin_sum"] / pairs}
