"""README.md and docs/: every relative link reaches a file (and a heading, when it names one),
every page is listed in the README, the vLLM server command the system tests start is found
where a user reads it, no command names a path outside the repository, and no page names a
commit by its hash. No model, no server: a quick check that the pages did not drift apart."""
import re
from pathlib import Path

import pytest

from conftest import ROOT
from vllm_server import DOCS, docs_command

LINK = re.compile(r"\]\(([^)\s]+)\)")

# Every page a user reads: README.md and docs/, its subfolders included (docs/results/).
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
PAGE_IDS = [str(p.relative_to(ROOT)) for p in PAGES]


def _anchors(text: str) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation dropped, spaces to hyphens."""
    return {re.sub(r"[^\w\- ]", "", m.group(1).strip().lower()).replace(" ", "-")
            for m in re.finditer(r"^#+ (.+)$", text, flags=re.M)}


@pytest.mark.parametrize("page", PAGES, ids=PAGE_IDS)
def test_every_relative_link_reaches_a_page_and_heading(page: Path):
    broken = []
    for target in LINK.findall(page.read_text()):
        if re.match(r"[a-z]+:", target):
            continue
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            broken.append(f"{page.relative_to(ROOT)}: {target} (no such file)")
        elif anchor and anchor not in _anchors(dest.read_text()):
            broken.append(f"{page.relative_to(ROOT)}: {target} (no such heading)")
    assert not broken, "\n".join(broken)


def test_the_readme_lists_every_docs_page():
    readme = (ROOT / "README.md").read_text()
    unlisted = [p.name for p in DOCS[1:] if f"](docs/{p.name})" not in readme]
    assert not unlisted, f"README.md's 'Documentation' misses {unlisted}"


def test_the_vllm_server_command_is_in_the_docs_with_the_cpu_options():
    argv = docs_command()
    assert argv[:3] == ["python", "-m", "vllm.entrypoints.openai.api_server"]
    for option in ("--model", "--port", "--no-enable-chunked-prefill", "--kv-cache-memory-bytes"):
        assert option in argv, option


# ---- commands name repository-relative paths only ----

URL = re.compile(r"\b[a-zA-Z][a-zA-Z0-9+.-]*://\S*")
# An absolute path (or one under a home directory) as a command's argument: it starts a word, or
# follows `=`, a quote, a bracket or a comma (`--out=/x`, "/x", [/x]).
ABSOLUTE = re.compile(r"(?:^|(?<=[\s'\"=(\[{,`]))(~?/[\w.][^\s'\"`),;\]}]*)")
# Placeholders a command may name: the remote a user points DVC at (docs/versioning.md), the null device.
PLACEHOLDERS = ("/mnt/backup", "/dev/null")
# Inline code that is a command: `retrosight run ...`, `python bench/...`, `.venv/bin/python ...`.
INLINE_COMMAND = re.compile(r"`((?:retrosight|python3?|\.venv/bin/\S+|dvc|make|torchrun|prefect|pip) [^`]*)`")


def command_lines(text: str) -> list[tuple[int, str]]:
    """(line number, text) of every command a page shows: each line of a fenced code block and of
    an indented code block, and each inline `retrosight ...` / `python ...` span (which may run
    over a line break, numbered by the line it starts on)."""
    lines = text.splitlines()
    found, prose = [], []
    fence, in_indented, previous_blank = None, False, True
    for n, line in enumerate(lines, 1):
        stripped = line.lstrip()
        if fence:
            if stripped.startswith(fence):
                fence = None
            else:
                found.append((n, line))
            prose.append("")
            continue
        if stripped.startswith(("```", "~~~")):
            fence, in_indented = stripped[:3], False
            prose.append("")
            continue
        indented = line.startswith(("    ", "\t")) and bool(stripped)
        if indented and (previous_blank or in_indented):
            in_indented = True
            found.append((n, line))
            prose.append("")
        else:
            in_indented = in_indented and not stripped
            prose.append(line)
        previous_blank = not stripped
    joined = "\n".join(prose)
    for m in INLINE_COMMAND.finditer(joined):
        found.append((joined.count("\n", 0, m.start()) + 1, m.group(1).replace("\n", " ")))
    return sorted(found)


def absolute_paths(line: str) -> list[str]:
    """The paths outside the repository a command line names; URLs and placeholders aside."""
    return [p for p in ABSOLUTE.findall(URL.sub(" ", line)) if not p.startswith(PLACEHOLDERS)]


def test_command_lines_are_found_in_fences_indented_blocks_and_inline():
    text = ("Run `retrosight run -S x=1` or\n\n    python a.py --out /tmp/x\n\nthen\n\n```\nls /work/y\n```\n"
            "prose /not/a/command, and `python b.py\n--base /root/z`.\n  - item\n\n      nested --out=/data/q\n")
    paths = [(n, p) for n, line in command_lines(text) for p in absolute_paths(line)]
    assert paths == [(3, "/tmp/x"), (8, "/work/y"), (10, "/root/z"), (14, "/data/q")]
    assert absolute_paths("dvc remote modify local url /mnt/backup/retrosight  # s3://bucket/x http://127.0.0.1:8000/v1") == []
    assert absolute_paths("ours 1/341, train / val, and/or, \"</s>\"") == []


@pytest.mark.parametrize("page", PAGES, ids=PAGE_IDS)
def test_no_command_names_a_path_outside_the_repository(page: Path):
    """Every path a documented command names is relative to the repository (bench outputs go
    under bench/out/, which git ignores), so the command runs as written on any clone."""
    found = [f"{page.relative_to(ROOT)}:{n}: {p}" for n, line in command_lines(page.read_text()) for p in absolute_paths(line)]
    assert not found, "commands naming a path outside the repository:\n" + "\n".join(found)


# ---- no commit hashes ----

HEX = re.compile(r"(?<![\w/.-])[0-9a-f]{7,40}(?![\w/-])")
# A hex word that is not a revision: a checksum ("sha256": "...", md5: ..., SHA-256 ...), or a
# trajectory, relabel or regeneration id in `retrosight lineage`'s output and arguments.
CHECKSUM_BEFORE = re.compile(r"(?i)(sha-?\d+|md5|checksum|digest)[\"']?\s*[:=]?\s*[\"']?$")
ID_BEFORE = re.compile(r"(?i)\b(lineage(?: of)?|policy|relabel|regeneration|trajectory(?:_id)?|parent_id|relabel_id)\s*[:=]?\s*$")


def commit_hashes(line: str) -> list[str]:
    """Words of 7 to 40 hex digits, with a digit and a letter, that read as a git revision."""
    line = URL.sub(" ", line)
    return [m.group() for m in HEX.finditer(line)
            if re.search(r"\d", m.group()) and re.search(r"[a-f]", m.group())
            and not CHECKSUM_BEFORE.search(line[: m.start()]) and not ID_BEFORE.search(line[: m.start()])]


def test_commit_hashes_are_told_from_numbers_checksums_ids_and_urls():
    assert commit_hashes("on a fresh clone of ed1b1ec (556fc7d); at 7d53a82 it took 949 s") == ["ed1b1ec", "556fc7d", "7d53a82"]
    assert commit_hashes("loss 0.37516239, 1070996 rows, a decade, faded") == []
    assert commit_hashes('"sha256": "3f2a9c1b2d4e5f60718293a4", md5: 0123456789abcdef0123456789abcdef') == []
    assert commit_hashes("retrosight lineage 1aab86b1 --rev baseline; relabel 791757137be6131f at turn 6") == []
    assert commit_hashes("https://github.com/o/r/commit/7d53a82e and http://x/?rev=ed1b1ec") == []


@pytest.mark.parametrize("page", PAGES, ids=PAGE_IDS)
def test_no_page_names_a_commit_by_its_hash(page: Path):
    """A page describes the code as it is; which commit a run was made at belongs in the run's
    own record (its DVC experiment, a results page's seeds), not in the prose."""
    found = [f"{page.relative_to(ROOT)}:{n}: {h}" for n, line in enumerate(page.read_text().splitlines(), 1)
             for h in commit_hashes(line)]
    assert not found, "commit hashes:\n" + "\n".join(found)
