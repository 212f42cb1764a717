"""The file each reward function's code comes from, so that a resume says when that code changed.

Reward functions are the user's code, and users edit them between two attempts of a run (a bug in a
parser, a weight): the steps after the resume are then scored by other code than the steps before, and a
reward curve that jumps there would have nothing to explain it. Unlike changed data (fingerprint.py) this
is no error: a committed step keeps the scores it was trained on (they are in its experience file, never
computed again), and the user may well mean the change. So the driver records each function's file
(bytes, checksum) in the manifest at the first start, and a resume names each one that changed and the
first step that the code as it is now scores.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from toolkit.config.base import split_function
from toolkit.store.checksum import checksum_of


def reward_sources(cfg) -> dict[str, dict]:
    """{field: {"function", "path", "bytes", "checksum"}} of each reward function of the config whose file
    is found without running it (`path/file.py:function`, or the file the import system finds for
    `package.module:function`); {} for a stage without rewards."""
    reward = getattr(cfg, "reward", None)
    out = {}
    for i, function in enumerate(reward.functions if reward is not None else []):
        path = _source_file(function.function)
        if path is not None:
            out[f"reward.functions.{i}"] = {"function": function.function, "path": str(path),
                                            "bytes": path.stat().st_size, "checksum": checksum_of(path)}
    return out


def _source_file(value: str) -> Path | None:
    where, _, is_file = split_function(value)
    if is_file:
        path = Path(where)
    else:
        try:
            spec = importlib.util.find_spec(where)  # (imports the packages above it, not the module)
        except (ImportError, ValueError):
            return None  # (the scorer names it when it loads the function)
        path = Path(spec.origin) if spec is not None and spec.origin else None
    return path if path is not None and path.is_file() else None


def changes(then: dict, now: dict) -> list[str]:
    """What differs between two records of reward_sources, one line per function (nothing: the same code)."""
    lines = []
    for field in sorted(then.keys() | now.keys(), key=lambda f: int(f.rsplit(".", 1)[1])):
        a, b = then.get(field), now.get(field)
        if a is None or b is None or a["function"] != b["function"]:
            lines.append(f"{field}: {a['function'] if a else 'none'} then, {b['function'] if b else 'none'} now")
        elif a["path"] != b["path"]:
            lines.append(f"{field} ({b['function']}): from {a['path']} then, {b['path']} now")
        elif a["checksum"] != b["checksum"]:
            lines.append(f"{field} ({b['function']}): {b['path']} has other contents ({a['bytes']} bytes then, "
                         f"{b['bytes']} now)")
    return lines
