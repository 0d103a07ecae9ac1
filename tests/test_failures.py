"""A failure the user can act on is one `error:` line: the reason, the counts of the commonest
reasons, and where the failed rows are; its traceback goes to .retrosight/logs/ (or the console,
with --debug). Anything else still shows its traceback."""
from __future__ import annotations

import logging
import re
import subprocess
import time
from pathlib import Path

import pytest
import yaml

from conftest import BIN, ROOT, free_port, make_project, project_env, run, stop_process
from fault_double import running, write_logged_games
from flows.common import _QuietExpected, expected_failure, stage_roles
from flows.pipeline import StageFailed
from models.base import BackendUnavailable
from models.openai import MissingAPIKey
from storage.parquet import SchemaVersionError
from tasks.params import ParamsError, RoleParams
from tasks.roles import Outcome, RoleFailure, account, check_failure_rate
from test_versions import prefect_server  # noqa: F401  (the fixture: a real `prefect server start`)

RETRO = str(BIN / "retrosight")


def test_expected_failures_are_told_from_bugs():
    inputs = [Path("data/collect/trajectories.parquet")]
    for e in (RoleFailure("x"), ParamsError("x"), BackendUnavailable("x"), SchemaVersionError("x"), StageFailed("x"), MissingAPIKey("x"),
              ValueError("data/collect/trajectories.parquet: not a readable Parquet file: ...")):
        assert expected_failure(e, inputs), e
    for e in (ValueError("badly formed hexadecimal UUID string"), ValueError("data/label/labels.parquet: column 'x'"), KeyError("k"), RuntimeError("x")):
        assert not expected_failure(e, inputs), e


def test_the_console_drops_prefect_s_report_of_an_expected_failure_only():
    seen: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record):
            seen.append(record.getMessage())

    handler = Keep()
    handler.addFilter(_QuietExpected([]))
    log = logging.getLogger("test_failures.console")
    log.addHandler(handler)
    log.propagate = False
    log.setLevel(logging.INFO)
    for e in (KeyError("a bug"), RoleFailure("summarize: too many failed")):
        try:
            raise e
        except Exception:
            log.exception("Encountered exception during execution: %r", e)  # as Prefect's flow engine logs it
    log.error("Finished in state Failed('Flow run encountered an exception: RoleFailure: ...')")
    log.info("Beginning flow run 'x' for flow 'summarize'")
    assert seen == ["Encountered exception during execution: KeyError('a bug')", "Beginning flow run 'x' for flow 'summarize'"]


def test_a_role_failure_counts_its_reasons_and_says_where_the_rows_are():
    refused = "openai: connection error (ConnectError: All connection attempts failed) [after 5 attempt(s)]"
    outcomes = [Outcome("failed", None, "", 5, refused)] * 320 + [Outcome("failed", None, "", 1, "openai: HTTP 500")] * 7
    outcomes += [Outcome("invalid", None, "?", 3, f"unparseable after 3 attempts: reply {i}") for i in range(3)] + [Outcome("ok", "s", "s", 1, None)] * 2
    stats = account(outcomes)
    assert stats["top_reasons"] == [[320, refused], [7, "openai: HTTP 500"], [1, "unparseable after 3 attempts: reply 0"]]
    with pytest.raises(RoleFailure) as e:
        check_failure_rate("summarize", "summarizer", RoleParams(backend="oracle"), stats)
    assert str(e.value) == (
        "summarize: the summarizer role failed on 330 of 332 requests (3 unparseable, 327 with no answer from the backend), "
        f"over its max_failure_rate 0.05: 320 × {refused}; 7 × openai: HTTP 500; 1 × unparseable after 3 attempts: reply 0; "
        "2 for other reasons; the rows: retrosight inspect --sql \"SELECT trajectory_id, status, reason FROM summaries WHERE status <> 'ok'\""
    )
    assert "top_reasons" not in account(outcomes[-2:])  # nothing failed: the metrics stay as they were


def _errors(output: str) -> list[str]:
    return [line for line in output.splitlines() if line.startswith("error:")]


def _set(project: Path, section: str, key: str, value) -> None:
    raw = yaml.safe_load((project / "params.yaml").read_text())
    raw[section][key] = value
    (project / "params.yaml").write_text(yaml.safe_dump(raw, sort_keys=False))


@pytest.mark.system
def test_a_stage_whose_role_fails_every_request_ends_the_run_in_one_line(tmp_path):
    project = make_project(tmp_path)
    write_logged_games(project / "data" / "collect" / "trajectories.parquet", 3, 8)  # summarize's input: 6 games
    with running() as double:
        # A server that answers every request with a 503.
        _set(project, "roles", "summarizer", {"backend": "openai", "model": "always-503", "base_url": double.url, "max_retries": 0, "timeout": 10})
        result = run([RETRO, "run", "summarize"], project, check=False)
        output = result.stdout + result.stderr
        assert result.returncode == 2, output[-4000:]
        [error] = _errors(output)
        assert error.startswith("error: summarize: the summarizer role failed on 6 of 6 requests (0 unparseable, 6 with no answer from the backend)"), error
        assert "6 × openai: HTTP 503" in error, error
        # No traceback, no Prefect failure report, no DVC "failed to reproduce" around it.
        for noise in ("Traceback", "Finished in state Failed", "failed to reproduce", "its output is above"):
            assert noise not in output, f"{noise!r} in:\n{output[-4000:]}"
        # The hint is a command to paste; the log it names holds the traceback.
        sql = re.search(r'the rows: retrosight inspect --sql "(.*?)"', error).group(1)
        rows = run([RETRO, "inspect", "--sql", sql], project).stdout
        assert rows.count("│ failed │") == 6 and "HTTP 503" in rows, rows
        log = (project / re.search(r"\[traceback: (.*)\]$", error).group(1)).read_text()
        assert "Traceback (most recent call last)" in log and "RoleFailure" in log

        debug = run([RETRO, "--debug", "run", "summarize"], project, check=False)
        output = debug.stdout + debug.stderr
        assert debug.returncode == 2 and "Traceback (most recent call last)" in output and "RoleFailure" in output, output[-4000:]
        assert len(_errors(output)) == 1, output[-4000:]


@pytest.mark.system
def test_a_bad_input_file_a_bad_param_and_a_bug_each_end_as_they_should(tmp_path):
    project = make_project(tmp_path)
    games = project / "data" / "collect" / "trajectories.parquet"
    write_logged_games(games, 3, 8)
    good = games.read_bytes()

    # A truncated input: one line naming the file, through the whole run.
    games.write_bytes(good[: len(good) // 2])
    result = run([RETRO, "run", "summarize"], project, check=False)
    output = result.stdout + result.stderr
    assert result.returncode == 2 and "Traceback" not in output, output[-4000:]
    [error] = _errors(output)
    assert error.startswith("error: summarize: data/collect/trajectories.parquet: not a readable Parquet file"), error
    games.write_bytes(good)

    # A bad value and a misspelt key: refused before any work, params.yaml as it was.
    before = (project / "params.yaml").read_text()
    for override, said in (
        ("roles.summarizer.max_failure_rate=2", "roles.summarizer.max_failure_rate: Input should be less than or equal to 1"),
        ("relabel.kk=3", "error: unknown param 'relabel.kk' (did you mean relabel.k?)"),
    ):
        result = run([RETRO, "run", "summarize", "-S", override], project, check=False)
        output = result.stdout + result.stderr
        assert result.returncode == 2 and said in output and len(_errors(output)) == 1 and "Traceback" not in output, output[-4000:]
        assert (project / "params.yaml").read_text() == before
    # The same bad value met by the stage itself, as `dvc repro` runs it.
    _set(project, "roles", "summarizer", {"backend": "oracle", "max_failure_rate": 2})
    result = run([RETRO, "stage", "summarize"], project, check=False)
    output = result.stdout + result.stderr
    assert result.returncode == 2 and "Traceback" not in output, output[-4000:]
    [error] = _errors(output)
    assert error.startswith("error: params.yaml: invalid parameters"), error
    (project / "params.yaml").write_text(before)

    # A server that is not there: one line naming it (the stage as `dvc repro` runs it).
    url = f"http://127.0.0.1:{free_port()}/v1"
    _set(project, "roles", "summarizer", {"backend": "openai", "model": "m", "base_url": url, "max_retries": 0, "timeout": 5})
    result = run([RETRO, "stage", "summarize"], project, check=False)
    output = result.stdout + result.stderr
    assert result.returncode == 2 and "Traceback" not in output, output[-4000:]
    [error] = _errors(output)
    assert error.startswith("error: ") and f"cannot reach {url}" in error, error
    (project / "params.yaml").write_text(before)

    # Anything else is a bug, and shows its traceback.
    result = run([RETRO, "stage", "summarize"], project, check=False, env_extra={"RETROSIGHT_PARENT_TASK_RUN_ID": "not-a-uuid"})
    output = result.stdout + result.stderr
    assert result.returncode != 0 and "Traceback" in output and "badly formed hexadecimal UUID string" in output, output[-4000:]


UNSET = "RETROSIGHT_UNSET_TEST_KEY"  # a variable no environment sets


def _needs_unset_key(project: Path) -> None:
    _set(project, "roles", "labeler", {"backend": "openai", "model": "m", "base_url": "http://127.0.0.1:9/v1", "api_key_env": UNSET})


def test_the_roles_a_stage_calls_are_those_its_dvc_yaml_params_name(monkeypatch):
    monkeypatch.chdir(ROOT)
    assert stage_roles(["bootstrap", "standardize"]) == []
    assert stage_roles(["label"]) == ["labeler"]
    assert stage_roles(["collect", "summarize"]) == ["policy", "simulator", "summarizer"]


def test_a_missing_api_key_is_one_line_naming_it_and_its_role_from_run_and_serve(tmp_path):
    project = make_project(tmp_path)
    # serve refuses now what every scheduled run would meet: here a bad value set with -S.
    result = run([RETRO, "serve", "--cron", "0 3 * * *", "-S", "roles.summarizer.max_failure_rate=2"], project, check=False)
    output = result.stdout + result.stderr
    assert result.returncode == 2 and "Traceback" not in output, output[-4000:]
    assert _errors(output) == ["error: params.yaml: invalid parameters"], output[-4000:]
    assert "roles.summarizer.max_failure_rate: Input should be less than or equal to 1" in output

    _needs_unset_key(project)
    before = (project / "params.yaml").read_text()
    # serve is refused before it looks for a Prefect server (none here), run before any stage.
    for cmd in ([RETRO, "run"], [RETRO, "serve", "--cron", "0 3 * * *"]):
        result = run(cmd, project, check=False)
        output = result.stdout + result.stderr
        assert result.returncode == 2 and "Traceback" not in output, output[-4000:]
        [error] = _errors(output)
        assert error.startswith(f"error: roles.labeler reads its API key for http://127.0.0.1:9/v1 from the environment variable {UNSET}, which is not set"), error
        assert (project / "params.yaml").read_text() == before
    assert not (project / "data").exists() and not (project / ".retrosight/logs/bootstrap.log").exists()


def _wait_for(what, timeout: float, proc: subprocess.Popen, log: Path):
    deadline = time.time() + timeout
    while time.time() < deadline:
        assert proc.poll() is None, log.read_text()[-4000:]
        if found := what():
            return found
        time.sleep(1)
    raise AssertionError(f"not within {timeout} s:\n{log.read_text()[-4000:]}")


@pytest.mark.system
def test_a_scheduled_run_ends_in_the_same_one_line_as_run(tmp_path, prefect_server):  # noqa: F811
    from prefect.client.orchestration import SyncPrefectClient

    project = make_project(tmp_path)
    params = project / "params.yaml"
    original = params.read_text()
    env = {**project_env(project.parent), "PREFECT_API_URL": prefect_server, "PREFECT_RUNNER_POLL_FREQUENCY": "2"}
    serve_log = tmp_path / "serve.log"
    with open(serve_log, "w") as out:
        serve = subprocess.Popen([RETRO, "serve", "--cron", "0 3 * * *", "--name", "nightly", "--no-push"], cwd=project, env=env, stdout=out, stderr=subprocess.STDOUT)
    try:
        def deployed():
            with SyncPrefectClient(prefect_server) as client:  # this process has no PREFECT_API_URL
                return any(d.name == "nightly" for d in client.read_deployments())

        _wait_for(deployed, 180, serve, serve_log)
        url = f"http://127.0.0.1:{free_port()}/v1"

        def bad_value():
            _set(project, "roles", "summarizer", {"backend": "oracle", "max_failure_rate": 2})

        def dead_simulator():  # passes every check before the run; collect, after bootstrap, meets it
            _set(project, "roles", "simulator", {"backend": "openai", "model": "m", "base_url": url, "max_retries": 0, "timeout": 5})

        # Each edit lands after serve started: the scheduled run reads params.yaml as it is then.
        for n, (edit, said) in enumerate((
            (bad_value, "error: params.yaml: invalid parameters"),
            (lambda: _needs_unset_key(project), f"error: roles.labeler reads its API key for http://127.0.0.1:9/v1 from the environment variable {UNSET}, which is not set"),
            (dead_simulator, f"error: collect: openai: cannot reach {url} (connection refused); nothing was sent [traceback: .retrosight/logs/collect.log]"),
        ), start=1):
            params.write_text(original)
            edit()
            start = len(serve_log.read_text())
            triggered = subprocess.run(
                [str(BIN / "prefect"), "deployment", "run", "retrosight-scheduled/nightly", "--watch", "--watch-timeout", "900"],
                cwd=project, env=env, text=True, capture_output=True, timeout=960,
            )
            assert "finished in state 'Failed'" in triggered.stdout, triggered.stdout[-3000:] + serve_log.read_text()[-4000:]
            # The run's process prints its line before it exits, and the runner logs the exit after
            # (to serve's log file alone).
            _wait_for(lambda: (project / ".retrosight/logs/serve.log").read_text().count("exited with status code: 1") == n, 60, serve, serve_log)  # noqa: B023
            output = serve_log.read_text()[start:]
            [error] = _errors(output)
            assert error.startswith(said), output[-4000:]
            # No traceback, no Prefect failure report, no runner's report of the exit.
            for noise in ("Traceback", "Finished in state Failed", "exited with status code", "Check the flow run logs"):
                assert noise not in output, f"{noise!r} in:\n{output[-4000:]}"
    finally:
        stop_process(serve)
    # The tracebacks are in the logs: the stage's, and the scheduled run's.
    collect = (project / ".retrosight/logs/collect.log").read_text()
    assert "Traceback (most recent call last)" in collect and "BackendUnavailable" in collect
    assert "StageFailed" in (project / ".retrosight/logs/scheduled.log").read_text()
