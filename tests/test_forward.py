"""HR's learned forward model (tasks/forward.py) and its use in regenerate (roles.forward:
{backend: learned}): the logged rest as a training target read back by the forward parser, the
hard model's mixing rate, the splice left untouched, unfinished continuations dropped and
counted, and the stage on persuasion with a tiny model."""
from __future__ import annotations

import json
from collections import Counter

import pytest

import tasks.regenerate as regenerate
from conftest import tiny_params
from envs import registry
from models.base import Completion
from storage.parquet import read_table, write_table
from storage.schema import from_table, to_table
from storage.validate import read_checked
from tasks.forward import cuts, example, hard_dialogues, run_forward
from tasks.params import Params
from tasks.regenerate import forward_models, run_regenerate, uses_hard_model
from tasks.rollout import ScriptedAgent, episode_from_prefix, new_episode, play

NOISE = {"p_random": 0.15, "p_repeat": 0.10, "p_early_guess": 0.10}
FINISHED = "AI: Would you give just $1 today?\nH: Fine, I'll give $1.\nDecision: donate $1"
UNFINISHED = "AI: Thanks for listening.\nH: Sure."  # no decision: the parser's unfinished


@pytest.fixture(scope="module")
def env():
    if "persuasion" not in registry.available():
        pytest.skip("the persuasion entry point is not installed (pip install -e .)")
    return registry.make("persuasion", {"max_turns": 6})


def dialogues(env, n: int, policies=("expert", "noisy", "pushy", "random")) -> list[dict]:
    """n scripted train dialogues, one policy each in turn, so returns differ."""
    eps = [new_episode(env, t, k) for k, t in enumerate(env.tasks("train")[:n])]
    for k, ep in enumerate(eps):
        name = policies[k % len(policies)]
        play([ep], ScriptedAgent(lambda rng, n=name: env.policies(NOISE)[n]), k, "test")
    return [ep.to_row() for ep in eps]


def persuasion_params(tmp_path, forward_role: dict | None = None, **stages) -> Params:
    raw = tiny_params({"relabel": {"mode": "hr"}, **stages})
    raw["env"] = {"name": "persuasion", "max_turns": 6}
    if forward_role:
        raw["roles"]["forward"] = forward_role
    return Params.model_validate(raw)


# ---- the training target ----

def test_the_logged_rest_is_a_reply_the_forward_parser_reads_back(env):
    row = next(r for r in dialogues(env, 8) if r["num_turns"] >= 3)
    for k in range(1, row["num_turns"]):
        chat, why = example(env, row, k)
        assert why is None, why
        assert chat[-1]["role"] == "assistant" and chat[-1]["content"].startswith("AI: ")
        assert chat[-1]["content"].count("AI: ") == row["num_turns"] - k and "Decision:" in chat[-1]["content"]
        assert "Continue it from the worker's message number" in chat[-2]["content"]
    assert cuts(row, None, 0) == list(range(1, row["num_turns"]))
    assert len(cuts(row, 1, 0)) == 1 and cuts(row, 1, 0) == cuts(row, 1, 0)


@pytest.mark.parametrize("name", ["twenty_questions", "guess_my_city", "car_dealer", "persuasion"])
def test_every_environments_logged_rest_round_trips_through_its_forward_parser(name):
    # The training target is right only if the parser reads it back as exactly the logged turns:
    # the same actions, what the other side said, the rewards, and the game ending at the last.
    if name not in registry.available():
        pytest.skip(f"the {name} entry point is not installed (pip install -e .)")
    env = registry.make(name, {})
    tasks = env.tasks("train")[:: max(1, len(env.tasks("train")) // 6)][:6]
    checked, refused = 0, Counter()
    for policy in ("expert", "noisy", "random"):
        eps = [new_episode(env, t, k) for k, t in enumerate(tasks)]
        play(eps, ScriptedAgent(lambda rng, n=policy: env.policies(NOISE)[n]), 0, "test")
        for row in (ep.to_row() for ep in eps):
            for k in range(1, row["num_turns"]):
                ep = episode_from_prefix(env, row, k, 0)
                try:  # a logged turn the format cannot write, or one the parser refuses (a lucky early guess): left out, and why
                    pairs = env.forward_request(ep.game).parse(env.forward_reply(ep.game, row["turns"][k:]))
                except ValueError as e:
                    assert policy != "expert", e
                    refused[str(e)[:60]] += 1
                    continue
                for text, answer in pairs:
                    ep.apply(text, answer)
                assert ep.game.done
                logged = [{k: t[k] for k in ("action", "observation", "reward")} for t in row["turns"][k:]]
                assert [{k: t[k] for k in ("action", "observation", "reward")} for t in ep.turns[k:]] == logged, (name, policy, k)
                checked += 1
    assert checked > 3 * sum(refused.values()), refused  # most logged rests are writable


def test_the_hard_model_learns_from_the_lowest_returns():
    rows = [{"trajectory_id": f"t{i}", "return": float(r)} for i, r in enumerate([2, 0, 1.5, 0, 0.5, 1, 1, 2])]
    hard = hard_dialogues(rows, 0.25, seed=0)
    assert sorted(r["return"] for r in hard) == [0.0, 0.0]
    assert len(hard_dialogues(rows[:2], 0.25, 0)) == 1  # at least one


# ---- the hard model's share ----

def test_the_hard_model_writes_its_share_of_continuations_by_a_seeded_hash():
    ids = [f"relabel-{i}" for i in range(4000)]
    for share in (0.0, 0.2, 0.5, 1.0):
        picked = [uses_hard_model(0, i, share) for i in ids]
        assert abs(sum(picked) / len(ids) - share) < 0.025
    assert [uses_hard_model(0, i, 0.2) for i in ids] == [uses_hard_model(0, i, 0.2) for i in ids]  # the same every run
    assert [uses_hard_model(0, i, 0.2) for i in ids] != [uses_hard_model(1, i, 0.2) for i in ids]  # the role's seed redraws
    # A larger share keeps every relabel a smaller one gave the hard model.
    assert all(uses_hard_model(0, i, 0.5) for i in ids if uses_hard_model(0, i, 0.2))


def test_forward_models_splits_a_hand_made_set_at_the_share(tmp_path):
    class Ep:
        def __init__(self, i):
            self.relabel_id = f"r{i}"

    role = {"backend": "learned", "model": "m", "hard_model": "h", "hard_share": 0.3}
    groups = forward_models(persuasion_params(tmp_path, role), [Ep(i) for i in range(1000)])
    assert len(groups["hard_model"]) + len(groups["model"]) == 1000 and abs(len(groups["hard_model"]) - 300) < 40
    policy = forward_models(persuasion_params(tmp_path), [Ep(i) for i in range(10)])
    assert len(policy["model"]) == 10 and not policy["hard_model"]


# ---- regenerate with the learned models ----

class ByModel:
    """Stands in for the two trained models: each answers every request with its own text."""

    backend = "openai"

    def __init__(self, text: str, model_id: str):
        self.text, self.model_id, self.requests = text, model_id, 0

    def generate(self, convs, sampling, seeds):
        self.requests += len(convs)
        return [Completion(self.text) for _ in convs]


def test_learned_regeneration_keeps_the_prefix_and_drops_unfinished_continuations_with_their_reason(env, tmp_path, monkeypatch):
    rows = dialogues(env, 12)
    write_table(to_table(rows, "trajectories"), tmp_path / "trajectories.parquet", "trajectories")
    p = persuasion_params(tmp_path, {"backend": "learned", "model": "fwd/model", "hard_model": "fwd/hard_model", "hard_share": 0.5})
    from tasks.relabel import run_relabel
    from tasks.summarize import run_summarize

    run_summarize(p, tmp_path / "trajectories.parquet", tmp_path)
    run_relabel(p, tmp_path / "trajectories.parquet", tmp_path / "summaries.parquet", tmp_path / "relabel")
    relabels = [r for r in read_table(tmp_path / "relabel/relabels.parquet").to_pylist() if r["status"] == "ok"]
    assert len(relabels) >= 4
    # The normal model finishes every dialogue, the hard one never does.
    models = {"fwd/model": ByModel(FINISHED, "normal"), "fwd/hard_model": ByModel(UNFINISHED, "hard")}
    monkeypatch.setattr(regenerate, "make_generator", lambda role, cache, model=None, batch_size=None: models[str(model)])
    m = run_regenerate(p, tmp_path / "trajectories.parquet", tmp_path / "relabel/relabels.parquet", tmp_path / "no-policy", tmp_path / "regen")

    kept, quarantine = read_checked(tmp_path / "regen/trajectories.parquet", "trajectories")
    regens = from_table(kept)
    dropped, dq = read_checked(tmp_path / "regen/dropped.parquet", "dropped")
    dropped = dropped.to_pylist()
    assert quarantine.num_rows == dq.num_rows == 0
    # Rows in = rows out + dropped, never silent; every drop says why.
    assert m["relabels"] == len(relabels) == len(regens) + len(dropped) == m["regenerations"] + m["dropped_rows"]
    hard = {r["relabel_id"] for r in relabels if uses_hard_model(p.roles.forward.seed, r["relabel_id"], 0.5)}
    at_branch = m["ended_at_branch"]
    assert {d["relabel_id"] for d in dropped} <= hard and len(dropped) >= len(hard) - at_branch
    assert all(d["status"] == "unfinished" and d["forward_model"] == "hard_model" and "before the donor decides" in d["reason"] for d in dropped)
    assert all(d["text"] == UNFINISHED for d in dropped)
    assert m["dropped"] == ({"unfinished": len(dropped)} if dropped else {})
    assert m["forward_calls"]["models"]["hard_model"]["unfinished"] == models["fwd/hard_model"].requests
    assert m["forward_calls"]["failure_rate"] == 0.0  # unfinished is an answer, not a failure
    assert m["hard_share"]["wanted"] == 0.5
    # The splice: the parent's turns up to the branch as logged, the counterfactual in its place.
    parents, by_id = {r["trajectory_id"]: r for r in rows}, {r["relabel_id"]: r for r in relabels}
    assert regens
    for g in regens:
        parent, relabel = parents[g["parent_id"]], by_id[g["relabel_id"]]
        if g["relabel_id"] in hard:  # the donor decided on the counterfactual: nothing for the hard model to write
            assert g["num_turns"] == g["branch_turn"] + 1 and g["policy_id"] == "forward:hard"
            continue
        assert g["turns"][: g["branch_turn"]] == parent["turns"][: g["branch_turn"]]
        assert g["messages"][: 2 * g["branch_turn"] + 2] == parent["messages"][: 2 * g["branch_turn"] + 2]
        assert g["turns"][g["branch_turn"]]["action"] == relabel["counterfactual_action"]
        if g["num_turns"] > g["branch_turn"] + 1:  # the forward model's line after the counterfactual
            assert g["turns"][-1]["action"] == "Would you give just $1 today?" and g["return"] == 1.0
        assert g["policy_id"] == "forward:normal"


# ---- the stage on persuasion with a tiny model ----

@pytest.fixture(scope="module")
def persuasion_base(env, tmp_path_factory):
    """An untrained tiny model whose tokenizer has seen persuasion's words and whose positions
    hold its forward prompts."""
    import torch

    from models.tiny import make_model, train_tokenizer

    rows = dialogues(env, 8)
    corpus = env.tokenizer_corpus() + [m["content"] for c in (example(env, r, 1)[0] for r in rows if r["num_turns"] > 1) for m in c]
    tok = train_tokenizer(corpus, vocab_size=800)
    torch.manual_seed(0)
    out = tmp_path_factory.mktemp("persuasion-base") / "model"
    make_model(tok, 64, 1, 1, 64, 128, 2048).save_pretrained(out)
    tok.save_pretrained(out)
    return out


def test_the_forward_stage_trains_both_models_and_measures_their_fidelity_on_held_out_prefixes(env, tmp_path, persuasion_base):
    rows = dialogues(env, 24)
    write_table(to_table(rows, "trajectories"), tmp_path / "trajectories.parquet", "trajectories")
    role = {"backend": "learned", "model": str(tmp_path / "fwd/models/model"), "hard_model": str(tmp_path / "fwd/models/hard_model"), "hard_share": 0.25,
            "sampling": {"temperature": 1.0, "top_p": 1.0, "max_new_tokens": 48}, "parse_attempts": 1, "max_failure_rate": 1.0}
    p = persuasion_params(tmp_path, role, forward={"base_model": str(persuasion_base), "cuts_per_dialogue": 1, "epochs": 1, "hard_epochs": 1,
                                                   "heldout_share": 0.2, "batch_size": 4})
    m = run_forward(p, tmp_path / "trajectories.parquet", tmp_path / "fwd")
    d = m["dialogues"]
    assert d["logged_train"] == 24 and d["train"] + d["heldout"] == 24 and d["heldout"] > 0
    assert d["hard"] == round(0.25 * d["train"]) and d["hard_return_cutoff"] <= sorted(r["return"] for r in rows)[d["hard"] + d["heldout"]]
    # One cut per dialogue of two turns or more: each an example, or left out and counted.
    assert m["trained"] is True and "skipped" not in m
    assert m["models"]["model"]["examples"] + m["examples_refused"] + m["examples_too_long"] == d["train"] - m["dialogues_too_short"]
    assert m["models"]["model"]["examples"] > m["models"]["hard_model"]["examples"] > 0
    assert sorted(p.name for p in (tmp_path / "fwd/models").iterdir()) == ["hard_model", "model"]
    for name in ("model", "hard_model"):
        assert (tmp_path / "fwd/models" / name / "config.json").exists()
        f = m["fidelity"][name]
        # An untrained model finishes no dialogue: every prefix is counted, none is silently lost.
        assert 0 < f["prefixes"] == f["calls"]["requests"] <= d["heldout"]  # a one-turn dialogue has no prefix to complete
        assert f["completed"] + f["unfinished"] + f["calls"]["invalid"] + f["calls"]["failed"] == f["prefixes"]
        assert set(f["logged"]) >= {"prefixes"} and "unfinished" in f["replayed"]
    assert json.loads((tmp_path / "fwd/metrics.json").read_text())["fidelity"] == m["fidelity"]
    curve = json.loads((tmp_path / "fwd/loss.json").read_text())
    assert {c["model"] for c in curve} == {"model", "hard_model"}

    # regenerate serves the trained models as roles.forward: {backend: learned}, without an
    # environment simulator after the splice; whatever they write is kept or dropped with a reason.
    from tasks.relabel import run_relabel
    from tasks.summarize import run_summarize

    run_summarize(p, tmp_path / "trajectories.parquet", tmp_path)
    run_relabel(p, tmp_path / "trajectories.parquet", tmp_path / "summaries.parquet", tmp_path / "relabel")
    g = run_regenerate(p, tmp_path / "trajectories.parquet", tmp_path / "relabel/relabels.parquet", tmp_path / "no-policy", tmp_path / "regen")
    assert g["relabels"] == g["regenerations"] + g["dropped_rows"]
    dropped = read_table(tmp_path / "regen/dropped.parquet").to_pylist()
    assert len(dropped) == g["dropped_rows"] and all(r["reason"] and r["status"] in ("unfinished", "invalid", "failed") for r in dropped)
    assert Counter(r["forward_model"] for r in dropped).keys() <= {"model", "hard_model"}


def test_the_forward_stage_trains_nothing_when_no_role_serves_the_models(env, tmp_path, persuasion_base, monkeypatch):
    # The default regenerate (roles.forward.backend: policy) never loads them: the stage checks
    # its input and says why it trained nothing, and leaves nothing a reader could load as a model.
    import tasks.forward as forward

    rows = dialogues(env, 8)
    write_table(to_table(rows, "trajectories"), tmp_path / "trajectories.parquet", "trajectories")
    out = tmp_path / "fwd"
    (out / "models/model").mkdir(parents=True)  # a model an earlier run trained is not left behind
    (out / "models/model/config.json").write_text("{}")
    monkeypatch.setattr(forward, "train_sft", lambda *a, **k: pytest.fail("trained with no role to serve the model"))
    p = persuasion_params(tmp_path, forward={"base_model": str(persuasion_base)})
    assert p.roles.forward.backend == "policy"
    m = run_forward(p, tmp_path / "trajectories.parquet", out)
    assert m["trained"] is False and "roles.forward.backend is policy, not learned" in m["skipped"]
    assert "models" not in m and "fidelity" not in m and m["dialogues"]["logged_train"] == 8
    assert [f.name for f in (out / "models").iterdir()] == ["NOT_TRAINED.txt"]
    assert "backend: learned" in (out / "models/NOT_TRAINED.txt").read_text()
    assert json.loads((out / "metrics.json").read_text())["trained"] is False
    assert json.loads((out / "loss.json").read_text()) == [] and read_table(out / "quarantine.parquet").num_rows == 0
    # The same inputs and params write the same bytes (DVC sees nothing new on a rerun).
    before = {f.name: f.read_bytes() for f in (out / "models").iterdir()}
    run_forward(p, tmp_path / "trajectories.parquet", out)
    assert {f.name: f.read_bytes() for f in (out / "models").iterdir()} == before
