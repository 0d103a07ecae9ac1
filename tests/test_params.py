import shutil
from pathlib import Path

import pytest
import yaml

from tasks.params import Params, ParamsError, check_key, load_params

ROOT = Path(__file__).resolve().parents[1]


def _write(tmp_path: Path, mutate) -> Path:
    raw = yaml.safe_load((ROOT / "params.yaml").read_text())
    mutate(raw)
    p = tmp_path / "params.yaml"
    p.write_text(yaml.safe_dump(raw))
    return p


def test_repository_params_are_valid():
    p = load_params(ROOT / "params.yaml")
    assert p.collect.m > 1  # Swift needs several trajectories per context
    assert p.bootstrap.model.head_dim >= 64


def test_unknown_key_is_named(tmp_path):
    path = _write(tmp_path, lambda r: r["collect"].update(temprature=0.5))
    with pytest.raises(ParamsError, match=r"collect\.temprature: unknown key"):
        load_params(path)


def test_wrong_type_is_named(tmp_path):
    path = _write(tmp_path, lambda r: r["collect"].update(m="many"))
    with pytest.raises(ParamsError, match=r"collect\.m:"):
        load_params(path)


def test_out_of_range_is_named(tmp_path):
    path = _write(tmp_path, lambda r: r["bootstrap"]["model"].update(head_dim=32))
    with pytest.raises(ParamsError, match=r"bootstrap\.model\.head_dim"):
        load_params(path)


def test_missing_file(tmp_path):
    with pytest.raises(ParamsError, match="not found"):
        load_params(tmp_path / "nope.yaml")


def test_a_role_switches_backend_by_an_edit(tmp_path):
    def to_openai(r):
        r["roles"]["summarizer"] = {"backend": "openai", "model": "llama-3.2-3b", "base_url": "http://127.0.0.1:8000/v1", "api_key_env": "MY_KEY"}

    p = load_params(_write(tmp_path, to_openai))
    assert p.roles.summarizer.backend == "openai" and p.roles.summarizer.api_key_env == "MY_KEY"
    assert p.roles.summarizer.sampling.max_new_tokens > 0  # defaults fill the rest


@pytest.mark.parametrize(
    "role, entry, message",
    [
        ("summarizer", {"backend": "vllm"}, r"roles\.summarizer.*needs a model"),
        ("proposer", {"backend": "openai", "model": "m"}, r"roles\.proposer.*needs a base_url"),
        ("policy", {"backend": "oracle"}, r"roles\.policy\.backend"),
        ("forward", {"backend": "oracle"}, r"roles\.forward.*use backend: policy"),
        ("labeler", {"backend": "hf", "model": "m", "api_key": "sk-123"}, r"roles\.labeler\.api_key: unknown key"),
    ],
)
def test_bad_roles_are_named(tmp_path, role, entry, message):
    with pytest.raises(ParamsError, match=message):
        load_params(_write(tmp_path, lambda r: r["roles"].update({role: entry})))


@pytest.mark.parametrize(
    "key",
    ["relabel.k", "roles.summarizer.base_url", "roles.labeler.mode", "train.methods.my_own.algorithm", "train.methods",
     "bootstrap.behaviour_mix.expert", "collect.scale.shards", "relabel.window",
     "train.methods.my_own.ilql.tau"],
)
def test_a_valid_key_passes(key):
    check_key(key)


@pytest.mark.parametrize(
    "key, message",
    [
        ("relabel.kk", r"unknown param 'relabel\.kk' \(did you mean relabel\.k\?\)"),
        ("relabl.k", r"did you mean relabel\.k\?"),
        ("roles.sumarizer.model", r"did you mean roles\.summarizer\.model\?"),
        ("train.methods.refit.algoritm", r"did you mean train\.methods\.refit\.algorithm\?"),  # under a name of the user's own
        ("relabel.zzzz", r"unknown param 'relabel\.zzzz' \(relabel has: mode, splits, k, t, n, window, hr_top, hr_suggestions\)"),
        ("relabel.k.x", r"relabel\.k is a value, with no keys under it"),
    ],
)
def test_an_unknown_key_is_refused_with_the_closest_names(key, message):
    with pytest.raises(ParamsError, match=message):
        check_key(key)


def test_overrides_are_checked_before_hydra_applies_them(tmp_path):
    from flows.pipeline import apply_overrides

    path = _write(tmp_path, lambda r: None)
    before = path.read_text()
    for bad in (["relabel.kk=3"], ["+relabel.kk=3"], ["relabel.k=3", "relabel.kk=3"]):
        with pytest.raises(ParamsError, match=r"unknown param 'relabel\.kk' \(did you mean relabel\.k\?\)"):
            apply_overrides(bad, path)
        assert path.read_text() == before  # nothing applied, not even the valid one
    with pytest.raises(ParamsError, match="expected key=value"):
        apply_overrides(["relabel.k"], path)

    # Valid keys apply whether params.yaml holds them yet or not, with or without Hydra's `+`.
    apply_overrides(["relabel.k=3", "+relabel.n=1", "roles.summarizer.model=tiny", "train.methods.mine.algorithm=sft"], path)
    p = load_params(path)
    assert (p.relabel.k, p.relabel.n, p.roles.summarizer.model, p.train.methods["mine"].algorithm) == (3, 1, "tiny", "sft")


def test_switching_environment_drops_the_old_ones_env_keys(tmp_path):
    """params.yaml's env keys were written for TwentyQuestions: -S env.name=guess_my_city starts
    GuessMyCity from its own defaults (10 questions, candidates shown), plus the env keys given."""
    from flows.pipeline import apply_overrides

    path = _write(tmp_path, lambda r: None)
    env = yaml.safe_load(path.read_text())["env"]
    assert env["name"] == "twenty_questions" and env["max_turns"] == 20 and env["facts_per_object"] == 40
    apply_overrides(["env.max_turns=12"], path)  # the same environment: its keys stay
    assert yaml.safe_load(path.read_text())["env"] == env | {"max_turns": 12}
    apply_overrides(["env.name=guess_my_city"], path)
    assert yaml.safe_load(path.read_text())["env"] == {"name": "guess_my_city"}
    assert (load_params(path).env.environment().max_turns, load_params(path).env.environment().options.show_candidates) == (10, True)
    apply_overrides(["env.name=twenty_questions", "env.show_candidates=true"], path)
    assert yaml.safe_load(path.read_text())["env"] == {"name": "twenty_questions", "show_candidates": True}
    apply_overrides(["env.name=car_dealer", "env.max_turns=6"], path)
    assert yaml.safe_load(path.read_text())["env"] == {"name": "car_dealer", "max_turns": 6}


def test_top_level_limit_tasks_shrinks_every_stage_and_a_stages_own_wins():
    raw = yaml.safe_load((ROOT / "params.yaml").read_text())
    p = Params.model_validate({**raw, "limit_tasks": 4, "collect": {**raw["collect"], "limit_tasks": 2}})
    assert (p.limit_tasks, p.bootstrap.limit_tasks, p.collect.limit_tasks, p.evaluate.limit_tasks) == (4, 4, 2, 4)
    plain = Params.model_validate(raw)
    assert (plain.limit_tasks, plain.bootstrap.limit_tasks, plain.evaluate.limit_tasks) == (None, None, None)
    with pytest.raises(ValueError, match="limit_tasks"):
        Params.model_validate({**raw, "limit_tasks": 0})


def test_a_quick_look_lays_its_sizes_over_the_stages_and_only_then():
    raw = yaml.safe_load((ROOT / "params.yaml").read_text())
    raw["quick_look"] = {"critic": {"epochs": 1}, "actor": {"prompts": 16}}
    plain = Params.model_validate(raw)
    assert (plain.critic.epochs, plain.actor.prompts) == (raw["critic"]["epochs"], raw["actor"]["prompts"])
    look = Params.model_validate({**raw, "limit_tasks": 4})
    assert (look.critic.epochs, look.actor.prompts, look.critic.batch_size) == (1, 16, raw["critic"]["batch_size"])
    assert raw["quick_look"] == {"critic": {"epochs": 1}, "actor": {"prompts": 16}}  # the raw params untouched
    # a misspelt key is an error naming it, quick look or not; a stage dvc.yaml does not rerun for it is refused
    with pytest.raises(ValueError, match=r"unknown param 'critic.epoks' \(did you mean critic.epochs\?\) \(under quick_look\)"):
        Params.model_validate({**raw, "quick_look": {"critic": {"epoks": 1}}})
    with pytest.raises(ValueError, match="unknown param 'quick_look.train.epochs': a quick look sizes bootstrap, collect, critic, actor, evaluate"):
        Params.model_validate({**raw, "quick_look": {"train": {"epochs": 1}}})



def test_a_quick_looks_size_is_overridden_under_quick_look(tmp_path):
    from flows.pipeline import apply_overrides

    path = tmp_path / "params.yaml"
    shutil.copy(ROOT / "params.yaml", path)
    apply_overrides(["limit_tasks=2", "quick_look.critic.epochs=3"], path)
    assert load_params(path).critic.epochs == 3
    with pytest.raises(ParamsError, match=r"unknown param 'critic.epoks' \(did you mean critic.epochs\?\) \(under quick_look\)"):
        apply_overrides(["quick_look.critic.epoks=3"], path)
    with pytest.raises(ParamsError, match="a quick look sizes bootstrap"):
        apply_overrides(["quick_look.train.epochs=3"], path)


def test_every_stage_a_quick_look_sizes_reruns_when_it_changes():
    from tasks.params import QUICK_LOOK_SIZES

    stages = yaml.safe_load((ROOT / "dvc.yaml").read_text())["stages"]
    for name in QUICK_LOOK_SIZES:
        assert {"limit_tasks", "quick_look"} <= set(stages[name]["params"]), name
    assert {"limit_tasks", "quick_look"} <= set(stages["iteration"]["do"]["params"])


def test_behaviour_mix_takes_any_policy_the_environment_offers_and_names_an_unknown_one(tmp_path):
    from tasks.bootstrap import behaviour

    check_key("bootstrap.behaviour_mix.pushy")  # a name of the environment's own

    def persuasion(mix):
        def mutate(r):
            r["env"] = {"name": "persuasion"}
            r["bootstrap"]["behaviour_mix"] = mix
        return mutate

    mixture = behaviour(load_params(_write(tmp_path, persuasion({"expert": 0.5, "pushy": 0.5}))))
    assert mixture.names == ["expert", "pushy"] and mixture.policies["pushy"].name == "pushy"
    with pytest.raises(ValueError, match=r"'pushi' is not a scripted policy of environment persuasion \(it offers expert, noisy, pushy, random\)"):
        behaviour(load_params(_write(tmp_path, persuasion({"expert": 0.5, "pushi": 0.5}))))
    # TwentyQuestions has no pushy persuader.
    with pytest.raises(ValueError, match=r"'pushy' is not a scripted policy of environment twenty_questions"):
        behaviour(load_params(_write(tmp_path, lambda r: r["bootstrap"].update(behaviour_mix={"expert": 1.0, "pushy": 0.1}))))


@pytest.mark.parametrize(
    "entry, message",
    [
        ({"backend": "learned"}, r"backend learned needs a model"),
        ({"backend": "learned", "model": "data/forward/models/model", "hard_share": 0.2}, r"hard_share 0.2 needs a hard_model"),
        ({"backend": "learned", "model": "m", "hard_model": "h", "hard_share": 1.5}, r"roles\.forward\.hard_share"),
        ({"backend": "policy", "hard_share": 0.2}, r"apply to backend learned only"),
    ],
)
def test_the_learned_forward_role_is_checked(tmp_path, entry, message):
    with pytest.raises(ParamsError, match=message):
        load_params(_write(tmp_path, lambda r: r["roles"].update(forward=entry)))


def test_the_learned_forward_role_and_the_forward_stage_load(tmp_path):
    entry = {"backend": "learned", "model": "data/forward/models/model", "hard_model": "data/forward/models/hard_model", "hard_share": 0.2}
    p = load_params(_write(tmp_path, lambda r: r["roles"].update(forward=entry)))
    assert p.roles.forward.hard_share == 0.2 and p.forward.hard_fraction == 0.25
