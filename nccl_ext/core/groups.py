"""Group identity and group reduction.

Every logical rank calls ``new_group`` in the same order, but with
``use_local_synchronization`` only members call it, so a group is identified by its
rank list plus how many times the caller has seen that same rank list before — a key
all members agree on. A group that does not contain the caller is never materialised
(``new_group`` returns ``None`` and torch hands back ``NON_GROUP_MEMBER``): O(1), no
store access, no communication. This is **group reduction** in its simplest form: in
emulation only sandbox ranks call ``new_group``, so only groups with a sandbox member
exist anywhere.
"""

from __future__ import annotations

import hashlib
from collections import defaultdict
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class GroupInfo:
    """A communicator of the logical world, as every member knows it."""

    key: str
    """Stable identity shared by all members: size, rank-list digest and occurrence."""
    ranks: tuple[int, ...]
    """Global (logical) ranks in group-rank order."""
    occurrence: int
    """How many earlier groups had exactly this rank list."""
    desc: str = ""
    """torch's ``group_desc`` when given (e.g. megatron's group names)."""

    @property
    def size(self) -> int:
        return len(self.ranks)

    def group_rank(self, global_rank: int) -> int:
        return self.ranks.index(global_rank)


def group_key(ranks: tuple[int, ...], occurrence: int) -> str:
    digest = hashlib.blake2b(repr(ranks).encode(), digest_size=8).hexdigest()
    return f"{len(ranks)}:{digest}:{occurrence}"


class GroupRegistry:
    """Assigns :class:`GroupInfo`s to the groups the calling rank belongs to."""

    def __init__(self, rank: int, world_size: int):
        self.rank = rank
        self.world_size = world_size
        self._seen: dict[tuple[int, ...], int] = defaultdict(int)
        self.created = 0
        """``new_group`` calls seen (members and non-members)."""
        self.materialised = 0

    def make(self, ranks, desc: str = "") -> GroupInfo | None:
        """The caller's view of a new group (``ranks``: global ranks in group-rank order, any
        sequence of ints); ``None`` when the caller is not a member. A non-member group costs a
        membership test and a count: its rank list is neither converted nor digested."""
        self.created += 1
        if self.rank not in ranks:
            return None
        ranks = tuple(map(int, ranks))
        occurrence = self._seen[ranks]
        self._seen[ranks] = occurrence + 1
        self.materialised += 1
        return GroupInfo(key=group_key(ranks, occurrence), ranks=ranks, occurrence=occurrence, desc=desc)

    def world(self) -> GroupInfo:
        return self.make(tuple(range(self.world_size)), "default_pg")
