"""transformers `generate` engine: the fallback on machines without vLLM, and the engine of a generator
that shares its worker with the trainer (it then generates with the trainer's actor module itself)."""

from __future__ import annotations

import torch

from toolkit.hf_sampling import stop_ids
from toolkit.roles.engines import Completion
from toolkit.transport.rendezvous import connect_store
from toolkit.weights.sync import WeightReceiver, form_group


class HFEngine:
    ranks = 1

    def __init__(self, cfg, device, model=None):
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.cfg, self.device = cfg, device
        self.tokenizer = AutoTokenizer.from_pretrained(cfg.tokenizer_path)
        if model is None:
            model = AutoModelForCausalLM.from_pretrained(cfg.model.actor, dtype=getattr(torch, cfg.model.dtype),
                                                         attn_implementation=cfg.model.attn_implementation)
            model.to(device).eval()
        self.model = model
        self.pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else self.tokenizer.eos_token_id
        self.stop = stop_ids(self.tokenizer, model)  # (where vLLM stops; rollout.ignore_eos: nowhere, as vLLM)
        self.rollout_stop = [] if cfg.rollout.ignore_eos else self.stop
        self._receiver = None
        self._store = None  # (the weight-sync group's rendezvous store)

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], seeds: list[int], sampling=None) -> list[Completion]:
        # In batches of rollout.generate_batch_size prompts (all at once when unset). Each sample is drawn
        # from its own seed (toolkit/hf_sampling.py), as vLLM draws it: what is sampled does not depend on
        # the batches, and the global random state, which a trainer in the same process draws from, is
        # not touched. A model's own generation_config (e.g. a repetition_penalty) does not apply.
        # `sampling`: an evaluation's (its responses end at the end-of-sequence token), else the rollout's.
        from toolkit.hf_sampling import sample

        size = self.cfg.rollout.generate_batch_size or len(prompts)
        s = self.cfg.rollout if sampling is None else sampling
        stop = self.rollout_stop if sampling is None else self.stop
        training = self.model.training
        self.model.eval()
        try:
            completions = []
            for start in range(0, len(prompts), size):
                rows = sample(self.model, self.device, prompts[start:start + size], seeds[start:start + size],
                              s.temperature, s.top_p, self.cfg.rollout.max_new_tokens, self.pad_id, stop)
                completions += [Completion(r.tokens, r.drawn, r.finished,
                                           self.tokenizer.decode(r.tokens, skip_special_tokens=True)) for r in rows]
            return completions
        finally:
            self.model.train(training)

    @torch.no_grad()
    def prompt_logprobs(self, tokens: list[int], top: int = 0) -> list[dict[int, float]]:
        """For each token after the first: {token id: log-prob} of that token and the `top` likeliest ones
        (`top=-1`: every token of the vocabulary)."""
        logits = self.model(torch.tensor([tokens], device=self.device)).logits[0, :-1].float()
        logprobs = logits.log_softmax(-1).cpu()
        k = logprobs.shape[-1] if top == -1 else top
        out = []
        for position, token in enumerate(tokens[1:]):
            ids = [token, *logprobs[position].topk(k).indices.tolist()]
            out.append({i: float(logprobs[position, i]) for i in ids})
        return out

    def join_weight_sync(self, host: str, port: int, first_rank: int, world_size: int, timeout_s: float,
                         name: str = "0") -> dict:
        """Join the trainer's weight-sync group `name`; {weights, probe}."""
        self._store = connect_store(host, port, timeout_s)  # (kept for the group's life: torch holds only its C++ side)
        group = form_group(self._store, first_rank, world_size, timeout_s, self.device, name)
        self._receiver = WeightReceiver(group, self.device, timeout_s)
        return {"weights": self._receiver.weights, "probe": self._receiver.probe}

    def receive_weights(self) -> tuple[int, torch.Tensor]:
        """Load the next version of the weights; (that version, the trainer's probe log-probs)."""
        version, tensors = self._receiver.receive()
        try:
            self.load_weights(tensors)
        finally:
            for _ in tensors:  # keep the group in step even if loading stopped early
                pass
        return version, self._receiver.probe_logprobs()

    @torch.no_grad()
    def load_weights(self, named_tensors) -> None:
        """Copy (name, tensor) pairs into the model's parameters."""
        params = dict(self.model.named_parameters())
        for name, tensor in named_tensors:
            params[name].data.copy_(tensor)

    def close(self) -> None:
        self.model = None
