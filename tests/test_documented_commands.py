"""Every `retrosight` command README.md and docs/ show runs in a test as written.

`documented()` finds them: the lines of fenced and indented code blocks that start with
`retrosight ` (or `$ retrosight `), a trailing `# comment` dropped, and inline code spans that
begin with `retrosight `. TABLE sorts each into a group, and each group is one way of running
it for real, through the installed CLI in a subprocess:

- workspace, versions: in a copy of the finished tiny workspace (conftest's finished_workspace),
  in TABLE's order, where a later command reads what an earlier one made (a run saved as
  `baseline` before `--rev baseline`, the git commits `v1` and `v2` before `diff HEAD~1`);
- user_env: the same, for an environment of the user's own package (`-S env.name=my_env`);
- serve: `retrosight serve --cron ...` against a real Prefect server, until it serves;
- quick_look: on a fresh copy of the repository with its real params.yaml, timed against
  QUICK_LOOK_LIMIT (10 minutes on 2 cores); with RETROSIGHT_QUICK_LOOKS=1 (44 minutes of worker
  time together, measured on the fresh-clone system tier: over CI's budget until stages start faster);
- bench: commands the docs show that take longer than a quick look, on a fresh copy, timed; run
  only with RETROSIGHT_BENCH=1 (hours on 2 cores);
- elsewhere: run as written by another test, named in ELSEWHERE;
- name: an inline mention of a command by its name alone (`retrosight import`), which some
  command of another group runs.

Synopsis lines (metavariables such as STAGE or REV, optional `[...]` parts) are allowed in code
blocks of docs/commands.md only (an inline mention in prose, `retrosight stage NAME`, may name one
anywhere); the tests fill their metavariables from FILL and run them like any other. A command no row of TABLE matches fails the fast test, naming its file and line: a new
command in the docs needs its row (and so a test) before CI passes.
"""
from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import yaml

from conftest import BIN, ROOT, copy_repo, fresh_clone, make_project, project_env, run, stop_process
from flows.common import stage_names
from test_versions import prefect_server  # noqa: F401  (the fixture: a real `prefect server start`)

PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]

# 10 minutes on 2 cores: what a quick look at an environment may take (issue 41, item 8).
QUICK_LOOK_LIMIT = 600


# -- what the docs show ---------------------------------------------------------------------------

@dataclass(frozen=True)
class Doc:
    file: str  # relative to the repository
    line: int
    command: str  # as written, one line, the comment dropped
    inline: bool  # an inline code span, not a code block's line
    output: tuple[str, ...] = ()  # the lines a `$ retrosight ...` block shows after it

    def __str__(self) -> str:
        return f"{self.file}:{self.line}: {self.command}"


def _drop_comment(line: str) -> str:
    """The command without a trailing `# comment` (a `#` inside quotes is the command's own)."""
    quote = None
    for i, c in enumerate(line):
        if quote:
            quote = None if c == quote else quote
        elif c in "\"'":
            quote = c
        elif c == "#" and (i == 0 or line[i - 1].isspace()):
            return line[:i].rstrip()
    return line.rstrip()


INLINE = re.compile(r"(?<!`)`(retrosight [^`]+)`(?!`)")


def documented(pages: list[Path] = PAGES) -> list[Doc]:
    """Every `retrosight` command of the pages, in page order (an inline span that runs over a line
    break is numbered by the line it starts on)."""
    found = []
    for page in pages:
        name = page.relative_to(ROOT).as_posix() if page.is_relative_to(ROOT) else page.name
        lines = page.read_text().splitlines()
        prose: list[str] = []
        fence, indented, previous_blank = None, False, True
        blocks: list[tuple[int, str]] = []  # (line number, stripped text) of code lines
        for n, line in enumerate(lines, 1):
            stripped = line.strip()
            code = False
            if fence:
                if stripped.startswith(fence):
                    fence = None
                else:
                    code = True
            elif stripped.startswith(("```", "~~~")):
                fence, indented = stripped[:3], False
                prose.append("")
                previous_blank = False
                continue
            elif line.startswith(("    ", "\t")) and stripped and (previous_blank or indented):
                indented = code = True
            else:
                indented = indented and not stripped
            prose.append("" if code else line)
            if code:
                blocks.append((n, stripped))
            elif not stripped and indented:
                blocks.append((n, ""))
            previous_blank = not stripped
        for i, (n, text) in enumerate(blocks):
            prompt = text.startswith("$ ")
            command = text[2:] if prompt else text
            if not command.startswith("retrosight "):
                continue
            output = []
            if prompt:  # what the block shows it printed: the lines up to the next prompt or blank
                for m, after in blocks[i + 1:]:
                    if not after or after.startswith("$ ") or m != n + 1 + len(output):
                        break
                    output.append(after)
            found.append(Doc(name, n, _drop_comment(command), False, tuple(output)))
        joined = "\n".join(prose)
        for m in INLINE.finditer(joined):
            found.append(Doc(name, joined.count("\n", 0, m.start()) + 1, " ".join(m.group(1).split()), True))
    return sorted(found, key=lambda d: (PAGES.index(ROOT / d.file) if (ROOT / d.file) in PAGES else 0, d.line))


# -- how each is run ------------------------------------------------------------------------------

# Metavariables and what the tests put in their place. `{trajectory}` is an id the test reads from
# the workspace (a regeneration's, so lineage has a chain to follow).
FILL = {
    "STAGE": "evaluate",
    "NAME": "k8-named",
    "TABLE": "relabels",
    "REV_A": "baseline",
    "REV_B": "late-window",
    "REV": "baseline",
    "TRAJECTORY_ID": "{trajectory}",
    "FILE.jsonl": "logs.jsonl",
    "DIR": "docs/results/hr_persuasion",
    "KEY=VALUE": "relabel.k=8",
    '"..."': '"SELECT count(*) AS relabels FROM relabels"',
    "...": "",
}
METAVARIABLE = re.compile(r"(?<![=\w])\[|(?<![\w.])(?:STAGE|NAME|TABLE|REV_A|REV_B|REV|TRAJECTORY_ID|FILE\.jsonl|DIR|KEY=VALUE|X)(?![\w.])|\.\.\.")
# A trajectory id a page shows from its own session (docs/versioning.md's `lineage 1aab86b1`):
# another workspace has other ids, so the test gives one of its own.
SESSION_ID = re.compile(r"(?<=^retrosight lineage )[0-9a-f]{8,16}\b")


def is_synopsis(command: str) -> bool:
    return bool(METAVARIABLE.search(command.removeprefix("retrosight ")))


def fill(command: str) -> str:
    """The command with its optional parts given and its metavariables filled."""
    command = re.sub(r"(?<![=\w])\[([^\[\]]*)\]", r"\1", command)  # an optional part, in full
    command = re.sub(r"^retrosight stage (?:NAME|STAGE)$", "retrosight stage STAGE", command)  # NAME: a stage's here
    for var, value in FILL.items():
        if var.startswith(('"', ".")):
            command = command.replace(var, value)
        else:
            command = re.sub(rf"(?<![\w.]){re.escape(var)}(?![\w.])", value, command)
    return SESSION_ID.sub("{trajectory}", " ".join(command.split()))


# (group, pattern): a command belongs to the first row whose pattern matches all of it (filled,
# when it is a synopsis). Within the workspace and versions groups the rows are also
# the order their test runs them in: a later one reads what an earlier one made.
ANY = r"(?: \S+)*"
# Commands another test runs as written (its file holds the command's text), and which.
ELSEWHERE = {
    "retrosight run -S env.name=X -S limit_tasks=2": "tests/test_env_pipelines.py",  # at the tiny size, on every environment
    "retrosight run -S +iterations.2.policy=data/actor/model": "tests/test_iterations.py",  # HOPE's second iteration
    "retrosight run iteration@2 --force --only": "tests/test_iterations.py",  # then its rerun alone
    "retrosight run -S +stepagent_iterations.2.policy=data/stepagent/model -S stepagent_select.last=data/iteration2/stepagent/model":
        "tests/test_stepagent_iterations.py",  # StepAgent's second iteration
    "retrosight run stepagent_iteration@2 --force --only": "tests/test_stepagent_iterations.py",  # then its rerun alone
    "retrosight run nlac_iteration@1 --force --only": "tests/test_nlac_iteration.py",  # NLAC's first iteration, rerun alone
}
TABLE: list[tuple[str, str]] = [
    # a command named alone in prose: another group runs it with its arguments
    ("name", r"retrosight (?:import|serve|lineage|diff)"),
    # run as written by the test ELSEWHERE names
    ("elsewhere", "|".join(re.escape(c) for c in ELSEWHERE)),

    # the finished workspace as it is, then reruns in it
    ("workspace", r"retrosight inspect"),
    ("workspace", r'retrosight inspect --sql "[^"]*"'),
    ("workspace", r"retrosight results"),
    ("workspace", r"retrosight lineage \{trajectory\}"),
    ("workspace", r"retrosight run"),
    ("workspace", r"retrosight run relabel"),
    ("workspace", r"retrosight run label --only"),
    ("workspace", r"retrosight (?:--debug )?run(?: evaluate)?(?: --force)?(?: --wait)?"),
    ("workspace", r"retrosight import logs\.jsonl"),
    ("workspace", r"retrosight report"),
    ("workspace", r"retrosight report --repro docs/results/\S+"),
    ("workspace", r"retrosight stage \S+"),  # what DVC runs for each stage, here by hand: last, as it leaves the stage's outputs changed

    # docs/versioning.md's session: saved runs, then reading them back
    ("versions", r"retrosight run -S relabel\.kk=3"),
    ("versions", r"retrosight run --name baseline"),  # then `git commit` as v1
    ("versions", r'retrosight run -S "relabel\.window=\[0\.6,1\.0\]" --name late-window'),
    ("versions", r"retrosight run -S train\.learning_rate=1\.0e-4 --name lr1e-4"),  # then v2
    ("versions", r"retrosight versions"),
    ("versions", r"retrosight inspect(?: relabels)? --rev (?!ep2)\S+(?: --sql \".*\"| --limit \d+)?"),
    ("versions", r"retrosight diff \S+(?: \S+)?"),
    ("versions", r"retrosight lineage \{trajectory\} --rev \S+"),
    ("versions", r"retrosight report(?: --rev \S+)+"),
    ("versions", r"retrosight run -S relabel\.k=8(?: --name \S+)?"),
    ("versions", r"retrosight run bootstrap --only -S bootstrap\.train\.epochs=2 --name ep2"),
    ("versions", r'retrosight inspect --rev ep2 --sql "[^"]*"'),

    # an environment from the user's own package (docs/adding-an-environment.md)
    ("user_env", r"retrosight run -S env\.name=my_env"),

    ("serve", r'retrosight serve --cron "[^"]+"(?: --name \S+)?'),

    # a quick look at an environment, or at a preset's: the real params.yaml, under 10 minutes
    ("quick_look", r"retrosight run (?:bootstrap --only )?(?:--preset bench/presets/\S+ )?(?:-S (?!limit_tasks)\S+ )*-S limit_tasks=\d+" + ANY),

    # longer than a quick look: a bench, its measured time beside it in the docs
    ("bench", r"retrosight run -S env\.name=guess_my_city -S env\.show_candidates=false"),
    ("bench", r"retrosight run bootstrap --only --preset bench/presets/car_dealer\.yaml -S runtime\.threads=1"),
]

# Commands that fail as written today for a reason outside this test, each with the reason (reported
# to the page's or the code's owner). The session still runs them and says how they went; one that
# passes fails the test, so the entry goes.
# Quick looks measured over QUICK_LOOK_LIMIT alone, with what was measured: an expected failure of
# the wall-time check alone (a crash, a missing stage or CPU over 2 x the limit still fail), strict
# when the test runs alone, so the entry goes once the look fits.
KNOWN_SLOW: dict[str, str] = {}  # a documented command measured over its limit: its measured time

KNOWN_FAILING: dict[str, str] = {
    "retrosight report --repro docs/results/hope_20q":
        "docs/results/hope_20q has no table.json or success.json until its seeds are committed (issue 41, item 3)",
}

def group(doc: Doc) -> tuple[str, int] | None:
    """The group of TABLE the command belongs to and its row, or None."""
    command = fill(doc.command) if is_synopsis(doc.command) else SESSION_ID.sub("{trajectory}", doc.command)
    for i, (name, pattern) in enumerate(TABLE):
        if re.fullmatch(pattern, command):
            return name, i
    return None


def problems(docs: list[Doc]) -> list[str]:
    """What the fast test fails on: a command no row covers, a synopsis outside docs/commands.md's
    code blocks, a bench command with no measured time beside it."""
    found = []
    for doc in docs:
        if is_synopsis(doc.command) and not doc.inline and doc.file != "docs/commands.md":
            found.append(f"{doc}: a synopsis (metavariables or [...]) outside docs/commands.md; show a command that runs as written")
            continue
        where = group(doc)
        if where is None:
            found.append(f"{doc}: no group of tests/test_documented_commands.py's TABLE runs it; add its row")
        elif where[0] == "bench" and not _time_beside(doc):
            found.append(f"{doc}: longer than a quick look, so a bench: give its measured time beside it")
    return found


TIME = re.compile(r"\b\d[\d,]*(?:\.\d+)? ?(?:s|min|minutes|hours?)\b")


def _time_beside(doc: Doc, lines: int = 2) -> bool:
    """A measured time on the command's line (its comment) or within `lines` lines of it."""
    text = (ROOT / doc.file).read_text().splitlines()
    return bool(TIME.search("\n".join(text[max(0, doc.line - 1 - lines): doc.line + lines])))


def commands(name: str) -> list[tuple[str, list[Doc]]]:
    """The group's commands, filled, in TABLE's order then the pages' order, each once, with the
    places that show it."""
    rows: dict[str, tuple[int, list[Doc]]] = {}
    for doc in documented():
        where = group(doc)
        if where is not None and where[0] == name:
            command = fill(doc.command) if is_synopsis(doc.command) else SESSION_ID.sub("{trajectory}", doc.command)
            rows.setdefault(command, (where[1], []))[1].append(doc)
    return [(c, docs) for c, (_, docs) in sorted(rows.items(), key=lambda kv: kv[1][0])]


# -- the fast tier ----------------------------------------------------------------------------------

def test_every_documented_command_has_a_group_that_runs_it():
    docs = documented()
    assert len(docs) > 40, "the pages' commands were not found"
    found = problems(docs)
    assert not found, "\n".join(found)
    shown = {fill(d.command) if is_synopsis(d.command) else d.command for d in docs}
    gone = [c for c in (*KNOWN_FAILING, *KNOWN_SLOW) if c not in shown]
    assert not gone, f"KNOWN_FAILING or KNOWN_SLOW names commands no page shows any more: {gone}; remove them"
    # every group a row names has its test below
    tested = {"name", "elsewhere", "workspace", "versions", "user_env", "serve", "quick_look", "bench"}
    assert {g for g, _ in TABLE} <= tested


def test_elsewhere_is_run_by_the_test_it_names():
    found = commands("elsewhere")
    assert found
    for command, docs in found:
        assert command in (ROOT / ELSEWHERE[command]).read_text(), f"{docs[0]}: {ELSEWHERE[command]} does not run it as written"


def test_a_name_alone_is_run_with_its_arguments_by_another_group():
    """`retrosight import` in prose: a command of another group starts with it."""
    docs = documented()
    runnable = [fill(d.command) for d in docs if (g := group(d)) and g[0] not in ("name", "elsewhere")]
    for doc in docs:
        if (g := group(doc)) and g[0] == "name":
            assert any(c.startswith(doc.command + " ") for c in runnable), doc


def test_commands_are_found_in_blocks_and_inline_with_their_output(tmp_path):
    page = tmp_path / "page.md"
    page.write_text(
        "Run `retrosight run -S x=1` or `retrosight inspect --sql \"SELECT 1\n"
        "FROM t\"` and\n\n"
        "    retrosight results       # the table\n"
        "    $ retrosight run -S relabel.kk=3\n"
        "    error: unknown param\n\n"
        "```\n$ retrosight versions\nname kind\n```\n"
        "    not code: no blank line before\n"
        "- a list\n\n      retrosight report --rev \"a # b\"   # nested\n"
        "a ```json``` span and `python x.py` and `retrosight` alone\n"
    )
    got = [(d.line, d.command, d.inline, d.output) for d in documented([page])]
    assert got == [
        (1, "retrosight run -S x=1", True, ()),
        (1, 'retrosight inspect --sql "SELECT 1 FROM t"', True, ()),
        (4, "retrosight results", False, ()),
        (5, "retrosight run -S relabel.kk=3", False, ("error: unknown param",)),
        (9, "retrosight versions", False, ("name kind",)),
        (15, 'retrosight report --rev "a # b"', False, ()),
    ]


def test_synopsis_lines_are_filled_and_sorted_into_groups():
    assert fill("retrosight run [STAGE] [--force] [--wait]") == "retrosight run evaluate --force --wait"
    assert fill('retrosight inspect [TABLE] [--rev REV] [--sql "..."]') == \
        'retrosight inspect relabels --rev baseline --sql "SELECT count(*) AS relabels FROM relabels"'
    assert fill("retrosight report [--rev REV ...]") == "retrosight report --rev baseline"
    assert fill("retrosight lineage 1aab86b1 --rev baseline") == "retrosight lineage {trajectory} --rev baseline"
    assert not is_synopsis("retrosight run -S env.name=my_env") and is_synopsis("retrosight run -S env.name=X -S limit_tasks=2")
    assert not is_synopsis('retrosight run -S "relabel.window=[0.6,1.0]" --name late-window')
    assert fill("retrosight stage NAME") == fill("retrosight stage STAGE") == "retrosight stage evaluate"
    doc = Doc("docs/commands.md", 1, "retrosight diff REV_A [REV_B]", False)
    assert group(doc)[0] == "versions"
    assert problems([Doc("docs/x.md", 3, "retrosight diff REV_A", False)])  # a synopsis outside commands.md
    assert problems([Doc("docs/x.md", 3, "retrosight frobnicate", True)])  # no row runs it


# -- running them ---------------------------------------------------------------------------------

RETRO = str(BIN / "retrosight")
GIT = ["git", "-c", "user.name=t", "-c", "user.email=t@t"]


@dataclass
class Session:
    """One workspace the commands of a group run in, one after another."""

    repo: Path
    values: dict = field(default_factory=dict)  # {trajectory} and the like
    log: list = field(default_factory=list)  # (command, seconds)
    failures: list = field(default_factory=list)

    def __call__(self, command: str, docs: list[Doc] = (), timeout: int = 1800, env: dict | None = None) -> subprocess.CompletedProcess:
        """Run the command here; what went other than the page shows is kept in `failures` (the
        session goes on, so one test names every command that failed)."""
        argv = shlex.split(command.format(**self.values))
        assert argv[0] == "retrosight"
        t0 = time.time()
        done = run([RETRO, *argv[1:]], self.repo, check=False, timeout=timeout, env_extra={"COLUMNS": "200", **(env or {})})
        self.log.append((command, time.time() - t0))
        where = "; ".join(map(str, docs)) or command
        said = done.stdout + done.stderr
        shown = [line for d in docs for line in d.output]
        errors = [line for line in shown if line.startswith("error:")]
        wrong = []
        if errors:  # the page shows it refused: the same one line
            if done.returncode == 0:
                wrong.append("the page shows it failing, but it exited 0")
            wrong += [f"not the page's line {line!r}" for line in errors if _squash(line) not in _squash(said)]
        else:
            if done.returncode != 0:
                wrong.append(f"exit {done.returncode}")
            # the lines that say what happened; of "Left stale in it ...: collect (...)" the
            # first stage named (a workspace where more had run names more)
            wrong += [f"not the page's line {line!r}" for line in shown if line.startswith(("note:", "Saved as", "Left stale"))
                      and _squash(line.split(" (")[0] if line.startswith("Left stale") else line) not in _squash(said)]
        if "Traceback" in said:
            wrong.append("a traceback")
        if command in KNOWN_FAILING:
            if wrong:
                print(f"known to fail: {where}: {KNOWN_FAILING[command]}")
            else:
                self.failures.append(f"{where}: runs as written now; remove it from KNOWN_FAILING")
            return done
        if wrong:
            self.failures.append(f"{where}: {', '.join(wrong)}:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
        return done

    def expect(self, ok: bool, command: str, why: str) -> None:
        if not ok:
            self.failures.append(f"{command}: {why}")

    def check(self) -> None:
        print("\n".join(f"{t:7.1f} s  {c}" for c, t in self.log))
        assert not self.failures, f"{len(self.failures)} of {len(self.log)} commands:\n\n" + "\n\n".join(self.failures)


def _squash(text: str) -> str:
    """Text with its whitespace runs as one space: rich wraps long lines at the console's width."""
    return " ".join(text.split())


def _trajectory(repo: Path, rev: str | None = None) -> str:
    """A regeneration's id in the workspace (its lineage runs from the logged game to its weight)."""
    sql = "SELECT trajectory_id FROM regenerate.trajectories ORDER BY trajectory_id LIMIT 1"
    out = run([RETRO, "inspect", *(["--rev", rev] if rev else []), "--sql", sql], repo).stdout
    found = re.findall(r"\b[0-9a-f]{16}\b", out)
    assert found, out
    return found[0][:8]


def _commit(repo: Path, tag: str) -> None:
    """README.md's `git add dvc.lock data/ && git commit`: the run's version of every dataset."""
    run(["git", "add", "dvc.lock", "data/", "params.yaml"], repo)
    run([*GIT, "commit", "-qm", tag], repo)
    run(["git", "tag", tag], repo)


def _import_file(repo: Path) -> None:
    """A JSONL log for `retrosight import FILE.jsonl`: two good games and one with an empty turn."""
    def game(task: str, **extra) -> dict:
        return {"messages": [{"role": "system", "content": "You play twenty questions."},
                             {"role": "user", "content": "Turn 1 of 20. Ask a yes-no question."},
                             {"role": "assistant", "content": "REASON: Start broad.\nQUESTION: Is it an animal?"},
                             {"role": "user", "content": "Answer: yes."}],
                "task_id": task, "env": "twenty_questions", **extra}

    bad = game("Dog")
    bad["messages"][2]["content"] = ""
    (repo / "logs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in (game("Cat"), game("Dog", split="val"), bad)))


def _workspace(finished_workspace, tmp_path: Path) -> Session:
    return Session(copy_repo(finished_workspace.repo, tmp_path))


@pytest.mark.system
def test_the_workspace_commands(finished_workspace, tmp_path):
    """inspect, results, lineage, the reruns that find nothing stale, import, report: in a copy of
    the finished tiny workspace, in TABLE's order."""
    s = _workspace(finished_workspace, tmp_path)
    s.values["trajectory"] = _trajectory(s.repo)
    _import_file(s.repo)
    for src in ("hr_persuasion", "hope_20q"):  # what `report --repro docs/results/...` reads
        if (ROOT / "docs/results" / src).is_dir():
            shutil.copytree(ROOT / "docs/results" / src, s.repo / "docs/results" / src)
    todo = commands("workspace")
    assert todo
    for command, docs in todo:
        done = s(command, docs)
        if command == "retrosight report":
            s.expect((s.repo / "reports/workspace.html").exists(), command, "no reports/workspace.html")
        if command.startswith("retrosight import"):
            s.expect("3 rows read, 2 imported, 1 quarantined" in _squash(done.stdout), command, done.stdout)
    s.check()


@pytest.mark.system
def test_the_versioning_session(finished_workspace, tmp_path):
    """docs/versioning.md's session and README.md's: runs saved as experiments (baseline,
    late-window, lr1e-4, k8, ep2) and commits v1 and v2, then read back with versions, inspect
    --rev, diff, lineage --rev and report --rev, in a copy of the finished tiny workspace."""
    s = _workspace(finished_workspace, tmp_path)
    todo = commands("versions")
    assert todo
    for command, docs in todo:
        if "{trajectory}" in command and "trajectory" not in s.values:
            s.values["trajectory"] = _trajectory(s.repo, "baseline")
        s(command, docs)
        if command == "retrosight run --name baseline":
            _commit(s.repo, "v1")
        elif command.startswith("retrosight run -S train.learning_rate"):
            _commit(s.repo, "v2")
        elif command == "retrosight report --rev v1 --rev v2":
            s.expect((s.repo / "reports/v1_vs_v2.html").exists(), command, "no reports/v1_vs_v2.html")
    s.check()


MY_ENV = '''
from envs.twenty_questions.env import TwentyQuestions, TwentyQuestionsOptions


class MyOptions(TwentyQuestionsOptions):
    max_turns: int = 8  # short games by default, as the tiny workspace plays them


class MyEnvironment(TwentyQuestions):
    """A user's environment: TwentyQuestions' rules under the user's own name."""

    name = "my_env"
    Options = MyOptions
'''


@pytest.mark.system
def test_an_environment_from_the_users_package(finished_workspace, tmp_path):
    """`retrosight run -S env.name=my_env` with `my_env` declared in the entry-point group
    `retrosight.envs` by a package of the user's (a dist-info folder on the path, as pip writes one)."""
    s = _workspace(finished_workspace, tmp_path)
    site = tmp_path / "site"
    (site / "my_package").mkdir(parents=True)
    (site / "my_package/__init__.py").write_text("")
    (site / "my_package/env.py").write_text(MY_ENV)
    dist = site / "my_package-0.1.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: my_package\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text('[retrosight.envs]\nmy_env = my_package.env:MyEnvironment\n')
    todo = commands("user_env")
    assert todo
    for command, docs in todo:
        done = s(command, docs, timeout=3000, env={"PYTHONPATH": str(site)})
        assert "evaluate: ran" in done.stdout, done.stdout[-3000:]
    s.check()
    assert {r["env"] for r in pq.read_table(s.repo / "data/evaluate/episodes.parquet").to_pylist()} == {"my_env"}


@pytest.mark.system
@pytest.mark.parametrize("command", [c for c, _ in commands("serve")], ids=str)
def test_serve(command, prefect_server, tmp_path):
    """Each documented `retrosight serve --cron ...`, in a new tiny project: it registers its
    deployment and serves, with no traceback, until stopped (no scheduled run is due)."""
    repo = make_project(tmp_path)
    env = {**project_env(repo.parent), "PREFECT_API_URL": prefect_server, "COLUMNS": "200"}
    log = tmp_path / "serve.log"
    with open(log, "w") as out:
        proc = subprocess.Popen([RETRO, *shlex.split(command)[1:]], cwd=repo, env=env, stdout=out, stderr=subprocess.STDOUT)
    try:
        deadline = time.time() + 240
        while "is being served" not in _squash(log.read_text()):
            assert proc.poll() is None, f"{command} exited {proc.returncode}:\n{log.read_text()[-3000:]}"
            assert time.time() < deadline, f"{command} did not serve in 240 s:\n{log.read_text()[-3000:]}"
            time.sleep(1)
    finally:
        stop_process(proc)
    said = log.read_text()
    assert "Serving retrosight-scheduled/" in said and "Traceback" not in said, said[-3000:]


@dataclass
class Timed:
    done: subprocess.CompletedProcess
    wall: float  # seconds
    cpu: float  # user + system seconds of the command's whole process tree (every process waited for)

    def __str__(self) -> str:
        return f"{self.wall:.0f} s wall, {self.cpu:.0f} s CPU, exit {self.done.returncode}"


def _timed_on_a_fresh_clone(command: str, tmp_path: Path, timeout: int) -> Timed:
    import resource

    repo = fresh_clone(tmp_path / "repo")
    before, t0 = resource.getrusage(resource.RUSAGE_CHILDREN), time.time()
    done = run([RETRO, *shlex.split(command)[1:]], repo, check=False, timeout=timeout, env_extra={"COLUMNS": "200"})
    wall, after = time.time() - t0, resource.getrusage(resource.RUSAGE_CHILDREN)
    return Timed(done, wall, after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime)


def _env_of(command: str) -> str:
    """The environment a quick look plays: its `-S env.name=`, else its preset's, else params.yaml's."""
    if m := re.search(r"-S env\.name=(\w+)", command):
        return m.group(1)
    if m := re.search(r"--preset (\S+)", command):
        if name := (yaml.safe_load((ROOT / m.group(1)).read_text()).get("env") or {}).get("name"):
            return name
    return yaml.safe_load((ROOT / "params.yaml").read_text())["env"]["name"]


class TooSlow(AssertionError):
    pass


def _quick_looks() -> list:
    # strict where the wall time is held to the limit (alone): beside other tests only the CPU time is
    strict = not os.environ.get("PYTEST_XDIST_WORKER")
    return [pytest.param(c, marks=pytest.mark.xfail(reason=f"measured {KNOWN_SLOW[c]}", raises=TooSlow, strict=strict)) if c in KNOWN_SLOW else c
            for c, _ in commands("quick_look")]


@pytest.mark.system
@pytest.mark.skipif(os.environ.get("RETROSIGHT_QUICK_LOOKS") != "1",
                    reason="the quick looks, 44 minutes of worker time together (CI's budget): RETROSIGHT_QUICK_LOOKS=1 runs them")
@pytest.mark.parametrize("command", _quick_looks(), ids=str)
def test_a_quick_look_runs_as_written_in_ten_minutes(command, tmp_path, request):
    """A quick look at an environment, or at a preset's, as the docs write it, on a fresh copy of
    the repository and its real params.yaml: it finishes, in 10 minutes on 2 cores. Its wall time
    is held to that when the test runs alone; beside other tests (pytest-xdist) the machine is
    shared, and only its CPU time is: over 2 x 600 CPU seconds, 2 cores could not have done it in
    10 minutes."""
    docs = dict(commands("quick_look"))[command]
    timed = _timed_on_a_fresh_clone(command, tmp_path, timeout=6 * QUICK_LOOK_LIMIT)
    request.node.user_properties.append(("seconds", {"wall": round(timed.wall), "cpu": round(timed.cpu)}))
    where, done = "; ".join(map(str, docs)), timed.done
    assert done.returncode == 0, f"{where}: {timed}:\n{done.stdout[-4000:]}\n{done.stderr[-3000:]}"
    assert "Traceback" not in done.stdout + done.stderr, f"{where}: {timed}:\n{done.stdout[-4000:]}"
    print(f"{where}: {timed}")
    # it shows what a whole run shows: every stage it names ran, on the environment it names
    repo = tmp_path / "repo"
    only = re.match(r"retrosight run (\w+) --only", command)
    for stage in [only.group(1)] if only else [s for s in stage_names(repo / "dvc.yaml") if "@" not in s]:
        assert f"{stage}: ran" in done.stdout, f"{where}: {stage} did not run:\n{done.stdout[-4000:]}"
    env = _env_of(command)
    for table in ["bootstrap/demos.parquet"] if only else ["collect/trajectories.parquet", "evaluate/episodes.parquet"]:
        assert {r["env"] for r in pq.read_table(repo / "data" / table, columns=["env"]).to_pylist()} == {env}, (where, table)
    if not only:
        evaluation = json.loads((repo / "data/evaluate/metrics.json").read_text())
        assert {"bootstrap", "actor"} <= set(evaluation["policies"]) and any("+best_of_" in p for p in evaluation["policies"]), evaluation["policies"]
    assert timed.cpu <= 2 * QUICK_LOOK_LIMIT, f"{where}: {timed}; 2 cores cannot do that in {QUICK_LOOK_LIMIT} s"
    if timed.wall > QUICK_LOOK_LIMIT and not os.environ.get("PYTEST_XDIST_WORKER"):
        raise TooSlow(f"{where}: {timed}, over a quick look's {QUICK_LOOK_LIMIT} s")


@pytest.mark.system
@pytest.mark.skipif(os.environ.get("RETROSIGHT_BENCH") != "1", reason="a bench, hours on 2 cores: RETROSIGHT_BENCH=1 runs it")
@pytest.mark.parametrize("command", [c for c, _ in commands("bench")], ids=str)
def test_a_bench_command_runs_as_written(command, tmp_path, request):
    """A command the docs show that takes longer than a quick look, as written, on a fresh copy:
    it finishes; its time is printed, for the docs' figure beside it."""
    docs = dict(commands("bench"))[command]
    timed = _timed_on_a_fresh_clone(command, tmp_path, timeout=12 * 3600)
    request.node.user_properties.append(("seconds", {"wall": round(timed.wall), "cpu": round(timed.cpu)}))
    where, done = "; ".join(map(str, docs)), timed.done
    assert done.returncode == 0, f"{where}: {timed}:\n{done.stdout[-4000:]}\n{done.stderr[-3000:]}"
    print(f"{where}: {timed}")
