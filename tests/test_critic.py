"""HOPE's process critic (tasks/train/critic.py, tasks/critic.py): the loss and head on hand-computed
cases, and the stage learning a target it can read off the action."""
from __future__ import annotations

import json
import math

import polars as pl
import pytest
import torch
from transformers import AutoModelForCausalLM

from conftest import tiny_params
from storage.parquet import write_table
from storage.schema import to_table
from tasks.buffer import pair_key
from tasks.critic import calibration, run_critic
from tasks.params import Params
from tasks.train import critic


def test_soft_bce_on_a_hand_computed_batch():
    loss = critic.soft_bce(torch.tensor([0.0, 2.0]), torch.tensor([0.5, 1.0]))
    # -(0.5 log s(0) + 0.5 log(1 - s(0))) = log 2; -log s(2) = log(1 + e^-2)
    assert loss.item() == pytest.approx((math.log(2) + math.log(1 + math.exp(-2))) / 2, rel=1e-6)


def test_the_head_reads_the_policy_at_the_last_token(tiny_model_dir):
    torch.manual_seed(0)
    model, tok = critic.load_critic(str(tiny_model_dir), base=True)
    policy = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    assert model.score.weight.shape == (1, policy.config.hidden_size) and model.score.bias is None
    assert torch.equal(model.model.embed_tokens.weight, policy.model.embed_tokens.weight)  # the policy's weights
    ids = critic.encode(tok, [{"role": "system", "content": "play"}, {"role": "user", "content": "Turn 1."}], {"role": "assistant", "content": "REASON: x\nQUESTION: Is it an animal?"})
    assert ids[-1] == tok.eos_token_id  # the action's end of turn
    hidden = policy.model(torch.tensor([ids])).last_hidden_state[0, -1]
    expected = torch.sigmoid(model.score.weight[0] @ hidden).item()
    # padded in a batch with a longer sequence, it is still read at its own last token
    got = critic.score(model, tok, [ids, ids + ids[:5]])[0]
    assert got == pytest.approx(expected, abs=1e-5)


def test_the_probe_fits_the_head_to_targets_the_frozen_features_carry(tiny_model_dir):
    torch.manual_seed(0)
    model, tok = critic.load_critic(str(tiny_model_dir), base=True)
    body = {k: v.clone() for k, v in model.model.state_dict().items()}
    sequences = [critic.encode(tok, [{"role": "user", "content": f"Turn {i}."}], {"role": "assistant", "content": f"QUESTION: Is it {w}?"})
                 for i in range(1, 9) for w in ("an animal", "red", "Cow", "made of metal")]
    x = critic.features(model, tok, sequences)
    # the features are what the head reads: sigmoid(head . feature) is the critic's score
    assert torch.sigmoid(x @ model.score.weight[0]).tolist() == pytest.approx(critic.score(model, tok, sequences), abs=1e-5)
    # targets a linear head on these features produces exactly; the fit must find them from zero
    w_true = torch.randn(x.shape[1]) * 5.0 / x.norm(dim=1).mean()
    targets = torch.sigmoid(x @ w_true).tolist()
    assert max(targets) - min(targets) > 0.5
    fit = critic.fit_head(model, tok, [{"input_ids": s, "target": t} for s, t in zip(sequences, targets)], l2=0.0)
    assert fit["loss_zero_head"] == pytest.approx(critic.soft_bce(torch.zeros(len(targets)), torch.tensor(targets)).item(), abs=1e-4)
    assert fit["loss_fit_head"] < fit["loss_zero_head"] - 0.01
    assert critic.score(model, tok, sequences) == pytest.approx(targets, abs=0.02)
    assert all(torch.equal(v, body[k]) for k, v in model.model.state_dict().items())  # the body is left alone


def test_calibration_against_the_mean():
    c = calibration([0.9, 0.2], [1.0, 0.0], mean=0.5)
    assert c == {"pairs": 2, "mae": 0.15, "rmse": pytest.approx(0.1581, abs=1e-4), "side_agreement": 1.0, "mae_of_mean": 0.5}


def pairs_table(n: int) -> list[dict]:
    """Pairs whose target the action says: "good" 0.9, "bad" 0.1."""
    rows = []
    for i in range(n):
        good = i % 2 == 0
        prompt = [{"role": "system", "content": "play"}, {"role": "user", "content": f"Turn {i % 7 + 1}."}]
        action = {"role": "assistant", "content": f"REASON: {'animal' if good else 'Known'}.\nQUESTION: Is it {'an animal' if good else 'Cow'}?"}
        rows.append({
            "key": pair_key(prompt, action) + str(i), "prompt": prompt, "action": action, "turn": i % 7, "target_raw": 0.0,
            "target": 0.9 if good else 0.1, "count": 1, "source": "on-policy", "trajectory_ids": [str(i)], "selected": i % 10 != 9,
        })
    return rows


def test_the_stage_learns_a_target_it_can_read_and_reports_calibration(tiny_model_dir, tmp_path):
    write_table(to_table(pairs_table(200), "pairs"), tmp_path / "pairs.parquet", "pairs")
    raw = tiny_params({"critic": {"base_model": str(tiny_model_dir), "epochs": 6, "batch_size": 8, "learning_rate": 3.0e-3, "heldout_share": 0.2}})
    m = run_critic(Params.model_validate(raw), tmp_path / "pairs.parquet", tmp_path / "out")
    held = m["calibration"]["heldout"]
    assert m["pairs_selected"] == 180 and held["pairs"] + m["calibration"]["train"]["pairs"] == 180
    assert held["pairs"] > 10
    assert held["mae"] < 0.5 * held["mae_of_mean"] and held["side_agreement"] == 1.0
    assert json.loads((tmp_path / "out/metrics.json").read_text())["calibration"] == m["calibration"]
    model, tok = critic.load_critic(str(tmp_path / "out/model"))
    assert model.config.architectures == ["LlamaForSequenceClassification"]
    assert pl.read_parquet(tmp_path / "out/quarantine.parquet").height == 0


def test_best_of_n_plays_the_candidate_the_score_ranks_highest(tiny_model_dir):
    """The policy's n samples at a turn are the ones a plain generation with the same seeds
    gives; the score picks among them (here a hand-made one: the shortest text), in one call."""
    from conftest import twenty_questions
    from models.base import SamplingParams
    from models.hf import HFGenerator
    from tasks.rollout import BestOfNAgent, derive_seed, new_episode

    env = twenty_questions(4)
    gen = HFGenerator(tiny_model_dir)
    sampling = SamplingParams(temperature=1.0, top_p=1.0, max_new_tokens=16)
    episodes = [new_episode(env, env.task(name), seed) for name, seed in (("Cat", 1), ("Dog", 2))]
    calls = []

    def shortest(pairs):
        calls.append(len(pairs))
        return [-len(action["content"]) for _, action in pairs]

    texts = BestOfNAgent(gen, sampling, 3, shortest).act(episodes, 0)
    assert calls == [6]
    for ep, text in zip(episodes, texts):
        seeds = [derive_seed(ep.seed, "turn", 0, "candidate", j) for j in range(3)]
        candidates = [c.text for c in gen.generate([ep.messages] * 3, sampling, seeds)]
        assert text == min(candidates, key=len) and ep.policy_id.endswith("+best_of_3")
        assert len(set(candidates)) > 1  # there was a choice to make


def test_candidates_of_one_state_share_its_encoding_and_score_as_whole_pairs(tiny_model_dir):
    torch.manual_seed(0)
    model, tok = critic.load_critic(str(tiny_model_dir), base=True)
    a = [{"role": "system", "content": "play"}, {"role": "user", "content": "Turn 1."}]
    b = [*a, {"role": "assistant", "content": "REASON: x\nQUESTION: Is it an animal?"}, {"role": "user", "content": "Yes. Turn 2."}]
    acts = [{"role": "assistant", "content": t} for t in ("REASON: y\nQUESTION: Is it huge?", "REASON: y\nQUESTION: Is it a car made of metal?", "")]
    pairs = [(a, acts[0]), (b, acts[1]), (a, acts[1]), (b, acts[0]), (b, acts[2])]
    expected = critic.score(model, tok, [critic.encode(tok, s, x) for s, x in pairs])
    assert critic.score_pairs(model, tok, pairs) == pytest.approx(expected, abs=1e-5)


def test_best_of_n_on_val_chooses_among_the_epochs_checkpoints(tiny_model_dir, tmp_path):
    write_table(to_table(pairs_table(80), "pairs"), tmp_path / "pairs.parquet", "pairs")
    raw = tiny_params({
        "roles": {"policy": {"model": str(tiny_model_dir)}},
        "critic": {"base_model": str(tiny_model_dir), "epochs": 2, "batch_size": 8, "heldout_share": 0.2, "select": "best_of_n_val", "select_n": 2,
                   "select_sampling": {"temperature": 1.0, "top_p": 1.0, "max_new_tokens": 16}},
    })
    m = run_critic(Params.model_validate(raw), tmp_path / "pairs.parquet", tmp_path / "out")
    sel = m["selection"]
    assert [c["checkpoint"] for c in sel["checkpoints"]] == ["epoch-1", "epoch-2"] and sel["n"] == 2
    chosen = next(c for c in sel["checkpoints"] if c["checkpoint"] == sel["chosen"])
    best = max(c["val_success"] for c in sel["checkpoints"])
    assert chosen["val_success"] == best
    assert chosen["heldout_mae"] == min(c["heldout_mae"] for c in sel["checkpoints"] if c["val_success"] == best)
    # the stage's model is the chosen checkpoint: its calibration is that checkpoint's
    assert m["calibration"]["heldout"]["mae"] == chosen["heldout_mae"]
    assert sel["checkpoints"][0]["heldout_mae"] != sel["checkpoints"][1]["heldout_mae"]  # two different critics
    assert not (tmp_path / "out/.epochs").exists()


def test_the_critic_trains_on_a_handful_of_pairs_and_says_they_are_few(tiny_model_dir, tmp_path, capsys):
    """Persuasion's quick look: the buffer's balance kept 4 pairs. The critic trains on them (a
    noisy batch does not stop it) and says they are few, and why."""
    rows = pairs_table(40)
    for i, r in enumerate(rows):
        r["selected"] = i < 4  # two good, two bad
    write_table(to_table(rows, "pairs"), tmp_path / "pairs.parquet", "pairs")
    params = Params.model_validate(tiny_params({"critic": {"base_model": str(tiny_model_dir), "epochs": 8}}))  # one batch a step, as there
    m = run_critic(params, tmp_path / "pairs.parquet", tmp_path / "out")
    out = capsys.readouterr().out
    n = m["calibration"]["train"]["pairs"]
    assert m["trained"] and n + m["calibration"]["heldout"]["pairs"] == 4 and n > 0
    assert len(json.loads((tmp_path / "out/loss.json").read_text())) == 8  # every step ran and logged
    assert m["few_pairs"] == f"{n} pairs to train on, fewer than one batch ({params.critic.batch_size}): its scores say little"
    assert f"critic: {n} pairs to train on (4 of the buffer's 40 pairs selected)" in out and m["few_pairs"] in out
    assert critic.untrained(tmp_path / "out/model") is None


def test_with_no_pair_to_train_on_the_critic_is_skipped_with_its_reason(tiny_model_dir, tmp_path, capsys):
    rows = pairs_table(10)
    for r in rows:
        r["selected"] = False
    write_table(to_table(rows, "pairs"), tmp_path / "pairs.parquet", "pairs")
    raw = tiny_params({"critic": {"base_model": str(tiny_model_dir)}})
    m = run_critic(Params.model_validate(raw), tmp_path / "pairs.parquet", tmp_path / "out")
    why = "no pair to train on (0 of the buffer's 10 pairs selected, 0 too long for the model's 1024 positions, 0 held out)"
    assert m["trained"] is False and m["untrained"] == why
    assert f"critic: not trained: {why}; it scores every pair 0.5" in capsys.readouterr().out
    assert json.loads((tmp_path / "out/metrics.json").read_text())["untrained"] == why
    assert critic.untrained(tmp_path / "out/model") == why
    # what best-of-N and the actor load: a critic that prefers no action
    score = critic.scorer(str(tmp_path / "out/model"))
    assert score([(r["prompt"], r["action"]) for r in rows]) == [0.5] * 10


def test_a_critic_stopped_mid_training_resumes_to_the_uninterrupted_weights(tiny_model_dir, tmp_path, monkeypatch, capsys):
    """With a checkpoint directory, a run stopped at step 25 resumes from its step-20 checkpoint
    and ends with the weights and loss curve of a run never stopped; the checkpoints go after."""
    import hashlib

    write_table(to_table(pairs_table(200), "pairs"), tmp_path / "pairs.parquet", "pairs")
    raw = tiny_params({"critic": {"base_model": str(tiny_model_dir), "epochs": 2, "batch_size": 8, "heldout_share": 0.2}})
    params = Params.model_validate(raw)
    run_critic(params, tmp_path / "pairs.parquet", tmp_path / "whole")

    steps = []
    loss = critic.CriticTrainer.compute_loss

    def stopping(self, *a, **k):
        steps.append(1)
        if len(steps) == 25:
            raise KeyboardInterrupt("stopped")
        return loss(self, *a, **k)

    monkeypatch.setattr(critic.CriticTrainer, "compute_loss", stopping)
    with pytest.raises(KeyboardInterrupt):
        run_critic(params, tmp_path / "pairs.parquet", tmp_path / "out", tmp_path / "ckpt")
    assert not (tmp_path / "out/model").exists()
    capsys.readouterr()
    monkeypatch.setattr(critic.CriticTrainer, "compute_loss", loss)
    run_critic(params, tmp_path / "pairs.parquet", tmp_path / "out", tmp_path / "ckpt")
    assert "critic: resuming from its checkpoint at step 20" in capsys.readouterr().out
    weights = [hashlib.sha256((tmp_path / d / "model/model.safetensors").read_bytes()).hexdigest() for d in ("whole", "out")]
    assert weights[0] == weights[1]
    assert (tmp_path / "out/loss.json").read_text() == (tmp_path / "whole/loss.json").read_text()
    assert not list((tmp_path / "ckpt").rglob("checkpoint-*"))
