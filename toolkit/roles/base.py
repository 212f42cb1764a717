"""Role: the part of the RL loop a worker hosts, fed samples by its worker and told commands."""

from __future__ import annotations

import logging

log = logging.getLogger(__name__)


class Role:
    def __init__(self, worker):
        self.worker = worker
        self.cfg = worker.cfg
        self.status = worker.status

    @property
    def device(self):
        import torch

        if self.worker.group.gpus_per_worker and torch.cuda.is_available():
            return torch.device("cuda", 0)  # each worker sees only its own GPUs
        return torch.device("cpu")

    def prepare(self) -> dict:
        """Called before registering; returns extra fields for the address book."""
        return {}

    def setup(self) -> None:
        """Load models, join groups; the address book is `self.worker.book`."""

    def ready_info(self) -> dict:
        """Extra fields of the `ready` event (the trainer reports its policy_version after a resume)."""
        return {}

    def handle(self, payload):
        """Do this role's part for one message (prompts for the generator, a SampleBatch for the others);
        return the samples for the next stage, or None when nothing goes on."""
        raise NotImplementedError

    def on_command(self, msg) -> None:
        log.warning("ignored command %r", msg.kind)

    def on_shutdown(self) -> None:
        """Called when the coordinator says `shutdown`, before the worker stops."""

    def close(self) -> None:
        pass
