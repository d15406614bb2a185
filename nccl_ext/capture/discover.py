"""Group discovery: how the program lays out its communicators, without running it.

A discovery process is one logical rank run up to its first communication op. Every
rank calls ``new_group`` for every group in the same order (members and non-members
alike), so that one process sees the whole world's group structure: each group's
rank list and ``group_desc``. Folded capture picks its representative ranks from it.
The list is written atomically when the first op is issued (or at exit), then the
process ends.
"""

from __future__ import annotations

import json
import os

from nccl_ext.core.atomic import atomic_write_text
from nccl_ext.core.pending import Pending


class DiscoverTransport:
    def __init__(self, out_path: str):
        self.out_path = out_path
        self.groups: list[tuple[list[int], str]] = []
        self._seen: dict[tuple[int, ...], int] = {}

    def observe_group(self, ranks, desc: str) -> None:
        self.groups.append((list(map(int, ranks)), desc))

    def _finish(self) -> None:
        atomic_write_text(self.out_path, json.dumps({"groups": self.groups}))
        os._exit(0)  # the program's state past this point is of no use; skip its teardown

    def register_group(self, group) -> None:
        pass

    def collective(self, group, seq, call) -> Pending:
        self._finish()

    def send(self, group, dst, tag, seq, tensor) -> Pending:
        self._finish()

    def recv(self, group, src, tag, seq, like) -> Pending:
        self._finish()

    def waited(self, ref, t0, t1) -> None:
        pass

    def park(self, pending):
        return None

    def report_memory(self, summary: dict) -> None:
        pass

    def marker(self, name: str) -> None:
        self._finish()

    def close(self) -> None:
        self._finish()
