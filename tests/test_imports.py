"""The project's imports, read statically: no module imports itself back through others, and the
layers of DESIGN.md hold (envs, models and storage are leaves; tasks uses them; flows uses tasks;
nothing imports flows but flows). Every import counts, at module level or inside a function: a
late import only hides a circle until the function runs."""
from __future__ import annotations

import ast
from pathlib import Path

from conftest import ROOT

PACKAGES = ("envs", "models", "storage", "tasks", "flows")
LEAVES = ("envs", "models", "storage")


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def project_modules() -> dict[str, Path]:
    return {module_name(p): p for pkg in PACKAGES for p in sorted((ROOT / pkg).rglob("*.py"))}


def imported(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The project modules `name` imports. `from a.b import c` is module a.b.c when c is one, else
    a.b. Importing a.b.c runs the packages a and a.b first, so they count too, except those
    `name` itself lies in (already being imported when it runs)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    targets = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the package, up level - 1
                base = ".".join([*package.split(".")[: len(package.split(".")) - node.level + 1], *([base] if base else [])])
            targets |= {f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names}
    found = set()
    for target in targets:
        parts = target.split(".")
        for i in range(1, len(parts) + 1):
            prefix = ".".join(parts[:i])
            if prefix in modules and prefix != name and not name.startswith(prefix + "."):
                found.add(prefix)
    return found


def import_graph() -> dict[str, set[str]]:
    modules = project_modules()
    return {name: imported(name, path, modules) for name, path in modules.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One circle through each strongly connected group of modules (Tarjan's algorithm), each
    written from its smallest name back to it."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    groups: list[set[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                group.add(w)
                if w == v:
                    break
            if len(group) > 1 or v in graph[v]:
                groups.append(group)

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return [_circle(graph, group) for group in groups]


def _circle(graph: dict[str, set[str]], group: set[str]) -> list[str]:
    """A shortest path in `group` from its smallest module back to itself (breadth first)."""
    start = min(group)
    paths = {start: [start]}
    frontier = [start]
    while frontier:
        nxt = []
        for v in frontier:
            for w in sorted(graph[v] & group):
                if w == start:
                    return paths[v] + [start]
                if w not in paths:
                    paths[w] = paths[v] + [w]
                    nxt.append(w)
        frontier = nxt
    raise AssertionError(f"no circle in {group}")


def test_the_graph_reads_every_kind_of_import():
    graph = import_graph()
    assert "tasks.train.distributed" in graph["tasks.critic"]  # module level, from a.b import names
    assert "tasks.train.critic" in graph["tasks.critic"] and "tasks.train" in graph["tasks.critic"]  # from a.b import module, and a.b runs first
    assert "tasks.regenerate" in graph["tasks.train"]  # inside a function
    assert "tasks.train" not in graph["tasks.train.sft"]  # a package's own modules do not import it back
    assert {"envs.persuasion.llm_roles", "envs.persuasion.donor"} <= graph["envs.persuasion.env"]  # relative: from . import m, from .m import x


def test_the_launcher_names_each_stage_it_starts_and_imports_none():
    from tasks.train import launch

    assert not {"tasks.train", "tasks.critic", "tasks.actor"} & import_graph()["tasks.train.launch"]
    for stage, (dotted, _) in launch.STAGES.items():
        assert launch.entry_point(stage).__name__ == dotted.split(":")[1], stage


def test_the_circle_finder_names_a_circle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": set(), "e": {"e"}}
    assert cycles(graph) == [["a", "b", "c", "a"], ["e", "e"]]


def test_no_module_imports_itself_back():
    found = cycles(import_graph())
    assert not found, "import circles:\n" + "\n".join(" -> ".join(c) for c in found)


def test_imports_go_one_way_through_the_layers():
    wrong = []
    for name, targets in import_graph().items():
        layer = name.split(".")[0]
        for target in sorted(targets):
            to = target.split(".")[0]
            if (layer in LEAVES and to in ("tasks", "flows")) or (layer != "flows" and to == "flows"):
                wrong.append(f"{name} imports {target}")
    assert not wrong, "imports against DESIGN.md's layers (envs, models, storage <- tasks <- flows):\n" + "\n".join(wrong)
