"""A pipeline file: the stages of DeepSpeed-Chat's recipe (sft -> rm -> rl, or any of them in that order)
in one YAML file, each stage reading the model the stage before it exported.

    pipeline: {name: my-pipeline}
    data:  {sources: [...], split: {sft: 2, rm: 4, rl: 4}}   # shared: merged into every stage's data,
                                                             # so the split is decided once for all
    slurm: {partition: gpu, time_min: 240}                   # shared Slurm settings, merged likewise
    sft: {model: {base: /models/llama-1b}, train: {...}}
    rm:  {model: {base: sft}, ...}                           # a stage's name: the model it exports
    rl:  {model: {actor: sft, critic: rm}, reward: {models: [{path: rm, normalize: true}]}, ...}

Each stage section is that stage's config (stages.py, schema.py) without `stage:`. A model path that names
an earlier stage becomes PIPELINE_DIR/<stage>/export, which that stage writes before the next one starts.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from pathlib import Path

from toolkit.config.base import name_problem
from toolkit.config.load import CONFIGS, anchor_paths, apply_override, read_yaml, validate
from toolkit.errors import ConfigError

ORDER = ("sft", "rm", "rl")
SHARED = ("data", "slurm")
ROWS = ("sources", "prompts")  # (the keys of data that say where the rows come from)
# Where a stage's config names models (key paths; `*` walks a list).
MODEL_FIELDS = {"sft": [("model", "base"), ("model", "tokenizer")], "rm": [("model", "base"), ("model", "tokenizer")],
                "rl": [("model", "actor"), ("model", "tokenizer"), ("model", "reference"), ("model", "critic"),
                       ("reward", "models", "*", "path")]}
# Fields that take only one kind of stage export: sft's is a causal LM, rm's a reward model (the others, a
# tokenizer or PPO's critic, take either).
EXPORT_OF = {("model", "actor"): "sft", ("model", "reference"): "sft", ("reward", "models", "*", "path"): "rm"}


@dataclass
class Pipeline:
    name: str
    source: Path                # the pipeline file
    text: str                   # its text (for errors by line)
    stages: dict[str, dict]     # stage -> its config mapping (shared sections merged, references not resolved)
    overridden: dict[tuple, str] = field(default_factory=dict)  # key path -> the --set that gave it

    def configs(self, directory: Path) -> list:
        """Every stage's validated config for a pipeline in `directory` (stage references resolved)."""
        out, pending = [], {}  # (a stage's export: the model it starts from, whose architecture it keeps)
        for stage, data in self.stages.items():
            data = copy.deepcopy(data)
            for path in MODEL_FIELDS[stage]:
                _resolve_references(data, path, stage, self.stages, directory, self.source)
            cfg = validate({**data, "stage": stage}, base_dir=self.source.resolve().parent, source=self.source,
                           text=self.text, overridden=self.overridden, prefix=(stage,), pending_models=pending)
            out.append(cfg)
            if stage != "rl":
                pending[str(directory / stage / "export")] = pending.get(cfg.model.base, cfg.model.base)
        return out


def is_pipeline(path: str | Path) -> bool:
    """Whether the YAML file at `path` is a pipeline file (it has a `pipeline` section)."""
    data, _ = read_yaml(path)
    return "pipeline" in data


def load_pipeline(path: str | Path, overrides: list[str] = ()) -> Pipeline:
    """Read a pipeline file with `--set stage.key=value` overrides; ConfigError naming what is wrong."""
    path = Path(path)
    data, text = read_yaml(path)
    given = [stage for stage in ORDER if stage in data]
    overridden = {}
    for expr in overrides:  # (a --set of a stage the file lacks would add it, to fail for its missing fields)
        key = apply_override(data, expr)
        if key[0] in ORDER and key[0] not in given:
            raise ConfigError(f"--set {expr}: {path} has no {key[0]} stage (its stages: {', '.join(given) or 'none'});"
                              f" a --set changes a stage the file gives: add an `{key[0]}:` section to the file to "
                              "run it")
        overridden[key] = expr
    for key in overridden:  # (a path given on the command line is relative to the current folder)
        if key[0] in ORDER:
            anchor_paths(data, key, [CONFIGS[key[0]]], keep=ORDER, skip=1)
        elif key[0] in SHARED:
            anchor_paths(data, key, [CONFIGS[stage] for stage in ORDER])
    head = data.pop("pipeline", None) or {}
    if not isinstance(head, dict) or not isinstance(head.get("name", ""), str):
        raise ConfigError(f"{path}: pipeline: expected {{name: ...}}")
    unknown = sorted(map(str, set(head) - {"name"}))
    if unknown:
        raise ConfigError(f"{path}: pipeline: unknown key(s) {', '.join(unknown)}; it has only `name` (the stages "
                          "are the sft, rm and rl sections present)")
    shared = {key: data.pop(key) for key in SHARED if key in data}
    unknown = sorted(set(data) - set(ORDER))
    if unknown:
        raise ConfigError(f"{path}: unknown section(s) {', '.join(unknown)}; a pipeline file has pipeline, "
                          f"{', '.join(SHARED)} and the stages {', '.join(ORDER)}")
    stages = {stage: data[stage] or {} for stage in ORDER if stage in data}
    own = [stage for stage, section in stages.items()
           if isinstance(section, dict) and isinstance(section.get("data"), dict) and section["data"].keys() & ROWS]
    if not stages:
        raise ConfigError(f"{path}: no stages; give at least one of {', '.join(ORDER)}")
    name = head.get("name") or path.stem
    problem = name_problem(name)
    if problem:
        raise ConfigError(f"{path}: pipeline.name: got {name!r}; {problem}")
    for stage, section in stages.items():
        if not isinstance(section, dict):
            raise ConfigError(f"{path}: {stage}: expected the stage's config (a mapping)")
        if "stage" in section:
            raise ConfigError(f"{path}: {stage}.stage: not needed in a pipeline (the section's name says it)")
        if isinstance(section.get("data"), dict) and "split" in section["data"]:
            raise ConfigError(f"{path}: {stage}.data.split: a pipeline splits its rows once for every stage (so "
                              "that no stage trains on another's rows); give the split in the shared data section")
        for key, value in shared.items():
            mine = section.get(key, {})
            if key == "data" and stage in own and isinstance(value, dict):
                value = {k: v for k, v in value.items() if k not in ROWS}  # (the stage's own rows replace them)
            section[key] = {**value, **mine} if isinstance(value, dict) and isinstance(mine, dict) else mine or value
        if not isinstance(section.setdefault("run", {}), dict):
            raise ConfigError(f"{path}: {stage}.run: expected the stage's run settings (a mapping), got "
                              f"{section['run']!r}")
        section["run"].setdefault("name", f"{name}-{stage}")
    _own_parts(stages, own, path.resolve().parent)
    return Pipeline(name, path, text, stages, overridden)


def _own_parts(stages: dict[str, dict], own: list[str], base: Path) -> None:
    """Give the stages in `own` (whose data section names rows of its own, which replace the shared ones)
    each own source that no other stage reads as a whole (data.sources[].part): the shared split is for rows
    that several stages read, and would drop most of a file of RL prompts, silently."""
    def read(section, stage):
        data = section.get("data")
        if not isinstance(data, dict):
            return {}
        if stage in own and isinstance(data.get("prompts"), str) and "sources" not in data:
            from toolkit.config.data import shorthand_format

            prompts = data.pop("prompts")  # (the shorthand as a source, which can name its part)
            data["sources"] = [{"path": prompts, "format": shorthand_format(base / prompts)}]
        listed = data.get("sources") if isinstance(data.get("sources"), list) else [{"path": data.get("prompts")}]
        return {str((base / s["path"]).resolve()): s for s in listed
                if isinstance(s, dict) and isinstance(s.get("path"), str)}

    reads = {stage: read(section, stage) for stage, section in stages.items()}
    for stage in own:
        others = set().union(*(paths for other, paths in reads.items() if other != stage))
        for path, source in reads[stage].items():
            if path not in others:
                source.setdefault("part", stage)


def _resolve_references(data: dict, pattern: tuple, stage: str, stages: dict, directory: Path, source: Path) -> None:
    """Replace a model path naming a stage by that stage's export directory (it must come earlier, and export
    the kind of model the field takes)."""
    kind = {"sft": "causal LM", "rm": "reward model"}
    for node, key, where in _places(data, pattern):
        named = node[key]
        if not isinstance(named, str) or named not in ORDER:
            continue
        field = f"{stage}.{'.'.join(map(str, where))}"
        if named not in stages or ORDER.index(named) >= ORDER.index(stage):
            raise ConfigError(f"{source}: {field}: {named!r} names a stage that does not come before {stage} in this "
                              f"pipeline (stages: {', '.join(stages)})")
        wants = EXPORT_OF.get(pattern, named)
        if named != wants:
            raise ConfigError(f"{source}: {field}: the {named} stage exports a {kind[named]}, but this field takes a "
                              f"{kind[wants]}: name {wants!r}")
        node[key] = str(directory / named / "export")


def _places(node, pattern: tuple, where: tuple = ()):
    """(mapping, key, where) of each value that `pattern` (a key path; `*` walks a list) reaches in `node`."""
    key, rest = pattern[0], pattern[1:]
    if key == "*":
        for index, item in enumerate(node if isinstance(node, list) else []):
            yield from _places(item, rest, where + (index,))
    elif isinstance(node, dict) and key in node:
        if rest:
            yield from _places(node[key], rest, where + (key,))
        else:
            yield node, key, where + (key,)
