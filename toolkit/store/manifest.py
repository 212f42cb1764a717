"""The run manifest (RUN_DIR/manifest.jsonl) and the resume plan drawn from it.

The manifest is append-only JSON Lines; each line is written and fsynced on its own, and a line cut
short by a crash is ignored when read. Records:

    {"kind": "experience", "step": s, "file": "experience/step-NNNNNN.h5", "checksum": ..., "bytes": ...}
    {"kind": "checkpoint", "step": v, "dir": "checkpoints/step-NNNNNN", "files": {relpath: [checksum, bytes]}}
    {"kind": "removed", "dir": ...}          an old checkpoint deleted to keep only the newest ones
    {"kind": "resume", ...}                  what a resume used, replayed and set aside
    {"kind": "data", "files": {field: {"path", "files": {name: [bytes, mtime_ns, checksum]}}}}
                                             the data files at the first start (toolkit/data/fingerprint.py)
    {"kind": "rewards", "functions": {field: {"function", "path", "bytes", "checksum"}}, "from_step": s}
                                             the reward functions' files at the first start, and again from
                                             a resume that found them changed (toolkit/rewards/sources.py)

Checksums: see toolkit/store/checksum.py; manifests of earlier versions name an experience file's
checksum "sha256".

A checkpoint at step v holds the weights after v updates (policy_version v): the experience of steps
0..v-1 is in it. Resuming loads the newest checkpoint whose files all match their checksums, trains on
the committed experience of steps v, v+1, ... (in order, each verified, never regenerated) and generates
from the first step that has no good experience. Damaged files are named and set aside.
"""

from __future__ import annotations

import itertools
import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

from toolkit.store import space
from toolkit.store.checksum import checksum_of, matches
from toolkit.store.experience import file_name


class Manifest:
    def __init__(self, run_dir: Path):
        self.run_dir = Path(run_dir)
        self.path = self.run_dir / "manifest.jsonl"

    def append(self, record: dict) -> None:
        """Append `record` (with the time), on disk when this returns; a full disk is a DiskFull naming it."""
        with space.named_if_full(f"{record['kind']} record of the manifest", self.path, self.run_dir):
            append_jsonl(self.path, {**record, "time": time.time()}, fsync=True)

    def records(self) -> list[dict]:
        return [r for r in read_jsonl(self.path) if "kind" in r]

    def last(self, kind: str) -> dict | None:
        """The newest record of `kind`; None if there is none."""
        return next((r for r in reversed(self.records()) if r["kind"] == kind), None)


def live_checkpoints(records: list[dict]) -> dict[int, dict]:
    """{step: record} of the checkpoints that `records` wrote and did not remove since (a step's last record
    wins: a resume from older weights may save a step again into a folder removed before)."""
    live: dict[int, dict] = {}
    for r in records:
        if r["kind"] == "checkpoint":
            live[r["step"]] = r
        elif r["kind"] == "removed":
            live = {step: c for step, c in live.items() if c["dir"] != r["dir"]}
    return live


def held_experience(run_dir: Path, records: list[dict]) -> dict[int, dict]:
    """{step: record} of the experience whose file is still in the run directory (a step's last commit
    wins; a file set aside by a resume is gone from experience/)."""
    last = {r["step"]: r for r in records if r["kind"] == "experience"}
    return {step: r for step, r in sorted(last.items()) if (Path(run_dir) / r["file"]).is_file()}


def append_jsonl(path: Path, record: dict, fsync: bool = False) -> None:
    """Append `record` as one line of JSON. After a line cut short by a crash (no newline at the end of the
    file) it starts a line of its own: joined to the cut line, it would be skipped with it when read."""
    line = json.dumps(record).encode() + b"\n"
    with open(path, "a+b") as f:
        if f.seek(0, os.SEEK_END) > 0:
            f.seek(-1, os.SEEK_END)
            if f.read(1) != b"\n":
                line = b"\n" + line
        f.write(line)  # (append mode: at the end, wherever the file position is)
        if fsync:
            f.flush()
            os.fsync(f.fileno())


def read_jsonl(path: Path) -> list[dict]:
    """The records of an append-only JSON Lines file of the run (none if it is missing); a line cut short
    by a crash is skipped."""
    try:
        lines = Path(path).read_bytes().splitlines()
    except FileNotFoundError:
        return []
    out = []
    for line in lines:
        try:
            record = json.loads(line)
        except (json.JSONDecodeError, UnicodeDecodeError):
            continue  # a line cut short by a crash (or what the disk held after it: not even UTF-8)
        if isinstance(record, dict):
            out.append(record)
    return out


def verify(path: Path, checksum: str, size: int) -> str | None:
    """None if the file is whole, else what is wrong with it."""
    try:
        actual = path.stat().st_size
    except FileNotFoundError:
        return "missing"
    if actual != size:
        return f"{actual} bytes, the manifest says {size} bytes (truncated or overwritten)"
    if not matches(path, checksum):
        return "checksum mismatch (corrupted)"
    return None


def checkpoint_files(directory: Path) -> dict[str, list]:
    """{relative path: [checksum, bytes]} of every file under a checkpoint directory."""
    return {str(p.relative_to(directory)): [checksum_of(p, ours=True), p.stat().st_size]
            for p in sorted(directory.rglob("*")) if p.is_file()}


@dataclass
class ResumePlan:
    checkpoint: dict | None = None          # manifest record of the checkpoint to load (None: initial weights)
    replay: list[Path] = field(default_factory=list)   # experience to train on after it, in step order
    next_step: int = 0                      # first step to generate
    problems: list[str] = field(default_factory=list)  # damaged files found, and what was done instead
    set_aside: list[Path] = field(default_factory=list)  # experience of steps >= next_step (generated again)

    @property
    def start_version(self) -> int:
        return self.checkpoint["step"] if self.checkpoint else 0


def plan_resume(run_dir: Path) -> ResumePlan:
    run_dir = Path(run_dir)
    records = Manifest(run_dir).records()
    plan = ResumePlan()
    for _, ckpt in sorted(live_checkpoints(records).items(), reverse=True):
        bad = [f"{rel}: {why}" for rel, (digest, size) in ckpt["files"].items()
               if (why := verify(run_dir / ckpt["dir"] / rel, digest, size))]
        if not bad:
            plan.checkpoint = ckpt
            break
        plan.problems.append(f"checkpoint {ckpt['dir']} is damaged ({'; '.join(bad[:3])}); using an older state")
    experience = {r["step"]: r for r in records if r["kind"] == "experience"}  # the last commit of a step wins
    step = plan.start_version
    while step in experience:
        rec = experience[step]
        why = verify(run_dir / rec["file"], experience_checksum(rec), rec["bytes"])
        if why:
            plan.problems.append(f"{rec['file']}: {why}; steps from {step} on are generated again")
            break
        plan.replay.append(run_dir / rec["file"])
        step += 1
    plan.next_step = step
    directory = run_dir / "experience"
    if directory.is_dir():
        plan.set_aside = sorted(p for p in directory.glob("step-*.h5")
                                if int(p.stem.split("-")[1]) >= plan.next_step)
    return plan


def set_aside(run_dir: Path, plan: ResumePlan) -> list[Path]:
    """Move experience that will be generated again to experience/set-aside/<time>/ (kept for the record)."""
    if not plan.set_aside:
        return []
    target = _new_folder(Path(run_dir) / "experience" / "set-aside", time.strftime("%Y%m%d-%H%M%S"))
    moved = []
    for path in plan.set_aside:
        dest = target / path.name
        os.replace(path, dest)
        moved.append(dest)
    return moved


def _new_folder(parent: Path, name: str) -> Path:
    """parent/name, or name-2, name-3, ...: a folder of its own (two resumes in one second set aside the same
    step's file, and the second replaced the first)."""
    parent.mkdir(parents=True, exist_ok=True)
    for n in itertools.count(1):
        target = parent / (name if n == 1 else f"{name}-{n}")
        try:
            target.mkdir()
            return target
        except FileExistsError:
            continue


def experience_checksum(record: dict) -> str:
    """The checksum of an experience record (named "sha256" in manifests of earlier versions)."""
    return record["checksum"] if "checksum" in record else record["sha256"]


def experience_path(run_dir: Path, step: int) -> Path:
    return Path(run_dir) / "experience" / file_name(step)
