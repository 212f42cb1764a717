"""The data-parallel ranks of a trainer node group: joining their process group, and what they say to
each other besides gradients (sums, barriers, rank 0's next command, rank 0's data). With the critic on
ranks of its own, the ranks split in two parts (`split`), each training its model over its own group.

Rank 0 hosts the run's TCPStore (`prepare`); the others find it in the address book (`join`). The group
is torch.distributed's default group (gloo on CPU, NCCL on GPU), which DeepSpeed then uses; the RL
trainer's weight-sync group rendezvous on the same store.
"""

from __future__ import annotations

import datetime
import json
import os

import numpy as np
import torch
import torch.distributed as dist


class Ranks:
    def __init__(self, rank: int, world: int, group=None):
        self.rank, self.world = rank, world
        self.store = None
        self.device = torch.device("cpu")  # (where tensors sent to another rank travel from: `join`)
        self.group = group  # (a part of the ranks, `split`: its process group; None: all of them)
        self.alone = None  # (a part: this rank's own group of one, DeepSpeed's model-parallel group)

    def prepare(self, bind_host: str, timeout_s: float) -> dict:
        """Before registering: rank 0 starts the run's TCPStore; the address book entry to publish."""
        if self.rank != 0:
            return {}
        from toolkit.transport.rendezvous import serve_store

        self.store = serve_store(bind_host, timeout_s)
        return {"store": f"{bind_host}:{self.store.port}"}

    def join(self, address: str, device: torch.device, startup_timeout_s: float, timeout_s: float) -> None:
        """Form the default process group over rank 0's store at `address` (every rank calls this); every
        collective then times out after `timeout_s`."""
        from toolkit.transport.rendezvous import connect_store

        if self.rank != 0:
            host, port = address.rsplit(":", 1)
            self.store = connect_store(host, int(port), startup_timeout_s)
        # DeepSpeed reads these; each worker sees only its own GPUs, so its local rank is 0.
        os.environ.update(RANK=str(self.rank), WORLD_SIZE=str(self.world), LOCAL_RANK="0")
        self.device = device
        backend = "nccl" if device.type == "cuda" else "gloo"
        dist.init_process_group(backend, store=dist.PrefixStore("trainer", self.store), rank=self.rank,
                                world_size=self.world, timeout=datetime.timedelta(seconds=timeout_s))

    def split(self, first: int) -> "Ranks":
        """This rank's part of the ranks split at `first` ([0, first) and [first, world)), with a process group
        of its own that a DeepSpeed engine of that part trains over (`mpu`). Every rank calls this."""
        parts = [list(range(first)), list(range(first, self.world))]
        groups = [dist.new_group(p) for p in parts]
        alone = [dist.new_group([r]) for r in range(self.world)]
        k = int(self.rank >= first)
        part = Ranks(self.rank - parts[k][0], len(parts[k]), groups[k])
        part.store, part.device, part.alone = self.store, self.device, alone[self.rank]
        return part

    def mpu(self):
        """For `deepspeed.initialize(mpu=...)`: data parallelism over these ranks (None: over all of them)."""
        return None if self.group is None else _DataParallel(self)

    def sum(self, t: torch.Tensor) -> torch.Tensor:
        """`t` summed over the ranks (a copy)."""
        if self.world > 1:
            t = t.clone()
            dist.all_reduce(t, group=self.group)
        return t

    def max(self, n: int) -> int:
        """The largest `n` over the ranks."""
        if self.world == 1:
            return n
        t = torch.tensor([n], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group)
        return int(t.item())

    def barrier(self) -> None:
        if self.world > 1:
            dist.barrier(group=self.group)

    def send(self, t: torch.Tensor, to: int) -> None:
        """`t` (float32) to rank `to` of all the ranks, which takes it with `receive`."""
        dist.send(t.to(self.device, torch.float32), to)

    def receive(self, shape, source: int) -> torch.Tensor:
        """The float32 tensor of `shape` that rank `source` of all the ranks sends (`send`), on the CPU."""
        t = torch.zeros(tuple(shape), dtype=torch.float32, device=self.device)
        dist.recv(t, source)
        return t.cpu()

    def command(self, code: int = 0, step: int = -1) -> tuple[int, int]:
        """Rank 0's (code, step) on every rank (what the ranks above 0 do next)."""
        t = torch.tensor([code, step], dtype=torch.int64)
        if self.world > 1:
            dist.broadcast(t, 0)
        return int(t[0]), int(t[1])

    def share(self, meta: dict | None, arrays: dict[str, np.ndarray] | None) -> tuple[dict, dict[str, np.ndarray]]:
        """Rank 0's (meta, arrays) on every rank: a JSON header (meta, dtypes, shapes), then each array."""
        if self.world == 1:
            return meta, arrays
        if self.rank == 0:
            header = json.dumps({"meta": meta, "arrays": {k: [a.dtype.str, list(a.shape)] for k, a in arrays.items()}})
            raw = torch.frombuffer(bytearray(header.encode()), dtype=torch.uint8)
            length = torch.tensor([raw.numel()], dtype=torch.int64)
        else:
            length = torch.zeros(1, dtype=torch.int64)
        dist.broadcast(length, 0)
        if self.rank != 0:
            raw = torch.zeros(int(length), dtype=torch.uint8)
        dist.broadcast(raw, 0)
        header = json.loads(bytes(raw.numpy()).decode())
        received = {}
        for name, (dtype, shape) in header["arrays"].items():
            t = torch.from_numpy(np.ascontiguousarray(arrays[name]).copy()) if self.rank == 0 else \
                torch.from_numpy(np.zeros(shape, dtype=np.dtype(dtype)))
            dist.broadcast(t, 0)
            received[name] = t.numpy()
        return header["meta"], received

    def gather_flat(self, arrays: dict[str, np.ndarray]) -> dict[str, np.ndarray] | None:
        """Rank 0 gets each float array concatenated over the ranks in rank order (the others get None)."""
        if self.world == 1:
            return arrays
        out = {}
        for name, array in arrays.items():
            local = torch.from_numpy(np.ascontiguousarray(array, dtype=np.float32))
            sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(self.world)]
            dist.all_gather(sizes, torch.tensor([local.numel()]))
            width = int(max(sizes))
            padded = torch.zeros(width, dtype=torch.float32)
            padded[: local.numel()] = local
            gathered = [torch.zeros(width, dtype=torch.float32) for _ in range(self.world)] if self.rank == 0 else None
            dist.gather(padded, gathered, dst=0)
            if self.rank == 0:
                out[name] = np.concatenate([g[: int(n)].numpy() for g, n in zip(gathered, sizes)])
        return out if self.rank == 0 else None

    def shard(self, n: int) -> np.ndarray:
        """This rank's contiguous share of `n` items."""
        return np.array_split(np.arange(n), self.world)[self.rank]


class _DataParallel:
    """The model-parallel unit (mpu) DeepSpeed asks for: data parallel over a part of the ranks, no model
    parallelism (each rank its own group of one)."""

    def __init__(self, part: Ranks):
        self.part = part

    def get_data_parallel_group(self):
        return self.part.group

    def get_data_parallel_world_size(self) -> int:
        return self.part.world

    def get_data_parallel_rank(self) -> int:
        return self.part.rank

    def get_model_parallel_group(self):
        return self.part.alone

    def get_model_parallel_world_size(self) -> int:
        return 1

    def get_model_parallel_rank(self) -> int:
        return 0
