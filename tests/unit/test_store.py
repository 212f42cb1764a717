"""The experience store and the manifest: atomic commits, checksums, resume plans (no processes)."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os

import numpy as np
import pytest
import xxhash

from tests.unit.test_samples_and_modeling import batch as make_batch
from toolkit.store import experience
from toolkit.store.checksum import checksum_of, matches
from toolkit.store.manifest import Manifest, plan_resume, verify


def scored_batch(step=0):
    b = make_batch(step=step)
    b.ref_logprobs = np.array([-1, -2, -3, -4, -5], np.float32)
    b.rewards = np.array([[1.0, 0.5], [0.0, 2.0]], np.float32)
    b.reward_total = np.array([1.25, 1.0], np.float32)
    b.reward_names, b.reward_weights = ["rule", "rm"], [1.0, 0.5]
    b.responses = ["a\0b", "c"]  # a NUL, as untrained models write
    return b


def record(step=0):
    per_token = {"old_logprobs": np.arange(5, dtype=np.float32), "advantages": np.ones(5, np.float32)}
    return experience.record_of(scored_batch(step), per_token, "grpo", step, 0.01, 16 * (step + 1))


def commit(run_dir, step):
    path, digest, size = experience.commit(run_dir / "experience", step, record(step))
    Manifest(run_dir).append({"kind": "experience", "step": step, "file": str(path.relative_to(run_dir)),
                              "checksum": digest, "bytes": size})
    return path


def test_commit_and_read_back(tmp_path):
    path = commit(tmp_path, 3)
    assert path.name == "step-000003.h5" and not list(path.parent.glob(".*tmp"))
    rec = experience.read(path)
    assert rec["attrs"]["step"] == 3 and rec["meta"]["reward_names"] == ["rule", "rm"]
    assert rec["samples"]["reward_total"].tolist() == [1.25, 1.0]
    assert rec["experience"]["old_logprobs"].tolist() == [0, 1, 2, 3, 4]
    assert rec["meta"]["responses"] == ["a\0b", "c"]  # the text as it was, NUL included
    back = experience.batch_of(rec)
    assert back.response(1).tolist() == [7, 8, 9] and back.reward_total.tolist() == [1.25, 1.0]
    assert back.fields == [{"topic": "x"}] * 2 and back.ref_logprobs.tolist() == [-1, -2, -3, -4, -5]
    assert "samples 2 (2 prompts x 1)" in experience.summary(path)


def test_commit_writes_the_bytes_of_h5pys_own_calls(tmp_path):
    """The commit writes through h5py's low-level API for speed; the file is the one its high-level
    calls would write, byte for byte (attributes, one fixed-length string, contiguous datasets)."""
    import h5py
    import orjson

    rec = record(5)
    path = experience.commit(tmp_path, 5, rec)[0]
    with h5py.File(tmp_path / "high-level.h5", "w") as f:
        for key, value in rec["attrs"].items():
            f.attrs[key] = value
        f.create_dataset("meta", data=np.bytes_(orjson.dumps(rec["meta"], option=experience.JSON_OPTIONS)))
        for group in ("samples", "experience"):
            g = f.create_group(group)
            for name, value in rec[group].items():
                g.create_dataset(name, data=value)
    assert path.read_bytes() == (tmp_path / "high-level.h5").read_bytes()


def test_failed_commit_leaves_nothing(tmp_path):
    bad = record(0)
    bad["samples"]["prompt_ids"] = np.array([object()], dtype=object)  # h5py cannot store this
    with pytest.raises(TypeError):
        experience.commit(tmp_path, 0, bad)
    assert list(tmp_path.iterdir()) == []


def test_manifest_ignores_a_torn_last_line(tmp_path):
    m = Manifest(tmp_path)
    m.append({"kind": "experience", "step": 0})
    with open(m.path, "a") as f:
        f.write('{"kind": "experience", "st')  # a crash in the middle of a write
    assert [r["step"] for r in m.records()] == [0]
    m.append({"kind": "experience", "step": 1})  # (the next attempt's record: a line of its own, not lost with it)
    assert [r["step"] for r in m.records()] == [0, 1]
    assert m.path.read_text().splitlines()[1] == '{"kind": "experience", "st'


def test_verify(tmp_path):
    path = commit(tmp_path, 0)
    rec = Manifest(tmp_path).records()[0]
    assert verify(path, rec["checksum"], rec["bytes"]) is None
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 1
    path.write_bytes(bytes(data))
    assert verify(path, rec["checksum"], rec["bytes"]) == "checksum mismatch (corrupted)"
    path.write_bytes(bytes(data[:10]))
    assert "truncated" in verify(path, rec["checksum"], rec["bytes"])
    path.unlink()
    assert verify(path, rec["checksum"], rec["bytes"]) == "missing"


def test_the_checksum_is_xxh3_128_of_the_files_bytes(tmp_path):
    path = commit(tmp_path, 0)
    rec = Manifest(tmp_path).records()[0]
    assert rec["checksum"] == "xxh3_128:" + xxhash.xxh3_128(path.read_bytes()).hexdigest()
    empty = tmp_path / "empty"
    empty.write_bytes(b"")
    assert checksum_of(empty) == "xxh3_128:" + xxhash.xxh3_128(b"").hexdigest() and matches(empty, checksum_of(empty))
    with pytest.raises(ValueError, match="unknown kind"):
        matches(path, "md5:" + "0" * 32)


def test_a_manifest_of_an_earlier_version_with_sha256_digests_still_resumes(tmp_path):
    paths = [experience.commit(tmp_path / "experience", step, record(step))[0] for step in (0, 1)]
    for step, path in enumerate(paths):  # as versions before the xxh3 checksum wrote them
        Manifest(tmp_path).append({"kind": "experience", "step": step, "file": str(path.relative_to(tmp_path)),
                                   "sha256": hashlib.sha256(path.read_bytes()).hexdigest(),
                                   "bytes": path.stat().st_size})
    assert plan_resume(tmp_path).replay == paths
    data = bytearray(paths[1].read_bytes())
    data[len(data) // 2] ^= 1
    paths[1].write_bytes(bytes(data))
    plan = plan_resume(tmp_path)
    assert plan.replay == paths[:1] and "checksum mismatch" in plan.problems[0]


def test_resume_plan(tmp_path):
    for step in range(5):
        commit(tmp_path, step)
    ckpt = tmp_path / "checkpoints" / "step-000002"
    ckpt.mkdir(parents=True)
    (ckpt / "w.pt").write_bytes(b"weights")
    from toolkit.store.manifest import checkpoint_files

    Manifest(tmp_path).append({"kind": "checkpoint", "step": 2, "dir": "checkpoints/step-000002",
                               "files": checkpoint_files(ckpt)})
    plan = plan_resume(tmp_path)
    assert plan.start_version == 2 and [p.name for p in plan.replay] == ["step-000002.h5", "step-000003.h5",
                                                                          "step-000004.h5"]
    assert plan.next_step == 5 and not plan.problems and not plan.set_aside
    # a damaged experience file stops the replay there; it and what follows are generated again
    (tmp_path / "experience" / "step-000003.h5").write_bytes(b"junk")
    plan = plan_resume(tmp_path)
    assert plan.next_step == 3 and [p.name for p in plan.set_aside] == ["step-000003.h5", "step-000004.h5"]
    assert plan.problems == ["experience/step-000003.h5: 4 bytes, the manifest says "
                             f"{json.loads(Manifest(tmp_path).path.read_text().splitlines()[3])['bytes']} bytes "
                             "(truncated or overwritten); steps from 3 on are generated again"]
    # a damaged checkpoint falls back to an older one (here: the initial weights)
    (ckpt / "w.pt").write_bytes(b"other!!")
    plan = plan_resume(tmp_path)
    assert plan.checkpoint is None and plan.next_step == 3 and "checkpoint checkpoints/step-000002" in plan.problems[0]
    # a removed checkpoint is not a problem
    Manifest(tmp_path).append({"kind": "removed", "dir": "checkpoints/step-000002"})
    assert all("checkpoints/" not in p for p in plan_resume(tmp_path).problems)


def test_two_resumes_in_one_second_set_their_files_aside_in_two_folders(tmp_path, monkeypatch):
    """Set-aside folders are named by the second: a second resume that set aside the same step's file within it
    replaced the first one's copy, which the folder is there to keep."""
    from toolkit.store import manifest

    monkeypatch.setattr(manifest.time, "strftime", lambda _: "20261207-120000")
    kept = []
    for content in (b"first", b"second"):
        (tmp_path / "experience").mkdir(exist_ok=True)
        (tmp_path / "experience" / "step-000003.h5").write_bytes(content)
        plan = manifest.ResumePlan(set_aside=[tmp_path / "experience" / "step-000003.h5"])
        kept += manifest.set_aside(tmp_path, plan)
    assert [p.relative_to(tmp_path).as_posix() for p in kept] == [
        "experience/set-aside/20261207-120000/step-000003.h5", "experience/set-aside/20261207-120000-2/step-000003.h5"]
    assert [p.read_bytes() for p in kept] == [b"first", b"second"]


def test_what_a_run_holds_is_each_steps_last_record_less_what_is_gone(tmp_path):
    """The one reading of the manifest that resume, `inspect`, `report` and `generate` share."""
    from toolkit.store.manifest import held_experience, live_checkpoints

    (tmp_path / "experience").mkdir()
    for step in (0, 1):
        (tmp_path / "experience" / experience.file_name(step)).write_bytes(b"x")
    records = [{"kind": "experience", "step": 1, "file": "experience/step-000001.h5", "bytes": 1},
               {"kind": "experience", "step": 0, "file": "experience/step-000000.h5", "bytes": 1},
               {"kind": "experience", "step": 2, "file": "experience/step-000002.h5", "bytes": 1},  # set aside
               {"kind": "experience", "step": 1, "file": "experience/step-000001.h5", "bytes": 2},  # again
               {"kind": "checkpoint", "step": 1, "dir": "checkpoints/step-000001", "files": {}},
               {"kind": "checkpoint", "step": 2, "dir": "checkpoints/step-000002", "files": {"a": 1}},
               {"kind": "checkpoint", "step": 2, "dir": "checkpoints/step-000002", "files": {"a": 2}},
               {"kind": "removed", "dir": "checkpoints/step-000001"}]
    held = held_experience(tmp_path, records)
    assert list(held) == [0, 1] and held[1]["bytes"] == 2
    assert {step: r["files"] for step, r in live_checkpoints(records).items()} == {2: {"a": 2}}
    # a resume from older weights saves step 1 again into the folder removed before: it is there again
    again = records + [{"kind": "checkpoint", "step": 1, "dir": "checkpoints/step-000001", "files": {"b": 1}}]
    assert {step: r["files"] for step, r in live_checkpoints(again).items()} == {1: {"b": 1}, 2: {"a": 2}}


def test_a_new_run_resumes_from_nothing(tmp_path):
    plan = plan_resume(tmp_path)
    assert plan.checkpoint is None and plan.replay == [] and plan.next_step == 0 and plan.problems == []


def test_a_write_that_found_no_space_is_explained_and_other_errors_are_not(tmp_path):
    import errno

    from toolkit.store import space

    target = tmp_path / "checkpoints" / "step-000004"  # (not made yet: its parent's file system counts)
    try:
        try:
            raise OSError(errno.ENOSPC, "No space left on device")
        except OSError as low:
            raise RuntimeError("unexpected pos 576 vs 534") from low  # (as torch's writer wraps it)
    except RuntimeError as e:
        error = space.explain("checkpoint", target, e, tmp_path)
    assert isinstance(error, space.DiskFull) and error.errno == errno.ENOSPC
    assert f"no space left to write the checkpoint {target} (" in str(error) and "MB free there" in str(error)
    assert f"`slurm-rlhf resume {tmp_path}`" in str(error) and "unexpected pos 576 vs 534" in str(error)
    other = ValueError("not about space")  # on a disk with room: left as it is
    assert space.explain("checkpoint", target, other, tmp_path) is other
    # a write inside this one named it already (a checkpoint's manifest record): not wrapped in a second message
    assert space.explain("checkpoint", target, error, tmp_path) is error


def test_writeback_starts_the_disk_writing_after_each_megabyte(tmp_path, monkeypatch):
    fd = os.open(tmp_path / "f", os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        os.write(fd, bytes(3 << 20))
        writeback = experience.Writeback(fd)
        real = experience.Writeback._call
        assert real, "libc has no sync_file_range on this Linux machine"
        assert real(fd, 0, 0, experience.Writeback.START_WRITE) == 0  # the real call takes this file
        calls = []
        monkeypatch.setattr(experience.Writeback, "_call", lambda *args: calls.append(args) or 0)
        writeback.wrote(600_000)
        assert calls == []
        writeback.wrote(600_000)  # 1.2 MB: one call, for the whole file
        writeback.wrote(100)
        assert calls == [(fd, 0, 0, 2)]
    finally:
        os.close(fd)


def test_a_checkpoint_is_loaded_only_where_nobody_else_could_have_written_it(tmp_path, monkeypatch):
    """DeepSpeed unpickles a checkpoint's files (store/ownership.py): every file and directory of it, and the
    run directory, must be this user's, not links, and not writable by others (by the group only where the
    group is the user's own); SLURM_RLHF_TRUST_CHECKPOINTS=1 turns the check off."""
    import grp
    import pwd

    from toolkit.store.ownership import TRUST_ENV, check_ours_alone

    monkeypatch.delenv(TRUST_ENV, raising=False)
    run_dir = tmp_path / "run"
    shard = run_dir / "checkpoints" / "step-000002" / "actor" / "ds" / "optim_states.pt"
    shard.parent.mkdir(parents=True)
    shard.write_bytes(b"x")
    for path in (run_dir, *run_dir.rglob("*")):
        path.chmod(0o700 if path.is_dir() else 0o600)
    checkpoint = run_dir / "checkpoints" / "step-000002"
    check_ours_alone(checkpoint)

    shard.chmod(0o602)
    with pytest.raises(PermissionError, match=f"{shard} may be written by everyone \\(mode 602\\), .*"
                                              f"chmod -R go-w {run_dir}"):
        check_ours_alone(checkpoint)
    monkeypatch.setenv(TRUST_ENV, "1")
    check_ours_alone(checkpoint)
    monkeypatch.delenv(TRUST_ENV)
    shard.chmod(0o600)
    run_dir.chmod(0o777)  # (the directory above it: a file could be put in place of any below)
    with pytest.raises(PermissionError, match=f"{run_dir} may be written by everyone"):
        check_ours_alone(checkpoint)
    run_dir.chmod(0o700)

    dangling = shard.parent / "dangling.pt"
    dangling.symlink_to(tmp_path / "nothing")
    with pytest.raises(PermissionError, match="dangling.pt is a symbolic link"):
        check_ours_alone(checkpoint)
    dangling.unlink()

    me = pwd.getpwuid(os.getuid())
    own = grp.getgrgid(me.pw_gid)
    shard.chmod(0o660)
    if own.gr_name == me.pw_name and set(own.gr_mem) <= {me.pw_name}:  # (a group of the user's own: umask 002)
        check_ours_alone(checkpoint)
    if os.getuid() != 0:
        return  # (files of another group or user need root)
    other = next(g for g in grp.getgrall() if g.gr_gid != me.pw_gid)
    os.chown(shard, 0, other.gr_gid)
    with pytest.raises(PermissionError, match=f"may be written by the group '{other.gr_name}' \\(mode 660\\)"):
        check_ours_alone(checkpoint)
    shard.chmod(0o640)
    check_ours_alone(checkpoint)  # (readable by the group is fine)
    os.chown(shard, 65534, 65534)
    with pytest.raises(PermissionError, match="optim_states.pt belongs to another user \\(uid 65534\\).*"
                                              "copy it \\(the copy is yours\\)"):
        check_ours_alone(checkpoint)


def test_a_checkpoint_is_written_so_that_its_own_resume_accepts_it(tmp_path):
    """A default ACL on a project directory gives its group write access whatever the umask (umask 002
    stands in for it here): the checkpoint's files and directories are made not writable by others before
    it is renamed into place, so the resume's check (store/ownership.py) accepts what the run wrote."""
    from toolkit.store import checkpoint
    from toolkit.store.ownership import check_ours_alone

    run_dir = tmp_path / "run"
    run_dir.mkdir(mode=0o700)
    left = run_dir / "checkpoints" / ".step-000009.tmp" / "actor"  # (a save killed before it ended, at another step)
    left.mkdir(parents=True)
    (left / "weights").write_bytes(b"x" * 1000)
    previous = os.umask(0o002)
    try:
        checkpoint.save(run_dir, 3, {}, {"step": 3}, rank=0, barrier=lambda: None, keep=2,
                        write_copies=lambda d: (d / "hf").mkdir() or (d / "hf" / "model.safetensors").write_bytes(b"x"))
    finally:
        os.umask(previous)
    final = checkpoint.directory_of(run_dir, 3)
    modes = {str(p.relative_to(final)): p.stat().st_mode & 0o777 for p in [final, *final.rglob("*")]}
    assert modes and not any(mode & 0o022 for mode in modes.values()), modes
    check_ours_alone(final)
    assert sorted(p.name for p in final.parent.iterdir()) == ["step-000003"]  # (nothing else removed what was left)


def test_an_export_is_put_in_place_of_one_whose_removal_was_killed(tmp_path):
    """A removal of the export before killed midway (or held open on NFS) left its folder: the next export
    took it for the name to move the old one to, and failed on every resume (Directory not empty)."""
    from toolkit.training.export import publish

    run_dir = tmp_path / "run"
    for name, content in (("export", b"old"), (".export.old", b"older")):  # (what a killed publish left)
        (run_dir / name).mkdir(parents=True)
        (run_dir / name / "model.safetensors").write_bytes(content)
    source = tmp_path / "hf"
    source.mkdir()
    (source / "model.safetensors").write_bytes(b"new")
    publish(run_dir, source)
    assert (run_dir / "export" / "model.safetensors").read_bytes() == b"new"
    assert sorted(p.name for p in run_dir.iterdir()) == ["export"]


def test_a_checkpoint_saved_again_replaces_a_folder_that_cannot_be_removed(tmp_path, monkeypatch):
    """A step saved again (after a resume from an older checkpoint) into a folder with a file that cannot be
    removed (held open on NFS): the old folder is moved aside, not removed in place; before, the rename
    onto it failed and the new checkpoint was deleted."""
    import shutil

    from toolkit.store import checkpoint

    run_dir = tmp_path / "run"
    run_dir.mkdir(mode=0o700)
    save = lambda state: checkpoint.save(run_dir, 3, {}, state, rank=0, barrier=lambda: None, keep=2)  # noqa: E731
    save({"step": 3, "attempt": 1})
    remove = shutil.rmtree
    monkeypatch.setattr(shutil, "rmtree", lambda path, *a, **k: None if "step-000003" in str(path) and not
                        str(path).endswith(".tmp") else remove(path, *a, **k))
    save({"step": 3, "attempt": 2})
    plan = plan_resume(run_dir)
    assert plan.checkpoint["dir"] == "checkpoints/step-000003" and plan.problems == []
    assert json.loads((run_dir / plan.checkpoint["dir"] / "trainer_state.json").read_text())["attempt"] == 2


def test_an_export_or_a_manifest_record_on_a_full_disk_is_named_and_leaves_no_partial_copy(tmp_path):
    from tests.conftest import tmpfs
    from toolkit.store.space import DiskFull
    from toolkit.training.export import publish

    source = tmp_path / "hf"
    source.mkdir()
    (source / "model.safetensors").write_bytes(os.urandom(3 << 20))
    with tmpfs(tmp_path / "disk", "2m") as disk:
        run_dir = disk / "run"
        run_dir.mkdir()
        with pytest.raises(DiskFull, match=rf"no space left to write the export {run_dir}/export \("):
            publish(run_dir, source)
        assert list(run_dir.iterdir()) == []  # (the partial copy is gone)
        with open(disk / "filler", "wb", buffering=0) as f:  # (then no room for even a line)
            with contextlib.suppress(OSError):
                while True:
                    f.write(b"x" * 4096)
        with pytest.raises(DiskFull, match=r"no space left to write the checkpoint record of the manifest"):
            Manifest(run_dir).append({"kind": "checkpoint", "step": 1, "dir": "x" * 5000})


def test_a_manifest_line_that_is_not_even_utf8_is_skipped_like_a_cut_one(tmp_path):
    m = Manifest(tmp_path)
    m.append({"kind": "experience", "step": 0})
    with open(m.path, "ab") as f:
        # (what the disk held after a crash)
        f.write(b'{"kind": "experience", "step": 1\x89PNG\xff\n[1, 2]\n"text"\n{"no kind": 1}\n')
    m.append({"kind": "experience", "step": 2})
    assert [r["step"] for r in m.records()] == [0, 2]


def test_a_data_files_checksum_is_read_in_blocks_and_the_runs_own_through_a_map(tmp_path, monkeypatch):
    """A mapped file that shrinks while it is read kills the process (SIGBUS): a data file being rewritten
    while a run starts is read in blocks; both ways give the same checksum, across blocks too."""
    import mmap

    from toolkit.store import checksum

    path = tmp_path / "rows.jsonl"
    path.write_bytes(os.urandom(checksum.BLOCK + 12345))
    expected = "xxh3_128:" + xxhash.xxh3_128(path.read_bytes()).hexdigest()
    assert checksum_of(path, ours=True) == expected
    monkeypatch.setattr(mmap, "mmap", lambda *a, **k: pytest.fail("a data file was mapped"))
    assert checksum_of(path) == expected


def test_an_export_is_on_disk_before_it_is_named(tmp_path, monkeypatch):
    """Every file and folder of the copy is fsynced before the rename (a rename alone does not order the
    files' data before it: after a power loss the manifest's export record could name empty files)."""
    from toolkit.training.export import publish

    source = tmp_path / "hf"
    (source / "adapter").mkdir(parents=True)
    for name in ("model.safetensors", "config.json", "adapter/adapter_model.safetensors"):
        (source / name).write_bytes(b"x")
    synced, fsync = [], os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: synced.append(os.readlink(f"/proc/self/fd/{fd}")) or fsync(fd))
    publish(tmp_path / "run", source)
    tmp = str(tmp_path / "run" / ".export.tmp")
    assert {p.removeprefix(tmp) for p in synced if p.startswith(tmp)} == {
        "/model.safetensors", "/config.json", "/adapter/adapter_model.safetensors", "/adapter", ""}
    assert synced[-1] == str(tmp_path / "run")  # (and the rename, in its folder)


def test_a_save_after_a_resume_that_skipped_a_damaged_newer_checkpoint_keeps_the_new_one(tmp_path):
    """keep=1: the newest checkpoint was damaged, so the resume went back before it. Counted among the newest,
    it had every checkpoint the resumed run saved removed at once, and a crash then went back to the start."""
    from toolkit.store import checkpoint

    run_dir = tmp_path / "run"
    run_dir.mkdir(mode=0o700)
    def save(step):
        checkpoint.save(run_dir, step, {}, {"step": step}, rank=0, barrier=lambda: None, keep=1)

    for step in (2, 4, 6):
        save(step)
    (checkpoint.directory_of(run_dir, 6) / "trainer_state.json").write_text("{}")  # damaged after its save
    plan = plan_resume(run_dir)
    assert plan.checkpoint is None and "checkpoint checkpoints/step-000006 is damaged" in plan.problems[0]
    save(2)
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["step-000002"]
    save(4)
    plan = plan_resume(run_dir)
    assert plan.checkpoint["dir"] == "checkpoints/step-000004" and plan.problems == []
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["step-000004"]


def test_checkpoint_folders_a_kill_left_outside_the_manifest_are_removed_by_the_next_save(tmp_path):
    """A kill -9 while an old checkpoint was removed (its record says removed, half its folder is there), or
    after a save's rename but before its record (a resume goes back before it, and a replay saves a later
    step): each stayed on disk for good, a full copy of the model and its optimizer state each."""
    import shutil

    from toolkit.store import checkpoint

    run_dir = tmp_path / "run"
    run_dir.mkdir(mode=0o700)

    def save(step):
        checkpoint.save(run_dir, step, {}, {"step": step}, rank=0, barrier=lambda: None, keep=1)

    save(2)
    half_removed = run_dir / "checkpoints" / "step-000002"
    shutil.copytree(half_removed, tmp_path / "copy")
    save(4)
    shutil.copytree(tmp_path / "copy", half_removed)  # (the removal killed midway)
    (half_removed / "trainer_state.json").unlink()
    unrecorded = run_dir / "checkpoints" / "step-000006"  # (renamed in place, killed before its record)
    shutil.copytree(tmp_path / "copy", unrecorded)
    assert plan_resume(run_dir).checkpoint["dir"] == "checkpoints/step-000004"
    save(8)  # (the resumed run replayed steps 4..7)
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["step-000008"]
    assert plan_resume(run_dir).checkpoint["dir"] == "checkpoints/step-000008"
