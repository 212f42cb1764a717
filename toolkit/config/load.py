"""Read a config from YAML, apply `--set a.b=c` overrides, validate, and explain errors by file and line.

Relative paths in a config file resolve against the file's folder; relative paths given by `--set` resolve
against the folder the command runs in, where the user typed them (`anchor_paths`).

The top-level `stage` key says which config it is: `rl` (the default), `sft` or `rm`. A file with a
`pipeline` key chains stages (pipeline.py reads it).
"""

from __future__ import annotations

import re
import shlex
import types
import typing
from pathlib import Path
from typing import Any

import yaml
from pydantic import AfterValidator, BaseModel, ValidationError

from toolkit.config.base import PATH_CHECKS, function_path, split_function
from toolkit.config.schema import RunConfig
from toolkit.config.stages import RMConfig, SFTConfig
from toolkit.errors import ConfigError

CONFIGS = {"rl": RunConfig, "sft": SFTConfig, "rm": RMConfig}


class _DuplicateKey(yaml.constructor.ConstructorError):
    pass


class _StrictLoader(yaml.SafeLoader):
    """YAML's safe loader, refusing a key given twice in one mapping: YAML keeps the last one silently, so a
    second `rollout:` section would drop every field of the first."""

    def construct_mapping(self, node, deep=False):
        seen = {}
        for key_node, _ in node.value:
            if isinstance(key_node, yaml.ScalarNode) and key_node.tag != "tag:yaml.org,2002:merge":
                key = self.construct_object(key_node)
                if key in seen:
                    raise _DuplicateKey(
                        None, None, f"key {key!r} is given twice (first on line {seen[key]}); keep one",
                        key_node.start_mark)
                seen[key] = key_node.start_mark.line + 1
        return super().construct_mapping(node, deep)


def parse_yaml(text: str, path: str | Path) -> Any:
    """The YAML document in `text` (read from `path`); ConfigError naming the file, line and column if it is
    not valid YAML or gives a key twice."""
    try:
        data = yaml.load(text, Loader=_StrictLoader)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark else str(path)
        raise ConfigError(f"{where}: not valid YAML: {getattr(e, 'problem', e)}") from None
    return _unshared(data, path)


def _unshared(value: Any, path: str | Path, inside: frozenset = frozenset()) -> Any:
    """`value` with a mapping or list of its own wherever YAML shares one: an anchor (`&x`) and each of its
    aliases (`*x`, `<<: *x`) are one object, so a `--set` on one place would change every place silently."""
    if not isinstance(value, (dict, list)):
        return value
    if id(value) in inside:
        raise ConfigError(f"{path}: an alias (*name) inside the mapping or list its anchor (&name) names: a config "
                          "cannot contain itself")
    inside = inside | {id(value)}
    if isinstance(value, dict):
        return {k: _unshared(v, path, inside) for k, v in value.items()}
    return [_unshared(v, path, inside) for v in value]


def read_yaml(path: str | Path) -> tuple[dict, str]:
    """(mapping, text) of a YAML config file; ConfigError naming the file (and line) if it is not one."""
    path = Path(path)
    if path.is_dir():  # (a run's own, often: `run runs/r1` for `resume runs/r1`)
        if (path / "pipeline.json").is_file():
            raise ConfigError(f"{path} is a pipeline directory, not a config file; continue its pipeline with "
                              f"`slurm-rlhf resume {shlex.quote(str(path))}`")
        if (path / "config.yaml").is_file():
            raise ConfigError(f"{path} is a run directory, not a config file; continue its run with `slurm-rlhf "
                              f"resume {shlex.quote(str(path))}`, or give its config, {path / 'config.yaml'}")
        raise ConfigError(f"{path} is a directory, not a config file; give a run config (YAML), e.g. "
                          "templates/examples/tiny-grpo.yaml")
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as e:
        raise ConfigError(f"{path}: cannot read config ({e.strerror})") from None
    except UnicodeDecodeError as e:
        raise ConfigError(f"{path}: not UTF-8 text (byte {e.start}: {e.object[e.start:e.start + 1]!r}); a config "
                          "is a YAML file") from None
    data = parse_yaml(text, path)
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: the config must be a mapping of sections (run:, model:, ...), got {type(data).__name__}")
    return data, text


def load_config(path: str | Path, overrides: list[str] = (), stage: str | None = None):
    """Load and validate `path` with overrides applied; raise ConfigError naming file, line and field.
    `stage`: the stage the caller expects (None: any; the file's `stage` key decides)."""
    path = Path(path)
    data, text = read_yaml(path)
    if "pipeline" in data:
        raise ConfigError(f"{path} is a pipeline file (it has a `pipeline` section); run it with "
                          "`slurm-rlhf run` or `slurm-rlhf submit`")
    overridden, sections = {}, list(data)  # (the file's own: a wrong --set is named as one, below)
    for expr in overrides:
        key = apply_override(data, expr)
        overridden[key] = expr
    if stage is not None and "stage" not in data:
        # (a file without `stage:` is an RL run's; `sft`/`rm` take such a file as theirs unless it has sections only
        # RL runs have: an RL config was refused field by field, each error saying to remove a section)
        rl_only = [key for key in sections if key in RunConfig.model_fields and key not in CONFIGS[stage].model_fields]
        if rl_only:
            raise ConfigError(f"{path}: this is an 'rl' config (no `stage:` key, and {', '.join(rl_only)}, which "
                              f"only RL runs have); this command runs {stage!r} configs: run this one with "
                              f"`slurm-rlhf run`, or give an {stage} config (`stage: {stage}`)")
        data["stage"] = stage
    elif stage is None and "stage" not in data:
        staged = [key for key in sections if key not in RunConfig.model_fields and key in CONFIGS["sft"].model_fields]
        if staged:  # (`run` of an sft or rm config without its `stage:` key)
            raise ConfigError(f"{path}: no `stage:` key, so this is an 'rl' config, but it has {', '.join(staged)}, "
                              "which only sft and rm stages have; add `stage: sft` or `stage: rm` to it (or run it "
                              "with `slurm-rlhf sft` or `slurm-rlhf rm`)")
    kind = data.get("stage", "rl")
    for key in overridden:  # (where the stage is wrong, validate says so)
        anchor_paths(data, key, [CONFIGS[kind]] if isinstance(kind, str) and kind in CONFIGS else [])
    return validate(data, base_dir=path.resolve().parent, source=path, text=text, overridden=overridden,
                    expect=stage)


def validate(data: dict, base_dir: Path, source: Path | str = "<config>", text: str | None = None,
             overridden: dict[tuple, str] | None = None, expect: str | None = None,
             pending_models: dict | None = None, prefix: tuple = ()):
    """Validate a config mapping (its `stage` picks the schema); relative paths resolve against `base_dir`.
    `pending_models`: {model directory a pipeline's earlier stage will write: the model directory it is made
    from} (the first is not checked for files yet; the second's config.json stands in for its own);
    `prefix`: where the mapping sits in the file (a pipeline's stage section), for errors."""
    stage = data.get("stage", "rl")
    if not isinstance(stage, str) or stage not in CONFIGS:
        raise ConfigError(f"{source}: stage: got {stage!r}; one of {', '.join(CONFIGS)}")
    if expect is not None and stage != expect:
        raise ConfigError(f"{source}: this is a {stage!r} config (stage: {stage}); this command runs {expect!r} "
                          f"configs (use `slurm-rlhf {'run' if stage == 'rl' else stage}`)")
    schema = CONFIGS[stage]
    try:
        pending = {str(export): str(origin) for export, origin in (pending_models or {}).items()}
        return schema.model_validate(data, context={"base_dir": str(base_dir), "pending_models": pending})
    except ValidationError as e:
        lines = [_explain(err, source, text, overridden or {}, schema, prefix) for err in e.errors()]
        raise ConfigError("invalid config:\n  " + "\n  ".join(lines)) from None


def apply_override(data: dict, expr: str) -> tuple:
    """Apply `a.b.c=value` (value parsed as YAML) to `data` in place; return the key path."""
    key, sep, raw = expr.partition("=")
    if not sep or not key.strip():
        raise ConfigError(f"--set {expr!r}: expected KEY=VALUE, e.g. --set rollout.group_size=8")
    parts: list[Any] = [int(p) if p.isdigit() else p for p in key.strip().split(".")]
    try:
        value = yaml.load(raw, Loader=_StrictLoader) if raw.strip() else ""
    except _DuplicateKey as e:
        raise ConfigError(f"--set {expr!r}: {e.problem}") from None
    except yaml.YAMLError:  # (not YAML: the text itself)
        value = raw
    node = data
    for i, part in enumerate(parts[:-1]):
        if isinstance(node, list):
            if not isinstance(part, int) or part >= len(node):
                raise ConfigError(f"--set {expr!r}: {'.'.join(map(str, parts[:i + 1]))} is not an index of the list")
            node = node[part]
        else:
            node = node.setdefault(part, {})
            if not isinstance(node, (dict, list)):
                raise ConfigError(f"--set {expr!r}: {'.'.join(map(str, parts[:i + 1]))} is a value, not a section")
    last = parts[-1]
    if isinstance(node, list):
        if not isinstance(last, int) or last >= len(node):
            raise ConfigError(f"--set {expr!r}: {key} is not an index of the list")
    node[last] = value
    return tuple(parts)


def anchor_paths(data: dict, key: tuple, schemas: list, keep: tuple[str, ...] = (), skip: int = 0) -> None:
    """Make each relative path in the value that `--set KEY=...` put at `key` of `data` absolute, against the
    current folder: a path typed on the command line means what it means in the shell. The schemas say
    which fields are paths (the first that knows `key`, less its first `skip` parts); values in `keep` (a
    pipeline's stage names) stay."""
    *parents, last = key
    node = data
    for part in parents:
        node = node[part]
    for schema in schemas:
        annotation = _annotation_at(schema, key[skip:])
        if annotation is not None:
            node[last] = _anchored(node[last], annotation, keep)
            return


def _annotation_at(schema, key: tuple) -> Any:
    """The annotation (with its validators) of the field of `schema` at `key`; None if it has none there."""
    annotation: Any = schema
    for part in key:
        if isinstance(part, int):
            annotation = next((a for a in _alternatives(annotation) if typing.get_origin(a) is list), None)
            annotation = typing.get_args(annotation)[0] if annotation is not None else None
        else:
            section = _section_type(annotation)
            if not (isinstance(section, type) and issubclass(section, BaseModel)) or part not in section.model_fields:
                return None
            info = section.model_fields[part]
            annotation = typing.Annotated[(info.annotation, *info.metadata)] if info.metadata else info.annotation
        if annotation is None:
            return None
    return annotation


def _alternatives(annotation: Any) -> list:
    """`annotation` and, for `X | Y` or `Annotated[X, ...]`, what it is made of, all the way down."""
    out = [annotation]
    if typing.get_origin(annotation) in (typing.Union, types.UnionType, typing.Annotated):
        for arg in typing.get_args(annotation):
            out += _alternatives(arg)
    return out


def _anchored(value: Any, annotation: Any, keep: tuple[str, ...]) -> Any:
    """`value` with its relative paths made absolute against the current folder, as `annotation` says which
    are paths (walking sections and lists)."""
    checks = {m.func for a in _alternatives(annotation) if typing.get_origin(a) is typing.Annotated
              for m in a.__metadata__ if isinstance(m, AfterValidator)}
    if isinstance(value, str) and value not in keep:
        if checks & PATH_CHECKS and not Path(value).expanduser().is_absolute():
            return str(Path.cwd() / value)
        if function_path in checks:
            where, attr, is_file = split_function(value)
            if is_file and not Path(where).expanduser().is_absolute():
                return f"{Path.cwd() / where}:{attr}"
        return value
    if isinstance(value, dict):  # (a key that is no field of a section: no annotation, the value as it is)
        return {k: _anchored(v, _annotation_at(annotation, (k,)), keep) for k, v in value.items()}
    if isinstance(value, list):
        return [_anchored(v, _annotation_at(annotation, (0,)), keep) for v in value]
    return value


def dump_config(cfg) -> str:
    """The resolved config (absolute paths, defaults filled in) as YAML."""
    return yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False)


def _explain(err: dict, source, text: str | None, overridden: dict[tuple, str], schema=RunConfig,
             prefix: tuple = ()) -> str:
    allowed = _allowed_keys(tuple(err["loc"])[:-1], schema) if err["type"] == "extra_forbidden" else []
    loc = prefix + tuple(err["loc"])
    field = ".".join(str(p) for p in loc) or "(top level)"
    kind = err["type"]
    msg = err["msg"].removeprefix("Value error, ").removeprefix("Assertion failed, ")
    if kind == "extra_forbidden":
        msg = f"unknown key {loc[-1]!r}; allowed here: {', '.join(allowed)}"
    elif kind == "missing":
        msg = "missing; this field is required"
    elif "input" in err and not isinstance(err["input"], (dict, list)):
        msg = f"got {err['input']!r}: {msg[0].lower()}{msg[1:]}"
        if isinstance(err["input"], bool) and kind in ("string_type", "literal_error", "enum"):
            msg += ("; YAML reads yes, no, on, off, true and false as true or false: quote the word to give it "
                    "as text ('off', not off)")
    # a check across fields (raised for the section that holds them) is labelled by the fields it names
    named = [prefix + path for path in _fields_named(msg)] if isinstance(err.get("input"), dict) else []
    where = _where([loc, *named], source, text, overridden, prefix, msg)
    if not loc:
        return f"{where}: {msg}"
    if msg.startswith(".".join(map(str, err["loc"])) + "."):  # (it names the field in full, from its section)
        return f"{where}: {''.join(f'{part}.' for part in prefix)}{msg}"
    return f"{where}: {field}: {msg}"


def _fields_named(msg: str) -> list[tuple]:
    """The key paths (`rollout.group_size`, `reward.models.0.path`) that an error message names, in order."""
    return [tuple(int(p) if p.isdigit() else p for p in m.split("."))
            for m in re.findall(r"\b[a-z_]+(?:\.[a-z_0-9]+)+\b", msg)]


def _where(locs: list[tuple], source, text: str | None, overridden: dict[tuple, str], prefix: tuple,
           msg: str = "") -> str:
    """Where the error about the fields `locs` (the first: where it was raised) comes from: the first that a
    `--set` gave, else a `--set` into the section where it was raised (_set_into), else the first of the others
    found in the file (by line), else the first's deepest part there. A `--set` of a pipeline's shared section
    (data, slurm) is matched within each stage too."""
    for loc in locs:
        for key, expr in overridden.items():
            if loc[: len(key)] == key or loc[len(prefix):][: len(key)] == key:
                return f"--set {expr}"
    for key, expr in overridden.items():
        if _set_into(locs[0], key, text, prefix, msg):
            return f"--set {expr}"
    if text is None:
        return str(source)
    found = next((line for loc in locs[1:] if (line := _line_in(text, loc, prefix, whole=True))), None)
    if found is None and not locs[0]:  # (the whole config: no one line)
        return str(source)
    return f"{source}:{found or _line_in(text, locs[0], prefix)}"


def _set_into(loc: tuple, key: tuple, text: str | None, prefix: tuple, msg: str) -> bool:
    """Whether the `--set` of `key` made the error raised at `loc`, a section that holds `key`: the file does
    not give that section (the --set wrote it: `--set rolout.group_size=8` makes an unknown key `rolout`), or
    the message names the rest of `key` (a check across the section's fields). The file's nearest line
    blamed an unrelated line (the file's first key, for `rolout`)."""
    for mine, floor in ((loc, len(prefix)), (loc[len(prefix):], 0)):  # (the stage's own, the shared section)
        if floor < len(mine) < len(key) and key[: len(mine)] == mine:
            rest = ".".join(map(str, key[len(mine):]))
            if (text is None or not _line_in(text, loc, prefix, whole=True)
                    or re.search(rf"(?<![\w.]){re.escape(rest)}(?![\w])", msg)):
                return True
    return False


def _line_in(text: str, loc: tuple, prefix: tuple, whole: bool = False) -> int | None:
    """_line_of `loc`, or, where the stage section at `prefix` does not give it, of `loc` in the pipeline's
    shared section of that name (`data`, `slurm`), whichever gives more of it."""
    if not prefix or loc[: len(prefix)] != prefix:
        return _line_of(text, loc, whole)
    if whole:
        return _line_of(text, loc, whole=True) or _line_of(text, loc[len(prefix):], whole=True)
    return max(_line_of(text, loc, depth=True), _line_of(text, loc[len(prefix):], depth=True),
               key=lambda pair: pair[0])[1]


def _line_of(text: str, loc: tuple, whole: bool = False, depth: bool = False):
    """Line (1-based) of the deepest part of `loc` that exists in the YAML text (`whole`: of `loc` itself, None
    if the text does not give it; `depth`: (parts found, line))."""
    try:
        node = yaml.compose(text)
    except yaml.YAMLError:
        return None if whole else (0, 1) if depth else 1
    line, found = node.start_mark.line + 1 if node is not None else 1, 0
    for part in loc:
        child = None
        if isinstance(node, yaml.MappingNode):
            for key_node, value_node in node.value:
                if key_node.value == str(part):
                    child, line = value_node, key_node.start_mark.line + 1
                    break
        elif isinstance(node, yaml.SequenceNode) and isinstance(part, int) and part < len(node.value):
            child = node.value[part]
            line = child.start_mark.line + 1
        if child is None:
            return None if whole else (found, line) if depth else line
        node, found = child, found + 1
    return (found, line) if depth else line


def _allowed_keys(loc: tuple, schema=RunConfig) -> list[str]:
    """Field names of the section at `loc` (walking list items and optionals)."""
    model: Any = schema
    for part in loc:
        if isinstance(part, int):
            continue
        if not (isinstance(model, type) and issubclass(model, BaseModel)) or part not in model.model_fields:
            return []
        model = _section_type(model.model_fields[part].annotation)
    if isinstance(model, type) and issubclass(model, BaseModel):
        return list(model.model_fields)
    return []


def _section_type(annotation: Any) -> Any:
    """The BaseModel inside `X`, `list[X]`, `X | None` (or the annotation itself)."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in typing.get_args(annotation):
        found = _section_type(arg)
        if isinstance(found, type) and issubclass(found, BaseModel):
            return found
    if isinstance(annotation, types.UnionType):
        return None
    return annotation
