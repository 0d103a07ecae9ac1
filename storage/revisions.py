"""Past runs and their datasets, read through DVC without touching the workspace.

A version is a git commit that records `dvc.lock` or a DVC experiment (`refs/exps/...`, what
`retrosight run -S/--name` and scheduled runs save). Its tables are found through
`DVCFileSystem(rev=...)`; DuckDB then reads each Parquet file straight from the DVC cache,
fetched from the default remote first when the cache lacks it.
"""
from __future__ import annotations

import atexit
import fnmatch
import gc
import json
import subprocess
import tempfile
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

import yaml

from storage.catalog import PATTERNS, TableInfo, stage_of, table_info

WORKSPACE = "workspace"
_OPEN: list = []  # file systems to close before the interpreter tears down git's pack objects


@atexit.register
def _close_all() -> None:
    while _OPEN:
        _OPEN.pop().close()
    gc.collect()


class RevisionError(ValueError):
    """A revision that names nothing, or a table that revision does not have."""


@dataclass(frozen=True)
class Version:
    name: str  # experiment name, or the commit's short sha
    rev: str  # full sha
    date: str  # ISO 8601, committer date
    kind: str  # experiment | commit
    message: str


def git(repo: Path, *args: str) -> str:
    """A git command's output in `repo`; RevisionError with git's message when it fails."""
    out = subprocess.run(["git", *args], cwd=repo, text=True, capture_output=True)
    if out.returncode != 0:
        raise RevisionError(out.stderr.strip() or f"git {' '.join(args)} failed")
    return out.stdout


def list_versions(repo: Path = Path(".")) -> list[Version]:
    """Commits on HEAD that change dvc.lock, and every DVC experiment, oldest first."""
    versions: dict[str, Version] = {}
    try:
        log = git(repo, "log", "--format=%H%x00%cI%x00%s", "--", "dvc.lock")
    except RevisionError:  # a repository with no commit yet
        log = ""
    for line in log.splitlines():
        sha, date, subject = line.split("\0", 2)
        versions[sha] = Version(sha[:7], sha, date, "commit", subject)
    refs = git(repo, "for-each-ref", "--format=%(objectname)%00%(refname)%00%(committerdate:iso-strict)%00%(subject)", "refs/exps")
    for line in refs.splitlines():
        sha, ref, date, subject = line.split("\0", 3)
        parts = ref.split("/")
        # refs/exps/<baseline[:2]>/<baseline[2:]>/<name>; exec/, celery/ and temp refs are DVC's own
        if len(parts) != 5 or len(parts[2]) != 2:
            continue
        versions[sha] = Version(parts[4], sha, date, "experiment", subject)
    return sorted(versions.values(), key=lambda v: (v.date, v.name))


class Revision:
    """One revision's files: the workspace (`rev=None` or "workspace") or any git/DVC revision."""

    def __init__(self, repo: Path = Path("."), rev: str | None = None):
        self.repo = Path(repo).resolve()
        self.rev = None if rev in (None, WORKSPACE) else rev
        self.label = rev or WORKSPACE
        self.missing: list[str] = []  # tables this revision records but neither cache nor remote holds

    @cached_property
    def fs(self):
        from dvc.api import DVCFileSystem
        from dvc.scm import RevError, SCMError, resolve_rev
        from scmrepo.git import Git

        scm = Git(str(self.repo))
        try:
            sha = resolve_rev(scm, self.rev)  # experiment names too
        except (RevError, SCMError):
            raise RevisionError(f"unknown revision '{self.rev}' (see `retrosight versions`)") from None
        finally:
            scm.close()
        fs = DVCFileSystem(str(self.repo), rev=sha)
        _OPEN.append(fs)
        return fs

    def read_text(self, path: str) -> str | None:
        if self.rev is None:
            p = self.repo / path
            return p.read_text() if p.exists() else None
        return self.fs.read_text(path) if self.fs.exists(path) else None

    def params(self) -> dict:
        text = self.read_text("params.yaml")
        return yaml.safe_load(text) if text else {}

    def metrics(self) -> dict[str, dict]:
        """Each stage's metrics.json at this revision, by stage."""
        out = {}
        for stage in self._stages():
            text = self.read_text(f"data/{stage}/metrics.json")
            if text:
                out[stage] = json.loads(text)
        return out

    def stale_stages(self) -> dict[str, str]:
        """Stages this revision's dvc.lock records as run from other inputs than the revision's
        own, each with why: a dep whose hash differs from the one the stage producing it
        recorded, or a param whose value differs from the params file. (Code deps are not
        hashed here: `dvc status` sees those, in the workspace.)"""
        lock = yaml.safe_load(self.read_text("dvc.lock") or "") or {}
        entries = lock.get("stages") or {}
        produced = {o["path"]: o.get("md5") for e in entries.values() for o in e.get("outs", [])}
        files: dict[str, dict] = {}
        out = {}
        for stage, entry in entries.items():
            why = [f"{d['path']} changed" for d in entry.get("deps", []) if d["path"] in produced and d.get("md5") != produced[d["path"]]]
            for file, values in (entry.get("params") or {}).items():
                if file not in files:
                    files[file] = yaml.safe_load(self.read_text(file) or "") or {}
                why += [f"param {key} changed" for key, value in values.items() if lookup(files[file], key) != value]
            if why:
                out[stage] = ", ".join(why)
        return out

    def _stages(self) -> list[str]:
        text = self.read_text("dvc.yaml")
        return list(yaml.safe_load(text)["stages"]) if text else []

    def tables(self) -> list[TableInfo]:
        """Every `data/<stage>/<table>.parquet` at this revision, with a local path to read it from."""
        if self.rev is None:
            from storage.catalog import list_tables

            return list_tables(self.repo / "data")
        infos, self.missing = [], []
        for path in self._table_paths():
            try:
                local = self._local(path)
            except FileNotFoundError:
                self.missing.append(path)
                continue
            infos.append(table_info(local, stage=stage_of(Path(path)), table=Path(path).stem))
        return infos

    def _table_paths(self) -> list[str]:
        """The paths PATTERNS match at this revision, listed a level at a time. A glob walks into
        every directory output, and listing one (a model's) needs its manifest from the cache or
        the remote: in a clone that never fetched it, that failed every table. Here only the
        directories a pattern descends into are listed."""
        from dvc_data.index.index import DataIndexError

        found: list[str] = []
        for pattern in PATTERNS:
            level, parts = ["data"], pattern.split("/")
            for depth, part in enumerate(parts):
                files, below = depth == len(parts) - 1, []
                for directory in level:
                    try:
                        entries = self.fs.ls(directory, detail=True)
                    except (FileNotFoundError, NotADirectoryError, DataIndexError):
                        continue
                    below += [e["name"] for e in entries
                              if fnmatch.fnmatch(e["name"].rsplit("/", 1)[-1], part) and (e["type"] == "file") == files]
                level = below
            found += level
        return sorted(set(found))

    def table(self, name: str) -> TableInfo:
        """A table by `<stage>.<table>`, or `<table>` when one stage alone writes that name."""
        infos = self.tables()
        matches = [t for t in infos if name in (f"{t.stage}.{t.table}", t.table)]
        if len(matches) == 1:
            return matches[0]
        known = ", ".join(f"{t.stage}.{t.table}" for t in infos) or "none"
        gone = [m for m in self.missing if name in (f"{stage_of(Path(m))}.{Path(m).stem}", Path(m).stem)]
        if gone:
            raise RevisionError(f"{gone[0]} at {self.label} is in neither the DVC cache nor the remote (`dvc fetch --rev {self.rev}` if another remote has it)")
        if not matches:
            raise RevisionError(f"no table '{name}' at {self.label} (tables: {known})")
        raise RevisionError(f"'{name}' is ambiguous at {self.label}: say {' or '.join(f'{t.stage}.{t.table}' for t in matches)}")

    def _local(self, path: str) -> Path:
        """The file's path in the DVC cache; a copy fetched from the remote (or git) when not there."""
        md5 = self.fs.info(path).get("dvc_info", {}).get("md5")
        if md5:
            local = Path(self.fs.repo.cache.local.oid_to_path(md5))
            if local.exists():
                return local
        # Streams from the default remote (or git, for a file git tracks); the cache stays as it was.
        tmp = Path(tempfile.mkdtemp(prefix="retrosight-rev-")) / Path(path).name
        self.fs.get_file(path, str(tmp))
        return tmp

    def row_counts(self) -> dict[str, int]:
        return {f"{t.stage}.{t.table}": t.rows for t in self.tables()}


_MISSING = object()


def lookup(d: dict, key: str, default: object = _MISSING) -> object:
    """params["relabel"]["k"] for "relabel.k", as DVC reads a stage's param; `default` if absent."""
    for part in key.split("."):
        if not isinstance(d, dict) or part not in d:
            return default
        d = d[part]
    return d


def flatten(d: dict, prefix: str = "") -> dict[str, object]:
    """{"relabel": {"k": 8}} -> {"relabel.k": 8}; lists are values."""
    out: dict[str, object] = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict) and v:
            out.update(flatten(v, key + "."))
        else:
            out[key] = v
    return out


def params_diff(a: dict, b: dict) -> dict[str, tuple[object, object]]:
    """Every dotted key whose value differs, as (a, b); a missing key is None."""
    fa, fb = flatten(a), flatten(b)
    return {k: (fa.get(k), fb.get(k)) for k in sorted(set(fa) | set(fb)) if fa.get(k) != fb.get(k)}
