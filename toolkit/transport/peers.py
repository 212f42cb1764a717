"""Every connection of a gloo process group proves the attempt's key before the group carries anything.

torch.distributed's gloo groups connect their ranks pair by pair over TCP. The address each rank listens on
travels through the run's store, which answers only the run's processes (transport/rendezvous.py), but
the connections themselves are not authenticated: for each pair, the rank whose address sorts lower
listens, and takes the first connection that names that pair's sequence number (the peer's rank, or a
small counter); one that comes before the rank is ready is kept for it. Every user of a node sees its
listening ports (`ss -ltn`), so a process without the run's key can connect first, with the number the
real peer would give, and take that peer's place: it then receives what the rank sends on the group (a
generator's weight broadcast, a trainer's gradients) and could send in the peer's stead. The peer's own
connection is left unread. tests/unit/test_peers.py does this to a real gloo group: without the check the
stranger receives the group's first broadcast.

So once a gloo group is formed, every pair of its ranks checks, over its own connection, that the other
end holds the attempt's key: each rank sends each peer 32 random bytes and answers each peer's bytes with
HMAC-SHA256 under the key, over the group's name, both ranks and those bytes. An end held by a stranger
cannot answer (nor replay an answer of another pair, group or attempt), and the group is refused, with an
error that names the rank, before anything else is sent on it. NCCL groups are not checked: what NCCL
does with such a connection needs two GPUs to try (see README, "Security").
"""

from __future__ import annotations

import datetime
import hmac
import logging
import secrets

import torch

from toolkit.errors import first_line

log = logging.getLogger(__name__)

CHALLENGE, ANSWER = 0x5EC1, 0x5EC2  # (tags of the two messages on each pair)
NONCE_BYTES = 32
ANSWER_BYTES = 32  # (HMAC-SHA256)
_proven: set[tuple[str, int]] = set()  # registered groups of this process already checked (`prove_registered`)


class StrangerInGroup(RuntimeError):
    """A rank of a gloo group did not prove the attempt's key over its connection."""


def answer(key: bytes, group: str, responder: int, asker: int, nonce: bytes) -> bytes:
    """What rank `responder` of `group` sends rank `asker` for its `nonce`."""
    message = b"slurm-rlhf gloo peer|%s|%d|%d|" % (group.encode(), responder, asker)
    return hmac.new(key, message + nonce, "sha256").digest()


def prove_peers(group, rank: int, size: int, key: bytes, name: str, timeout_s: float) -> None:
    """Every rank of the gloo group `group` (a ProcessGroupGloo, this process its rank `rank` of `size`)
    calls this at once: each pair of ranks shows the other the attempt's `key` over its connection.
    Raises StrangerInGroup, naming the rank, where one does not (and every wait ends within `timeout_s`)."""
    if size < 2:
        return
    timeout = datetime.timedelta(seconds=timeout_s)
    peers = [p for p in range(size) if p != rank]
    mine = {p: secrets.token_bytes(NONCE_BYTES) for p in peers}
    theirs = {p: torch.zeros(NONCE_BYTES, dtype=torch.uint8) for p in peers}
    answers = {p: torch.zeros(ANSWER_BYTES, dtype=torch.uint8) for p in peers}
    sends = []  # (rank, work): each send is waited for at the end
    peer = peers[0]
    try:
        for peer in peers:
            sends.append((peer, group.send([_tensor(mine[peer])], peer, CHALLENGE)))
        for peer in peers:
            group.recv([theirs[peer]], peer, CHALLENGE).wait(timeout)
            reply = answer(key, name, rank, peer, theirs[peer].numpy().tobytes())
            sends.append((peer, group.send([_tensor(reply)], peer, ANSWER)))
        for peer in peers:
            group.recv([answers[peer]], peer, ANSWER).wait(timeout)
        for peer, work in sends:
            work.wait(timeout)
    except RuntimeError as e:
        raise StrangerInGroup(
            f"process group {name!r}: rank {peer} did not answer the check of the run's key over its "
            f"connection to rank {rank} ({type(e).__name__}: {first_line(e)}): "
            f"it ended, or a process without the run's key connected in its place; nothing else was sent on "
            f"this group") from e
    for p in peers:
        if not hmac.compare_digest(answers[p].numpy().tobytes(), answer(key, name, p, rank, mine[p])):
            raise StrangerInGroup(
                f"process group {name!r}: the connection of rank {rank} to rank {p} answered the check of the "
                f"run's key wrongly: a process without this attempt's key holds it (another user's, or one of "
                f"an earlier attempt); nothing else was sent on this group")
    log.info("process group %r: the connections of rank %d to its %d peer(s) proved the run's key", name, rank,
             len(peers))


def prove_registered(key: bytes, timeout_s: float) -> int:
    """`prove_peers` over every group of torch.distributed's registry that this process is a rank of and that
    has a gloo part (the default group, those DeepSpeed or vLLM made), each once a process; every rank of
    those groups calls this at the same point, where the groups are made in the same order. The number
    checked now."""
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    if not dist.is_initialized():
        return 0
    checked = 0
    for pg, name in list(c10d._world.pg_names.items()):  # (creation order: the same on every rank)
        if (name, id(pg)) in _proven or pg.size() < 2 or pg.rank() < 0:
            continue
        try:
            gloo = pg._get_backend(torch.device("cpu"))
        except (RuntimeError, ValueError):  # (no gloo part: an NCCL group)
            continue
        if gloo.name() != "gloo":
            continue
        prove_peers(gloo, pg.rank(), pg.size(), key, f"registered/{name}", timeout_s)
        _proven.add((name, id(pg)))
        checked += 1
    return checked


def _tensor(data: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)
