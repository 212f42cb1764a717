"""Supervised fine-tuning: the model, its micro-batches and its loss (the loop is supervised.py's).

The loss is the cross-entropy on the response tokens only (the prompt is context, not a target). With
`train.packing`, a micro-batch's rows are packed into one sequence, positions restarting at each row and
each row's attention computed on its own (`toolkit.packing`), so no padding is computed.
"""

from __future__ import annotations

import torch

from toolkit.algorithms.supervised import response_lm_loss
from toolkit.data.tokens import fit, render_prompt, response_ids
from toolkit.modeling import right_pad
from toolkit.packing import model_inputs


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
        ids, n, _ = self._cut(example)
        return ids, n

    def _cut(self, example) -> tuple[list[int], int, bool]:
        """`tokens`, and whether train.max_tokens cut the example."""
        prompt = render_prompt(self.tokenizer, example.prompt, self.cfg.data.chat_template)
        response = response_ids(self.tokenizer, example.response)
        whole = len(prompt) + len(response)
        prompt, response = fit(prompt, response, self.cfg.train.max_tokens, bos=self.tokenizer.bos_token_id)
        return prompt + response, len(prompt), len(prompt) + len(response) < whole

    def batch(self, examples, packing: bool = False) -> dict:
        """The model inputs of a micro-batch, its loss mask (1 on response tokens) and their count (`targets`:
        what its loss is a mean over) and how many rows train.max_tokens cut (`cut_rows`). Packed, the batch's
        `packed` (a `toolkit.packing.Packed`) is what its forward and backward passes run inside."""
        cuts = [self._cut(ex) for ex in examples]
        rows = [(seq, n) for seq, n, _ in cuts]
        padded_ids, attention = right_pad([seq for seq, _ in rows], self.pad_id)
        packed, ids, inputs = model_inputs(padded_ids, attention, packing)
        # (a sample's first token is never a target: nothing in it comes before; packed, it would be predicted
        # from the sample before. So a row whose prompt is empty, or cut away by train.max_tokens, has one
        # target fewer than response tokens, and `targets` counts what the loss averages, in either layout)
        if packed is not None:
            mask = torch.tensor([[int(i >= max(n, 1)) for seq, n in rows for i in range(len(seq))]])
        else:
            mask = torch.zeros_like(ids)
            for i, (seq, n) in enumerate(rows):
                mask[i, max(n, 1): len(seq)] = 1
        return {"input_ids": ids, "inputs": inputs, "loss_mask": mask, "tokens": int(attention.sum()),
                "positions": ids.numel(), "packed": packed, "targets": int(mask.sum()),
                "cut_rows": sum(cut for _, _, cut in cuts)}

    def loss(self, model, batch: dict, device) -> tuple[torch.Tensor, dict[str, float]]:
        """(loss to minimise, sums for metrics): the token mean over the micro-batch's response tokens."""
        ids = batch["input_ids"].to(device)
        logits = model(input_ids=ids, **{k: v.to(device) for k, v in batch["inputs"].items()}).logits
        total, tokens = response_lm_loss(logits, ids, batch["loss_mask"].to(device))
        return total / tokens.clamp(min=1), {"loss_sum": float(total.detach()), "target_tokens": float(tokens)}

    @staticmethod
    def summary(sums: dict[str, float], prefix: str = "") -> dict[str, float]:
        """Metrics from summed statistics: mean loss per response token (and perplexity when evaluating)."""
        import math

        loss = sums["loss_sum"] / max(sums["target_tokens"], 1)
        out = {f"{prefix}loss": loss}
        if prefix:
            out[f"{prefix}ppl"] = math.exp(min(loss, 50))
        return out
