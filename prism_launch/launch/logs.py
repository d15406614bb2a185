"""What the report reads from a rank's log (its layout: :class:`prism_launch.trace.layout.RankLogs`)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from prism_launch.config import ReportConfig


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
