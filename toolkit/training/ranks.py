"""The data-parallel ranks of a trainer node group: joining their process group, and what they say to
each other besides gradients (sums, barriers, rank 0's next command, rank 0's data). With the critic on
ranks of its own, the ranks form two parts, each training its model over a process group of its own.

Rank 0 hosts the run's rendezvous store (`prepare`; transport/rendezvous.py); the others find it in the
address book (`join`). The ranks' models train over torch.distributed's default group (gloo on CPU; on
GPU, NCCL for CUDA tensors and gloo for CPU ones), which DeepSpeed then uses. With two parts, each part's
default group holds its own ranks only: DeepSpeed's ZeRO-3 runs collectives and checks of its own over
the default group (barriers while it partitions a model, the order of each forward pass), which must not
mix the actor's ranks with the critic's. What every rank of both parts says to each other then goes over
a gloo group of all of them (`control`). The RL trainer's weight-sync groups rendezvous on the same
store. Before anything travels on a gloo group, every connection of it proves the store's key (`prove`).
"""

from __future__ import annotations

import datetime
import json
import os

import numpy as np
import torch
import torch.distributed as dist


class Ranks:
    def __init__(self, rank: int, world: int):
        self.rank, self.world = rank, world
        self.store = None
        self.control = None  # (with two parts: the gloo group of every rank; None: the default group)
        self.part = self  # (the ranks this rank's models train over: all of them, or with two parts, its own)

    def prepare(self, bind_host: str, timeout_s: float) -> dict:
        """Before registering: rank 0 starts the run's rendezvous store; the address book entry to publish."""
        if self.rank != 0:
            return {}
        from toolkit.transport.rendezvous import serve_store

        self.store = serve_store(bind_host, timeout_s)
        return {"store": f"{bind_host}:{self.store.port}"}

    def join(self, address: str, device: torch.device, startup_timeout_s: float, timeout_s: float,
             split_at: int | None = None) -> None:
        """Form the process groups over rank 0's store at `address` (every rank calls this); every collective
        then times out after `timeout_s`. `split_at`: the ranks form two parts, [0, split_at) and
        [split_at, world), each with a default group of its own (`part`), and all of them the `control`
        group."""
        from toolkit.transport.peers import prove_peers
        from toolkit.transport.rendezvous import connect_store

        if self.rank != 0:
            host, port = address.rsplit(":", 1)
            self.store = connect_store(host, int(port), startup_timeout_s)
        timeout = datetime.timedelta(seconds=timeout_s)
        first, size, name = 0, self.world, "trainer"
        if split_at is not None:
            k = int(self.rank >= split_at)
            first, size, name = (0, split_at, "trainer/part0") if k == 0 else (split_at, self.world - split_at,
                                                                              "trainer/part1")
            self.control = dist.ProcessGroupGloo(dist.PrefixStore("trainer/control", self.store), self.rank,
                                                 self.world, timeout)
            prove_peers(self.control, self.rank, self.world, self.store.key, "trainer/control", timeout_s)
            self.part = Ranks(self.rank - first, size)
            self.part.store = self.store
        # DeepSpeed reads these; each worker sees only its own GPUs, so its local rank is 0.
        os.environ.update(RANK=str(self.rank - first), WORLD_SIZE=str(size), LOCAL_RANK="0")
        dist.init_process_group(_backend(device), store=dist.PrefixStore(name, self.store), rank=self.rank - first,
                                world_size=size, timeout=timeout)
        if size > 1:
            _deepspeed_world_group()
        self.prove(timeout_s)

    def prove(self, timeout_s: float) -> None:
        """Every connection of the groups of torch.distributed's registry not proven yet proves the run's key
        (transport/peers.py): the default group and DeepSpeed's, made in `join`; every rank calls this again
        once its engines are built, for any DeepSpeed made then (the control group proves it in `join`, as
        it is made). Collective."""
        from toolkit.transport.peers import prove_registered

        prove_registered(self.store.key, timeout_s)

    def sum(self, t: torch.Tensor) -> torch.Tensor:
        """`t` summed over the ranks (a copy)."""
        if self.world > 1:
            t = t.clone()
            self._all_reduce(t, dist.ReduceOp.SUM)
        return t

    def max(self, n: int) -> int:
        """The largest `n` over the ranks."""
        if self.world == 1:
            return n
        t = torch.tensor([n], dtype=torch.int64)
        self._all_reduce(t, dist.ReduceOp.MAX)
        return int(t.item())

    def barrier(self) -> None:
        if self.world == 1:
            return
        if self.control is None:
            dist.barrier()
        else:
            self.control.barrier().wait()

    def send(self, t: torch.Tensor, to: int) -> None:
        """`t` (float32) to rank `to` of the other part, which takes it with `receive` (over `control`)."""
        self.control.send([t.to("cpu", torch.float32).contiguous()], to, 0).wait()

    def receive(self, shape, source: int) -> torch.Tensor:
        """The float32 tensor of `shape` that rank `source` of the other part sends (`send`)."""
        t = torch.zeros(tuple(shape), dtype=torch.float32)
        self.control.recv([t], source, 0).wait()
        return t

    def command(self, code: int = 0, step: int = -1) -> tuple[int, int]:
        """Rank 0's (code, step) on every rank (what the ranks above 0 do next)."""
        t = torch.tensor([code, step], dtype=torch.int64)
        if self.world > 1:
            self._broadcast(t)
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
        self._broadcast(length)
        if self.rank != 0:
            raw = torch.zeros(int(length), dtype=torch.uint8)
        self._broadcast(raw)
        header = json.loads(bytes(raw.numpy()).decode())
        received = {}
        for name, (dtype, shape) in header["arrays"].items():
            t = torch.from_numpy(np.ascontiguousarray(arrays[name]).copy()) if self.rank == 0 else \
                torch.from_numpy(np.zeros(shape, dtype=np.dtype(dtype)))
            self._broadcast(t)
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
            self._all_gather(sizes, torch.tensor([local.numel()]))
            width = int(max(sizes))
            padded = torch.zeros(width, dtype=torch.float32)
            padded[: local.numel()] = local
            gathered = [torch.zeros(width, dtype=torch.float32) for _ in range(self.world)] if self.rank == 0 else None
            self._gather(padded, gathered)
            if self.rank == 0:
                out[name] = np.concatenate([g[: int(n)].numpy() for g, n in zip(gathered, sizes)])
        return out if self.rank == 0 else None

    def shard(self, n: int) -> np.ndarray:
        """This rank's contiguous share of `n` items."""
        return np.array_split(np.arange(n), self.world)[self.rank]


    # Collectives of every rank: over the default group, or with two parts, over `control` (CPU tensors).
    def _broadcast(self, t: torch.Tensor) -> None:
        """Rank 0's `t` into every rank's `t`."""
        if self.control is None:
            dist.broadcast(t, 0)
        else:
            self.control.broadcast(t, 0).wait()

    def _all_reduce(self, t: torch.Tensor, op) -> None:
        if self.control is None:
            dist.all_reduce(t, op=op)
        else:
            options = dist.AllreduceOptions()
            options.reduceOp = op
            self.control.allreduce([t], options).wait()

    def _all_gather(self, out: list[torch.Tensor], t: torch.Tensor) -> None:
        if self.control is None:
            dist.all_gather(out, t)
        else:
            self.control.allgather([out], [t]).wait()

    def _gather(self, t: torch.Tensor, out: list[torch.Tensor] | None) -> None:
        """Every rank's `t` into rank 0's `out` (None on the others)."""
        if self.control is None:
            dist.gather(t, out, dst=0)
        else:
            options = dist.GatherOptions()
            options.rootRank = 0
            self.control.gather([out] if out is not None else [], [t], options).wait()


def alone(device: torch.device) -> None:
    """The default process group of this process alone, for a tool that trains on one rank (a benchmark, the
    calibration), which DeepSpeed then takes as it is. Its store lives in memory: there is no port to pick.
    A port found free and then handed to torch can be taken by another process in between (a CI run's
    benchmark failed so: EADDRINUSE)."""
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1")  # (DeepSpeed reads these)
    dist.init_process_group(_backend(device), store=dist.HashStore(), rank=0, world_size=1)


def _backend(device: torch.device) -> str:
    return "cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo"


def _deepspeed_world_group() -> None:
    """DeepSpeed's clone of the default group, made now: every engine takes the one DeepSpeed keeps (its
    data-parallel group) and broadcasts the model's weights over it as it starts, so its connections
    prove the key before that (`Ranks.prove`)."""
    import deepspeed.comm as ds_dist
    from deepspeed.accelerator import get_accelerator
    from deepspeed.utils import groups

    from toolkit.training.ops import load_ops

    load_ops()  # (init_distributed loads the shared-memory op: through the flock, as every load must be)
    ds_dist.init_distributed(dist_backend=get_accelerator().communication_backend_name(), verbose=False)
    groups._clone_world_group()
