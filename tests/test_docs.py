"""README.md and docs/: every relative link reaches a file (and a heading, when it names one),
every page is listed in the README, and the vLLM server command the system tests start is found
where a user reads it. No model, no server: a quick check that the pages did not drift apart."""
import re

from conftest import ROOT
from vllm_server import DOCS, docs_command

LINK = re.compile(r"\]\(([^)\s]+)\)")


def _anchors(text: str) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation dropped, spaces to hyphens."""
    return {re.sub(r"[^\w\- ]", "", m.group(1).strip().lower()).replace(" ", "-")
            for m in re.finditer(r"^#+ (.+)$", text, flags=re.M)}


def test_every_relative_link_reaches_a_page_and_heading():
    broken = []
    for page in DOCS:
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
    assert not unlisted, f"README.md's 'Where to look next' misses {unlisted}"


def test_the_vllm_server_command_is_in_the_docs_with_the_cpu_options():
    argv = docs_command()
    assert argv[:3] == ["python", "-m", "vllm.entrypoints.openai.api_server"]
    for option in ("--model", "--port", "--no-enable-chunked-prefill", "--kv-cache-memory-bytes"):
        assert option in argv, option
