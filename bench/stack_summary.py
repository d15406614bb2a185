"""Print what ``bench/stack_sampler`` recorded: per process and thread, its busiest stacks."""

import json
import sys
from pathlib import Path


def main() -> None:
    root = Path(sys.argv[1])
    top = int(sys.argv[2]) if len(sys.argv) > 2 else 8
    for p in sorted(root.glob("*.json")):
        d = json.loads(p.read_text())
        print(f"== pid {p.stem} rank {d.get('rank')}: {' '.join(d['argv'])[:160]}")
        for name, stacks in d["threads"].items():
            total = d["totals"][name]
            if total < 50:
                continue
            print(f"  thread {name}: {total} samples")
            for stack, n in sorted(stacks.items(), key=lambda kv: -kv[1])[:top]:
                print(f"    {100 * n / total:5.1f}%  {stack[:400]}")


if __name__ == "__main__":
    main()
