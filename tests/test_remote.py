"""DVC remotes: the default local remote from this repo's .dvc/config, and an S3-compatible remote
(moto's server standing in for AWS or MinIO), each a full push, wipe, pull round trip."""
from __future__ import annotations

import hashlib
import inspect
import shutil
import subprocess
import time
import urllib.request
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml

from conftest import BIN, ROOT, built, copy_repo, digest, free_port, project_env, run, stop_process

pytestmark = pytest.mark.system

BUCKET = "retrosight-data"
PREFIX = "team/retrosight"
KEY_ID = "AKIARETROSIGHTTEST"
SECRET = "retrosight-test-secret-9f3c2a7e"  # must never land in .dvc/config


@pytest.fixture(scope="module")
def s3_endpoint(tmp_path_factory):
    """moto's S3-compatible server on a free local port, stopped at teardown."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = (tmp_path_factory.mktemp("moto") / "server.log").open("w")
    proc = subprocess.Popen([str(BIN / "moto_server"), "-H", "127.0.0.1", "-p", str(port)], stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 20
        while True:
            try:
                urllib.request.urlopen(f"{url}/moto-api/", timeout=1).close()
                break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"moto_server did not come up on {url} (exit {proc.poll()})")
                time.sleep(0.2)
        yield url
    finally:
        stop_process(proc, timeout=10)
        log.close()


def _s3_client(endpoint: str):
    import boto3

    return boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1", aws_access_key_id=KEY_ID, aws_secret_access_key=SECRET)


def _aws_env(tmp: Path) -> dict:
    """What a user exports: credentials in the environment, nothing from ~/.aws."""
    env = project_env(tmp)
    for name in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_SECURITY_TOKEN"):
        env.pop(name, None)
    env.update(
        AWS_ACCESS_KEY_ID=KEY_ID,
        AWS_SECRET_ACCESS_KEY=SECRET,
        AWS_DEFAULT_REGION="us-east-1",
        AWS_CONFIG_FILE=str(tmp / "no-aws-config"),
        AWS_SHARED_CREDENTIALS_FILE=str(tmp / "no-aws-credentials"),
        NO_PROXY="127.0.0.1,localhost",
        no_proxy="127.0.0.1,localhost",
    )
    return env


def _dvc(args: list[str], repo: Path, env: dict) -> subprocess.CompletedProcess:
    result = subprocess.run([str(BIN / "dvc"), *args], check=False, cwd=repo, env=env, text=True, capture_output=True, timeout=120)
    if result.returncode != 0:
        raise AssertionError(f"dvc {args} failed ({result.returncode}):\n{result.stdout[-4000:]}\n{result.stderr[-4000:]}")
    return result


def _tracked_table(out: Path) -> None:
    repo = out / "repo"
    repo.mkdir()
    run(["git", "init", "-q"], repo)
    run([str(BIN / "dvc"), "init", "-q"], repo)
    shutil.copy(ROOT / ".dvc" / "config", repo / ".dvc" / "config")
    shutil.copy(ROOT / ".dvc" / ".gitignore", repo / ".dvc" / ".gitignore")
    table = pa.table({"trajectory_id": [f"t{i:03d}" for i in range(200)], "reward": [i / 7 for i in range(200)]})
    (repo / "data").mkdir()
    pq.write_table(table, repo / "data" / "table.parquet")
    run([str(BIN / "dvc"), "add", "-q", "data/table.parquet"], repo)
    run(["git", "add", "-A"], repo)
    run(["git", "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "table"], repo)


@pytest.fixture(scope="session")
def tracked_table(request) -> Path:
    """_tracked_table's repository, built once per tree (conftest.built) and shared: read only."""
    key = digest(ROOT / ".dvc" / "config", ROOT / ".dvc" / ".gitignore", inspect.getsource(_tracked_table))
    return built(request, "remote-repo", key, _tracked_table) / "repo"


@pytest.fixture
def repo(tracked_table: Path, tmp_path: Path) -> Path:
    """A git + DVC repo with this project's .dvc/config (default remote `local`) and one
    Parquet table tracked by `dvc add`: a copy of the shared one, for this test to push and wipe."""
    return copy_repo(tracked_table, tmp_path)


def _md5(repo: Path) -> str:
    return yaml.safe_load((repo / "data" / "table.parquet.dvc").read_text())["outs"][0]["md5"]


def _wipe(repo: Path) -> None:
    shutil.rmtree(repo / ".dvc" / "cache")
    (repo / "data" / "table.parquet").unlink()


def test_default_local_remote_round_trip(repo: Path):
    original = (repo / "data" / "table.parquet").read_bytes()
    md5 = _md5(repo)
    assert run([str(BIN / "dvc"), "remote", "default"], repo).stdout.strip() == "local"

    run([str(BIN / "dvc"), "push"], repo)
    storage = repo / ".dvc" / "storage"
    assert (storage / "files" / "md5" / md5[:2] / md5[2:]).is_file()
    assert run(["git", "check-ignore", "-q", ".dvc/storage/files"], repo, check=False).returncode == 0
    assert run(["git", "status", "--porcelain"], repo).stdout == ""  # the pushed objects stay out of git

    _wipe(repo)
    run([str(BIN / "dvc"), "pull"], repo)
    assert (repo / "data" / "table.parquet").read_bytes() == original
    assert hashlib.md5(original).hexdigest() == md5


def test_s3_remote_round_trip(repo: Path, s3_endpoint: str):
    s3 = _s3_client(s3_endpoint)
    s3.create_bucket(Bucket=BUCKET)
    env = _aws_env(repo.parent)
    original = (repo / "data" / "table.parquet").read_bytes()
    md5 = _md5(repo)

    # As in docs/versioning.md: the remote and its endpoint go into .dvc/config, the credentials do not.
    _dvc(["remote", "add", "s3", f"s3://{BUCKET}/{PREFIX}"], repo, env)
    _dvc(["remote", "modify", "s3", "endpointurl", s3_endpoint], repo, env)
    for name in ("config", "config.local"):
        path = repo / ".dvc" / name
        if path.exists():
            assert SECRET not in path.read_text() and KEY_ID not in path.read_text()

    _dvc(["push", "-r", "s3"], repo, env)
    keys = {o["Key"] for o in s3.list_objects_v2(Bucket=BUCKET, Prefix=f"{PREFIX}/").get("Contents", [])}
    assert f"{PREFIX}/files/md5/{md5[:2]}/{md5[2:]}" in keys, keys
    assert not (repo / ".dvc" / "storage").exists()  # nothing went to the default remote

    _wipe(repo)
    _dvc(["pull", "-r", "s3"], repo, env)
    assert (repo / "data" / "table.parquet").read_bytes() == original
    assert _dvc(["data", "status", "--json"], repo, env).stdout.strip() == "{}"
