"""A rank list as every message prints it: in full when short, its head, tail and count when long."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

SHOWN = 8
"""A list of at most this many ranks is printed in full; a longer one as its first
``SHOWN - 2`` ranks (the stride shows), its last two and how many there are."""


def short_ranks(ranks: Iterable[int]) -> str:
    """``[0, 1, 2]``; ``[0, 8, 16, 24, 32, 40, ..., 1008, 1016] (128 ranks)``."""
    if not isinstance(ranks, Sequence):
        ranks = list(ranks)
    n = len(ranks)  # only what is printed is read: every op's message names its group's ranks
    if n <= SHOWN:
        return str([int(r) for r in ranks])
    head = ", ".join(str(int(r)) for r in ranks[:SHOWN - 2])
    return f"[{head}, ..., {int(ranks[-2])}, {int(ranks[-1])}] ({n} ranks)"


__all__ = ["SHOWN", "short_ranks"]
