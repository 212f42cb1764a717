"""What a run's data files were when it started, so that a resume on changed data is a named error.

A resumed run draws the rows of its next steps from the order it began with (a seeded shuffle of every
row, from a cursor the step gives). If a data file changed in between (rows added, removed or edited),
the same cursor points into another order: some rows would be trained on twice and some never, and
nothing would say so. So the driver records each data file (bytes, modification time, checksum) in the
manifest at the first start, and a resume compares; `slurm-rlhf resume RUN_DIR --data-changed` records
the files as they are now and goes on with them. A file whose size and time are unchanged is not read
again, so a resume of a large data set costs a `stat` per file.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from toolkit.store.checksum import checksum_of

PROMPT_KEYS = ("prompt_key", "input_key", "messages_key", "chosen_key", "rejected_key")


def data_files(cfg) -> dict[str, str]:
    """{field: path} of every data source of a config: a stage's rows, or the RL prompts and PTX text."""
    fields = {f"data.sources.{i}.path": s.path for i, s in enumerate(cfg.data.sources)}
    ptx = getattr(cfg, "ptx", None)
    if ptx is not None and ptx.coef > 0 and ptx.data is not None:
        fields.update({f"ptx.data.sources.{i}.path": s.path for i, s in enumerate(ptx.data.sources)})
    return fields


def fingerprint(cfg, known: dict | None = None) -> dict:
    """{field: {"path", "files": {name: [bytes, mtime_ns, checksum]}}} of the config's data (a directory
    source: each file under it, by its path below it; a file source: "."). A file that `known` (an earlier
    fingerprint) has with the same size and time keeps its checksum there, unread."""
    out = {}
    for field, path in data_files(cfg).items():
        root = Path(path)
        before = (known or {}).get(field, {})
        before = before.get("files", {}) if before.get("path") == str(root) else {}
        files = {}
        for file in sorted(p for p in root.rglob("*") if p.is_file()) if root.is_dir() else [root]:
            name = str(file.relative_to(root))  # ("." for a source that is one file)
            st = os.stat(file)
            old = before.get(name)
            same = old is not None and old[:2] == [st.st_size, st.st_mtime_ns]
            files[name] = [st.st_size, st.st_mtime_ns, old[2] if same else checksum_of(file)]
        out[field] = {"path": str(root), "files": files}
    return out


PTX_ROWS = "ptx rows per step (algorithm.epochs x rollout.prompts_per_step x rollout.group_size)"


def draw_settings(cfg) -> dict:
    """The settings that decide which rows each step draws (the cursor of step s is s x the rows a step takes,
    in an order the seed, the shuffle, the split, the held-out share and the sources' weights and parts
    give): a change of any between attempts makes the next steps draw rows twice or never, as a change of the
    files does."""
    d = cfg.data
    per_step = (("rollout.prompts_per_step", cfg.rollout.prompts_per_step) if cfg.stage == "rl"
                else ("train.batch_size", cfg.train.batch_size))
    settings = {"run.seed": cfg.run.seed, "data.shuffle": d.shuffle, "data.eval_fraction": d.eval_fraction,
                "data.split": d.split.model_dump() if d.split else None,
                "data.sources.*.weight": [s.weight for s in d.sources], per_step[0]: per_step[1],
                "split and held out by": "prompt"}  # (earlier versions hashed the whole row: others)
    if any(s.part for s in d.sources):  # (only where given: runs from before it have no such setting)
        settings["data.sources.*.part"] = [s.part for s in d.sources]
    # The fields a row's prompt is read from: another gives other prompts, and the split and the held-out rows
    # go by a hash of the prompt, so it moves rows between the parts (recorded where not the default: runs
    # from before it recorded none).
    settings.update({f"data.{key}": getattr(d, key) for key in PROMPT_KEYS
                     if getattr(d, key) != type(d).model_fields[key].default})
    ptx = getattr(cfg, "ptx", None)
    if ptx is not None and ptx.coef > 0 and ptx.data is not None:  # (the PTX text's order: training/ptx.py)
        settings.update({"ptx.data.shuffle": ptx.data.shuffle,
                         "ptx.data.sources.*.weight": [s.weight for s in ptx.data.sources],
                         # (a step's PTX rows: one per sample trained on, so another group size or number of
                         # epochs moved every later step's slice of the order)
                         PTX_ROWS: cfg.algorithm.epochs * cfg.rollout.prompts_per_step * cfg.rollout.group_size})
    return json.loads(json.dumps(settings))  # (as the manifest gives them back)


def draw_changes(then: dict, now: dict) -> list[str]:
    """The draw settings that differ, one line each."""
    from toolkit.config.data import DataSection

    def value(settings: dict, key: str):  # (a prompt field not recorded is its default)
        field = key.removeprefix("data.")
        return settings.get(key, DataSection.model_fields[field].default if field in PROMPT_KEYS else None)

    # (PTX settings where either has none: PTX off then or now, which its files' fingerprint names, or a run
    # from before they were recorded)
    keys = [key for key in sorted(set(then) | set(now)) if not key.startswith("ptx") or key in then and key in now]
    return [f"{key}: {value(then, key)!r} then, {value(now, key)!r} now" for key in keys
            if value(then, key) != value(now, key)]


def changes(then: dict, now: dict) -> list[str]:
    """What differs between two fingerprints, one line per data file (nothing: the same data)."""
    lines = []
    for field in sorted(set(then) | set(now)):
        a, b = then.get(field), now.get(field)
        if a is None or b is None or a["path"] != b["path"]:
            lines.append(f"{field}: {a['path'] if a else 'none'} then, {b['path'] if b else 'none'} now")
            continue
        for name in sorted(set(a["files"]) | set(b["files"])):
            x, y = a["files"].get(name), b["files"].get(name)
            path = Path(a["path"]) / name if name != "." else Path(a["path"])
            if x is None:
                lines.append(f"{path} ({field}): a new file")
            elif y is None:
                lines.append(f"{path} ({field}): gone")
            elif x[2] != y[2]:
                lines.append(f"{path} ({field}): other contents ({x[0]} bytes then, {y[0]} now)")
    return lines
