"""The PTX mixture's text (DeepSpeed-Chat's unsupervised data): micro-batches of language-modelling rows.

Which rows a micro-batch holds is a pure function of (step, micro-batch, rank), so a resumed run trains
on the same text: the blended order of the text rows is cut into consecutive slices of `size` rows, one
per (step, micro-batch, rank) in that order.
"""

from __future__ import annotations

import torch

from toolkit.data.dataset import StageData
from toolkit.data.tokens import text_ids
from toolkit.modeling import right_pad


class PtxText:
    def __init__(self, ptx, tokenizer, seed: int, size: int, per_step: int, rank: int, world: int):
        """`ptx`: the PtxSection; `size` rows per micro-batch; `per_step` micro-batches per step."""
        self.data = StageData(ptx.data, "ptx", "text", seed)
        self.tokenizer, self.max_tokens = tokenizer, ptx.max_tokens
        self.size, self.per_step, self.rank, self.world = size, per_step, rank, world
        self.cursor = 0
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0

    def batch(self, step: int, index: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(input_ids, attention_mask, loss_mask) of micro-batch `index` of `step` on this rank."""
        start = ((step * self.per_step + index) * self.world + self.rank) * self.size
        if start < self.cursor:
            self.data.skip(start)
        elif start > self.cursor:
            self.data.next(start - self.cursor)
        rows = self.data.next(self.size)
        self.cursor = start + self.size
        sequences = [text_ids(self.tokenizer, ex.text)[: self.max_tokens] for ex in rows]
        ids, attention = right_pad(sequences, self.pad_id)
        return ids, attention, attention
