"""Wire format: a msgpack header plus raw array buffers, authenticated with a per-run secret.

A message travels as ZeroMQ multipart frames:

    [MAGIC + nonce, header, small arrays, buffer_0, ..., buffer_n-1, tag]

- nonce: 16 random bytes, new for every message, after the 6 bytes of MAGIC in the first frame.
- header: msgpack map {kind, sender, to, seq, meta, arrays: [[name, dtype, shape], ...]}; never pickle.
  `to` names the recipient: a worker (`trainer:0`), the workers of a group (`scorer`: a PUSH socket
  spreads over them), or `coordinator`.
- small arrays: the bytes of every array under 4 KB, in the header's order, each padded to 8 bytes,
  joined into one frame (possibly empty). A frame costs ZeroMQ, pyzmq and the MAC a few microseconds on
  each side whatever its size: a bench_trl step's batch, 12 arrays of which 8 are small, went from 16
  frames to 8 (see tools/bench_transport.py).
- buffers: the bytes of every larger array, C order, one frame each, sent without copying.
- tag: GMAC (AES-256-GCM with an empty plaintext: the GCM tag of its associated data) over the lengths
  of every preceding frame (8 bytes each), then the frames, under the one-time key HMAC-SHA256(run
  secret, nonce). Each message has a key of its own, so GCM's rule that a key never sees the same IV
  twice holds with a fixed IV. On this machine's AES-NI/VPCLMULQDQ it runs at about 16 GB/s, against
  Poly1305's 8 and SHA-256's 1.5 (an HMAC-SHA256 over the whole message halved the throughput of rollout
  streaming; Poly1305 under the same one-time keys took 38 us for the batch of a bench_trl step, GMAC 20).

`Codec.decode` checks the MAC before it parses anything, then the header's shape, then that every buffer
has exactly the bytes its dtype and shape need, that `seq` grows per sender (no replays), and that the
frame is addressed to this receiver (`to`, covered by the MAC: a valid frame replayed to a receiver it was
not meant for is refused). Only the socket's frame limit bounds a header, which only the run's own
processes can have made: a step's texts travel in it, tens of MB in a big step (a cap of 16 MB dropped
every message of a step of 4,000 samples of 5,000 characters). A frame that fails raises `FrameError`
with the reason; receivers log it, count it and drop it.
"""

from __future__ import annotations

import hmac
import itertools
import math
import os
import secrets
import struct
from dataclasses import dataclass, field
from typing import Any

import msgpack
import numpy as np
from cryptography.hazmat.primitives.ciphers import Cipher
from cryptography.hazmat.primitives.ciphers.algorithms import AES
from cryptography.hazmat.primitives.ciphers.modes import GCM

MAGIC = b"SRLHF5"
NONCE_BYTES = 16
MAC_BYTES = 16
# Only plain numeric dtypes cross the wire (no object arrays, no structured dtypes).
DTYPES = {"bool", "int8", "uint8", "int16", "int32", "int64", "float16", "float32", "float64"}
# (dtype.name is slow to compute; these are looked up per array of every message)
_NAME_OF = {np.dtype(name): name for name in DTYPES}
_ITEMSIZE = {name: np.dtype(name).itemsize for name in DTYPES}
# Arrays of fewer bytes travel joined in one frame; frames shorter than this are joined before they are
# fed to the MAC (fewer calls per message).
_SMALL = 4096
_PADDING = bytes(8)
_IV = bytes(12)  # (a fixed IV: every key is used for one message only)
MAX_ARRAYS = 1024


class FrameError(ValueError):
    """A received message was forged, damaged, replayed or malformed."""

    def __init__(self, reason: str, detail: str = ""):
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason


@dataclass
class Message:
    """What roles exchange: a kind, small metadata, and named numpy arrays."""

    kind: str
    meta: dict[str, Any] = field(default_factory=dict)
    arrays: dict[str, np.ndarray] = field(default_factory=dict)
    sender: str = ""
    seq: int = 0


def new_secret() -> bytes:
    """A fresh per-run secret."""
    return secrets.token_bytes(32)


def attempt_secret(secret: bytes, attempt: str) -> bytes:
    """The key of one attempt of a run (one start of its workers by a driver; a worker started again keeps
    it): frames of an earlier attempt (a requeue, a resume, a restart of every worker), captured on
    the network, do not authenticate in a later one, whose receivers know none of their sequence numbers."""
    return hmac.new(secret, b"slurm-rlhf attempt " + attempt.encode(), "sha256").digest()


def connection_password(secret: bytes) -> bytes:
    """What a socket gives to open a connection to a listening socket of the run (transport/gate.py):
    drawn from the attempt's key, so a peer of an earlier attempt is refused as well."""
    return hmac.new(secret, b"slurm-rlhf connection", "sha256").hexdigest().encode()


def read_secret(path: str | os.PathLike) -> bytes:
    """Read the run secret from a file that only its owner may read. ConfigError, naming the file and the fix,
    where it is missing, open to others or too short (it authenticates only the live processes of a run, so
    a new one may replace it: nothing kept in the run directory depends on it)."""
    import shlex

    from toolkit.errors import ConfigError

    quoted = shlex.quote(str(path))
    new = f"make a new one (nothing the run keeps depends on it): (umask 077; head -c 32 /dev/urandom > {quoted})"
    try:
        mode = os.stat(path).st_mode
        if mode & 0o077:
            raise ConfigError(f"{path}, the run's secret (the key its processes prove to each other), may be read "
                              f"by others (mode {mode & 0o777:o}); make it yours alone with `chmod 600 {quoted}`, "
                              f"or, if someone else may have read it, {new}")
        with open(path, "rb") as f:
            secret = f.read()
    except OSError as e:
        raise ConfigError(f"{path}, the run's secret (the key its processes prove to each other), cannot be read "
                          f"({e.strerror}): a copy of the run directory without it?; {new}") from None
    if len(secret) < 16:
        raise ConfigError(f"{path}, the run's secret, is too short ({len(secret)} bytes; at least 16); {new}")
    return secret


class Codec:
    """Encodes messages of one sender and decodes (and authenticates) messages of any sender addressed to
    one of the names in `accepts` (None: any recipient, for tools and tests) or to this codec's own
    `sender` name (a reply to this one sender)."""

    def __init__(self, secret: bytes, sender: str, accepts=None):
        self._secret = secret
        self.password = connection_password(secret)  # (for the sockets that carry its messages)
        self._accepts = None if accepts is None else frozenset(accepts)
        # A random suffix tells two incarnations of the same worker apart (their seqs restart at 0).
        self.sender = f"{sender}#{secrets.token_hex(4)}"
        self._seq = itertools.count(1)
        self._last_seq: dict[str, int] = {}

    def encode(self, kind: str, meta: dict | None = None, arrays: dict[str, np.ndarray] | None = None,
               to: str = "") -> list:
        """Frames for one message to `to` (buffers are views of the arrays, not copies)."""
        specs, small, buffers = [], [], []
        for name, arr in (arrays or {}).items():
            arr = np.asarray(arr)
            if not arr.flags.c_contiguous:  # (np.ascontiguousarray would turn 0-d arrays into 1-d)
                arr = arr.copy(order="C")
            dtype = _NAME_OF.get(arr.dtype)
            if dtype is None:
                raise TypeError(f"array {name!r} has dtype {arr.dtype}; allowed: {sorted(DTYPES)}")
            specs.append([name, dtype, list(arr.shape)])
            data = memoryview(arr.reshape(-1).view(np.uint8))
            if arr.nbytes < _SMALL:
                small += (data, _PADDING[: -arr.nbytes % 8])
            else:
                buffers.append(data)
        header = msgpack.packb(
            {"kind": kind, "sender": self.sender, "to": to, "seq": next(self._seq), "meta": meta or {},
             "arrays": specs},
            use_bin_type=True,
        )
        frames = [MAGIC + secrets.token_bytes(NONCE_BYTES), header, b"".join(small), *buffers]
        return [*frames, self._mac(frames)]

    def decode(self, frames: list) -> Message:
        """Authenticate and parse frames (bytes, memoryviews or zmq.Frame); raise FrameError if bad."""
        views = [memoryview(f) for f in frames]  # (a zmq.Frame is a buffer itself)
        if len(views) < 4:
            raise FrameError("malformed", f"{len(views)} frames, need at least 4")
        if views[0][: len(MAGIC)] != MAGIC:
            raise FrameError("malformed", "bad magic (not a slurm-rlhf frame, or another version)")
        *body, mac = views
        if (len(body[0]) != len(MAGIC) + NONCE_BYTES or len(mac) != MAC_BYTES
                or not hmac.compare_digest(self._mac(body), bytes(mac))):
            raise FrameError("bad-mac", "authentication failed (wrong run secret, or the frame was altered)")
        header = self._parse_header(body[1])
        if self._accepts is not None and header["to"] not in self._accepts and header["to"] != self.sender:
            raise FrameError("misdirected", f"a frame for {header['to']!r} from {header['sender']} reached "
                                            f"{'/'.join(sorted(self._accepts)) or 'a send-only socket'}")
        sender, seq = header["sender"], header["seq"]
        last = self._last_seq.get(sender, 0)
        if seq <= last:
            raise FrameError("replay", f"seq {seq} from {sender} after {last}")
        small, buffers = body[2], body[3:]
        arrays, at, taken = {}, 0, 0
        for spec in header["arrays"]:
            name, dtype, shape = _check_spec(spec)
            need = math.prod(shape) * _ITEMSIZE[dtype]
            if need < _SMALL:
                buf = small[at: at + need]
                at += need + (-need % 8)
            elif taken < len(buffers):
                buf = buffers[taken]
                taken += 1
            else:
                raise FrameError("malformed", f"array {name!r} {dtype}{tuple(shape)} has no buffer: "
                                              f"{len(buffers)} came")
            if len(buf) != need:
                raise FrameError("malformed", f"array {name!r} {dtype}{tuple(shape)} needs {need} bytes, got {len(buf)}")
            arrays[name] = np.frombuffer(buf, dtype=dtype).reshape(shape)
        if at != len(small) or taken != len(buffers):
            raise FrameError("malformed", f"header lists {len(header['arrays'])} arrays, of {at} bytes joined and "
                                          f"{taken} buffers, but {len(small)} bytes and {len(buffers)} buffers came")
        self._last_seq[sender] = seq
        return Message(header["kind"], header["meta"], arrays, sender, seq)

    def _mac(self, frames) -> bytes:
        """GMAC tag of `frames` (frames[0] holds the nonce) under the message's one-time key (see above)."""
        frames = [memoryview(f) for f in frames]
        key = hmac.digest(self._secret, b"slurm-rlhf gmac key:" + bytes(frames[0][len(MAGIC):]), "sha256")
        mac = Cipher(AES(key), GCM(_IV)).encryptor()
        small = bytearray(struct.pack(f"<{len(frames)}Q", *(f.nbytes for f in frames)))
        for f in frames:  # (GCM's associated data may come in pieces of any length: it is their concatenation)
            if f.nbytes < _SMALL:
                small += f
                continue
            mac.authenticate_additional_data(small)
            small.clear()
            mac.authenticate_additional_data(f)
        mac.authenticate_additional_data(small)
        mac.finalize()
        return mac.tag

    @staticmethod
    def _parse_header(raw) -> dict:
        try:
            header = msgpack.unpackb(raw, raw=False, strict_map_key=True)
        except Exception as e:  # msgpack raises several types for bad input
            raise FrameError("malformed", f"header is not msgpack ({type(e).__name__})") from None
        if not isinstance(header, dict) or set(header) != {"kind", "sender", "to", "seq", "meta", "arrays"}:
            raise FrameError("malformed", "header keys")
        if not all(isinstance(header[key], str) for key in ("kind", "sender", "to")):
            raise FrameError("malformed", "kind, sender and to must be strings")
        if not isinstance(header["seq"], int) or isinstance(header["seq"], bool):
            raise FrameError("malformed", "seq must be an integer")
        if not isinstance(header["meta"], dict) or not isinstance(header["arrays"], list):
            raise FrameError("malformed", "meta must be a map and arrays a list")
        if len(header["arrays"]) > MAX_ARRAYS:
            raise FrameError("malformed", f"{len(header['arrays'])} arrays")
        return header


def _check_spec(spec) -> tuple[str, str, list[int]]:
    # (msgpack gives exact lists, strings and ints: `type(...) is` checks them, and rejects bools, at a
    # third of isinstance's cost, per array of every message)
    if type(spec) is not list or len(spec) != 3:
        raise FrameError("malformed", "array spec must be [name, dtype, shape]")
    name, dtype, shape = spec
    if type(name) is not str or type(dtype) is not str or dtype not in DTYPES:  # (a list is unhashable)
        raise FrameError("malformed", f"array {name!r}: dtype {dtype!r} not allowed")
    if type(shape) is not list or len(shape) > 8:
        raise FrameError("malformed", f"array {name!r}: bad shape {shape!r}")
    for d in shape:
        if type(d) is not int or not 0 <= d < 2**40:
            raise FrameError("malformed", f"array {name!r}: bad shape {shape!r}")
    return name, dtype, shape
