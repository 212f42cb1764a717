"""Model checkpoints of any training stage: every DeepSpeed engine (weights and optimizer state), each
rank's random generators, the stage's own state, and Hugging Face copies for use elsewhere.

    checkpoints/step-NNNNNN/<engine>/ds/...       DeepSpeed save_checkpoint (every rank writes its shard)
    checkpoints/step-NNNNNN/rng/rank-K.json       rank K's torch random state (exact resume with dropout)
    checkpoints/step-NNNNNN/trainer_state.json    the stage's state (step or policy_version, ...) and the
                                                  engine settings its DeepSpeed files depend on (`layout`)
    checkpoints/step-NNNNNN/hf/ ...               what the stage's `write_copies` adds (the model in
                                                  Hugging Face format with its tokenizer, an EMA copy)

Everything is written under a temporary name; rank 0 checksums every file, renames the directory into
place and only then records it in the manifest, so a checkpoint in the manifest is always complete.
"""

from __future__ import annotations

import base64
import json
import shutil
from pathlib import Path
from typing import Callable

import torch

from toolkit.hold import hold
from toolkit.store import space
from toolkit.store.durable import put_in_place, settle
from toolkit.store.manifest import Manifest, checkpoint_files, live_checkpoints
from toolkit.store.ownership import check_ours_alone

TAG = "ds"


def directory_of(run_dir: Path, step: int) -> Path:
    return Path(run_dir) / "checkpoints" / f"step-{step:06d}"


def rng_state(generator: torch.Generator | None = None) -> str:
    state = generator.get_state() if generator is not None else torch.get_rng_state()
    return base64.b64encode(state.numpy().tobytes()).decode()


def set_rng_state(encoded: str, generator: torch.Generator | None = None) -> None:
    state = torch.frombuffer(bytearray(base64.b64decode(encoded)), dtype=torch.uint8)
    if generator is not None:
        generator.set_state(state)
    else:
        torch.set_rng_state(state)


def save(run_dir: Path, step: int, engines: dict, state: dict, rank: int, barrier, keep: int,
         write_copies: Callable[[Path], None] = lambda directory: None) -> float:
    """Save a checkpoint at `step` (every trainer rank calls this); return its size in MB. `write_copies`
    runs on every rank with the checkpoint's directory (it may gather weights under ZeRO-3)."""
    final = directory_of(run_dir, step)
    tmp = final.parent / f".{final.name}.tmp"
    if rank == 0:  # (and what a save killed before it ended left, of any step: nothing else removes it)
        for stale in final.parent.glob(".step-*.tmp"):
            shutil.rmtree(stale, ignore_errors=True)
        (tmp / "rng").mkdir(parents=True)
    barrier()
    # (a full disk, mostly: say so, and leave no half-written checkpoint)
    with space.named_if_full("checkpoint", final, run_dir,
                             lambda: rank == 0 and shutil.rmtree(tmp, ignore_errors=True)):
        for name, engine in engines.items():
            engine.save_checkpoint(str(tmp / name), tag=TAG)
        rng = {"torch": rng_state()}
        if torch.cuda.is_available():
            rng["cuda"] = base64.b64encode(torch.cuda.get_rng_state().numpy().tobytes()).decode()
        (tmp / "rng" / f"rank-{rank}.json").write_text(json.dumps(rng))
        write_copies(tmp)
        hold("checkpointing", run_dir)  # (tests: a checkpoint half written)
        barrier()
        size_mb = 0.0
        if rank == 0:
            (tmp / "trainer_state.json").write_text(json.dumps(state))
            settle(tmp)  # (a file system without modes keeps them: its files are for SLURM_RLHF_TRUST_CHECKPOINTS)
            files = checkpoint_files(tmp)
            size_mb = sum(size for _, size in files.values()) / 2**20
            put_in_place(tmp, final)  # (a step saved again after a resume from an older one replaces its folder)
            manifest = Manifest(run_dir)
            manifest.append({"kind": "checkpoint", "step": step, "dir": str(final.relative_to(run_dir)),
                             "files": files})
            _remove_old(run_dir, manifest, keep, step)
    barrier()
    return size_mb


def layout(section, ranks: int) -> dict:
    """The settings of an EngineSection (`trainer:` of RL, `train:` of a stage) and the data-parallel `ranks`
    of its (actor's) engine that decide what a checkpoint's DeepSpeed files hold, so that an engine built
    otherwise cannot load them: the ZeRO stage (ZeRO-0, ZeRO-1/2 and ZeRO-3 write different files), the
    ranks (ZeRO-1 to 3 split the optimizer states that many ways) and the LoRA adapters (their names and
    shapes; alpha scales what they add)."""
    lora = section.lora
    return {"zero_stage": section.zero_stage, "ranks": ranks,
            "lora": None if lora is None else {"rank": lora.rank, "alpha": lora.alpha,
                                               "target_modules": lora.target_modules}}


def layout_problem(directory: Path, section, ranks: int, field: str, ranks_field: str) -> str | None:
    """Why checkpoint `directory` cannot be resumed with `section` (an EngineSection, the config's `field`) on
    `ranks` data-parallel ranks (`ranks_field`), or None. A resume with, say, `lora` added, `zero_stage` 2
    changed to 3 or another number of trainer workers in the run's config failed in every trainer with
    DeepSpeed's traceback (`Missing key(s) in state_dict`, a bare `AssertionError`, `ZeRORuntimeException`).
    A checkpoint of an earlier version records no layout: not checked."""
    saved = json.loads((Path(directory) / "trainer_state.json").read_text()).get("layout")
    if saved is None:
        return None
    now = layout(section, ranks)
    family = {0: 0, 1: 1, 2: 1, 3: 3}  # (ZeRO-1 and ZeRO-2 write the same files)
    fix = "to resume (or start a new run from its hf/ copy)"
    if family[saved["zero_stage"]] != family[now["zero_stage"]]:
        return (f"{field}.zero_stage is {now['zero_stage']}, but the checkpoint {directory} was saved under "
                f"zero_stage {saved['zero_stage']}, whose files another stage cannot load; set {field}.zero_stage "
                f"back to {saved['zero_stage']} {fix}")
    if saved["zero_stage"] > 0 and saved["ranks"] != now["ranks"]:
        return (f"{ranks_field} is {now['ranks']}, but the checkpoint {directory} was saved by {saved['ranks']} "
                f"trainer ranks under ZeRO-{saved['zero_stage']}, which split the optimizer states that many ways "
                f"(DeepSpeed cannot split them otherwise); set {ranks_field} back to {saved['ranks']} {fix}")
    if saved["lora"] != now["lora"]:
        def said(lora):
            return "no lora" if lora is None else ", ".join(f"{k} {v}" for k, v in lora.items())
        return (f"{field}.lora is {said(now['lora'])}, but the checkpoint {directory} was saved with "
                f"{said(saved['lora'])}; set {field}.lora back to that {fix}")
    return None


def load(directory: Path, engines: dict, rank: int) -> dict:
    """Load the engines' weights and optimizer states and this rank's random state; return the stage's
    state saved with them."""
    if rank == 0:  # (the driver checked before the workers started; one rank again, not every rank of a big run)
        check_ours_alone(Path(directory))
    for name, engine in engines.items():
        path, _ = engine.load_checkpoint(str(directory / name), tag=TAG, load_optimizer_states=True,
                                         load_lr_scheduler_states=True)
        if path is None:
            raise RuntimeError(f"DeepSpeed could not load the {name} checkpoint in {directory / name}")
    rng_file = directory / "rng" / f"rank-{rank}.json"
    if rng_file.exists():  # (a checkpoint from more ranks than now: the others keep their seeds)
        rng = json.loads(rng_file.read_text())
        set_rng_state(rng["torch"])
        if "cuda" in rng and torch.cuda.is_available():
            torch.cuda.set_rng_state(torch.frombuffer(bytearray(base64.b64decode(rng["cuda"])), dtype=torch.uint8))
    return json.loads((directory / "trainer_state.json").read_text())


def _remove_old(run_dir: Path, manifest: Manifest, keep: int, step: int) -> None:
    """Keep the newest `keep` checkpoints up to `step`, the one just saved (experience is never removed).
    Those of later steps are what a resume found damaged and went back before (it named them): the run
    saves those steps again, and counted among the newest they had every new checkpoint removed at once.
    Folders the manifest does not name as kept go too: what a removal killed midway left, and a save killed
    after its rename but before its record (a resume never loads either; a replay saves a later step)."""
    live = sorted(live_checkpoints(manifest.records()).items())
    kept = [record for s, record in live if s <= step][-keep:]
    for record in [record for _, record in live if record not in kept]:
        manifest.append({"kind": "removed", "dir": record["dir"]})  # (first: a crash between the two leaves a
        shutil.rmtree(Path(run_dir) / record["dir"], ignore_errors=True)  # folder, not a record of a missing one)
    names = {Path(record["dir"]).name for record in kept}
    for folder in directory_of(run_dir, step).parent.glob("step-*"):
        if folder.name not in names:
            shutil.rmtree(folder, ignore_errors=True)
