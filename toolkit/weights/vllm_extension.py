"""vLLM worker extension: join the weight-sync group and reload weights in place.

vLLM mixes this class into its workers (`LLM(worker_extension_cls=...)`); the generator calls its
methods through `llm.collective_rpc`, so they run wherever vLLM runs the model (in the generator's own
process on CPU, in each tensor-parallel worker process on GPU).
"""

from __future__ import annotations

from toolkit.transport.rendezvous import connect_store
from toolkit.weights.sync import WeightReceiver, form_group


class WeightSyncExtension:
    def join_weight_sync(self, host: str, port: int, first_rank: int, world_size: int, bucket_bytes: int,
                         timeout_s: float) -> int:
        """Join as rank `first_rank + <this worker's rank>`; return the number of weights in the manifest."""
        store = connect_store(host, port, timeout_s)
        group = form_group(store, first_rank + self.rank, world_size, timeout_s, self.device)
        self._weight_receiver = WeightReceiver(group, bucket_bytes, self.device)
        return len(self._weight_receiver.manifest)

    def receive_weights(self) -> int:
        """Receive the next version of the weights into the model; return that version."""
        version, tensors = self._weight_receiver.receive()
        try:
            self.model_runner.reload_weights(weights_iterator=tensors)
        finally:
            for _ in tensors:  # keep the group in step even if loading stopped early
                pass
        return version
