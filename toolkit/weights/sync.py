"""Weight sync: trainer rank 0 broadcasts full actor weights to every generator worker, in buckets.

The group is a dedicated torch.distributed process group (gloo on CPU, NCCL on GPU), formed by
rendezvous on the TCPStore that trainer rank 0 hosts: rank 0 is the trainer, ranks 1..N the generator
workers (or their vLLM workers). It is separate from the trainer's own data-parallel group.

Protocol, all on that group, root 0:
  join:  manifest length (int64[1]), manifest (uint8 JSON: [[name, dtype, shape], ...])
  sync:  version (int64[1]), then one flat tensor per bucket of the manifest
Both sides cut the manifest into the same buckets (`plan_buckets`), so no per-sync metadata travels.
"""

from __future__ import annotations

import datetime
import json
import logging
from typing import Iterable, Iterator

import torch
import torch.distributed as dist

log = logging.getLogger(__name__)

STORE_PREFIX = "weight-sync"


def form_group(store: dist.Store, rank: int, world_size: int, timeout_s: float, device: torch.device):
    """The weight-sync process group over `store` (gloo for CPU tensors, NCCL for CUDA ones)."""
    prefixed = dist.PrefixStore(STORE_PREFIX, store)
    timeout = datetime.timedelta(seconds=timeout_s)
    if device.type == "cuda":  # not exercised on CPU-only machines
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        return dist.ProcessGroupNCCL(prefixed, rank, world_size, options)
    return dist.ProcessGroupGloo(prefixed, rank, world_size, timeout)


def plan_buckets(manifest: list, bucket_bytes: int) -> list[list[int]]:
    """Consecutive manifest entries of one dtype, each bucket about `bucket_bytes` (at least one entry)."""
    buckets, current, size, dtype = [], [], 0, None
    for i, (_, dt, shape) in enumerate(manifest):
        nbytes = _numel(shape) * _dtype(dt).itemsize
        if current and (dt != dtype or size + nbytes > bucket_bytes):
            buckets.append(current)
            current, size = [], 0
        current.append(i)
        size += nbytes
        dtype = dt
    if current:
        buckets.append(current)
    return buckets


class WeightSender:
    """Trainer rank 0's side of the group."""

    def __init__(self, group, manifest: list, bucket_bytes: int, device: torch.device):
        self.group, self.manifest, self.device = group, manifest, device
        self.buckets = plan_buckets(manifest, bucket_bytes)
        payload = torch.frombuffer(bytearray(json.dumps(manifest).encode()), dtype=torch.uint8).to(device)
        self._broadcast(torch.tensor([payload.numel()], dtype=torch.int64, device=device))
        self._broadcast(payload)

    def send(self, version: int, buckets: Iterable[list[torch.Tensor]]) -> int:
        """Broadcast `version`, then each bucket's tensors (in manifest order); return bytes sent."""
        self._broadcast(torch.tensor([version], dtype=torch.int64, device=self.device))
        sent = 0
        for index, tensors in zip(self.buckets, buckets):
            expected = [tuple(self.manifest[i][2]) for i in index]
            if [tuple(t.shape) for t in tensors] != expected:
                raise RuntimeError(f"weight bucket shapes {[tuple(t.shape) for t in tensors]} differ from {expected}")
            flat = torch.cat([t.detach().reshape(-1).to(self.device) for t in tensors])
            self._broadcast(flat)
            sent += flat.numel() * flat.element_size()
        return sent

    def _broadcast(self, tensor: torch.Tensor) -> None:
        self.group.broadcast(tensor, 0).wait()


class WeightReceiver:
    """A generator's side of the group: receives the manifest on join, then versions of the weights."""

    def __init__(self, group, bucket_bytes: int, device: torch.device):
        self.group, self.device = group, device
        length = torch.zeros(1, dtype=torch.int64, device=device)
        self._broadcast(length)
        payload = torch.zeros(int(length.item()), dtype=torch.uint8, device=device)
        self._broadcast(payload)
        self.manifest = json.loads(bytes(payload.cpu().numpy()).decode())
        self.buckets = plan_buckets(self.manifest, bucket_bytes)

    def receive(self) -> tuple[int, Iterator[tuple[str, torch.Tensor]]]:
        """(version, iterator of (name, tensor)). Consume the whole iterator: it receives bucket by bucket."""
        version = torch.zeros(1, dtype=torch.int64, device=self.device)
        self._broadcast(version)
        return int(version.item()), self._tensors()

    def _tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        for index in self.buckets:
            entries = [self.manifest[i] for i in index]
            flat = torch.empty(sum(_numel(shape) for _, _, shape in entries), dtype=_dtype(entries[0][1]),
                               device=self.device)
            self._broadcast(flat)
            offset = 0
            for name, _, shape in entries:
                n = _numel(shape)
                yield name, flat[offset: offset + n].view(shape)
                offset += n

    def _broadcast(self, tensor: torch.Tensor) -> None:
        self.group.broadcast(tensor, 0).wait()


def gathered_buckets(params: list[torch.nn.Parameter], buckets: list[list[int]], zero3: bool) -> Iterator[list]:
    """Full tensors of each bucket of `params`. Under ZeRO-3 every data-parallel rank must iterate this
    (each bucket is all-gathered with GatheredParameters and released after the consumer's next call)."""
    for index in buckets:
        chosen = [params[i] for i in index]
        if zero3:
            import deepspeed

            with deepspeed.zero.GatheredParameters(chosen, modifier_rank=None):
                yield [p.data for p in chosen]
        else:
            yield [p.data for p in chosen]


def manifest_of(named_parameters: Iterable[tuple[str, torch.nn.Parameter]]) -> list:
    """[[name, dtype, full shape], ...]; under ZeRO-3 the full shape is `ds_shape`."""
    return [[name, str(p.dtype).removeprefix("torch."), list(getattr(p, "ds_shape", p.shape))]
            for name, p in named_parameters]


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n


def _dtype(name: str) -> torch.dtype:
    return getattr(torch, name)
