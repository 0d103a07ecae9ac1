"""ETO (tasks/train/eto.py): the pairing rule on hand-made tables, the mask (every assistant turn
of the whole trajectory, no observation) and the loss on a hand-computed case, and a tiny train
through the train stage on played trajectories."""
from __future__ import annotations

import json
import math
from types import SimpleNamespace

import polars as pl
import pytest
import torch
import yaml
from pydantic import ValidationError
from transformers import AutoModelForCausalLM, AutoTokenizer

from conftest import CONV, ROOT, SHORT, tiny_params, twenty_questions
from storage.parquet import write_table
from storage.schema import to_table
from tasks.params import MethodParams, Params, lay_preset
from tasks.rollout import ScriptedAgent, derive_seed, new_episode, play
from tasks.train import eto, online_dpo, run_train
from tasks.train.sft import IGNORE


def traj(i: str, task: str, success: bool | None, seed: int = 0, split: str = "train") -> dict:
    return {"trajectory_id": i, "task_id": task, "split": split, "seed": seed, "success": success, "messages": [{"role": "user", "content": i}]}


EXPERT = [
    traj("e_dog", "Dog", True),
    traj("e_cat", "Cat", False),  # the expert lost Cat
    traj("e_cow", "Cow", True),
    traj("e_owl_lost", "Owl", False, seed=1), traj("e_owl_won", "Owl", True, seed=2), traj("e_owl_won_too", "Owl", True, seed=3),
]
POLICY = [
    traj("p_dog_2", "Dog", False, seed=2), traj("p_dog_1", "Dog", False, seed=1), traj("p_dog_won", "Dog", True, seed=3),  # two failures
    traj("p_cat", "Cat", False),  # its expert failed
    traj("p_cow_1", "Cow", True), traj("p_cow_2", "Cow", True),  # no failure
    traj("p_fox", "Fox", False),  # the expert never played Fox
    traj("p_dog_val", "Dog", False, split="val"),  # nor the val split
    traj("p_hen", "Hen", None),  # an import that does not say
    traj("p_owl", "Owl", False),
]


def test_each_failure_is_paired_with_its_tasks_first_successful_expert():
    pairs, counts = eto.pairs(EXPERT, POLICY)
    assert [(p["task_id"], p["expert_id"], p["failure_id"]) for p in pairs] == [
        ("Dog", "e_dog", "p_dog_1"), ("Dog", "e_dog", "p_dog_2"),  # several failures: one pair each, by seed
        ("Owl", "e_owl_won", "p_owl"),  # the first successful expert by seed, not its lost one
    ]
    assert pairs[0]["chosen"] == EXPERT[0]["messages"] and pairs[0]["rejected"] == POLICY[1]["messages"]
    assert counts == {
        "policy_trajectories": 10, "successes": 3, "outcome_unknown": 1,
        "failures_paired": 3, "failures_expert_failed": 1, "failures_without_expert": 2,
        "tasks": 7, "tasks_paired": 2, "tasks_several_failures": 1, "tasks_without_failure": 2, "tasks_expert_failed": 1,
        "tasks_without_expert": 2, "expert_trajectories": 6, "experts_paired": 2,
    }
    # Nothing dropped silently: every policy trajectory is in exactly one count.
    assert counts["successes"] + counts["outcome_unknown"] + counts["failures_paired"] + counts["failures_expert_failed"] \
        + counts["failures_without_expert"] == len(POLICY)


def test_the_mask_covers_every_assistant_turn_and_no_observation(tiny_model_dir):
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    [(chosen, rejected)], cut = eto.encode(tok, [{"chosen": CONV, "rejected": SHORT}], 10**6)
    assert cut == 0
    for enc, messages in ((chosen, CONV), (rejected, SHORT)):
        supervised = [t for t in enc["labels"] if t != IGNORE]
        turns = [m["content"] for m in messages if m["role"] == "assistant"]
        assert tok.decode(supervised, skip_special_tokens=False) == "".join(t + tok.eos_token for t in turns)
        assert [t if t != IGNORE else i for t, i in zip(enc["labels"], enc["input_ids"])] == enc["input_ids"]
    assert len([m for m in CONV if m["role"] == "assistant"]) == 2  # both of the expert's turns, not the last alone
    # A context shorter than a trajectory keeps its start, and the pair is counted as cut.
    [(short_chosen, _)], cut = eto.encode(tok, [{"chosen": CONV, "rejected": SHORT}], len(chosen["input_ids"]) - 3)
    assert cut == 1 and short_chosen["labels"] == chosen["labels"][:-3]


class Fixed(torch.nn.Module):
    """A 2-token model whose next-token logits are `logits` at every position."""

    def __init__(self, logits: tuple[float, float]):
        super().__init__()
        self.head = torch.nn.Linear(1, 2, bias=False)
        self.head.weight.data = torch.tensor([[logits[0]], [logits[1]]])

    def get_decoder(self):
        return lambda input_ids, attention_mask: SimpleNamespace(last_hidden_state=torch.ones(*input_ids.shape, 1))

    def get_output_embeddings(self):
        return self.head


def test_the_loss_on_a_hand_computed_pair():
    # Two agent tokens each (positions 2 and 4), an observation between them (position 3, masked).
    chosen = {"input_ids": [0, 1, 1, 0, 1], "labels": [IGNORE, IGNORE, 1, IGNORE, 1]}
    rejected = {"input_ids": [0, 1, 0, 1, 0], "labels": [IGNORE, IGNORE, 0, IGNORE, 0]}
    # The reference is uniform: log ref = 2 ln 1/2 on either side.
    [row] = online_dpo.pair_rows(Fixed((0.0, 0.0)), SimpleNamespace(pad_token_id=0), [(chosen, rejected)])
    assert (row["ref_chosen"], row["ref_rejected"]) == pytest.approx((2 * math.log(0.5), 2 * math.log(0.5)))
    # The policy: p(1) = 3/4, p(0) = 1/4 everywhere. log pi(chosen) = 2 ln 3/4, log pi(rejected) = 2 ln 1/4.
    batch = online_dpo.PairCollator(0)([row])
    logps = online_dpo.sequence_logps(Fixed((0.0, math.log(3))), batch["input_ids"], batch["attention_mask"], batch["labels"])
    assert logps.tolist() == pytest.approx([2 * math.log(0.75), 2 * math.log(0.25)])
    # Had the observation counted, chosen would carry ln 1/4 more and rejected ln 3/4 more.
    # beta [(2 ln 3/4 - 2 ln 1/2) - (2 ln 1/4 - 2 ln 1/2)] = beta * 2 ln 3, so loss = ln(1 + 3^(-2 beta)).
    loss, r_chosen, r_rejected = online_dpo.dpo_loss(logps[:1], logps[1:], batch["ref_logps"][:1], batch["ref_logps"][1:], beta=0.1)
    assert loss.item() == pytest.approx(0.589309, abs=1e-6)  # ln(1 + 3^-0.2) = ln 1.802742
    assert (r_chosen.item(), r_rejected.item()) == pytest.approx((0.2 * math.log(1.5), -0.2 * math.log(2)))


def test_eto_takes_no_training_table_settings_and_beta_is_its_own():
    assert Params.model_validate(tiny_params()).train.config_for(MethodParams(algorithm="eto")).beta == 0.1  # ETO's, when unset
    for bad in ({"alpha": 0.4}, {"data": "logged"}, {"aggregate_multiple": 2.0}):
        with pytest.raises(ValidationError, match="eto trains on the expert's and collect's trajectories"):
            MethodParams(algorithm="eto", **bad)
    with pytest.raises(ValidationError, match="beta applies to algorithms eto, dpo, step_dpo only"):
        MethodParams(algorithm="sft", beta=0.5)
    # The params as the ranks of a multi-rank run read them back: every field written out.
    raw = tiny_params()
    raw["train"]["methods"] = {"sft": {"algorithm": "sft"}, "rft": {"algorithm": "rft"}, "eto": {"algorithm": "eto", "beta": 0.5}}
    params = Params.model_validate(raw)
    assert Params.model_validate_json(params.model_dump_json()) == params


def test_the_baselines_preset_is_valid_params_with_rft_and_eto_as_its_arms():
    raw = yaml.safe_load((ROOT / "params.yaml").read_text())
    lay_preset(raw, yaml.safe_load((ROOT / "bench/presets/stepagent_baselines.yaml").read_text()))
    methods = Params.model_validate(raw).train.methods
    assert {n: m.algorithm for n, m in methods.items()} == {"rft": "rft", "eto": "eto"} and methods["eto"].beta == 0.1


def played(policy: str, tasks, m: int, tag: str) -> list[dict]:
    env = twenty_questions(8)
    scripted = env.policies({"p_random": 0.5, "p_repeat": 0.2, "p_early_guess": 0.0})[policy]
    eps = [new_episode(env, t, derive_seed("eto", tag, t.id, k)) for t in tasks for k in range(m)]
    play(eps, ScriptedAgent(lambda rng: scripted), 0, tag)
    return [e.to_row() for e in eps]


def test_the_train_stage_prefers_the_expert_over_the_policys_failures(tiny_model_dir, tmp_path):
    tasks = twenty_questions(8).tasks("train")[:3]
    expert = played("expert", tasks, 1, "expert")
    lucky = [r for r in played("expert", tasks, 2, "lucky") if r["success"]][:1]  # one success among the policy's trajectories
    policy = played("random", tasks, 2, "policy") + lucky  # random play loses
    write_table(to_table(expert, "trajectories"), tmp_path / "expert.parquet", "trajectories")
    write_table(to_table(policy, "trajectories"), tmp_path / "collect.parquet", "trajectories")
    write_table(pl.DataFrame([{  # the training table, which eto does not read
        "trajectory_id": "t", "task_id": "Dog", "split": "train", "source": "policy", "parent_id": None, "relabel_id": None,
        "messages": CONV, "reward": -3.0, "standardized_reward": 0.0, "weight": 0.6, "group_size": 1,
        "group_mean": None, "group_std": None, "standardize_status": "singleton",
    }]).to_arrow(), tmp_path / "train.parquet", "training")
    raw = tiny_params({"train": {"base_model": str(tiny_model_dir), "epochs": 3, "batch_size": 2}})
    raw["train"]["methods"] = {"eto": {"algorithm": "eto", "learning_rate": 1.0e-3}}
    params = Params.model_validate(raw)

    with pytest.raises(ValueError, match="an eto method pairs the expert's trajectories"):
        run_train(params, tmp_path / "train.parquet", tmp_path / "none", trajectories=tmp_path / "collect.parquet")
    m = run_train(params, tmp_path / "train.parquet", tmp_path / "out", trajectories=tmp_path / "collect.parquet", expert=tmp_path / "expert.parquet")
    e = m["methods"]["eto"]
    want, counts = eto.pairs(expert, policy)
    assert want and e["trained"] and e["rows"] == len(want) == e["failures_paired"] and e["beta"] == 0.1
    assert {k: e[k] for k in counts} == counts and e["successes"] == 1 and e["policy_trajectories"] == len(policy)
    assert e["successes"] + e["outcome_unknown"] + e["failures_paired"] + e["failures_expert_failed"] + e["failures_without_expert"] == len(policy)
    assert len(json.loads((tmp_path / "out/loss/eto.json").read_text())) == math.ceil(len(want) / 2) * 3
    # DPO's implicit reward now prefers the expert: log pi / ref rose on the chosen side against the rejected.
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    encoded, _ = eto.encode(tok, want, 1024)
    seqs = [s for pair in encoded for s in pair]
    base = online_dpo.reference_logps(AutoModelForCausalLM.from_pretrained(tiny_model_dir), tok, seqs)
    trained = online_dpo.reference_logps(AutoModelForCausalLM.from_pretrained(tmp_path / "out/models/eto"), tok, seqs)
    margins = [(trained[2 * i] - base[2 * i]) - (trained[2 * i + 1] - base[2 * i + 1]) for i in range(len(encoded))]
    assert sum(margins) / len(margins) > 1.0


@pytest.mark.system
def test_eto_on_two_cpu_ranks_matches_one_process(tiny_model_dir, tmp_path):
    """Both ranks read the reference themselves (sft first: a model loaded after a ZeRO-3 run may
    come partitioned, and its weights are gathered for it) and take their share of every batch."""
    tasks = twenty_questions(8).tasks("train")[:2]
    write_table(to_table(played("expert", tasks, 1, "expert"), "trajectories"), tmp_path / "expert.parquet", "trajectories")
    write_table(to_table(played("random", tasks, 4, "policy"), "trajectories"), tmp_path / "collect.parquet", "trajectories")
    write_table(pl.DataFrame([{
        "trajectory_id": f"t{i}", "task_id": "Dog", "split": "train", "source": "policy", "parent_id": None, "relabel_id": None,
        "messages": CONV, "reward": -3.0, "standardized_reward": 0.0, "weight": 0.6, "group_size": 1,
        "group_mean": None, "group_std": None, "standardize_status": "singleton",
    } for i in range(4)]).to_arrow(), tmp_path / "train.parquet", "training")

    def params(nproc: int, batch_size: int) -> Params:
        raw = tiny_params({"train": {"base_model": str(tiny_model_dir), "nproc_per_node": nproc, "batch_size": batch_size, "epochs": 2,
                                     "deepspeed": str(ROOT / "tasks/train/deepspeed_zero3.json"), "bf16": False}})
        raw["train"]["methods"] = {"sft": {"algorithm": "sft"}, "eto": {"algorithm": "eto", "learning_rate": 1.0e-3}}
        return Params.model_validate(raw)

    inputs = {"trajectories": tmp_path / "collect.parquet", "expert": tmp_path / "expert.parquet"}
    two = run_train(params(2, 2), tmp_path / "train.parquet", tmp_path / "two", **inputs)
    one = run_train(params(1, 4), tmp_path / "train.parquet", tmp_path / "one", **inputs)
    assert two["world_size"] == 2 and two["methods"]["eto"]["rows"] == one["methods"]["eto"]["rows"] > 0
    curve2, curve1 = (json.loads((tmp_path / f"{d}/loss/eto.json").read_text()) for d in ("two", "one"))
    assert [p["step"] for p in curve2] == [p["step"] for p in curve1]
    for a, b in zip(curve2, curve1):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-4)
