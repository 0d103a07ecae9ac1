"""A base policy shipped in the repository: its files, their checksums, and how it was made.

A checkpoint directory holds `model/` (a Hugging Face model directory: weights, config,
tokenizer), `loss.json` (its training curve) and `provenance.json`: the command and params that
trained it, its first-look figures, and the SHA-256 of every file. `verify` checks every file
against those checksums before a stage uses it, so a checkpoint changed by hand, or cut short by a
bad checkout, is an error naming the file rather than a policy that quietly plays differently.
"""
from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

PROVENANCE = "provenance.json"


class CheckpointError(ValueError):
    pass


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _files(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*") if p.is_file() and p.name != PROVENANCE)


def pack(source: Path, dest: Path, provenance: dict) -> dict:
    """Copy a bootstrap output's model/ and loss.json to dest and write provenance.json with the
    checksum of every file. Returns the provenance written."""
    if dest.exists():
        shutil.rmtree(dest)
    shutil.copytree(source / "model", dest / "model")
    shutil.copy2(source / "loss.json", dest / "loss.json")
    files = {str(p.relative_to(dest)): sha256(p) for p in _files(dest)}
    written = {**provenance, "files": files}
    (dest / PROVENANCE).write_text(json.dumps(written, indent=1, sort_keys=True) + "\n")
    return written


def verify(root: Path) -> dict:
    """The provenance of the checkpoint at root, once every file's checksum is the recorded one
    and no file is missing or extra; CheckpointError naming the first that is not."""
    try:
        provenance = json.loads((root / PROVENANCE).read_text())
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{root / PROVENANCE}: not readable ({e})") from None
    recorded = provenance.get("files") or {}
    present = {str(p.relative_to(root)) for p in _files(root)}
    if missing := sorted(set(recorded) - present):
        raise CheckpointError(f"{root / missing[0]}: missing (recorded in {root / PROVENANCE})")
    if extra := sorted(present - set(recorded)):
        raise CheckpointError(f"{root / extra[0]}: not part of the checkpoint ({root / PROVENANCE} records no such file)")
    for name, digest in sorted(recorded.items()):
        if (actual := sha256(root / name)) != digest:
            raise CheckpointError(f"{root / name}: SHA-256 {actual[:12]}... is not the recorded {digest[:12]}... "
                                  f"(changed after it was packed; retrain it with the command in {root / PROVENANCE})")
    return provenance
