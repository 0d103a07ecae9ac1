from __future__ import annotations

import functools
import hashlib
import inspect
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml
from filelock import FileLock

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent

# Enough to exercise every code path in seconds: 3 tasks per split, a one-layer model.
TINY = {
    "env": {"max_turns": 8, "facts_per_object": 1},  # short games: every stage's rollouts stay cheap
    "runtime": {"processes": 1},  # a tiny evaluate: starting worker processes would cost more than it saves
    "bootstrap": {
        "demos_per_task": 2,
        "limit_tasks": 3,
        "eval_splits": ["train"],
        "eval_sampling": {"temperature": 1.0, "top_p": 1.0, "max_new_tokens": 48},  # >= its longest scripted action
        "tokenizer": {"vocab_size": 600},
        # 2048 positions: at this vocabulary the proposer's prompt (its rules alone ~560 tokens) with
        # a site's two counterfactuals runs to ~1100 tokens, and at 1024 every site was too long
        "model": {"hidden_size": 64, "num_layers": 1, "num_heads": 1, "head_dim": 64, "intermediate_size": 128, "max_length": 2048},
        "train": {"epochs": 1, "batch_size": 8, "learning_rate": 3.0e-3, "warmup_ratio": 0.0, "weight_decay": 0.0},
    },
    "collect": {"splits": ["train", "val"], "m": 2, "limit_tasks": 3, "sampling": {"temperature": 1.0, "top_p": 1.0, "max_new_tokens": 24}},
    "relabel": {"k": 2, "t": 1, "n": 2},
    "regenerate": {"sampling": {"temperature": 1.0, "top_p": 1.0, "max_new_tokens": 24}},
    "critic": {"epochs": 1, "batch_size": 8},
    "actor": {"prompts": 16, "rounds": 2, "batch_size": 4, "sampling": {"temperature": 1.0, "top_p": 1.0, "max_new_tokens": 24}},
    "expert": {"limit_tasks": 3},
    "practice": {"prefixes": 8, "k": 2, "sampling": {"temperature": 1.0, "top_p": 1.0, "max_new_tokens": 24}},
    "stepagent": {"batch_size": 4},
    "train": {"epochs": 1, "batch_size": 4, "methods": {"sft": {"algorithm": "sft"}}},  # added to params.yaml's
    "evaluate": {"limit_tasks": 1, "episodes_per_task": 2, "sampling": {"temperature": 1.0, "top_p": 1.0, "max_new_tokens": 24}},
}


# One short game in the chat format, and a lost one: the trainers' hand-made conversations.
CONV = [
    {"role": "system", "content": "You play twenty questions."},
    {"role": "user", "content": "Turn 1 of 20. Ask a yes-no question."},
    {"role": "assistant", "content": "REASON: Ask about animal.\nQUESTION: Is it an animal?"},
    {"role": "user", "content": "Answer: yes. Turn 2 of 20."},
    {"role": "assistant", "content": "REASON: Only Dog fits.\nQUESTION: Is it Dog?"},
    {"role": "user", "content": "Answer: yes. You found it."},
]
SHORT = CONV[:3] + [{"role": "user", "content": "Answer: no. Game over."}]


def deep_update(d: dict, u: dict) -> dict:
    for k, v in u.items():
        d[k] = deep_update(d.get(k, {}), v) if isinstance(v, dict) else v
    return d


def tiny_params(overrides: dict | None = None) -> dict:
    raw = yaml.safe_load((ROOT / "params.yaml").read_text())
    # Each caller gets its own empty response cache: a test never reads another's responses.
    raw["cache"] = {"path": str(Path(tempfile.mkdtemp(prefix="retrosight-cache-")) / "responses.sqlite")}
    raw = deep_update(deep_update(raw, TINY), overrides or {})
    name = raw["env"]["name"]
    if name != "twenty_questions":  # as -S env.name=... does, the other environment's keys go
        from envs import registry

        known = registry.get(name).Options.model_fields if name in registry.available() else {}  # unknown: Params says so
        raw["env"] = {"name": name, **{k: v for k, v in TINY["env"].items() if k in known}, **(overrides or {}).get("env", {})}
    return raw


# -- built once, kept on disk -------------------------------------------------------------------
# What several slow tests need (a tiny model, a finished pipeline workspace, stage outputs) is
# built once and kept under pytest's cache, keyed by a hash of the code and params that make it:
# a change rebuilds it, an unchanged tree reuses it in the next session. With the cache off
# (-p no:cacheprovider) it is built once per session in a temporary directory instead.

CODE = [ROOT / name for name in ("flows", "tasks", "storage", "envs", "models")]
BUILT = ".built"  # written last: a directory without it is a build that did not finish


@functools.cache
def _installed() -> str:
    """The interpreter and every installed package: a new torch or DVC may write other bytes."""
    import importlib.metadata

    dists = sorted(f"{d.metadata['Name']}=={d.version}" for d in importlib.metadata.distributions())
    return "\n".join([sys.version, *dists])


def digest(*parts) -> str:
    """A key over files and directories under ROOT (their paths and bytes) and any other values
    (by repr), with the installed packages and the threads torch may use (float sums, and with
    them sampled tokens, may differ with the thread count)."""
    h = hashlib.sha256(_installed().encode())
    h.update(repr([os.environ.get(v) for v in ("OMP_NUM_THREADS", "MKL_NUM_THREADS")] + [len(os.sched_getaffinity(0))]).encode())
    for part in parts:
        if isinstance(part, Path):
            files = sorted(p for p in part.rglob("*") if p.is_file() and "__pycache__" not in p.parts) if part.is_dir() else [part]
            for f in files:
                h.update(f"{f.relative_to(ROOT)}\0".encode() + f.read_bytes() + b"\0")
        else:
            h.update(f"{part!r}\0".encode())
    return h.hexdigest()[:24]


def built(request, name: str, key: str, build: Callable[[Path], None], keep: int = 3) -> Path:
    """A directory `build(directory)` filled, for this key: from pytest's cache if an earlier session
    built it, else built now (in a temporary directory renamed into place when complete, so a
    session that is killed or fails leaves nothing another would take for finished). Sessions and
    pytest-xdist workers that ask for the same build at once take turns: one builds, the others
    then find it."""
    cache = getattr(request.config, "cache", None)
    if cache is None:
        out = request.getfixturevalue("tmp_path_factory").mktemp(name)
        build(out)
        return out
    root = Path(cache.mkdir(f"retrosight-{name}"))
    done = root / key
    with FileLock(str(root / f"{key}.lock")):
        if not (done / BUILT).exists():
            _build(build, root, key, done)
    os.utime(done)  # the newest are kept
    _prune(root, keep)
    return done


def _build(build: Callable[[Path], None], root: Path, key: str, done: Path) -> None:
    work = Path(tempfile.mkdtemp(prefix=f".{key}-", dir=root))
    try:
        build(work)
        (work / BUILT).touch()
        work.rename(done)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _prune(root: Path, keep: int) -> None:
    """Builds for older trees: all but the `keep` last used, once no session has taken them for two
    hours (a session still running may be reading one), and builds abandoned a day ago."""
    now = time.time()
    entries = sorted((p for p in root.iterdir() if p.is_dir()), key=lambda p: p.stat().st_mtime, reverse=True)
    finished = [p for p in entries if not p.name.startswith(".")]
    idle = [p for p in finished[keep:] if now - p.stat().st_mtime > 2 * 3600]
    abandoned = [p for p in entries if p.name.startswith(".") and now - p.stat().st_mtime > 24 * 3600]
    for old in idle + abandoned:
        shutil.rmtree(old, ignore_errors=True)
        (root / f"{old.name}.lock").unlink(missing_ok=True)


def copy_repo(src: Path, parent: Path) -> Path:
    """A private copy of a shared repository (its .git and .dvc included) for a test that changes
    it, at parent/repo as make_project places it."""
    return Path(shutil.copytree(src, parent / "repo", symlinks=True))


def _tiny_model(out: Path) -> None:
    import torch

    from envs.twenty_questions.format import system_prompt
    from envs.twenty_questions.kb import load_kb
    from models.tiny import make_model, train_tokenizer

    kb = load_kb()
    corpus = [system_prompt(20)] + [e.name for e in kb.entities] + ["REASON: Known: animal.\nQUESTION: Is it an animal?"] * 5
    tok = train_tokenizer(corpus, vocab_size=400)
    torch.manual_seed(0)
    model = make_model(tok, 64, 1, 1, 64, 128, 1024)
    model.save_pretrained(out / "model")
    tok.save_pretrained(out / "model")


@pytest.fixture(scope="session")
def tiny_model_dir(request) -> Path:
    """An untrained tiny model: plumbing tests do not depend on the policy being good. Shared: read only."""
    key = digest(ROOT / "models", ROOT / "envs", inspect.getsource(_tiny_model))
    return built(request, "tiny-model", key, _tiny_model) / "model"


@pytest.fixture(scope="session")
def untied_model_dir(tiny_model_dir, tmp_path_factory) -> Path:
    """The tiny model with an output head of its own. With the head tied to the embeddings an
    untrained model's greedy token is the one it was just fed (the chat template's closing role
    token, a special token), so every text would be empty and agree trivially."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(tiny_model_dir)
    config.tie_word_embeddings = False
    assert config.head_dim >= 64  # vLLM's CPU attention needs it
    torch.manual_seed(1)
    model = AutoModelForCausalLM.from_config(config)
    model.lm_head.weight.data.normal_(0, 0.3)  # wide logit gaps: greedy is not decided by rounding
    return save_variant(model, tiny_model_dir, tmp_path_factory.mktemp("untied") / "untied")


def save_variant(model, like: Path, out: Path) -> Path:
    """A changed copy of the model directory `like`: the model's weights and config, its tokenizer."""
    model.save_pretrained(out)
    for f in like.iterdir():
        if f.suffix != ".safetensors" and f.name != "config.json":
            shutil.copy(f, out / f.name)
    return out


@pytest.fixture
def project(tmp_path: Path) -> Path:
    """A fresh git + DVC repository holding this project's pipeline and a tiny params.yaml."""
    return make_project(tmp_path)


def make_project(tmp_path: Path, methods: dict | None = None, env: dict | None = None, overrides: dict | None = None) -> Path:
    """The `project` fixture's repository; `methods` replaces params.yaml's training methods, `env`
    its env section (another environment), `overrides` are laid over the tiny params."""
    repo = tmp_path / "repo"
    repo.mkdir()
    for name in ("flows", "tasks", "storage", "envs", "models"):
        shutil.copytree(ROOT / name, repo / name, ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("dvc.yaml", ".dvcignore"):
        shutil.copy(ROOT / name, repo / name)
    raw = tiny_params({"cache": {"path": ".retrosight/cache/responses.sqlite"}, **(overrides or {})})
    if methods is not None:
        raw["train"]["methods"] = methods
    if env is not None:
        raw["env"] = env
    (repo / "params.yaml").write_text(yaml.safe_dump(raw, sort_keys=False))
    run(["git", "init", "-q"], repo)
    run([str(BIN / "dvc"), "init", "-q"], repo)
    shutil.copy(ROOT / ".dvcignore", repo / ".dvcignore")
    if (ROOT / ".dvc" / "plots").exists():  # the plot templates dvc.yaml names
        shutil.copytree(ROOT / ".dvc" / "plots", repo / ".dvc" / "plots")
    run(["git", "add", "-A"], repo)
    run(["git", "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "init"], repo)
    return repo


def _finished_workspace(out: Path) -> None:
    repo = make_project(out)
    done = run([str(BIN / "retrosight"), "run"], repo)
    (out / "run.log").write_text(done.stdout + done.stderr)
    shutil.rmtree(out / ".prefect-home", ignore_errors=True)  # the run's Prefect history, outside the repository


@dataclass
class Workspace:
    repo: Path  # shared, read only: copy_repo() it to change anything, even to run `retrosight run`
    output: str  # what the full run that made it printed


@pytest.fixture(scope="session")
def finished_workspace(request) -> Workspace:
    """make_project's repository after one full `retrosight run` from nothing: every stage ran once."""
    key = digest(*CODE, ROOT / "dvc.yaml", ROOT / ".dvcignore", ROOT / ".dvc" / "plots", ROOT / "params.yaml", TINY,
                 *map(inspect.getsource, (deep_update, tiny_params, make_project, _finished_workspace)))
    out = built(request, "finished-workspace", key, _finished_workspace)
    return Workspace(out / "repo", (out / "run.log").read_text())


def project_env(tmp: Path) -> dict:
    env = os.environ.copy()
    env["PATH"] = f"{BIN}{os.pathsep}{env['PATH']}"
    env["PREFECT_HOME"] = str(tmp / ".prefect-home")
    env.pop("PREFECT_API_URL", None)
    env["DVC_NO_ANALYTICS"] = "1"
    return env


def run(cmd: list[str], cwd: Path, check: bool = True, timeout: int = 900, env_extra: dict | None = None) -> subprocess.CompletedProcess:
    env = {**project_env(cwd.parent), **(env_extra or {})}
    result = subprocess.run(cmd, cwd=cwd, env=env, text=True, capture_output=True, timeout=timeout)
    if check and result.returncode != 0:
        raise AssertionError(f"{cmd} failed ({result.returncode}):\n{result.stdout[-4000:]}\n{result.stderr[-4000:]}")
    return result


def free_port() -> int:
    """A loopback port nothing listens on now, for a server a test starts."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def stop_process(proc: subprocess.Popen, timeout: float = 30) -> None:
    """Terminate a server a test started; kill it if it does not stop in time."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


# What the reliability tests did, totalled over the session and printed at its end: the figures
# docs/reliability.md ("When things fail") quotes. Each test adds what it measured to its report,
# so the totals reach the summary from pytest-xdist's workers too.
FAULTS: dict[str, int] = {}


@pytest.fixture
def faults(request):
    def add(**counts: int) -> None:
        request.node.user_properties.append(("faults", {k.replace("_", " "): n for k, n in counts.items()}))

    return add


def pytest_runtest_logreport(report):
    if report.when == "call":
        for name, counts in report.user_properties:
            if name == "faults":
                for key, n in counts.items():
                    FAULTS[key] = FAULTS.get(key, 0) + n


def pytest_terminal_summary(terminalreporter):
    if FAULTS:
        terminalreporter.section("reliability")
        terminalreporter.write_line(", ".join(f"{k}: {v}" for k, v in sorted(FAULTS.items())))


# The longest system tests (4 to 10 minutes each on 2 cores), handed to the workers first so no
# worker is left with one of them at the end while the other idles.
LONGEST = ("test_documented_commands", "test_bench_noop", "test_versions", "test_pipeline_dvc", "test_iterations", "test_bench_repro", "test_env_pipelines")
# Modules of long, self-contained tests (each its own repository): each test its own group.
SPREAD = ("test_env_pipelines", "test_documented_commands")


def pytest_collection_modifyitems(items):
    """Groups for `pytest -n 2 --dist loadgroup` (make test-all's system tier): a module's tests
    stay on one worker, so its module-scoped servers start once. The tests on the session's
    finished workspace copy it from pytest's cache (the fast tier built it) and, like the
    environment DAGs and the documented commands, each long and self-contained, spread over the
    workers."""
    rank = {name: i for i, name in enumerate(LONGEST)}
    items.sort(key=lambda item: rank.get(item.module.__name__, len(LONGEST)))  # stable: the rest keep their order
    for item in items:
        if item.get_closest_marker("xdist_group"):
            continue
        if "finished_workspace" in getattr(item, "fixturenames", ()) or item.module.__name__ in SPREAD:
            group = item.nodeid
        else:
            group = item.module.__name__
        item.add_marker(pytest.mark.xdist_group(group))


def twenty_questions(max_turns: int = 20, **options):
    """The TwentyQuestions environment, from the registry as the stages take it."""
    from envs import registry

    return registry.make("twenty_questions", {"max_turns": max_turns, **options})


def fresh_clone(dest: Path) -> Path:
    """What a fresh clone of this working tree holds: its tracked files and its new ones that git
    does not ignore (the uncommitted edits too), committed in a new git repository at dest. The
    tree is already a DVC project (.dvc/config is tracked); `dvc init` as make_project runs it
    only when .dvc is missing. Its dvc.lock names outputs no cache holds, so every stage runs."""
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                            cwd=ROOT, capture_output=True, check=True).stdout.decode().split("\0")
    for name in filter(None, listed):
        src = ROOT / name
        if src.is_file() or src.is_symlink():  # a file deleted in the tree but not yet in git's index is gone
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / name, follow_symlinks=False)
    run(["git", "init", "-q"], dest)
    if not (dest / ".dvc").exists():
        run([str(BIN / "dvc"), "init", "-q"], dest)
    run(["git", "add", "-A"], dest)
    run(["git", "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "a fresh clone"], dest)
    return dest
