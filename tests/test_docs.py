"""The newcomer's pages stay short and point where they say."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_readme_fits_ten_kib_and_architecture_twenty():
    assert (ROOT / "README.md").stat().st_size <= 10 * 1024, "README.md is over 10 KiB: move detail to docs/"
    assert (ROOT / "docs" / "ARCHITECTURE.md").stat().st_size <= 20 * 1024, "docs/ARCHITECTURE.md is over 20 KiB"


def test_readme_first_screen_says_how_to_start_and_how_long_the_demo_takes():
    first_screen = "\n".join((ROOT / "README.md").read_text().splitlines()[:30])
    assert "make demo" in first_screen and "make test" in first_screen
    assert re.search(r"make demo\s+#.*~1 min", first_screen), first_screen


def test_readme_links_resolve():
    text = (ROOT / "README.md").read_text()
    links = re.findall(r"\]\(([^)#]+)\)", text)
    assert {"docs/configuration.md", "docs/ARCHITECTURE.md", "docs/benchmarks.md"} <= set(links)
    for link in links:
        if not link.startswith("http"):
            assert (ROOT / link).exists(), link
