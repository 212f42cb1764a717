"""The bounds of a seed, one source for the config's check and the CLI's (light: `--help` imports no pydantic)."""
from __future__ import annotations

SEED_LIMIT = 2**32  # (vLLM's set_random_seed is numpy's, which refuses others, and vLLM only after start-up)


def seed_problem(value: int) -> str | None:
    """What is wrong with a seed, or None."""
    if not 0 <= value < SEED_LIMIT:
        return f"a seed is from 0 to {SEED_LIMIT - 1} (2**32 - 1; vLLM and numpy refuse others); give one in that range"
    return None
