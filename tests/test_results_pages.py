"""Each results page's command reads its committed seeds back, as written, and prints the table
the page shows: a user can check every figure from the episodes in the repository."""
import json
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import fresh_clone

ROOT = Path(__file__).resolve().parents[1]
PAGES = sorted((ROOT / "docs/results").glob("*.md"))
COMMAND = re.compile(r"^\s*(python bench/hindsight_repro\.py .*--results (docs/results/\S+).*)$", re.MULTILINE)


def read_back_commands() -> list[tuple[Path, str, Path]]:
    """(page, command, results dir) for every bench command a page gives that writes its results
    under docs/results/."""
    return [(page, m[1], ROOT / m[2]) for page in PAGES for m in COMMAND.finditer(page.read_text())]


def test_every_page_with_seeds_gives_the_command_that_reads_them_back():
    with_seeds = {d.parent for d in (ROOT / "docs/results").glob("*/seeds") if any(d.glob("seed*.json"))}
    commanded = {results for _, _, results in read_back_commands()}
    assert with_seeds and with_seeds <= commanded, f"seeds without a read-back command on a page: {sorted(map(str, with_seeds - commanded))}"


@pytest.mark.parametrize("page,command,results", read_back_commands(), ids=lambda x: x.name if isinstance(x, Path) else "")
def test_a_pages_command_reads_its_seeds_back_to_the_committed_table(page, command, results, tmp_path):
    argv = shlex.split(command)
    seeds = argv[argv.index("--seeds") + 1:]
    seeds = [s for s in seeds[: next((i for i, a in enumerate(seeds) if a.startswith("--")), len(seeds))]]
    missing = [s for s in seeds if not (results / "seeds" / f"seed{s}.json").exists()]
    if missing:  # a seed not yet run would run here (hours): the page must say it is pending
        assert "being rerun" in page.read_text() or "pending" in page.read_text(), f"{page.name}: seeds {missing} missing, and the page does not say so"
        pytest.skip(f"{page.name}: seeds {missing} not committed yet (the page says so)")
    repo = fresh_clone(tmp_path / "repo")
    proc = subprocess.run([sys.executable, *argv[1:]], cwd=repo, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert proc.stdout.count("read back from") == len(seeds), proc.stdout[-3000:]
    rel = results.relative_to(ROOT)
    assert json.loads((repo / rel / "table.json").read_text()) == json.loads((results / "table.json").read_text())
    assert (repo / rel / "success.json").read_text() == (results / "success.json").read_text()
