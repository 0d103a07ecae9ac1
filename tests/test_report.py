"""The stages' histogram plots, and the static HTML report of a real git + DVC project's plots.

The project here is a stand-in: one stage writing every plot file the pipeline writes, with the
pipeline's own plot functions and this repo's top-level `plots:` definitions, so two commits
take seconds rather than a full run's minutes.
"""
from __future__ import annotations

import inspect
import json
import math
import random
import re
import shutil
from pathlib import Path

import polars as pl
import pytest
import yaml

from conftest import BIN, CODE, ROOT, built, copy_repo, digest, run, tiny_params, twenty_questions
from flows.report import ARM_SEED_TEMPLATE, _page, default_report_path, read_repro, write_report
from tasks.label import RUBRIC, reward_histograms, return_scale
from tasks.plots import histogram, write_plot
from tasks.standardize import weight_histograms

CHROMIUM = Path("/usr/bin/chromium")
REV_COLOURS = [(0x94, 0x5D, 0xD6), (0x13, 0xAD, 0xC7)]  # DVC's first two revision colours


# -- histograms ----------------------------------------------------------------------------------

def test_integer_returns_fall_in_unit_bins_over_the_whole_range():
    rows = histogram([-20, -20, -20, -7, 0, None, float("nan")], "reward", 1.0, -20, 0)
    assert [r["reward"] for r in rows] == [float(k) for k in range(-20, 1)]
    counts = {r["reward"]: r["count"] for r in rows if r["count"]}
    assert counts == {-20.0: 3, -7.0: 1, 0.0: 1}  # the null and the NaN are left out
    assert sum(r["share"] for r in rows) == pytest.approx(1.0, abs=1e-5)
    assert rows[0]["share"] == 0.6


def test_float_rewards_go_to_the_nearest_bin_half_way_up():
    rows = histogram([-19.6, -19.5, -0.4, -0.5, -3.2], "reward", 1.0, -20, 0)
    counts = {r["reward"]: r["count"] for r in rows if r["count"]}
    assert counts == {-20.0: 1, -19.0: 1, -3.0: 1, 0.0: 2}


def test_a_rubric_reward_gets_tenths_and_logged_and_hindsight_share_their_bins():
    rows = [{"source": "policy", "reward": 0.3}, {"source": "import", "reward": 0.7}, {"source": "policy", "reward": None},
            {"source": "regeneration", "reward": 1.0}, {"source": "regeneration", "reward": 0.3}]
    h = reward_histograms(rows, RUBRIC)
    assert [r["reward"] for r in h["reward_logged"]] == [round(0.1 * k, 1) for k in range(11)]
    assert [r["reward"] for r in h["reward_with_hindsight"]] == [r["reward"] for r in h["reward_logged"]]
    assert {r["reward"]: r["share"] for r in h["reward_logged"] if r["count"]} == {0.3: 0.5, 0.7: 0.5}
    assert {r["reward"]: r["count"] for r in h["reward_with_hindsight"] if r["count"]} == {0.3: 2, 0.7: 1, 1.0: 1}


def test_a_value_out_of_range_widens_both_histograms_alike():
    rows = [{"source": "policy", "reward": -3.0}, {"source": "regeneration", "reward": -25.0}]
    h = reward_histograms(rows, return_scale(twenty_questions(20)))
    assert h["reward_logged"][0]["reward"] == h["reward_with_hindsight"][0]["reward"] == -25.0
    assert len(h["reward_logged"]) == len(h["reward_with_hindsight"]) == 26


def test_too_many_bins_widen_them_and_empty_input_gives_zeros_or_nothing():
    rows = histogram(range(-500, 1), "reward", 1.0, max_bins=60)
    assert len(rows) <= 60 and sum(r["count"] for r in rows) == 501
    assert all(r["share"] == 0.0 for r in histogram([None], "reward", 1.0, -2, 0))
    assert histogram([], "reward", 1.0) == []
    with pytest.raises(ValueError, match="width"):
        histogram([1.0], "reward", 0.0)


def test_the_same_values_in_any_order_give_the_same_file(tmp_path):
    values = [random.Random(1).uniform(-20, 0) for _ in range(200)] + [None] * 3
    shuffled = values[:]
    random.Random(2).shuffle(shuffled)
    write_plot(histogram(values, "reward", 1.0, -20, 0), tmp_path / "a.json")
    write_plot(histogram(shuffled, "reward", 1.0, -20, 0), tmp_path / "b.json")
    assert (tmp_path / "a.json").read_bytes() == (tmp_path / "b.json").read_bytes()
    assert len((tmp_path / "a.json").read_bytes()) < 4000  # small enough to commit beside dvc.lock


def test_weight_histograms_leave_out_rows_without_a_reward():
    df = pl.DataFrame({"standardized_reward": [-1.1547, 0.5774, 0.5774, 0.0, None], "weight": [0.0, 1.0, 1.0, 0.5, None]})
    h = weight_histograms(df)
    assert sum(r["count"] for r in h["standardized_reward"]) == sum(r["count"] for r in h["weight"]) == 4
    assert {r["standardized_reward"]: r["count"] for r in h["standardized_reward"] if r["count"]} == {-1.25: 1, 0.5: 2, 0.0: 1}
    assert [r["weight"] for r in h["weight"]][:3] == [0.0, 0.05, 0.1] and len(h["weight"]) == 21


def test_label_and_standardize_write_their_plot_files(tmp_path):
    from envs.twenty_questions.kb import load_kb
    from envs.twenty_questions.env import Scripted
    from envs.twenty_questions.policies import NoisyPolicy
    from storage.parquet import write_table
    from storage.schema import to_table
    from tasks.label import run_label
    from tasks.params import Params
    from tasks.rollout import ScriptedAgent, derive_seed, new_episode, play
    from tasks.standardize import run_standardize

    kb = load_kb()
    eps = [new_episode(twenty_questions(20), task, derive_seed("report", task.name, k)) for task in kb.split("train")[:3] for k in range(3)]
    play(eps, ScriptedAgent(lambda rng: Scripted(NoisyPolicy(0.4, 0.2, 0.1))), 0, "report")
    trajs = tmp_path / "trajectories.parquet"
    write_table(to_table([e.to_row() for e in eps], "trajectories"), trajs, "trajectories")
    params = Params.model_validate(tiny_params({"env": {"max_turns": 20}}))
    run_label(params, [trajs], tmp_path / "label")
    first = {p.name: p.read_bytes() for p in (tmp_path / "label/plots").iterdir()}
    assert set(first) == {"reward_logged.json", "reward_with_hindsight.json"}
    logged = json.loads(first["reward_logged.json"])
    assert sum(r["count"] for r in logged) == 9 and len(logged) == 21
    run_label(params, [trajs], tmp_path / "label")  # a rerun writes the same bytes
    assert {p.name: p.read_bytes() for p in (tmp_path / "label/plots").iterdir()} == first
    run_standardize(params, [trajs], tmp_path / "label/labels.parquet", tmp_path / "standardize")
    weights = json.loads((tmp_path / "standardize/plots/weight.json").read_text())
    assert sum(r["count"] for r in weights) == 9
    assert (tmp_path / "standardize/plots/standardized_reward.json").exists()


# -- the report ----------------------------------------------------------------------------------

STAGE = '''\
"""Writes every plot file the pipeline writes, from made-up numbers keyed by params.yaml's run."""
import json
from pathlib import Path

import polars as pl
import yaml

from envs import registry
from tasks.label import reward_histograms, return_scale
from tasks.plots import write_plot
from tasks.standardize import weight_histograms

p = yaml.safe_load(open("params.yaml"))["run"]
tag, shift = p["tag"], p["shift"]
write_plot([{"step": s, "loss": 5.0 / s + shift} for s in range(1, 11)], Path("data/bootstrap/loss.json"))
rows = [{"source": "policy", "reward": -20.0} for _ in range(30)] + [{"source": "policy", "reward": -12.0 + shift}]
rows += [{"source": "regeneration", "reward": -8.0 - shift} for _ in range(4)] + [{"source": "regeneration", "reward": None}]
for name, h in reward_histograms(rows, return_scale(registry.make("twenty_questions", {"max_turns": 20}))).items():
    write_plot(h, Path("data/label/plots") / f"{name}.json")
df = pl.DataFrame({"standardized_reward": [0.0] * 20 + [1.5 + shift, -0.5], "weight": [0.0] * 20 + [0.6, 0.1 * shift]})
for name, h in weight_histograms(df).items():
    write_plot(h, Path("data/standardize/plots") / f"{name}.json")
write_plot([{"step": s, "loss": 3.0 - 0.1 * s * (1 + shift)} for s in range(1, 6)], Path(f"data/train/loss/{tag}_method.json"))
policies = {"bootstrap": 0.02, f"{tag}_policy": 0.05 + 0.1 * shift}
write_plot([{"policy": k, "success_rate": v, "success_se": 0.01} for k, v in policies.items()], Path("data/evaluate/plots/success_heldout.json"))
Path("data/evaluate/metrics.json").write_text(json.dumps({"policies": {
    k: {"heldout": {"episodes": 40, "success_rate": v, "success_se": 0.01}} for k, v in policies.items()}}))
Path("data/label/metrics.json").write_text(json.dumps({"labels": 36, "by_source": {"policy": 31, "regeneration": 5},
    "status": {"failed": 1, "ok": 35}, "mean_reward": {"policy": -19.7, "regeneration": -8.0 - shift}}))
'''

OUTS = ["data/bootstrap/loss.json", "data/label/plots", "data/standardize/plots", "data/train/loss", "data/evaluate/plots"]


def _two_runs(out: Path) -> None:
    """A git + DVC repo with two commits (runs tagged alpha, then omega); the first sha in out/first."""
    repo = out / "repo"
    repo.mkdir()
    (repo / "make_plots.py").write_text(STAGE)
    stage = {
        "cmd": "python make_plots.py",
        "deps": ["make_plots.py"],
        "params": ["run"],
        "outs": [{o: {"cache": False}} for o in OUTS],
        "metrics": [{m: {"cache": False}} for m in ("data/evaluate/metrics.json", "data/label/metrics.json")],
    }
    plots = yaml.safe_load((ROOT / "dvc.yaml").read_text())["plots"]  # the pipeline's own plot definitions
    (repo / "dvc.yaml").write_text(yaml.safe_dump({"stages": {"plots": stage}, "plots": plots}, sort_keys=False))
    (repo / "params.yaml").write_text(yaml.safe_dump({"run": {"tag": "alpha", "shift": 0}}))
    for d in ("data/evaluate", "data/label"):
        (repo / d).mkdir(parents=True)
    run(["git", "init", "-q"], repo)
    run([str(BIN / "dvc"), "init", "-q"], repo)
    (repo / ".dvc/plots").mkdir()
    shutil.copy(ROOT / ".dvc/plots/histogram.json", repo / ".dvc/plots/histogram.json")
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@t"]
    run([str(BIN / "dvc"), "repro", "-q"], repo)
    run(["git", "add", "-A"], repo)
    run([*git, "commit", "-qm", "run 1"], repo)
    (out / "first").write_text(run(["git", "rev-parse", "HEAD"], repo).stdout.strip())
    (repo / "params.yaml").write_text(yaml.safe_dump({"run": {"tag": "omega", "shift": 1}}))
    run([str(BIN / "dvc"), "repro", "-q"], repo)
    run(["git", "add", "-A"], repo)
    run([*git, "commit", "-qm", "run 2"], repo)


@pytest.fixture(scope="session")
def two_runs(request) -> Path:
    """_two_runs' repository, built once per tree (conftest.built) and shared: read only."""
    key = digest(*CODE, ROOT / "dvc.yaml", ROOT / ".dvc/plots/histogram.json", STAGE, OUTS, inspect.getsource(_two_runs))
    return built(request, "report-two-runs", key, _two_runs)


@pytest.fixture
def plots_project(two_runs: Path, tmp_path: Path) -> tuple[Path, str]:
    """A copy of the two-run repository, whole: DVC finds nothing stale in it. Returns it and the first sha."""
    repo = copy_repo(two_runs / "repo", tmp_path)
    assert json.loads(run([str(BIN / "dvc"), "status", "--json"], repo).stdout) == {}
    return repo, (two_runs / "first").read_text()


def revs_drawn(page: str) -> set[str]:
    """The revisions named in the data of the drawn marks (Vega's aria labels carry them)."""
    return set(re.findall(r"rev: ([^;\"]+)[;\"]", page)) - {"undefined"}


def check_static(page: str, n_plots: int) -> None:
    assert page.count("<svg") == n_plots == page.count("</figure>")
    assert "<script" not in page.lower()
    assert not re.search(r"<link|<img|<iframe|src=|@import|url\(http", page, re.I)  # nothing fetched
    ids = re.findall(r'\bid="([^"]+)"', page)
    assert len(ids) == len(set(ids)), "element ids repeat across the inline SVGs"


@pytest.mark.system
def test_report_of_the_workspace_one_revision_and_two(plots_project, tmp_path):
    repo, first = plots_project
    head_files = {p: (repo / p).read_bytes() for p in ("params.yaml", "data/evaluate/metrics.json", "data/train/loss/omega_method.json")}

    ws = write_report(None, tmp_path / "ws.html", repo=repo)
    page = ws.read_text()
    # bootstrap loss, the reward histograms (one plot, two panels), 2 weight histograms, 1 loss curve, success
    check_static(page, 6)
    assert "omega_method" in page and "omega_policy" in page and "alpha" not in page
    assert revs_drawn(page) == {"workspace"}
    assert "Labelled reward, logged vs logged + hindsight" in page and "reward_with_hindsight.json" in page
    assert "held-out success: omega_policy" in page and "0.150 ± 0.010 (n = 40)" in page

    one = write_report([first], tmp_path / "one.html", repo=repo).read_text()
    check_static(one, 6)
    assert "alpha_method" in one and "alpha_policy" in one and "omega" not in one  # that run's data only
    assert revs_drawn(one) == {first}
    assert "0.050 ± 0.010" in one and "0.150" not in one
    assert "run 1" in one and first[:7] in one

    both = write_report([first, "HEAD"], tmp_path / "both.html", repo=repo).read_text()
    # The same plots overlaid, except the loss curves, whose files are named per run: one each.
    check_static(both, 7)
    assert revs_drawn(both) == {first, "HEAD"}
    assert "alpha_policy" in both and "omega_policy" in both
    header = both.split("<table>")[0]
    assert "run 1" in header and "run 2" in header
    # As many plots as `dvc plots diff --json` gives for the same revisions.
    diff = json.loads(run([str(BIN / "dvc"), "plots", "diff", first, "HEAD", "--json"], repo).stdout)
    assert len([k for k, v in diff["data"].items() if v]) == 7

    # Reading the past revision checked nothing out.
    assert run(["git", "status", "--porcelain"], repo).stdout == ""
    assert {p: (repo / p).read_bytes() for p in head_files} == head_files

    shutil.copy(ROOT / ARM_SEED_TEMPLATE, repo / ARM_SEED_TEMPLATE)
    with_repro = write_report(None, tmp_path / "repro.html", repo=repo, repro=repro_results(tmp_path / "results")).read_text()
    check_static(with_repro, 7)
    assert "Success by arm and seed" in with_repro and "(seeds 0, 1)" in with_repro and "0.275 ± 0.025" in with_repro

    with pytest.raises(ValueError, match="unknown revision 'no-such-rev'"):
        write_report(["no-such-rev"], tmp_path / "bad.html", repo=repo)

    if not CHROMIUM.exists():
        pytest.skip(f"{CHROMIUM} is not installed: the reports were checked as HTML, not drawn by a browser")
    for name, colours in (("ws", REV_COLOURS[:1]), ("both", REV_COLOURS)):
        png = screenshot(tmp_path / f"{name}.html", tmp_path)
        check_png(png, colours)


def repro_results(out: Path) -> Path:
    """A reproduction's --results directory by hand: two arms, two seeds, held-out only."""
    by_seed = {"bootstrap": [0.25, 0.30], "refit": [0.20, 0.40]}
    table = {"seeds": [0, 1], "splits": ["heldout"], "policies": {
        arm: {"heldout": {"success_rate": {"mean": sum(v) / 2, "se": abs(v[0] - v[1]) / 2, "by_seed": v}}} for arm, v in by_seed.items()}}
    # a judge's score as the return (the QA teacher's), and refit measured against the base
    table["policies"]["refit"]["heldout"]["mean_return"] = {"mean": 0.55, "se": 0.05, "by_seed": [0.5, 0.6]}
    table["paired"] = {"refit": {"against": "bootstrap", "heldout": {"success": {"diff": 0.025, "ci95": [-0.1, 0.15]}}}}
    points = [{"arm": arm, "seed": seed, "split": "heldout", "success_rate": rate}
              for arm, v in by_seed.items() for seed, rate in zip((0, 1), v)]
    out.mkdir()
    (out / "table.json").write_text(json.dumps(table))
    (out / "success.json").write_text(json.dumps(points))
    return out


def test_a_reproductions_results_give_its_plot_and_its_table(tmp_path):
    results = repro_results(tmp_path / "results")
    spec, seeds, rows = read_repro(results, ROOT / ARM_SEED_TEMPLATE)
    assert seeds == [0, 1]
    assert rows == [("bootstrap", "0.275 ± 0.025", [0.25, 0.30], "–", "–"),
                    ("refit", "0.300 ± 0.100", [0.20, 0.40], "0.550 ± 0.050", "bootstrap: +0.025 [-0.100, +0.150]")]
    assert [(p["arm"], p["seed"]) for p in spec["data"]["values"]] == [("bootstrap", 0), ("bootstrap", 1), ("refit", 0), ("refit", 1)]
    page = _page(tmp_path, ["workspace"], {}, [("Success by arm and seed", ["seeds 0, 1"], spec)], {"workspace": {}}, [], results, rows)
    check_static(page, 1)
    assert "<h2>Reproduction: " in page and "0.300 ± 0.100" in page and "0.200 0.400" in page
    assert "0.550 ± 0.050" in page and "bootstrap: +0.025 [-0.100, +0.150]" in page

    (results / "success.json").unlink()
    with pytest.raises(ValueError, match=r"success\.json not found: --repro takes the directory bench/hindsight_repro\.py --results wrote"):
        read_repro(results, ROOT / ARM_SEED_TEMPLATE)
    with pytest.raises(ValueError, match="no plot template"):
        read_repro(repro_results(tmp_path / "again"), tmp_path / "nothing.json")


def test_default_report_paths():
    assert default_report_path(None) == Path("reports/workspace.html")
    assert default_report_path(["HEAD~1"]) == Path("reports/HEAD_1.html")
    assert default_report_path(["v1", "exp/feature"]) == Path("reports/v1_vs_exp_feature.html")


# -- drawing it in a browser -----------------------------------------------------------------------

def screenshot(page: Path, tmp: Path) -> Path:
    png = page.with_suffix(".png")
    cmd = [
        str(CHROMIUM), "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
        "--disable-background-networking", "--disable-component-update", "--disable-sync",
        f"--user-data-dir={tmp / 'chromium-profile'}", f"--screenshot={png}", "--window-size=1200,2400",
        page.resolve().as_uri(),
    ]
    run(cmd, tmp, timeout=120)
    assert png.exists(), "chromium wrote no screenshot"
    return png


def check_png(png: Path, colours: list[tuple[int, int, int]]) -> None:
    """Not a blank page: the screenshot has many colours, and bars in each revision's colour."""
    from PIL import Image

    data = png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 20_000
    im = Image.open(png).convert("RGB")
    assert im.size == (1200, 2400)
    counts = im.getcolors(maxcolors=im.width * im.height)  # [(pixels, colour)]
    assert len(counts) > 200
    for c in colours:
        near = sum(n for n, p in counts if math.dist(p, c) < 12)
        assert near > 2000, f"few pixels in {c}: the plots were not drawn"
