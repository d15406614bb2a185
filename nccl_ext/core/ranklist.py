"""A rank list as every message prints it: in full when short, its head, tail and count when long."""

from __future__ import annotations

from collections.abc import Iterable

SHOWN = 8
"""A list of at most this many ranks is printed in full; a longer one as its first
``SHOWN - 2`` ranks (the stride shows), its last two and how many there are."""


def short_ranks(ranks: Iterable[int]) -> str:
    """``[0, 1, 2]``; ``[0, 8, 16, 24, 32, 40, ..., 1008, 1016] (128 ranks)``."""
    ranks = [int(r) for r in ranks]
    if len(ranks) <= SHOWN:
        return str(ranks)
    head = ", ".join(map(str, ranks[:SHOWN - 2]))
    return f"[{head}, ..., {ranks[-2]}, {ranks[-1]}] ({len(ranks)} ranks)"


__all__ = ["SHOWN", "short_ranks"]
