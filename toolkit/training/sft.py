"""Supervised fine-tuning: the model, its micro-batches and its loss (the loop is supervised.py's).

The loss is the cross-entropy on the response tokens only (the prompt is context, not a target). With
`train.packing`, a micro-batch's rows are packed into one sequence, positions restarting at each row and
attention kept within each row by a block-diagonal causal mask, so no padding is computed.
"""

from __future__ import annotations

import torch

from toolkit.algorithms.supervised import response_lm_loss
from toolkit.data.tokens import fit, render_prompt, response_ids
from toolkit.modeling import right_pad


class SFTTask:

    def __init__(self, cfg, tokenizer):
        self.cfg, self.tokenizer = cfg, tokenizer
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0

    def model(self, dtype: torch.dtype):
        from transformers import AutoModelForCausalLM

        from toolkit.modeling import pretrained_kwargs

        m = self.cfg.model
        return AutoModelForCausalLM.from_pretrained(m.base, **pretrained_kwargs(m.base, dtype, m.attn_implementation,
                                                                                m.dropout))

    def tokens(self, example) -> tuple[list[int], int]:
        """(prompt + response ids, prompt length) of an example, cut to train.max_tokens."""
        prompt = render_prompt(self.tokenizer, example.prompt, self.cfg.data.chat_template)
        prompt, response = fit(prompt, response_ids(self.tokenizer, example.response), self.cfg.train.max_tokens)
        return prompt + response, len(prompt)

    def batch(self, examples, packing: bool = False) -> dict:
        """The model inputs of a micro-batch and its loss mask (1 on response tokens)."""
        rows = [self.tokens(ex) for ex in examples]
        if packing:
            ids = torch.tensor([[t for seq, _ in rows for t in seq]])
            mask = torch.tensor([[int(i >= n) for seq, n in rows for i in range(len(seq))]])
            positions = torch.tensor([[i for seq, _ in rows for i in range(len(seq))]])
            segments = torch.tensor([k for k, (seq, _) in enumerate(rows) for _ in seq])
            allowed = (segments[:, None] == segments[None, :]) & torch.ones(len(segments), len(segments)).tril().bool()
            return {"input_ids": ids, "position_ids": positions, "loss_mask": mask, "tokens": ids.numel(),
                    "positions": ids.numel(), "attention_mask": allowed[None, None]}
        ids, attention = right_pad([seq for seq, _ in rows], self.pad_id)
        mask = torch.zeros_like(ids)
        for i, (seq, n) in enumerate(rows):
            mask[i, n: len(seq)] = 1
        return {"input_ids": ids, "attention_mask": attention, "loss_mask": mask, "tokens": int(attention.sum()),
                "positions": ids.numel()}

    def loss(self, model, batch: dict, device) -> tuple[torch.Tensor, dict[str, float]]:
        """(loss to minimise, sums for metrics): the token mean over the micro-batch's response tokens."""
        ids = batch["input_ids"].to(device)
        attention = batch["attention_mask"].to(device)
        if attention.dim() == 4:  # packed: an additive float mask, in the model's dtype
            dtype = next(model.parameters()).dtype
            attention = torch.zeros(attention.shape, dtype=dtype, device=device).masked_fill(
                ~attention, torch.finfo(dtype).min)
        extra = {"position_ids": batch["position_ids"].to(device)} if "position_ids" in batch else {}
        logits = model(input_ids=ids, attention_mask=attention, **extra).logits
        total, tokens = response_lm_loss(logits, ids, batch["loss_mask"].to(device))
        return total / tokens.clamp(min=1), {"loss_sum": float(total), "target_tokens": float(tokens)}

    @staticmethod
    def summary(sums: dict[str, float], prefix: str = "") -> dict[str, float]:
        """Metrics from summed statistics: mean loss per response token (and perplexity when evaluating)."""
        import math

        loss = sums["loss_sum"] / max(sums["target_tokens"], 1)
        out = {f"{prefix}loss": loss}
        if prefix:
            out[f"{prefix}ppl"] = math.exp(min(loss, 50))
        return out
