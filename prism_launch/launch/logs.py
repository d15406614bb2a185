"""The per-rank logs of one run as torchrun lays them out (``<log-dir>/<rank>/stdout.log``,
``stderr.log``, ``error.json``), and what the report reads from them."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from prism_launch.config import ReportConfig


@dataclass(frozen=True, slots=True)
class RankLogs:
    root: Path

    def rank_dir(self, rank: int) -> Path:
        return Path(self.root) / str(rank)

    def stdout(self, rank: int) -> Path:
        return self.rank_dir(rank) / "stdout.log"

    def error_file(self, rank: int) -> Path:
        return self.rank_dir(rank) / "error.json"


def parse_rank_log(path: Path, cfg: ReportConfig) -> list[dict]:
    """Per-step ``{step, loss, line}`` found in a rank's stdout log (empty if none)."""
    if not path.exists():
        return []
    loss_re, step_re = re.compile(cfg.loss_pattern), re.compile(cfg.step_pattern)
    out = []
    for line in path.read_text(errors="replace").splitlines():
        m = loss_re.search(line)
        if not m:
            continue
        s = step_re.search(line)
        try:
            loss = float(m.group(1))
        except ValueError:
            continue
        out.append({"step": int(s.group(1)) if s else len(out), "loss": loss, "line": line.strip()})
    return out
