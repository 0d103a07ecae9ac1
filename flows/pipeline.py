"""`retrosight run`: one Prefect flow, one task per dvc.yaml stage, each calling DVC's CLI.

DVC decides what is stale (dvc.yaml + params.yaml + dvc.lock); this flow only walks the
stages in dvc.yaml's order and lets `dvc repro --single-item` run or skip each. A stage's cmd
(`retrosight stage NAME`) runs that stage's flow as a child run of the calling task.
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING

import yaml
from prefect import flow, get_client, task
from prefect.cache_policies import NO_CACHE
from prefect.context import get_run_context

from flows.common import stage_names
from flows.linking import ERROR_FILE_ENV

if TYPE_CHECKING:
    from tasks.params import Params

PARENT_TASK_ENV = "RETROSIGHT_PARENT_TASK_RUN_ID"
TIMINGS_FILE_ENV = "RETROSIGHT_TIMINGS_FILE"  # where a stage process leaves its timestamps for the run's table
# One pipeline run per workspace: two would interleave stages, params.yaml edits and experiments.
LOCK = Path(".retrosight/run.lock")
LOCK_OWNER = Path(".retrosight/run.owner")
# dvc.lock as DVC left it after the last stage it finished. DVC rewrites dvc.lock in place, so a
# run killed while DVC writes it leaves a file cut short, which every later DVC command refuses.
LAST_LOCK = Path(".retrosight/dvc.lock.last")


class StageFailed(RuntimeError):
    pass


class WorkspaceBusy(RuntimeError):
    pass


@contextmanager
def workspace_lock(what: str, wait: bool, on_wait: Callable[[str], None] = print) -> Iterator[None]:
    """Hold the workspace for one run. Busy: raise WorkspaceBusy, or with `wait` block until free.

    An OS file lock (flock), so a killed run releases it with its process; the owner file only
    says who holds it.
    """
    from filelock import FileLock, Timeout

    LOCK.parent.mkdir(parents=True, exist_ok=True)
    lock = FileLock(str(LOCK))
    try:
        lock.acquire(timeout=0)
    except Timeout:
        owner = LOCK_OWNER.read_text().strip() if LOCK_OWNER.exists() else "owner unknown"
        if not wait:
            raise WorkspaceBusy(f"another pipeline run holds this workspace ({owner}); wait for it, or pass --wait") from None
        on_wait(f"Waiting for the run that holds this workspace ({owner}) ...")
        lock.acquire()
    try:
        LOCK_OWNER.write_text(f"pid {os.getpid()}: {what}, since {datetime.now(timezone.utc):%Y-%m-%d %H:%M:%S} UTC\n")
        yield
    finally:
        LOCK_OWNER.unlink(missing_ok=True)
        lock.release()


def dvc(*args: str, check: bool = True, capture: bool = False, env_extra: dict | None = None, module: str = "dvc") -> subprocess.CompletedProcess:
    env = {**os.environ, **(env_extra or {})}
    # Stage commands call `retrosight`, which lives beside this interpreter.
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    result = subprocess.run([sys.executable, "-m", module, *args], env=env, text=True, capture_output=capture)
    if check and result.returncode != 0:
        # Captured output would otherwise be lost behind a bare exit status.
        said = (result.stderr or result.stdout or "").strip() if capture else "its output is above"
        raise StageFailed(f"dvc {' '.join(args)} failed (exit {result.returncode}): {said}")
    return result


def stale_stages() -> list[str]:
    """Stages `dvc status` reports as changed (names in dvc.yaml order)."""
    out = dvc("status", "--json", capture=True).stdout
    changed = json.loads(out or "{}")
    return [s for s in stage_names() if s in changed]


def downstream(stage: str) -> list[str]:
    """`stage` and every stage after it that DVC would rerun with --downstream."""
    out = dvc("repro", "--dry", "--downstream", "--force", stage, capture=True).stdout
    names = stage_names()
    return [s for s in names if f"'{s}'" in out]


def stale_upstream(stage: str) -> list[str]:
    """Stages `stage` depends on, directly or not, that DVC finds changed."""
    out = dvc("status", "--json", "--with-deps", stage, capture=True).stdout
    changed = json.loads(out or "{}")
    return [s for s in stage_names() if s in changed and s != stage]


def checked_overrides(overrides: list[str]) -> list[str]:
    """Each `-S` override with its key checked against the params model (ParamsError naming the
    closest valid keys), as Hydra's `++key=value`: set whether or not params.yaml already holds
    the key, so a valid key never meets Hydra's "use +key to append" advice. `~key` deletes."""
    from tasks.params import ParamsError, check_key

    out = []
    for override in overrides:
        m = re.fullmatch(r"(~|\+\+|\+)?([^=]*)(=.*)?", override, re.S)
        prefix, key, value = m.group(1) or "", m.group(2).strip(), m.group(3)
        if value is None and prefix != "~":
            raise ParamsError(f"-S {override}: expected key=value (e.g. -S relabel.k=8)")
        check_key(key)
        out.append(f"~{key}{value or ''}" if prefix == "~" else f"++{key}{value}")
    return out


def env_switch(overrides: list[str], params: Path) -> list[str]:
    """Deletions for `-S env.name=X` naming another environment than params.yaml's: the env keys
    params.yaml holds were written for the old one (TwentyQuestions' 20 turns are not
    GuessMyCity's 10), so X starts from its own defaults and the env keys the overrides set."""
    given = {}
    for override in overrides:
        if m := re.fullmatch(r"(?:\+\+|\+)?env\.([^.=]+)=(.*)", override.strip(), re.S):
            given[m.group(1)] = m.group(2)
    if "name" not in given:
        return []
    env = (yaml.safe_load(params.read_text()) or {}).get("env") or {}
    if yaml.safe_load(given["name"]) == env.get("name"):
        return []
    return [f"~env.{key}" for key in env if key != "name" and key not in given]


def apply_preset(preset: Path, params: Path = Path("params.yaml")) -> None:
    """`--preset FILE`: lay a params file over params.yaml as the benchmarks do (tasks.params.lay_preset:
    mappings merge, train.methods and another environment's env replace), keeping params.yaml's comments."""
    import copy

    from dvc.utils.collections import merge_dicts, remove_missing_keys
    from dvc.utils.serialize import modify_yaml

    from storage.revisions import lookup
    from tasks.params import PRESET_REPLACES, lay_preset, read_preset

    overlay = read_preset(preset)
    with modify_yaml(params) as data:
        new = copy.deepcopy(dict(data))
        lay_preset(new, overlay)
        # a mapping the preset replaces is emptied where it stands, so its keys come in the preset's order
        cleared = [key for key in PRESET_REPLACES if lookup(overlay, key, None) is not None]
        if (new.get("env") or {}).get("name") != (data.get("env") or {}).get("name"):
            cleared.append("env")
        for key in cleared:
            if isinstance(node := lookup(data, key, None), dict):
                node.clear()
        merge_dicts(data, new)
        remove_missing_keys(data, new)


def apply_overrides(overrides: list[str], params: Path = Path("params.yaml")) -> None:
    """`-S relabel.k=8`: the same override grammar as `dvc exp run -S` (Hydra), applied to params.yaml.
    A switch of environment drops the old one's env keys first (env_switch)."""
    from dvc.exceptions import InvalidArgumentError
    from dvc.utils.hydra import apply_overrides as hydra_apply

    try:
        hydra_apply(params, checked_overrides(env_switch(overrides, params) + overrides))
    except InvalidArgumentError as e:
        cause = e.__cause__
        raise ValueError(f"{' '.join(overrides)}: {cause or e}") from None


def params_with(overrides: list[str], params: Path = Path("params.yaml")) -> Params:
    """The params a run with these `-S` overrides reads, `params` itself left as it is: ParamsError
    (a bad key or value) or ValueError (an override Hydra cannot apply) before any run does."""
    import shutil

    from tasks.params import load_params

    with tempfile.TemporaryDirectory(prefix="retrosight-") as tmp:
        copy = Path(tmp) / params.name
        shutil.copy(params, copy)
        try:
            apply_overrides(overrides, copy)
            return load_params(copy)
        except ValueError as e:  # said of the copy; the user knows the file it copies
            raise type(e)(str(e).replace(str(copy), str(params))) from None


def save_experiment(name: str, message: str) -> list[str]:
    """Record the workspace (params, dvc.lock, metrics, plots; outputs by hash) as DVC experiment
    `name`. Returns the stages it holds as stale.

    `dvc exp save` commits the stages it is given with force, recording the deps and params now in
    the workspace as the ones their outputs came from: given every stage (its default), it would
    record a stage left stale (collect after `run bootstrap --only`) as up to date beside outputs
    an older model made. So it is given only the stages that are up to date; a stale one keeps
    its dvc.lock entry from its last run, and stays stale in the experiment as in the workspace.
    """
    stale = stale_stages()
    lock = Path("dvc.lock")
    recorded = (yaml.safe_load(lock.read_text()) or {}).get("stages", {}) if lock.exists() else {}
    fresh = [s for s in stage_names() if s in recorded and s not in stale]
    if not fresh:
        raise StageFailed(f"could not save experiment '{name}': no stage is up to date (stale: {', '.join(stale) or 'none'})")
    # Metrics and plots are `cache: false` outputs: git files that a new repository may not have
    # added yet, and `exp save` leaves untracked files out unless told.
    untracked = subprocess.run(
        ["git", "ls-files", "--others", "--exclude-standard", "--", "data", "dvc.lock", "params.yaml"],
        check=True, text=True, capture_output=True,
    ).stdout.split()
    args = ["exp", "save", *fresh, "--name", name, "--message", message]
    for path in untracked:
        args += ["--include-untracked", path]
    # An experiment is a git commit; on a machine with no git identity, sign it as the pipeline.
    has_identity = all(subprocess.run(["git", "config", key], capture_output=True).returncode == 0 for key in ("user.name", "user.email"))
    identity = {} if has_identity else {
        f"GIT_{who}_{what}": value
        for who in ("AUTHOR", "COMMITTER")
        for what, value in (("NAME", "retrosight"), ("EMAIL", "retrosight@localhost"))
    }
    result = dvc(*args, check=False, capture=True, env_extra=identity)
    if result.returncode != 0:
        raise StageFailed(f"could not save experiment '{name}': {(result.stderr or result.stdout).strip()}")
    return [s for s in stale if s in recorded]


def push(remote: str | None = None) -> str:
    """Upload the workspace's outputs to a DVC remote (the default one unless named)."""
    result = dvc("push", *(["--remote", remote] if remote else []), check=False, capture=True)
    if result.returncode != 0:
        raise StageFailed(f"dvc push failed: {(result.stderr or result.stdout).strip()}")
    return result.stdout.strip().splitlines()[-1] if result.stdout.strip() else "pushed"


def keep_lock() -> None:
    """LAST_LOCK := dvc.lock, atomically (a copy, then a rename)."""
    lock = Path("dvc.lock")
    if lock.exists():
        LAST_LOCK.parent.mkdir(exist_ok=True)
        tmp = LAST_LOCK.with_name(LAST_LOCK.name + ".tmp")
        tmp.write_bytes(lock.read_bytes())
        os.replace(tmp, LAST_LOCK)


def _readable_lock(data: bytes) -> bool:
    """Whether DVC would read `data` as a dvc.lock (its own schema)."""
    from dvc.schema import COMPILED_LOCKFILE_SCHEMA

    try:
        COMPILED_LOCKFILE_SCHEMA(yaml.load(data, Loader=yaml.CSafeLoader))
    except Exception:  # noqa: BLE001  (YAML's errors and the schema's: either way, not readable)
        return False
    return True


def restore_cut_lock() -> str | None:
    """A dvc.lock that DVC cannot read, left by a killed run, is replaced by LAST_LOCK when that
    one is readable: the stages DVC finished keep their record, and the one it was recording
    runs again. Returns the line to print, or None when nothing was wrong."""
    lock = Path("dvc.lock")
    if not lock.exists() or not LAST_LOCK.exists():
        return None
    data, last = lock.read_bytes(), LAST_LOCK.read_bytes()
    if data == last or _readable_lock(data) or not _readable_lock(last):
        return None
    tmp = lock.with_name("dvc.lock.tmp")
    tmp.write_bytes(last)
    os.replace(tmp, lock)
    return "dvc.lock was cut short (a run killed while DVC wrote it): restored as the last finished stage left it"


def _lock_entry(stage: str) -> dict | None:
    lock = Path("dvc.lock")
    return (yaml.load(lock.read_text(), Loader=yaml.CSafeLoader) or {}).get("stages", {}).get(stage) if lock.exists() else None


@task(cache_policy=NO_CACHE, task_run_name="repro-{stage}")
def repro(stage: str, force: bool = False, server: dict | None = None) -> dict:
    """`dvc repro --single-item STAGE`: DVC runs the stage or skips it. Returns the outcome and, for
    a stage that ran, where its seconds went (`timings`)."""
    t0 = time.time()
    with get_client(sync_client=True) as client:
        api_url = str(client.api_url).rstrip("/")
    # The stage process joins this run's API (the ephemeral server or a real one) instead of
    # starting its own, and files its flow run under this task. Its output, progress bars
    # included, goes straight to the terminal.
    env_extra = {"PREFECT_API_URL": api_url, PARENT_TASK_ENV: str(get_run_context().task_run.id), **(server or {})}
    args = ["repro", "--single-item", *(["--force"] if force else []), stage]
    before = _lock_entry(stage)
    with tempfile.TemporaryDirectory(prefix="retrosight-") as tmp:
        # A stage that fails for a reason it can say in one line leaves the line here, and
        # flows.linking runs DVC's CLI without DVC's own report of that failure.
        error_file, timings_file = Path(tmp) / "error", Path(tmp) / "timings.json"
        env_extra |= {ERROR_FILE_ENV: str(error_file), TIMINGS_FILE_ENV: str(timings_file)}
        result = dvc(*args, check=False, env_extra=env_extra, module="flows.linking")
        said = error_file.read_text().strip() if error_file.exists() else ""
        stamps = json.loads(timings_file.read_text()) if timings_file.exists() else None
    if result.returncode != 0:
        if said:
            raise StageFailed(said if said.startswith(f"{stage}: ") else f"{stage}: {said}")
        raise StageFailed(f"stage '{stage}' failed (dvc repro exit {result.returncode}); its output is above")
    keep_lock()
    if stamps is None:  # a stage of ours that ran left its timings; another kind of stage, its lock entry
        return {"outcome": "ran" if force or _lock_entry(stage) != before else "skipped"}
    return {"outcome": "ran", **timings(t0, time.time(), stamps)}


def timings(t0: float, t1: float, stamps: dict) -> dict:
    """Where a stage's seconds went, from the task's start and end (t0, t1) and the stage process's
    stamps: DVC until the stage's process began (DVC's own start-up, the interpreter's), the
    imports until its flow was called, Prefect's share of the flow beside the stage's own work
    (its metrics' seconds), and DVC after it (hashing the outputs, the lock)."""
    flow = stamps["end"] - stamps["flow"]
    work = min(stamps["work"], flow) if stamps.get("work") is not None else flow
    parts = {"dvc": stamps["process"] - t0, "imports": stamps["flow"] - stamps["process"], "prefect": flow - work}
    return {"seconds": t1 - t0, "work": work, "startup": sum(parts.values()), **parts, "after": t1 - stamps["end"]}


def run_pipeline(stages: list[str], force: bool = False, preload: bool = True) -> dict[str, dict]:
    """The pipeline flow over `stages`; with `preload`, the stage server started first, so that its
    imports (torch, transformers, TRL: seconds) run while Prefect starts its API, not while the
    first stage waits. The server needs no API address: each stage's child rereads Prefect's
    settings from the environment its stage process hands over."""
    if not preload:
        return pipeline(stages, force=force)
    from flows.relay import stage_server

    with stage_server({}) as server:
        return pipeline(stages, force=force, server=server)


@flow(name="retrosight-pipeline")
def pipeline(stages: list[str], force: bool = False, server: dict | None = None) -> dict[str, dict]:
    return {s: repro(s, force=force, server=server) for s in stages}
