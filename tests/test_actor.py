"""HOPE's online DPO actor (tasks/train/online_dpo.py, tasks/actor.py): the mask and the loss on
hand-made cases, an update that moves chosen over rejected, and the stage on scripted games."""
from __future__ import annotations

import math

import polars as pl
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from conftest import tiny_params, twenty_questions
from storage.parquet import write_table
from storage.schema import chat_message, to_table
from tasks.actor import run_actor
from tasks.buffer import run_buffer
from tasks.params import Params
from tasks.rollout import ScriptedAgent, derive_seed, new_episode, play
from tasks.summarize import run_summarize
from tasks.train import critic, online_dpo
from tasks.train.sft import IGNORE, PadCollator

STATE = [
    {"role": "system", "content": "play"},
    {"role": "user", "content": "Turn 1."},
    {"role": "assistant", "content": "REASON: start.\nQUESTION: Is it an animal?"},
    {"role": "user", "content": "Yes. Turn 2."},
]
GOOD = {"role": "assistant", "content": "REASON: animal.\nQUESTION: Is it huge?"}
BAD = {"role": "assistant", "content": "REASON: animal.\nQUESTION: Is it a car?"}


def test_the_mask_covers_the_action_alone_not_the_earlier_agent_turns(tiny_model_dir):
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    enc, cut = online_dpo.encode(tok, STATE, GOOD, context=1024)
    assert not cut and len(enc["input_ids"]) == len(enc["labels"])
    kept = [t for t in enc["labels"] if t != IGNORE]
    assert tok.decode(kept, skip_special_tokens=False) == GOOD["content"] + tok.eos_token
    # contiguous, at the end: the earlier assistant turn ("Is it an animal?") carries no loss
    first = next(i for i, t in enumerate(enc["labels"]) if t != IGNORE)
    assert all(t != IGNORE for t in enc["labels"][first:]) and enc["labels"][first:] == enc["input_ids"][first:]
    # cut to a short context: the state's start goes, the action stays whole
    short, cut = online_dpo.encode(tok, STATE, GOOD, context=len(enc["input_ids"]) - 5)
    assert cut and short["input_ids"] == enc["input_ids"][5:] and short["labels"] == enc["labels"][5:]


def test_dpo_loss_on_hand_computed_numbers():
    loss, rc, rr = online_dpo.dpo_loss(torch.tensor([-1.0, -4.0]), torch.tensor([-3.0, -2.0]), torch.tensor([-2.0, -2.0]), torch.tensor([-2.0, -2.0]), 0.5)
    # rewards 0.5 * (pi - ref): (0.5, -0.5) and (-1, 0); loss = mean(-log s(1), -log s(-1))
    assert rc.tolist() == [0.5, -1.0] and rr.tolist() == [-0.5, 0.0]
    assert loss.item() == pytest.approx((math.log(1 + math.exp(-1)) + math.log(1 + math.exp(1))) / 2, rel=1e-6)


def test_sequence_logps_sum_the_labelled_tokens_of_each_padded_row(tiny_model_dir):
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    a, _ = online_dpo.encode(tok, STATE, GOOD, 1024)
    b, _ = online_dpo.encode(tok, STATE[:2], BAD, 1024)
    batch = PadCollator(tok.pad_token_id)([a, b])
    got = online_dpo.sequence_logps(model, batch["input_ids"], batch["attention_mask"], batch["labels"])
    with torch.no_grad():
        logp = model(torch.tensor([a["input_ids"]])).logits[0].log_softmax(-1)
    expected = sum(logp[i - 1, t].item() for i, t in enumerate(a["labels"]) if t != IGNORE)
    assert got[0].item() == pytest.approx(expected, abs=1e-4)


def test_an_update_raises_chosen_over_rejected_against_the_reference(tiny_model_dir):
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    reference = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    pairs = [(online_dpo.encode(tok, STATE, GOOD, 1024)[0], online_dpo.encode(tok, STATE, BAD, 1024)[0])] * 8
    curve = online_dpo.train(
        model, reference, tok, pairs, seed=0, beta=0.1, epochs=3, batch_size=4, learning_rate=3e-3, warmup_ratio=0.0, weight_decay=0.0, bf16=False,
    )
    assert curve[0]["loss"] == pytest.approx(math.log(2), abs=1e-3)  # the actor starts as the reference: margin 0
    assert curve[-1]["loss"] < 0.5 and curve[-1]["accuracy"] == 1.0 and curve[-1]["margin"] > 0
    batch = PadCollator(tok.pad_token_id)(list(pairs[0]))
    with torch.no_grad():
        pi = online_dpo.sequence_logps(model, batch["input_ids"], batch["attention_mask"], batch["labels"])
        ref = online_dpo.sequence_logps(reference, batch["input_ids"], batch["attention_mask"], batch["labels"])
    assert (pi[0] - ref[0]) - (pi[1] - ref[1]) > 1.0


@pytest.fixture(scope="module")
def chain(tmp_path_factory, tiny_model_dir):
    """Scripted games on train tasks (noisy, so some win and some lose), their oracle summaries,
    the buffer over them, and a critic with a new head on the tiny policy."""
    d = tmp_path_factory.mktemp("actor")
    env = twenty_questions(Params.model_validate(tiny_params()).env.max_turns)
    policies = env.policies({"p_random": 0.3, "p_repeat": 0.1, "p_early_guess": 0.1})
    eps = [new_episode(env, task, derive_seed("actor", task.id, k)) for task in env.tasks("train")[:6] for k in range(3)]
    play(eps, ScriptedAgent(lambda rng: policies["noisy"]), 0, "logged")
    write_table(to_table([e.to_row() for e in eps], "trajectories"), d / "collect.parquet", "trajectories")
    write_table(to_table([], "trajectories"), d / "regenerate.parquet", "trajectories")
    params = Params.model_validate(tiny_params())
    run_summarize(params, d / "collect.parquet", d)
    run_buffer(params, [d / "collect.parquet", d / "regenerate.parquet"], d)
    torch.manual_seed(0)
    model, tok = critic.load_critic(str(tiny_model_dir), base=True)
    model.save_pretrained(d / "critic")
    tok.save_pretrained(d / "critic")
    return d


def actor_params(d, tiny_model_dir, **actor) -> Params:
    return Params.model_validate(tiny_params({"actor": {
        "base_model": str(tiny_model_dir), "critic": str(d / "critic"), "prompts": 12, "rounds": 2, "batch_size": 4,
        "explore_prob": 0.5, "sampling": {"temperature": 1.0, "top_p": 1.0, "max_new_tokens": 24}, **actor,
    }}))


def test_the_stage_trains_on_critic_ranked_pairs_from_the_actor_and_the_proposer(chain, tiny_model_dir, tmp_path):
    p = actor_params(chain, tiny_model_dir)
    args = (chain / "pairs.parquet", [chain / "collect.parquet", chain / "regenerate.parquet"], chain / "summaries.parquet")
    m = run_actor(p, *args, tmp_path / "a")
    assert m["states"] == 12 and len(m["rounds"]) == 2
    prefs = pl.read_parquet(tmp_path / "a/preferences.parquet")
    assert prefs.height == m["pairs"] == sum(r["pairs"] for r in m["rounds"]) > 0
    assert sum(r["explored"] for r in m["rounds"]) == (prefs["source"] == "proposer").sum() > 0
    assert (prefs["source"] == "policy").sum() > 0
    assert sum(r["pairs"] + r["ties"] + r["generation_failed"] for r in m["rounds"]) == 12
    # chosen is the candidate the critic scores higher: scored again here, the same numbers
    score = critic.scorer(str(chain / "critic"))
    rows = prefs.to_dicts()
    again = score([(list(map(chat_message, r["prompt"])), chat_message(r[side])) for r in rows for side in ("chosen", "rejected")])
    assert again == pytest.approx([q for r in rows for q in (r["chosen_score"], r["rejected_score"])], abs=1e-5)
    assert all(r["chosen_score"] > r["rejected_score"] for r in rows)
    # a proposer pair's two actions are the oracle proposer's at that state
    env = p.env.environment()
    collect = {t["trajectory_id"]: t for t in pl.read_parquet(chain / "collect.parquet").to_dicts()}
    for r in (r for r in rows if r["source"] == "proposer"):
        proposed = {c.text for c in env.propose(env.task(collect[r["trajectory_id"]]["task_id"]), collect[r["trajectory_id"]]["turns"][: r["turn"]], 2)}
        assert {r["chosen"]["content"], r["rejected"]["content"]} == proposed
    # the actor moved from the base; a rerun repeats it to the byte
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir).state_dict()
    actor = AutoModelForCausalLM.from_pretrained(tmp_path / "a/model").state_dict()
    assert any(not torch.equal(base[k], actor[k]) for k in base)
    run_actor(p, *args, tmp_path / "b")
    assert (tmp_path / "a/preferences.parquet").read_bytes() == (tmp_path / "b/preferences.parquet").read_bytes()
    assert (tmp_path / "a/model/model.safetensors").read_bytes() == (tmp_path / "b/model/model.safetensors").read_bytes()


def test_without_exploration_every_pair_comes_from_the_actor(chain, tiny_model_dir, tmp_path):
    m = run_actor(
        actor_params(chain, tiny_model_dir, explore_prob=0.0, prompts=6, rounds=1),
        chain / "pairs.parquet", [chain / "collect.parquet", chain / "regenerate.parquet"], chain / "summaries.parquet", tmp_path,
    )
    assert m["rounds"][0]["explored"] == 0
    assert set(pl.read_parquet(tmp_path / "preferences.parquet")["source"]) == {"policy"}


def test_with_an_untrained_critic_the_actor_is_the_base_and_says_why(chain, tiny_model_dir, tmp_path, capsys):
    """The critic stage skipped for want of pairs: its critic would tie every candidate, so the
    actor plays no round and keeps the base, with the critic's reason."""
    from tasks.critic import run_critic

    pairs = pl.read_parquet(chain / "pairs.parquet").with_columns(selected=pl.lit(False))
    write_table(pairs.to_arrow(), tmp_path / "none.parquet", "pairs")
    run_critic(Params.model_validate(tiny_params({"critic": {"base_model": str(tiny_model_dir)}})), tmp_path / "none.parquet", tmp_path / "critic")
    p = actor_params(chain, tiny_model_dir, critic=str(tmp_path / "critic/model"))
    m = run_actor(p, chain / "pairs.parquet", [chain / "collect.parquet", chain / "regenerate.parquet"], chain / "summaries.parquet", tmp_path / "a")
    assert m["rounds"] == [] and m["pairs"] == 0 and pl.read_parquet(tmp_path / "a/preferences.parquet").height == 0
    assert m["untrained"].startswith(f"the critic at {tmp_path / 'critic/model'} was not trained (no pair to train on (0 of the buffer's")
    assert f"actor: {m['untrained']}" in capsys.readouterr().out
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir).state_dict()
    kept = AutoModelForCausalLM.from_pretrained(tmp_path / "a/model").state_dict()
    assert all(torch.equal(base[k], kept[k]) for k in base)


def test_the_loss_and_its_masks_match_trls_dpo_trainer(tiny_model_dir, tmp_path):
    """TRL's DPOTrainer, given the same pair as prompt and completions in its conversational
    format, computes the same loss: the same action tokens carry it, against the same reference."""
    from datasets import Dataset
    from trl import DPOConfig, DPOTrainer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    with torch.no_grad():  # an actor that has moved from its reference
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    reference = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    data = Dataset.from_list([{"prompt": STATE, "chosen": [GOOD], "rejected": [BAD]}])
    args = DPOConfig(output_dir=str(tmp_path), beta=0.1, per_device_train_batch_size=1, report_to="none", use_cpu=True, max_length=None)
    trl = DPOTrainer(model=model, ref_model=reference, args=args, train_dataset=data, processing_class=tok)
    with torch.no_grad():
        expected = trl.compute_loss(model, trl.data_collator([trl.train_dataset[0]])).item()
        batch = PadCollator(tok.pad_token_id)([online_dpo.encode(tok, STATE, GOOD, 1024)[0], online_dpo.encode(tok, STATE, BAD, 1024)[0]])
        pi = online_dpo.sequence_logps(model, batch["input_ids"], batch["attention_mask"], batch["labels"])
        ref = online_dpo.sequence_logps(reference, batch["input_ids"], batch["attention_mask"], batch["labels"])
    assert online_dpo.dpo_loss(pi[:1], pi[1:], ref[:1], ref[1:], 0.1)[0].item() == pytest.approx(expected, abs=1e-4)  # float rounding
    assert expected != pytest.approx(math.log(2), abs=1e-3)  # the pair's margin is not 0: the check has teeth


def test_select_val_keeps_the_round_whose_actor_wins_most_val_games(chain, tiny_model_dir, tmp_path):
    p = actor_params(chain, tiny_model_dir, explore_prob=0.0, prompts=8, rounds=2, select="val", learning_rate=3e-3)
    m = run_actor(p, chain / "pairs.parquet", [chain / "collect.parquet", chain / "regenerate.parquet"], chain / "summaries.parquet", tmp_path)
    wins = [r["val_success"] for r in m["rounds"]]
    assert len(wins) == 2 and m["chosen_round"] == max(range(2), key=lambda j: (wins[j], j))
    from tasks.actor import val_success
    assert val_success(p, tmp_path / "model", "again") == wins[m["chosen_round"]]  # the kept model is that round's
