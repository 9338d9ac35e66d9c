"""Small helpers for what the commands print."""

from __future__ import annotations


def plural(count: int | str, noun: str) -> str:
    """"1 rank", "4 ranks", "1,024 tokens"; a count that is not a number ("?") takes the plural."""
    shown = f"{count:,}" if isinstance(count, int) else count
    return f"{shown} {noun}{'' if count == 1 else 's'}"
