"""A config mapping as YAML with each key's documentation above it, taken from the schema's field
docstrings (what `slurm-rlhf init` writes: a starter config that explains itself)."""

from __future__ import annotations

import textwrap
import typing

import yaml
from pydantic import BaseModel

WIDTH = 100


def _section_type(annotation):
    """The Section class inside an annotation (`X`, `X | None`, `list[X]`), if there is one."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in typing.get_args(annotation):
        if (inner := _section_type(arg)) is not None:
            return inner
    return None


def _comment(text: str | None, indent: str) -> list[str]:
    if not text:
        return []
    lines = []
    for paragraph in " ".join(text.split()).split("\n"):
        lines += textwrap.wrap(paragraph, WIDTH - len(indent) - 2)
    return [f"{indent}# {line}" for line in lines]


def _scalar(value) -> str:
    return yaml.safe_dump(value, default_flow_style=True, width=1_000_000).strip().removesuffix("\n...").strip()


def commented_yaml(data: dict, schema: type[BaseModel], indent: str = "") -> str:
    lines = []
    extra = None  # (the Section of a section's own keys, e.g. placement's node groups)
    if schema.model_config.get("extra") == "allow":
        extra = _section_type(typing.get_type_hints(schema).get("__pydantic_extra__"))
    for key, value in data.items():
        field = schema.model_fields.get(key)
        sub = _section_type(field.annotation) if field is not None else extra
        lines += _comment(field.description if field is not None else None, indent)
        if isinstance(value, dict) and value:
            lines.append(f"{indent}{key}:")
            body = commented_yaml(value, sub, indent + "  ") if sub is not None else \
                textwrap.indent(yaml.safe_dump(value, sort_keys=False), indent + "  ").rstrip("\n")
            lines.append(body)
        elif isinstance(value, list) and value and all(isinstance(v, dict) for v in value):
            lines.append(f"{indent}{key}:")
            for item in value:
                text = commented_yaml(item, sub, indent + "    ") if sub is not None else \
                    textwrap.indent(yaml.safe_dump(item, sort_keys=False), indent + "    ").rstrip("\n")
                item_lines = text.split("\n")  # (the comments of the first key stay above the dash)
                start = next(i for i, line in enumerate(item_lines) if not line.lstrip().startswith("#"))
                lines += item_lines[:start]
                lines.append(f"{indent}  - {item_lines[start].lstrip()}")
                lines += item_lines[start + 1:]
        else:
            lines.append(f"{indent}{key}: {_scalar(value)}")
    return "\n".join(lines)
