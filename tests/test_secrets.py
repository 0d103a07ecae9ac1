"""The canary test: an API key comes from the environment only and reaches nothing but the API.

A random canary key sits in the environment variable the LLM roles' `api_key_env` names; a real
pipeline section (summarize and label, their roles on the `openai` backend) runs through
`retrosight run` (Prefect on its ephemeral API, DVC) against the fault double, which answers
some requests with a 401 whose body echoes the key, as hosted APIs do, and others with 5xx,
hangs, truncated and malformed bodies; the labeler is set to fail its stage. Then the canary,
as text and in base64, is looked for everywhere the run could have put it: every file under the
project (data, dvc.lock, params.yaml, metrics, .dvc/cache, the response cache), Prefect's home
and database, the run's output, and the Prefect API's artifacts, flow and task runs and logs.
"""
from __future__ import annotations

import base64
import json
import secrets
import subprocess
import zlib
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml

from conftest import BIN, ROOT, project_env, run, tiny_params
from fault_double import FAULTS, running, write_logged_games

KEY_ENV = "RETROSIGHT_CANARY_KEY"
SECTION = ("summarize", "label")


def needles(secret: str) -> dict[str, bytes]:
    """The secret as text, and the stretch of its base64 that any encoding of a longer string
    containing it must hold, at each of the three byte alignments it can have in that string."""
    out = {"text": secret.encode()}
    for shift in range(3):
        for name, encode in (("base64", base64.b64encode), ("base64url", base64.urlsafe_b64encode)):
            encoded = encode(b"\0" * shift + secret.encode())
            # Leading characters carry bits of the bytes before it, the last group those after.
            out[f"{name}@{shift}"] = encoded[-(-4 * shift // 3) : -4]
    return out


def leaks_in(data: bytes, where: str, found: dict[str, bytes]) -> list[str]:
    return [f"{where}: {name}" for name, needle in found.items() if needle in data]


def scan_file(path: Path, found: dict[str, bytes]) -> list[str]:
    """The file's bytes, and what a compressed file holds: Parquet pages (zstd) decoded by
    pyarrow, git's zlib objects inflated."""
    raw = path.read_bytes()
    hits = leaks_in(raw, str(path), found)
    if raw[:4] == b"PAR1" and raw[-4:] == b"PAR1":
        table = pq.read_table(path)
        decoded = json.dumps(table.to_pylist(), default=str) + repr(table.schema.metadata)
        hits += leaks_in(decoded.encode(), f"{path} (decoded Parquet)", found)
    elif "objects" in path.parts and ".git" in path.parts:
        try:
            hits += leaks_in(zlib.decompress(raw), f"{path} (inflated)", found)
        except zlib.error:
            pass  # a pack or its index: none is written here, the repository has one commit
    return hits


def scan_tree(root: Path, found: dict[str, bytes]) -> tuple[list[str], int]:
    files = [p for p in root.rglob("*") if p.is_file() and not p.is_symlink()]
    return [hit for p in files for hit in scan_file(p, found)], len(files)


# The client on Prefect's API app in process, over the run's database (PREFECT_HOME): the same
# routes as a server, without the seconds a temporary server process takes to start.
READ_PREFECT = """
import asyncio, json
from prefect.client.orchestration import PrefectClient
from prefect.server.api.server import create_app

async def main():
    async with PrefectClient(api=create_app(ephemeral=True)) as client:
        print(json.dumps({
            "artifacts": [a.model_dump(mode="json") for a in await client.read_artifacts()],
            "flow_runs": [r.model_dump(mode="json") for r in await client.read_flow_runs()],
            "task_runs": [r.model_dump(mode="json") for r in await client.read_task_runs()],
            "logs": [entry.model_dump(mode="json") for entry in await client.read_logs()],
        }))

asyncio.run(main())
"""


def _section_project(project: Path, url: str) -> None:
    """The project's pipeline cut to the stages under test, their inputs written as plain files."""
    spec = yaml.safe_load((ROOT / "dvc.yaml").read_text())
    (project / "dvc.yaml").write_text(yaml.safe_dump({"stages": {s: spec["stages"][s] for s in SECTION}}, sort_keys=False))
    write_logged_games(project / "data/collect/trajectories.parquet", 20, 6)
    from storage.parquet import write_table
    from storage.schema import to_table

    write_table(to_table([], "trajectories"), project / "data/regenerate/trajectories.parquet", "trajectories")
    role = {
        "backend": "openai", "model": "roles", "base_url": url, "api_key_env": KEY_ENV,
        "timeout": 0.5, "max_retries": 1, "concurrency": 16, "parse_attempts": 1, "max_failure_rate": 0.6,
    }  # fmt: skip
    params = tiny_params({
        "env": {"max_turns": 6},
        "roles": {"summarizer": role, "labeler": {**role, "few_shot": 2, "max_failure_rate": 0.0}},  # the labeler fails its stage
        "cache": {"path": ".retrosight/cache/responses.sqlite"},
    })
    (project / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))


def test_the_scanner_finds_a_key_in_text_base64_and_compressed_parquet(tmp_path):
    key = "sk-canary-" + secrets.token_hex(16)
    found = needles(key)
    for shift in range(3):
        blob = base64.b64encode(b"x" * shift + f"Authorization: Bearer {key}".encode() + b"!")
        assert f"blob: base64@{(shift + 22) % 3}" in leaks_in(blob, "blob", found)
    # Deflated pages and no min/max statistics (which Parquet keeps uncompressed): only decoding finds it.
    pq.write_table(pa.table({"reason": [f"Incorrect API key provided: {key}"] * 50}), tmp_path / "t.parquet", compression="gzip", write_statistics=False)
    assert key.encode() not in (tmp_path / "t.parquet").read_bytes()
    assert scan_tree(tmp_path, found)[0] == [f"{tmp_path / 't.parquet'} (decoded Parquet): text"]


@pytest.mark.system
def test_the_api_key_reaches_only_the_api(project, tmp_path, faults):
    canary = "sk-canary-" + secrets.token_hex(16)
    with running(hang_seconds=3.0) as double:
        double.inject(FAULTS, slots=12)  # 5 of 12 requests fail for good: a 401 echoing the key among them
        _section_project(project, double.url)
        result = run([str(BIN / "retrosight"), "run"], project, check=False, env_extra={KEY_ENV: canary})
    output = result.stdout + result.stderr
    # The section ran: summarize passed, the labeler failed its stage past its rate.
    assert result.returncode != 0 and "label: the labeler role failed on" in output, output[-4000:]
    assert set(yaml.safe_load((project / "dvc.lock").read_text())["stages"]) == {"summarize"}

    # The key was sent, and echoed back: the test could have caught a leak.
    assert f"Bearer {canary}" in double.auth and double.faults_sent["401"] > 0
    reasons = [r for t in ("summarize/summaries", "label/labels") for r in pq.read_table(project / f"data/{t}.parquet").column("reason").to_pylist()]
    assert any("HTTP 401" in (r or "") and "[redacted]" in r for r in reasons)

    prefect = subprocess.run([str(BIN / "python"), "-c", READ_PREFECT], check=False, cwd=project, env=project_env(tmp_path), text=True, capture_output=True, timeout=300)
    assert prefect.returncode == 0, prefect.stderr[-3000:]
    api = json.loads(prefect.stdout)
    assert "retrosight-summarize" in {a["key"] for a in api["artifacts"]} and api["logs"]
    assert any(r["state_type"] == "FAILED" for r in api["flow_runs"])

    found = needles(canary)
    hits, files = scan_tree(tmp_path, found)  # the project and PREFECT_HOME (tmp_path/.prefect-home)
    assert files > 50 and (tmp_path / ".prefect-home/prefect.db").exists() and any((project / ".dvc/cache").rglob("*"))
    assert (project / ".retrosight/cache/responses.sqlite").exists()
    hits += leaks_in(output.encode(), "retrosight run output", found)
    hits += leaks_in(prefect.stdout.encode(), "Prefect API (artifacts, flow runs, task runs, logs)", found)
    assert hits == []
    faults(canary_files_scanned=files, canary_leaks=len(hits))


def _params_with(tmp_path: Path, **summarizer) -> Path:
    raw = tiny_params({"roles": {"summarizer": {"backend": "openai", "model": "m", "base_url": "http://127.0.0.1:9/v1", **summarizer}}})
    path = tmp_path / "params.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


def test_a_key_written_into_params_is_refused_without_being_repeated(tmp_path):
    from models.openai import OpenAIGenerator
    from tasks.params import ParamsError, load_params

    key = "sk-live-" + secrets.token_hex(16)
    with pytest.raises(ParamsError) as refused:
        load_params(_params_with(tmp_path, api_key=key))
    assert "roles.summarizer.api_key: unknown key" in str(refused.value) and key not in str(refused.value)
    # The backend refuses a key pasted where its variable's name belongs, and does not repeat it.
    with pytest.raises(ValueError) as refused:
        OpenAIGenerator("m", base_url="http://127.0.0.1:9/v1", api_key_env=key)
    assert "name of an environment variable" in str(refused.value) and key not in str(refused.value)


def test_params_refuse_a_key_pasted_as_api_key_env(tmp_path):
    from tasks.params import ParamsError, load_params

    key = "sk-live-" + secrets.token_hex(16)
    with pytest.raises(ParamsError) as refused:
        load_params(_params_with(tmp_path, api_key_env=key))
    assert "roles.summarizer.api_key_env" in str(refused.value) and key not in str(refused.value)
