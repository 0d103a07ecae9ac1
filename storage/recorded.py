"""Is a file as the pipeline wrote it? Its MD5 against the one DVC recorded for the stage output.

When a stage ends, DVC records the MD5 of each of its outputs in dvc.lock. A later stage reading
that file finds the same MD5 only if nobody changed it since, so what the writing stage computed
(each trajectory's content hash, from the content it wrote) still holds and need not be redone.
A file edited, replaced or copied in by hand has another MD5 (or no record) and is checked in
full. `dvc commit` after a hand edit records the edited file: DVC is then told it is an output.
"""
from __future__ import annotations

import hashlib
from pathlib import Path

import yaml

CHUNK = 1 << 22


def file_md5(path: Path | str) -> str:
    """The MD5 DVC 3 records for a file: of its bytes as they are."""
    digest = hashlib.md5()
    with open(path, "rb") as f:
        while block := f.read(CHUNK):
            digest.update(block)
    return digest.hexdigest()


def recorded_md5(path: Path | str) -> str | None:
    """The MD5 of `path` as the stage that wrote it left it: the outs entry naming it in a dvc.lock
    of a directory above it, up to the DVC project's root; None without such a record."""
    path = Path(path).resolve()
    for root in path.parents:
        lock = root / "dvc.lock"
        if lock.is_file():
            try:
                stages = (yaml.load(lock.read_text(), Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader)) or {}).get("stages", {})
            except (OSError, yaml.YAMLError, AttributeError):
                return None  # an unreadable lock vouches for nothing: the file is checked in full
            name = path.relative_to(root).as_posix()
            for stage in stages.values() if isinstance(stages, dict) else []:
                for out in stage.get("outs", []) if isinstance(stage, dict) else []:
                    if isinstance(out, dict) and out.get("path") == name and isinstance(out.get("md5"), str):
                        return out["md5"]
        if (root / ".dvc").is_dir():
            return None
    return None


def as_written(path: Path | str) -> bool:
    """True when `path` is byte for byte the output its stage recorded in dvc.lock."""
    recorded = recorded_md5(path)
    return recorded is not None and file_md5(path) == recorded
