"""bench/hindsight_repro.py at a tiny size: two seeds through every stage with a preset laid over
params.yaml; the table it prints, the paired differences and the plot it writes agree with the
per-seed evaluations on disk."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import polars as pl
import pytest
import yaml
from conftest import TINY

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

import hindsight_repro  # noqa: E402
from tasks.params import lay_preset  # noqa: E402


def test_paired_difference_and_its_interval_on_hand_made_episodes():
    # 4 shared episodes: the hindsight arm wins 3, the logged arm 1 (on the first); one episode only one arm played.
    a = {("val", "x", 1): (1.0, -3.0), ("val", "y", 1): (1.0, -4.0), ("test", "z", 1): (1.0, -5.0), ("test", "w", 1): (0.0, -20.0), ("val", "only", 1): (1.0, 0.0)}
    b = {("val", "x", 1): (1.0, -6.0), ("val", "y", 1): (0.0, -20.0), ("test", "z", 1): (0.0, -20.0), ("test", "w", 1): (0.0, -20.0)}
    p = hindsight_repro.paired(a, b)
    assert p["episodes"] == 4
    d = [0.0, 1.0, 1.0, 0.0]  # success differences, in key order
    m = sum(d) / 4
    se = (sum((x - m) ** 2 for x in d) / 3 / 4) ** 0.5
    assert p["success"]["diff"] == 0.5 and p["success"]["se"] == pytest.approx(se, abs=1e-4)
    assert p["success"]["ci95"] == pytest.approx([m - 1.96 * se, m + 1.96 * se], abs=1e-4)
    assert p["return"]["diff"] == pytest.approx((3 + 16 + 15 + 0) / 4)


def test_each_hindsight_arm_is_paired_with_its_logged_only_arm():
    methods = {"refit_logged": {"algorithm": "refit", "data": "logged"}, "refit": {"algorithm": "refit"},
               "swift": {"algorithm": "swift"}, "bc_logged": {"algorithm": "filtered_bc", "data": "logged"}, "bc": {"algorithm": "filtered_bc"}}
    assert {m: hindsight_repro.logged_arm(m, methods) for m in methods} == {
        "refit_logged": None, "refit": "refit_logged", "swift": "refit_logged", "bc_logged": None, "bc": "bc_logged"}


def test_a_presets_arms_replace_the_params_arms_and_other_keys_merge():
    raw = {"collect": {"m": 3, "batch_size": 512}, "train": {"epochs": 2, "methods": {"a": {"algorithm": "sft"}}}}
    lay_preset(raw, {"collect": {"m": 14}, "train": {"methods": {"b": {"algorithm": "refit"}}}})
    assert raw == {"collect": {"m": 14, "batch_size": 512}, "train": {"epochs": 2, "methods": {"b": {"algorithm": "refit"}}}}


def test_the_reproduction_preset_is_valid_params():
    """The preset the README's command uses validates as params once laid over params.yaml."""
    from tasks.params import Params

    raw = yaml.safe_load((ROOT / "params.yaml").read_text())
    lay_preset(raw, yaml.safe_load((ROOT / "bench/presets/hope_20q.yaml").read_text()))
    p = Params.model_validate(raw)
    assert p.env.environment().options.observation == "known" and p.bootstrap.demo_splits == ["train"]


def test_the_stepagent_preset_is_rft_and_eto_from_the_shipped_base_played_greedily():
    from tasks.params import Params

    raw = yaml.safe_load((ROOT / "params.yaml").read_text())
    lay_preset(raw, yaml.safe_load((ROOT / "bench/presets/stepagent_20q.yaml").read_text()))
    p = Params.model_validate(raw)
    assert {m.algorithm for m in p.train.methods.values()} == {"rft", "eto"} and p.evaluate.sampling.temperature == 0
    assert p.bootstrap.checkpoint == "auto" and p.evaluate.episodes_per_task == 1


def test_the_nlac_preset_is_nlac_against_its_baselines_from_the_shipped_base_at_equal_steps():
    from tasks.params import Params

    raw = yaml.safe_load((ROOT / "params.yaml").read_text())
    lay_preset(raw, yaml.safe_load((ROOT / "bench/presets/nlac_20q.yaml").read_text()))
    hindsight_repro.equal_steps(raw)
    p = Params.model_validate(raw)
    assert hindsight_repro.nlac_arms(p) == {"nlac": "nlac", "rft": "rft", "grpo": "grpo", "ppo": "ppo"}
    assert p.bootstrap.checkpoint == "auto" and len(p.nlac_iterations) == 2
    steps = {name: m.gradient_steps if m.algorithm == "rft" else getattr(m, m.algorithm).gradient_steps for name, m in p.train.methods.items()}
    assert steps == {"rft": p.nlac.steps, "grpo": p.nlac.steps, "ppo": p.nlac.steps}
    assert p.nlac.model_copy(update={"algorithm": "grpo"}).episodes_per_task() == 4 and p.nlac.episodes_per_task() == 1
    assert p.train.learning_rate == p.nlac.learning_rate and p.nlac.update == "separate"
    assert p.evaluate.sampling.temperature == 0 and p.evaluate.episodes_per_task == 1 and p.evaluate.splits == ["val", "test"]
    # a baseline held to another step count is refused, not evened out
    raw["train"]["methods"]["grpo"]["grpo"]["gradient_steps"] = p.nlac.steps + 1
    with pytest.raises(SystemExit, match="train.methods.grpo takes 17 gradient steps, nlac.steps 16"):
        hindsight_repro.equal_steps(raw)


def test_a_preset_naming_another_environment_starts_from_its_defaults():
    raw = {"env": {"name": "twenty_questions", "max_turns": 20, "show_candidates": False}, "seed": 0}
    lay_preset(raw, {"env": {"name": "persuasion", "max_turns": 6}})
    assert raw == {"env": {"name": "persuasion", "max_turns": 6}, "seed": 0}
    same = {"env": {"name": "twenty_questions", "max_turns": 20, "show_candidates": False}}
    lay_preset(same, {"env": {"observation": "known"}})
    assert same == {"env": {"name": "twenty_questions", "max_turns": 20, "show_candidates": False, "observation": "known"}}


def test_the_persuasion_preset_is_hrs_arms_on_learned_forward_models():
    from tasks.params import Params

    raw = yaml.safe_load((ROOT / "params.yaml").read_text())
    lay_preset(raw, yaml.safe_load((ROOT / "bench/presets/hr_persuasion.yaml").read_text()))
    p = Params.model_validate(raw)
    assert (p.env.name, p.relabel.mode, p.roles.forward.backend) == ("persuasion", "hr", "learned")
    methods = {name: m.model_dump() for name, m in p.train.methods.items()}
    assert {m: hindsight_repro.logged_arm(m, methods) for m in methods} == {
        "ilql_logged": None, "ilql": "ilql_logged", "filtered_bc_logged": None, "filtered_bc": "filtered_bc_logged"}
    assert len(p.evaluate.splits) * 40 * p.evaluate.episodes_per_task == 400  # HR's 400 simulated interactions a method


def test_the_car_dealer_preset_trains_on_whole_sales():
    """bench/presets/car_dealer.yaml validates as params, on CarDealer, at a length past its dialogues."""
    from tasks.params import Params

    raw = yaml.safe_load((ROOT / "params.yaml").read_text())
    lay_preset(raw, yaml.safe_load((ROOT / "bench/presets/car_dealer.yaml").read_text()))
    p = Params.model_validate(raw)
    assert p.env.name == "car_dealer" and p.bootstrap.model.max_length > 2200
    assert "max_turns" not in raw["env"]  # TwentyQuestions' env keys dropped, as -S env.name=car_dealer does


def test_a_saved_seed_reads_back_whole_and_refuses_other_params(tmp_path):
    raw = yaml.safe_load((ROOT / "params.yaml").read_text())
    raw["seed"] = 2
    metrics = {"splits": ["val"], "policies": {"bootstrap": {"policy_id": "p0", "val": {"success_rate": 0.5}}}}
    episodes = {"bootstrap": {("val", "t1", 7): (1.0, 0.5), ("val", "t2", 8): (0.0, 0.0)}}
    base = {**raw, "seed": 0}
    assert hindsight_repro.load_seed(tmp_path, 2, raw, base) is None  # nothing saved yet: the seed runs
    hindsight_repro.save_seed(tmp_path, 2, raw, base, metrics, episodes)
    assert hindsight_repro.load_seed(tmp_path, 2, raw, base) == (metrics, episodes)
    other = {**raw, "collect": {**raw["collect"], "m": raw["collect"]["m"] + 1}}
    for params, base_params in ((other, base), (raw, None), (raw, {**base, "seed": 1})):  # other params, no shared base, another base
        with pytest.raises(SystemExit, match=r"seeds/seed2\.json holds seed 2 run with other params or another base"):
            hindsight_repro.load_seed(tmp_path, 2, params, base_params)


def episode_diffs(dirs: list[Path], name: str, base: str, column: str) -> list[float]:
    """`column` of policy `name` minus `base`'s, over the evaluation episodes both played, read
    from each seed's episodes on disk (not through the bench's code)."""
    diffs = []
    for d in dirs:
        ids = {n: p["policy_id"] for n, p in json.loads((d / "evaluate/metrics.json").read_text())["policies"].items()}
        eps = pl.read_parquet(d / "evaluate/episodes.parquet").unique(["policy_id", "split", "task_id", "seed"])
        a = eps.filter(pl.col("policy_id") == ids[name]).select("split", "task_id", "seed", a=column)
        b = eps.filter(pl.col("policy_id") == ids[base]).select("split", "task_id", "seed", b=column)
        joined = a.join(b, on=["split", "task_id", "seed"])
        diffs += (joined["a"].cast(float) - joined["b"].cast(float)).to_list()
    return diffs


@pytest.mark.system

def test_repro_bench_small(tmp_path):
    preset = {**TINY, "collect": {**TINY["collect"], "splits": ["train"]},
              "train": {"epochs": 1, "batch_size": 4, "methods": {
                  "refit_logged": {"algorithm": "refit", "data": "logged"}, "refit": {"algorithm": "refit", "alpha": 0.4},
                  "swift": {"algorithm": "swift", "alpha": 0.4}, "filtered_bc_logged": {"algorithm": "filtered_bc", "data": "logged"},
                  "filtered_bc": {"algorithm": "filtered_bc", "alpha": 0.4}}}}
    (tmp_path / "preset.yaml").write_text(yaml.safe_dump(preset, sort_keys=False))
    out, results = tmp_path / "runs", tmp_path / "results"
    cmd = [sys.executable, str(ROOT / "bench/hindsight_repro.py"), "--preset", str(tmp_path / "preset.yaml"),
           "--seeds", "0", "1", "--out", str(out), "--results", str(results), "--set", "cache.path=" + str(tmp_path / "cache.sqlite")]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=1500)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-4000:]
    table = json.loads((results / "table.json").read_text())
    assert table["seeds"] == [0, 1] and table["splits"] == ["val", "test", "heldout"]
    assert list(table["policies"]) == ["bootstrap", "refit_logged", "refit", "swift", "filtered_bc_logged", "filtered_bc", "actor", "actor_prm",
                                      "bootstrap+best_of_4", "bootstrap+best_of_4[prm]"]
    for seed, d in ((0, out / "seed0"), (1, out / "seed1")):
        metrics = json.loads((d / "evaluate/metrics.json").read_text())
        for name, row in table["policies"].items():
            assert row["heldout"]["success_rate"]["by_seed"][seed] == metrics["policies"][name]["heldout"]["success_rate"]
        prm = json.loads((d / "buffer_prm/metrics.json").read_text())
        assert prm["trajectories"]["hindsight"] == 0 < json.loads((d / "buffer/metrics.json").read_text())["trajectories"]["hindsight"]
        used = yaml.safe_load((d / "params.yaml").read_text())
        assert used["collect"]["m"] == TINY["collect"]["m"] and used["train"]["methods"]["refit"]["alpha"] == 0.4
    # Paired differences, recomputed from the episodes: the hindsight arm minus its logged-only arm.
    assert {n: p["against"] for n, p in table["paired"].items()} == {
        "refit": "refit_logged", "swift": "refit_logged", "filtered_bc": "filtered_bc_logged",
        "actor": "actor_prm", "bootstrap+best_of_4": "bootstrap+best_of_4[prm]",  # HOPE against PRM+RL
    }
    diffs = episode_diffs([out / "seed0", out / "seed1"], "refit", "refit_logged", "success")
    p = table["paired"]["refit"]["heldout"]
    assert p["episodes"] == len(diffs) > 0
    assert p["success"]["diff"] == pytest.approx(sum(diffs) / len(diffs), abs=1e-4)
    assert p["success"]["ci95"][0] <= p["success"]["diff"] <= p["success"]["ci95"][1]
    assert "refit - refit_logged" in proc.stdout and "Each arm minus the one it is measured against" in proc.stdout
    # every policy against the base, over the same episodes
    assert set(table["versus_base"]) == set(table["policies"]) - {"bootstrap"}
    base_diffs = episode_diffs([out / "seed0", out / "seed1"], "actor", "bootstrap", "return")
    assert table["versus_base"]["actor"]["heldout"]["return"]["diff"] == pytest.approx(sum(base_diffs) / len(base_diffs), abs=1e-4)
    assert "actor - bootstrap (n = " in proc.stdout
    points = json.loads((results / "success.json").read_text())
    assert len(points) == 10 * 3 * 2 and (results / "success.svg").read_text().startswith("<svg")  # six arms, two actors, best-of-N with two critics
    # A stopped seed resumes after its last finished stage, and only with the params it ran with.
    shutil.rmtree(out / "seed1/evaluate")
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=1500)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-4000:]
    assert "[seed 1] train finished earlier, kept" in proc.stdout and "[seed 1] evaluate done in" in proc.stdout
    assert "[seed 0]" not in proc.stdout  # its evaluation is on disk
    assert json.loads((results / "table.json").read_text())["policies"] == table["policies"]  # deterministic rerun
    proc = subprocess.run([*cmd, "--set", "train.epochs=2"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0 and "holds a run with other params" in proc.stderr
    # a seed kept in --results adds to the table without its run directory, and is not rerun
    shutil.rmtree(out / "seed1")
    again = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-4000:]
    assert f"[seed 1] read back from {results}/seeds/seed1.json" in again.stdout and not (out / "seed1").exists()
    assert json.loads((results / "table.json").read_text()) == table  # the resumed seed 1's evaluation, kept


@pytest.mark.system
def test_stepagent_bench_small(tmp_path):
    """--stepagent: expert, practice, Implicit and Inverse beside RFT and ETO, one seed; StepAgent's
    variants are paired against ETO, every arm against the base, and no hindsight stage runs."""
    preset = {**TINY, "collect": {**TINY["collect"], "splits": ["train"]}, "practice": {"prefixes": 8},
              "stepagent": {"batch_size": 4},
              "train": {"epochs": 1, "batch_size": 4, "methods": {"rft": {"algorithm": "rft"}, "eto": {"algorithm": "eto"}}}}
    (tmp_path / "preset.yaml").write_text(yaml.safe_dump(preset, sort_keys=False))
    out, results = tmp_path / "runs", tmp_path / "results"
    cmd = [sys.executable, str(ROOT / "bench/hindsight_repro.py"), "--stepagent", "--preset", str(tmp_path / "preset.yaml"),
           "--seeds", "0", "--out", str(out), "--results", str(results), "--set", "cache.path=" + str(tmp_path / "cache.sqlite")]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=1500)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-4000:]
    table = json.loads((results / "table.json").read_text())
    assert list(table["policies"]) == ["bootstrap", "rft", "eto", "stepagent", "stepagent_inverse"]
    assert {n: p["against"] for n, p in table["paired"].items()} == {"stepagent": "eto", "stepagent_inverse": "eto"}
    d = out / "seed0"
    assert not [s for s in hindsight_repro.HINDSIGHT + hindsight_repro.ACTOR_CRITIC if (d / s).exists()]
    assert json.loads((d / "stepagent_inverse/metrics.json").read_text())["variant"] == "inverse"
    assert json.loads((d / "stepagent/metrics.json").read_text())["variant"] == "implicit"
    assert set(json.loads((d / "train/metrics.json").read_text())["methods"]) == {"rft", "eto"}
    diffs = episode_diffs([d], "stepagent_inverse", "eto", "return")
    assert table["paired"]["stepagent_inverse"]["heldout"]["return"]["diff"] == pytest.approx(sum(diffs) / len(diffs), abs=1e-4)


@pytest.mark.system
def test_qa_bench_small(tmp_path):
    """--qa: Refit/Swift's miniature on the QA teacher, one seed, three questions a split: every
    arm trains (StepDPO rolling its branches out in train), each is paired against the next in the
    paper's order, evaluate's success is exact match and its return the judge's score, and no
    hindsight, actor-critic or StepAgent stage runs."""
    overrides = ["limit_tasks=3", "cache.path=" + str(tmp_path / "cache.sqlite"), "bootstrap.model.hidden_size=64",
                 "bootstrap.model.num_layers=1", "bootstrap.model.num_heads=1", "bootstrap.model.intermediate_size=128",
                 "bootstrap.tokenizer.vocab_size=600", "train.epochs=1", "train.batch_size=4"]
    out, results = tmp_path / "runs", tmp_path / "results"
    cmd = [sys.executable, str(ROOT / "bench/hindsight_repro.py"), "--qa", "--preset", str(ROOT / "bench/presets/refit_swift_qa.yaml"),
           "--seeds", "0", "--out", str(out), "--results", str(results), *[a for o in overrides for a in ("--set", o)]]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=1500)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-4000:]
    table = json.loads((results / "table.json").read_text())
    assert list(table["policies"]) == ["bootstrap", "refit", "swift", "star_gate", "star_gate_d", "dpo", "step_dpo"]
    assert {n: p["against"] for n, p in table["paired"].items()} == hindsight_repro.QA_AGAINST
    d = out / "seed0"
    assert not [s for s in hindsight_repro.HINDSIGHT + hindsight_repro.ACTOR_CRITIC + hindsight_repro.STEPAGENT if (d / s).exists()]
    trained = json.loads((d / "train/metrics.json").read_text())["methods"]
    assert trained["step_dpo"]["branches"] == 3 * 3 * 3  # every step of the 9 logged dialogues branched once
    assert trained["star_gate"]["questions"] == trained["star_gate_d"]["questions"] == 3
    episodes = pl.read_parquet(d / "evaluate/episodes.parquet")
    assert set(episodes["split"]) == {"test"} and set(episodes["num_turns"]) == {3}
    judged = pl.read_parquet(d / "label/labels.parquet")  # the judge's Overall / 10 beside exact match
    assert judged["scores"].null_count() == 0 and (judged["reward"] == judged["env_reward"]).all()


@pytest.mark.system
def test_nlac_bench_small(tmp_path):
    """--nlac on the real preset at a small size: from the shipped base, each arm's two iterations
    on 2 train tasks at 2 steps, every arm against GRPO, the iterations' metrics in the table, and a
    rerun that keeps every finished iteration."""
    preset = yaml.safe_load((ROOT / "bench/presets/nlac_20q.yaml").read_text())
    preset["nlac"].update({"limit_tasks": 2, "group": 2, "steps": 2, "batch_size": 4, "critic_eval": 4})
    preset.update({"runtime": {"processes": 1}, "evaluate": {**preset["evaluate"], "limit_tasks": 1}})
    preset["train"]["batch_size"] = 2
    (tmp_path / "preset.yaml").write_text(yaml.safe_dump(preset, sort_keys=False))
    out, results = tmp_path / "runs", tmp_path / "results"
    cmd = [sys.executable, str(ROOT / "bench/hindsight_repro.py"), "--nlac", "--preset", str(tmp_path / "preset.yaml"),
           "--seeds", "0", "--out", str(out), "--results", str(results), "--set", "cache.path=" + str(tmp_path / "cache.sqlite")]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=3000)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-4000:]
    print(proc.stdout)
    table = json.loads((results / "table.json").read_text())
    assert list(table["policies"]) == ["bootstrap", "rft", "grpo", "ppo", "nlac"]
    assert {n: p["against"] for n, p in table["paired"].items()} == {"rft": "grpo", "ppo": "grpo", "nlac": "grpo"}
    d = out / "seed0"
    assert not [s for s in (*hindsight_repro.HINDSIGHT, *hindsight_repro.ACTOR_CRITIC, "collect", "train") if (d / s).exists()]
    assert (d / "bootstrap/model/model.safetensors").read_bytes() == (ROOT / "models/base/twenty_questions/model/model.safetensors").read_bytes()
    for arm, algorithm in (("nlac", "nlac"), ("rft", "rft"), ("grpo", "grpo"), ("ppo", "ppo")):
        first, second = (json.loads((d / arm / f"iteration{k}/nlac/metrics.json").read_text()) for k in (1, 2))
        assert first["algorithm"] == second["algorithm"] == algorithm
        assert second["policy"] == str(d / arm / "iteration1/nlac/model")  # each arm collects with its own last policy
        games = 2 * (2 if arm == "grpo" else 1)  # GRPO: its group of 2 a task, the others one
        assert first["collect"]["train"]["episodes"] == games
    # every arm at the same steps: NLAC's 2, each baseline held to 2 (none where its games give no signal)
    training = table["training"]["0"]
    assert [it["steps"] for it in training["nlac"]] == [2, 2]
    assert {it["steps"] for arm in ("rft", "grpo", "ppo") for it in training[arm]} <= {0, 2}
    used = yaml.safe_load((d / "params.yaml").read_text())["train"]["methods"]
    assert (used["rft"]["gradient_steps"], used["grpo"]["grpo"]["gradient_steps"], used["ppo"]["ppo_returns"]["gradient_steps"]) == (2, 2, 2)
    nlac2 = json.loads((d / "nlac/iteration2/nlac/metrics.json").read_text())
    assert nlac2["buffer"]["from_earlier_iterations"] > 0 and nlac2["critic_accuracy"]["transitions"] <= 4
    assert training["nlac"][1]["critic_accuracy"] == nlac2["critic_accuracy"]
    diffs = episode_diffs([d], "nlac", "grpo", "return")
    assert table["paired"]["nlac"]["heldout"]["return"]["diff"] == pytest.approx(sum(diffs) / len(diffs), abs=1e-4)
    assert "[seed 0] nlac/iteration1 done in" in proc.stdout and "nlac - grpo (n = " in proc.stdout and "seed 0 nlac: it1: 2 steps" in proc.stdout
    # a stopped seed resumes: every finished iteration kept, evaluate played again to the same table
    shutil.rmtree(d / "evaluate")
    again = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=1500)
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-4000:]
    assert all(f"[seed 0] {arm}/iteration{k} finished earlier, kept" in again.stdout for arm in ("nlac", "rft", "grpo", "ppo") for k in (1, 2))
    assert "[seed 0] evaluate done in" in again.stdout and json.loads((results / "table.json").read_text()) == table
