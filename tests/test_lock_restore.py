"""A dvc.lock cut short by a run killed while DVC wrote it (DVC rewrites the file in place) is
restored from the copy `retrosight run` keeps after each stage DVC finished."""
import os
import subprocess
import sys
from pathlib import Path

from flows import pipeline as p

DVC = str(Path(sys.executable).parent / "dvc")


def test_a_cut_lock_is_restored_as_the_last_finished_stage_left_it(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    subprocess.run([DVC, "init", "--no-scm", "-q"], check=True)
    Path("in.txt").write_text("a\n")
    subprocess.run([DVC, "stage", "add", "-q", "-n", "copy", "-d", "in.txt", "-o", "out.txt", "cp in.txt out.txt"], check=True)
    subprocess.run([DVC, "repro", "-q"], check=True)
    assert p.restore_cut_lock() is None  # no copy yet: nothing to restore from
    p.keep_lock()
    whole = Path("dvc.lock").read_bytes()
    assert p.LAST_LOCK.read_bytes() == whole and p.restore_cut_lock() is None  # the same file: nothing done

    cut = whole[: whole.index(b"- path: in.txt") + len(b"- path")]  # DVC killed mid-write: a dep that is no mapping
    Path("dvc.lock").write_bytes(cut)
    refused = subprocess.run([DVC, "status"], capture_output=True, text=True)
    assert refused.returncode != 0 and "validation failed" in refused.stdout + refused.stderr  # what a killed run left
    assert "restored" in p.restore_cut_lock()
    assert Path("dvc.lock").read_bytes() == whole
    assert subprocess.run([DVC, "status", "-q"]).returncode == 0  # up to date again

    # A lock DVC can read is the user's (or DVC's) and is never replaced, even if it differs.
    Path("in.txt").write_text("b\n")
    subprocess.run([DVC, "repro", "-q"], check=True)
    newer = Path("dvc.lock").read_bytes()
    assert newer != p.LAST_LOCK.read_bytes() and p.restore_cut_lock() is None and Path("dvc.lock").read_bytes() == newer
    assert not any(n.endswith(".tmp") for n in os.listdir(".retrosight"))
