"""Example rule-based rewards: `function(prompt=..., response=..., **fields) -> float`.

`digit_ratio` is the reward of the tiny demos: an untrained model rarely writes digits, so learning to
write them is visible within a few dozen steps.
"""


def digit_ratio(prompt: str, response: str, **fields) -> float:
    """Fraction of the response's non-space characters that are ASCII digits (0 for an empty response)."""
    chars = [c for c in response if not c.isspace()]
    if not chars:
        return 0.0
    return sum(c in "0123456789" for c in chars) / len(chars)


def mentions(prompt: str, response: str, topic: str = "", **fields) -> float:
    """1.0 when the response contains the prompt's `topic` field (case-insensitive), else 0.0."""
    return float(bool(topic) and topic.lower() in response.lower())


def length_penalty(prompt: str, response: str, max_chars: int = 200, **fields) -> float:
    """-1.0 for responses longer than `max_chars` characters, else 0.0 (combine with a weight)."""
    return -1.0 if len(response) > max_chars else 0.0
