"""Weight sync: trainer rank 0 broadcasts full actor weights to every generator worker, in buckets.

Each generator worker has a group of its own, a dedicated torch.distributed process group (gloo on CPU,
NCCL on GPUs, gloo where ranks share a GPU: `form_group`) formed by rendezvous on the store that trainer
rank 0 hosts (transport/rendezvous.py): rank 0 is the trainer, ranks 1..N that worker's engine ranks (its
vLLM workers). A generator that dies breaks only its own group: the trainer drops that group and goes on
with the others, and the worker started in its place joins a new group (a new name, so no key of the old
rendezvous is read again), where the trainer first sends it the current weights. The groups are separate
from the trainer's own data-parallel group. The trainer sends each tensor on every group at once
(asynchronous broadcasts).

Protocol, on each group, root 0:
  join:  layout length (int64[1]), layout (uint8 JSON: {"buckets": [[[name, dtype, shape], ...], ...],
         "probe": [token ids]})
  sync:  version (int64[1]), one flat tensor per bucket of the layout, then the trainer's log-probs of
         the probe (float32[len(probe) - 1])
The layout says what each bucket carries as the generator loads it (see `hf_format`), so no per-sync
metadata travels. The probe log-probs let the generator check the sync (see `probe`); they go last, so
the trainer computes them while the weights travel, in a thread of its own started once the first bucket
is on its way (under ZeRO-3, whose gathers are collectives of every trainer rank, after the last).

Each bucket travels as one asynchronous broadcast: the trainer packs its tensors into one of two send
buffers, reused at every sync (a bucket of one tensor goes straight from that tensor's memory), while the
bucket before travels; so at most two buckets exist at once, and tensors made on the way (merged LoRA
weights, converted experts) never add up to a copy of the model. The receiver takes each bucket into one
new flat tensor and hands on views of it. One broadcast per tensor cost about 0.3 ms each over gloo
here, a quarter of a small model's sync, more than packing's copy (`tools/bench_sync.py` compares the
sync with one raw broadcast of the same bytes).
"""

from __future__ import annotations

import contextlib
import datetime
import json
import logging
import os
import threading
from dataclasses import dataclass
from typing import Callable, Iterable, Iterator

import torch
import torch.distributed as dist

from toolkit.errors import first_line
from toolkit.transport.peers import prove_peers
from toolkit.weights.hf_format import Converter, identity

log = logging.getLogger(__name__)

STORE_PREFIX = "weight-sync"


def sync_group_name(worker_id: str, generation: int) -> str:
    """The name of a generator worker's weight-sync group; a worker started again joins a new one."""
    return f"{worker_id}#{generation}"


def form_group(store: dist.Store, rank: int, world_size: int, timeout_s: float, device: torch.device,
               name: str = "0", connect_s: float | None = None):
    """The weight-sync process group `name` over `store` (the run's: transport/rendezvous.py): gloo for CPU
    tensors; for CUDA ones NCCL, or gloo where two ranks share one GPU (NCCL needs a GPU per rank; gloo
    copies through host memory then). A rank other than 0 first says which GPU it has and that it has
    arrived (`arrived`), so that rank 0 can wait for it without blocking; rank 0 then says which backend
    the group takes. Every connection of a gloo group proves the store's key before it is returned
    (transport/peers.py: one taken by a stranger raises StrangerInGroup).
    `connect_s`: how long a gloo group's connections may take to form, where every peer has arrived
    already and connects at once (a peer that ended after it arrived never does): then a RuntimeError
    names the group; the group's transfers still wait up to `timeout_s`."""
    prefixed = _prefixed(store, name)
    gpu = torch.cuda.get_device_properties(device).uuid if device.type == "cuda" else None
    if rank:
        prefixed.set(f"gpu/{rank}", str(gpu))
        prefixed.set(f"arrived/{rank}", "1")
        backend = prefixed.get("backend").decode()  # (waits for rank 0, up to the store's timeout)
    else:
        gpus = [str(gpu)] + [prefixed.get(f"gpu/{r}").decode() for r in range(1, world_size)]
        backend = sync_backend(device, gpus)
        prefixed.set("backend", backend)
    timeout = datetime.timedelta(seconds=timeout_s)
    if backend == "nccl":  # (a group of several ranks not exercised: no machine here has two GPUs)
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        # A collective that fails or times out aborts this group's communicator and raises, where torch's
        # default (SkipCleanUp) ends the whole process from NCCL's watchdog thread: a dead generator would
        # take the trainer down with it. The group reads this as it is made; other groups keep theirs.
        # NCCL sets up the communicator at the group's first transfer, blocking, with no timeout: a peer that
        # dies just then holds this rank (nonblocking set-up would bound it; not used: README, "on NCCL").
        with _environ(TORCH_NCCL_ASYNC_ERROR_HANDLING=NCCL_CLEAN_UP_ONLY):
            return dist.ProcessGroupNCCL(prefixed, rank, world_size, options)
    if device.type == "cuda":
        log.info("weight-sync group %s: gloo, not NCCL (ranks share a GPU): copies through host memory", name)
    connect = timeout if connect_s is None else datetime.timedelta(seconds=min(connect_s, timeout_s))
    try:
        group = dist.ProcessGroupGloo(prefixed, rank, world_size, connect)
    except RuntimeError as e:
        if connect == timeout:
            raise
        raise RuntimeError(f"weight-sync group {name!r}: its {world_size - 1} peer rank(s) had arrived, but did not "
                           f"connect within {connect.total_seconds():g} s (one ended after it arrived?): "
                           f"{first_line(e)}") from e
    group._set_default_timeout(timeout)  # (the collectives' limit; each point-to-point wait names its own)
    prove_peers(group, rank, world_size, store.key, f"weight-sync/{name}", timeout_s)  # (before the layout goes)
    return group


NCCL_CLEAN_UP_ONLY = "2"  # (torch's ErrorHandlingMode CleanUpOnly)


@contextlib.contextmanager
def _environ(**values: str):
    """The process's environment with `values` set, restored afterwards."""
    before = {name: os.environ.get(name) for name in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for name, value in before.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def sync_backend(device: torch.device, gpus: list[str]) -> str:
    """The backend of a weight-sync group whose ranks hold `gpus` (each rank's GPU UUID, "None" for a rank
    on the CPU) and whose rank 0 holds its tensors on `device`: NCCL when every rank has a GPU of its own,
    else gloo."""
    return "nccl" if device.type == "cuda" and "None" not in gpus and len(set(gpus)) == len(gpus) else "gloo"


def arrived(store: dist.Store, name: str, world_size: int) -> bool:
    """Whether every rank but 0 of group `name` has reached `form_group` (it joins at once then): rank 0
    asks this between other work before it forms a group whose peers may never come."""
    return _prefixed(store, name).check([f"arrived/{rank}" for rank in range(1, world_size)])


def _prefixed(store: dist.Store, name: str) -> dist.PrefixStore:
    return dist.PrefixStore(f"{STORE_PREFIX}/{name}/", store)


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


@dataclass
class SyncLayout:
    """How the trainer's parameters travel: which parameters make each bucket (`sources`, indices into
    `names`), what the bucket carries after conversion (`wire`: [name, dtype, shape] entries) and the probe."""

    names: list[str]
    sources: list[list[int]]
    wire: list[list[list]]
    probe: list[int]
    convert: Converter = identity

    def converted(self, index: int, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        """Bucket `index`'s tensors (its source parameters, in order) as the layout sends them."""
        out = self.convert({self.names[i]: t for i, t in zip(self.sources[index], tensors)})
        missing = [name for name, _, _ in self.wire[index] if name not in out]
        if missing or len(out) != len(self.wire[index]):
            raise RuntimeError(f"weight bucket {index} converted to {sorted(out)}, the layout says "
                               f"{[name for name, _, _ in self.wire[index]]}")
        return [out[name] for name, _, _ in self.wire[index]]


def plan_layout(named_parameters: list[tuple[str, torch.nn.Parameter]], bucket_bytes: int, probe: list[int],
                convert: Converter = identity) -> SyncLayout:
    """Buckets of about `bucket_bytes` over the parameters, and what each carries once converted. The
    conversion runs on meta tensors here; it must map each bucket on its own to what it maps the whole
    model to (true of every transformers conversion met so far; checked)."""
    manifest = manifest_of(named_parameters)
    names = [name for name, _, _ in manifest]
    meta = {name: torch.empty(shape, dtype=_dtype(dt), device="meta") for name, dt, shape in manifest}
    sources = plan_buckets(manifest, bucket_bytes)
    wire = []
    for index in sources:
        out = convert({names[i]: meta[names[i]] for i in index})
        # (the weights the conversion passes on unchanged in the parameters' order, which is their order in
        # memory under ZeRO-1/2, so that the bucket goes without a copy (`span`); transformers 5 returns
        # them sorted by name. What it made of several comes after, in its own order.)
        position = {names[i]: k for k, i in enumerate(index)}
        ordered = sorted(out.items(), key=lambda item: position.get(item[0], len(position)))
        wire.append([[name, str(t.dtype).removeprefix("torch."), list(t.shape)] for name, t in ordered])
    whole = {name: list(t.shape) for name, t in convert(dict(meta)).items()}
    pieces = {name: shape for bucket in wire for name, _, shape in bucket}
    if whole != pieces:
        raise RuntimeError("the model's weights cannot be converted bucket by bucket for weight sync "
                           f"(whole model: {len(whole)} tensors, by bucket: {len(pieces)}); raise "
                           "trainer.weight_sync_bucket_mb so that related weights share a bucket")
    return SyncLayout(names, sources, wire, probe, convert)


class WeightSender:
    """Trainer rank 0's side: one group per generator worker (`add`), each sent the same tensors."""

    def __init__(self, layout: SyncLayout, device: torch.device):
        self.layout, self.device = layout, device
        self.groups: dict[str, object] = {}  # receiver name -> its group
        self.limits: dict[str, datetime.timedelta] = {}  # receiver name -> how long its NCCL transfers may take
        self.lost: list[str] = []  # receivers whose group failed (a dead generator), in order
        self.buffers: list[torch.Tensor] = []  # two send buffers (bytes), made at the first sync
        self.copied = 0  # buckets of the last send that were copied to be sent (not sent from their own memory)

    @property
    def names(self) -> list[str]:
        return list(self.groups)

    def add(self, name: str, group, timeout_s: float | None = None) -> None:
        """Start sending to `group` (a receiver's new group replaces its old one): the layout first.
        `timeout_s`: how long a transfer on an NCCL group may take (a gloo group's own timeout bounds its
        waits); NCCL's `wait()` holds only the GPU stream, so the host waits with this limit, which also
        makes a dead receiver's transfer raise here, and `sync_s` time the transfers, not their launch."""
        self.groups[name] = group
        self.limits.pop(name, None)
        if timeout_s is not None and group.name() == "nccl":
            self.limits[name] = datetime.timedelta(seconds=timeout_s)
        payload = json.dumps({"buckets": self.layout.wire, "probe": self.layout.probe}).encode()
        payload = torch.frombuffer(bytearray(payload), dtype=torch.uint8).to(self.device)
        self._broadcast(torch.tensor([payload.numel()], dtype=torch.int64, device=self.device), [name])
        self._broadcast(payload, [name])

    def send(self, version: int, buckets: Iterable[list[torch.Tensor]], probe: Callable[[], torch.Tensor],
             transient: bool = False, to: list[str] | None = None) -> int:
        """Broadcast `version`, each bucket (its source parameters' full tensors, in layout order,
        converted here), then `probe()`, the trainer's log-probs of the probe, to the receivers `to`
        (default: all); return bytes sent to each. `transient`: a bucket's tensors are freed once the
        next one is taken (ZeRO-3 gathers), so each bucket's transfer ends before the next is taken,
        and the probe (a collective then) runs after the last; otherwise the probe runs in a thread
        (`Prober`) from the first bucket's start on, and each next bucket is packed while the one before
        travels. A receiver whose group fails is dropped (named in `lost`) and the others go on."""
        to = self.names if to is None else to
        self._broadcast(torch.tensor([version], dtype=torch.int64, device=self.device), to)
        sent, previous, prober, self.copied = 0, [], None, 0
        try:
            for index, tensors in enumerate(buckets):
                converted = self.layout.converted(index, tensors)
                expected = [tuple(shape) for _, _, shape in self.layout.wire[index]]
                if [tuple(t.shape) for t in converted] != expected:
                    raise RuntimeError(f"weight bucket shapes {[tuple(t.shape) for t in converted]} differ from {expected}")
                flat = self._pack(converted, index % 2)  # (the buffer of the bucket before last: its transfer ended)
                self._wait(previous)  # (one bucket travels while the next is packed)
                previous = [(flat, self._start(flat, to))]  # (flat stays referenced until its transfers end)
                sent += flat.numel() * flat.element_size()
                if transient:
                    self._wait(previous)
                elif index == 0 and self.layout.probe:  # (it reads the trainer's weights, not the buckets)
                    prober = Prober(probe, self.device)
            if prober is not None:
                logprobs = prober.result()
            else:  # (ZeRO-3: after the last bucket; none when the check is off)
                logprobs = probe() if self.layout.probe else None
        finally:
            if prober is not None:
                prober.join()
        self._wait(previous)
        if logprobs is not None:
            self._broadcast(logprobs.to(self.device, torch.float32).contiguous(), to)
        return sent

    def _pack(self, tensors: list[torch.Tensor], which: int) -> torch.Tensor:
        """`tensors` (one dtype) as one flat tensor: the one tensor's own memory, the memory they lie in one
        after another (`span`), or a copy in send buffer `which`."""
        if len(tensors) == 1:  # (a copy where it is on another device or not contiguous)
            flat = tensors[0].detach().to(self.device).contiguous().view(-1)
            self.copied += flat.data_ptr() != tensors[0].data_ptr()
            return flat
        spanned = span(tensors, self.device)
        if spanned is not None:
            return spanned
        self.copied += 1
        if not self.buffers:
            size = max(sum(_numel(shape) * _dtype(dt).itemsize for _, dt, shape in bucket)
                       for bucket in self.layout.wire if len(bucket) > 1)
            self.buffers = [torch.empty(size, dtype=torch.uint8, device=self.device) for _ in range(2)]
        dtype = tensors[0].dtype
        numel = sum(t.numel() for t in tensors)
        flat = self.buffers[which][: numel * dtype.itemsize].view(dtype)
        torch.cat([t.detach().to(self.device).reshape(-1) for t in tensors], out=flat)
        return flat

    def _broadcast(self, tensor: torch.Tensor, to: list[str]) -> None:
        self._wait([(tensor, self._start(tensor, to))])

    def _start(self, tensor: torch.Tensor, to: list[str]) -> list:
        """Start broadcasting `tensor` on the groups of `to` that still work; [(name, work)]."""
        works = []
        for name in to:
            if name in self.groups:
                try:
                    works.append((name, self.groups[name].broadcast(tensor, 0)))
                except RuntimeError as e:
                    self._lose(name, e)
        return works

    def _wait(self, pending: list) -> None:
        for _, works in pending:
            for name, work in works:
                if name in self.groups:
                    try:
                        work.wait(self.limits[name]) if name in self.limits else work.wait()
                    except RuntimeError as e:  # (NCCL's DistBackendError is one)
                        self._lose(name, e)
        pending.clear()

    def _lose(self, name: str, error: Exception) -> None:
        del self.groups[name]
        self.limits.pop(name, None)
        self.lost.append(name)
        log.warning("weight sync to %s failed, so it is left out from now on (%s: %s); a generator started "
                    "in its place joins a new group", name, type(error).__name__, first_line(error))


class Prober(threading.Thread):
    """The probe's forward pass in a thread of its own, so that the buckets go on being packed and sent
    while it runs (torch leaves the GIL to the other thread during each operation). Run in the sending
    thread, after the first bucket's start, it held back the second bucket on a CPU, where the forward
    pass reads every weight once as the sync does: tools/bench_sync.py's 26M model synced in 0.072-0.081 s
    with the thread, 0.082-0.107 s without (134M: 0.317-0.366 against 0.364-0.392; six runs each, as the
    README gives them)."""

    def __init__(self, probe: Callable[[], torch.Tensor], device: torch.device):
        super().__init__(name="weight-sync-probe", daemon=True)
        self.probe, self.logprobs, self.error = probe, None, None
        # (the current GPU is a thread's own: the thread takes the sender's, by index, as "cuda" alone names none)
        self.gpu = None
        if device.type == "cuda":
            self.gpu = torch.cuda.current_device() if device.index is None else device.index
        self.start()

    def run(self) -> None:
        try:
            if self.gpu is not None:
                torch.cuda.set_device(self.gpu)
            self.logprobs = self.probe()
        except BaseException as e:  # (raised again in the sending thread)
            self.error = e

    def result(self) -> torch.Tensor:
        self.join()
        if self.error is not None:
            raise self.error
        return self.logprobs


class WeightReceiver:
    """A generator's side of the group: receives the layout on join, then versions of the weights."""

    def __init__(self, group, device: torch.device, timeout_s: float | None = None):
        """`timeout_s`: how long a transfer on an NCCL group may take, as for `WeightSender.add` (NCCL's
        `wait()` holds only the stream: the host would block at the first read of a tensor, with no limit
        until the watchdog aborts the group and leaves the tensor half-written)."""
        self.group, self.device, self.timeout_s = group, device, timeout_s
        nccl = timeout_s is not None and group.name() == "nccl"
        self.limit = datetime.timedelta(seconds=timeout_s) if nccl else None
        length = torch.zeros(1, dtype=torch.int64, device=device)
        self._broadcast(length, "the layout")
        payload = torch.zeros(int(length.item()), dtype=torch.uint8, device=device)
        self._broadcast(payload, "the layout")
        layout = json.loads(bytes(payload.cpu().numpy()).decode())
        self.buckets, self.probe = layout["buckets"], layout["probe"]

    @property
    def weights(self) -> int:
        return sum(len(b) for b in self.buckets)

    def receive(self) -> tuple[int, Iterator[tuple[str, torch.Tensor]]]:
        """(version, iterator of (name, tensor)). Consume the whole iterator (it receives bucket by
        bucket), then call `probe_logprobs`."""
        version = torch.zeros(1, dtype=torch.int64, device=self.device)
        self._broadcast(version, "the next version's number")
        return int(version.item()), self._tensors()

    def probe_logprobs(self) -> torch.Tensor:
        """The trainer's log-probs of the probe for the version just received (sent after the weights)."""
        expected = torch.zeros(max(len(self.probe) - 1, 0), dtype=torch.float32, device=self.device)
        if self.probe:  # (an empty probe: the check is off and nothing follows the weights)
            self._broadcast(expected, "the probe's log-probs")
        return expected.cpu()

    def _tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        # (a new tensor per bucket: a loader may hold views of earlier buckets until a layer is whole)
        for index, entries in enumerate(self.buckets):
            flat = torch.empty(sum(_numel(shape) for _, _, shape in entries), dtype=_dtype(entries[0][1]),
                               device=self.device)
            self._broadcast(flat, f"weight bucket {index + 1} of {len(self.buckets)} ({entries[0][0]}, ...)")
            offset = 0
            for name, _, shape in entries:
                n = _numel(shape)
                yield name, flat[offset: offset + n].view(shape)
                offset += n

    def _broadcast(self, tensor: torch.Tensor, what: str) -> None:
        """Receive `tensor` from trainer rank 0; a RuntimeError that says what did not come, and why it may not
        have (the group's own error, e.g. gloo's "Timed out waiting 600000ms for recv operation", said neither)."""
        try:
            work = self.group.broadcast(tensor, 0)
            work.wait(self.limit) if self.limit is not None else work.wait()
        except RuntimeError as e:
            within = f" within transport.step_timeout_s ({self.timeout_s:g} s)" if self.timeout_s is not None else ""
            raise RuntimeError(f"weight sync: {what} did not come from trainer rank 0{within}: the trainer ended, "
                               f"or stalled, during the sync (its log says which); {first_line(e)}") from e


def span(tensors: list[torch.Tensor], device: torch.device) -> torch.Tensor | None:
    """`tensors` as one flat view of the memory they share, where they lie one after another in one
    storage, in order, on `device`; else None. A trainer's weights under DeepSpeed ZeRO-1/2 are views of
    one flat buffer in the order of `named_parameters`, so a bucket of them, not converted, is sent without
    a copy (on 2 cores the copy was 10-15 ms of the 26M model's 37 ms sync without the check; bench_sync).
    The trainer changes no weight until its send returns, after every transfer ended."""
    first = tensors[0]
    storage, end = first.untyped_storage().data_ptr(), first.data_ptr()
    for t in tensors:
        if (t.device != device or t.dtype != first.dtype or not t.is_contiguous() or t.data_ptr() != end
                or t.untyped_storage().data_ptr() != storage):
            return None
        end += t.numel() * t.element_size()
    numel = (end - first.data_ptr()) // first.element_size()
    return torch.as_strided(first.detach(), (numel,), (1,), first.storage_offset())


def gathered_buckets(params: list[torch.nn.Parameter], buckets: list[list[int]], zero3: bool,
                     deltas: list | None = None) -> Iterator[list]:
    """Full tensors of each bucket of `params`, each plus `deltas[i]()` where that is given (a LoRA
    adapter's update, merged on the way; see training/lora.py). Under ZeRO-3 every data-parallel rank
    must iterate this (each bucket is all-gathered with GatheredParameters and released after the
    consumer's next call)."""
    def full(i: int) -> torch.Tensor:
        delta = deltas[i] if deltas is not None else None
        return params[i].data if delta is None else params[i].data + delta().to(params[i].dtype)

    for index in buckets:
        if zero3:
            import deepspeed

            with deepspeed.zero.GatheredParameters([params[i] for i in index], modifier_rank=None):
                yield [full(i) for i in index]
        else:
            yield [full(i) for i in index]


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
