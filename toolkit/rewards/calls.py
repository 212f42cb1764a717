"""Whether each reward function can be called as the scorer calls it, `function(prompt=..., response=...,
**fields, **args)`, with the fields of the RL rows. Checked before any process starts: a function written
for TRL (`f(prompts, completions, **kwargs)`), one that needs a field the rows lack or takes no `**fields`
while they have some failed only at the first scoring, after the generators had started."""

from __future__ import annotations

import inspect

from toolkit.errors import ConfigError


def check_calls(functions, examples) -> None:
    """ConfigError naming the function and a row whose fields it cannot be called with. `functions`: the
    config's reward.functions; `examples`: the RL prompts (data.examples.Example, with `fields`)."""
    from toolkit.config.base import load_function

    rows = {}  # (each set of field names once, with the first row that has it)
    for example in examples:
        rows.setdefault(tuple(sorted(example.fields)), example.location)
    for i, function in enumerate(functions):
        try:
            signature = inspect.signature(load_function(function.function))
        except (TypeError, ValueError):  # (a builtin without a signature: its first call will tell)
            signature = None
        for names, location in rows.items():
            clash = sorted(({"prompt", "response"} | set(names)) & set(function.args))
            if clash:
                raise ConfigError(f"reward.functions.{i}.args: {', '.join(clash)} is given by the scorer too (the "
                                  f"prompt, the response, or a field of {location}); rename it")
            if signature is None:
                continue
            try:
                signature.bind(prompt="", response="", **dict.fromkeys(names), **function.args)
            except TypeError as e:
                given = ", ".join(["prompt", "response", *names, *function.args])
                raise ConfigError(
                    f"reward.functions.{i}: {function.function}{signature} cannot be called with what the scorer "
                    f"gives it for {location} ({given}): {e}. A reward function scores one sample: def "
                    f"{function.function.rpartition(':')[2]}(prompt, response, **fields), not lists as TRL's; a row "
                    "field or an `args` entry it needs is a keyword of that name") from None
