"""Plain-text tables for the terminal: columns padded to their widest cell."""

from __future__ import annotations


def text_table(rows: list[tuple[str, ...]]) -> str:
    """`rows` (the first is the header) as lines of left-aligned columns two spaces apart."""
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows)
