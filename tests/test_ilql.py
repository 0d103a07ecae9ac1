"""ILQL (tasks/train/ilql.py, models/ilql.py): transitions, Bellman targets, the expectile and the
whole loss on a hand-computed batch, the masks on a real chat, Polyak targets, the extracted policy
and its play on the hf backend, and a few steps of the train stage on the tiny model."""
from __future__ import annotations

import json
import math

import polars as pl
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from conftest import CONV, tiny_params
from models.base import SamplingParams
from models.hf import HFGenerator
from models.ilql import IlqlForCausalLM, extract
from storage.parquet import write_table
from tasks.params import MethodParams, Params
from tasks.train.ilql import bellman_targets, expectile_loss, ilql_loss, transitions
from tasks.train.sft import IGNORE, tokenize_chats

I = IGNORE
# Row 0: agent tokens 5, 6 (one turn, positions 1-2), a user token, then 7 (a second turn); reward 2.
# Row 1: one agent token, then cut at the context: reward 5 never reached.
LABELS = torch.tensor([[I, I, 5, 6, I, I, 7, I], [I, 3, I, I, I, I, I, I]])
REWARD, CUT = torch.tensor([2.0, 5.0]), torch.tensor([False, True])
V = torch.tensor([1.0, 2.0, 3.0, 4.0])


def test_transitions_follow_the_agent_tokens_and_put_the_reward_on_the_last():
    t = transitions(LABELS, REWARD, CUT, gamma=0.9)
    assert t.rows.tolist() == [0, 0, 0, 1] and t.positions.tolist() == [1, 2, 5, 0]  # position i acts token i + 1
    assert t.actions.tolist() == [5, 6, 7, 3]
    assert t.next.tolist() == [1, 2, -1, -1]  # the first turn's end bootstraps from the next turn's first state
    assert t.reward.tolist() == [0.0, 0.0, 2.0, 0.0]  # a cut conversation's reward is never reached
    assert t.q_mask.tolist() == [True, True, True, False]
    assert t.discount.tolist() == pytest.approx([0.9, 0.9, 0.0, 0.0])
    assert transitions(LABELS, REWARD, CUT, gamma=0.9, discount_per="turn").discount.tolist() == pytest.approx([1.0, 0.9, 0.0, 0.0])


def test_bellman_targets_at_turn_ends_and_the_terminal():
    per_token = bellman_targets(transitions(LABELS, REWARD, CUT, 0.9), V)
    # r + gamma V(s'): 0.9 * V1, 0.9 * V2 at the first turn's end, r = 2 alone at the last action
    assert per_token.tolist() == pytest.approx([1.8, 2.7, 2.0, 0.0])
    per_turn = bellman_targets(transitions(LABELS, REWARD, CUT, 0.9, "turn"), V)
    assert per_turn.tolist() == pytest.approx([2.0, 2.7, 2.0, 0.0])  # no discount inside a turn
    v = V.clone().requires_grad_(True)
    assert not bellman_targets(transitions(LABELS, REWARD, CUT, 0.9), v).requires_grad  # V(s') is a fixed target


def test_the_expectile_both_ways_of_tau():
    u = torch.tensor([1.0, -1.0])  # target above V, target below V
    assert expectile_loss(u, 0.8).tolist() == pytest.approx([0.8, 0.2])
    assert expectile_loss(u, 0.2).tolist() == pytest.approx([0.2, 0.8])
    assert expectile_loss(u, 0.5).tolist() == pytest.approx([0.5, 0.5])  # half the squared error
    # V minimising it over targets {0, 1} is the tau-expectile: 0.8 * (1 - v) = 0.2 * v at v = 0.8, and 0.2 at tau 0.2.
    targets = torch.tensor([0.0, 1.0])
    for tau in (0.8, 0.2):
        v = torch.tensor(tau, requires_grad=True)
        expectile_loss(targets - v, tau).mean().backward()
        assert v.grad.item() == pytest.approx(0.0, abs=1e-6)


def hand_heads() -> dict:
    q = torch.zeros(2, 4, 8)
    q[0, torch.arange(4), torch.tensor([5, 6, 7, 3])] = 1.0  # head 1 gives the taken action 1, head 2 gives 0
    target_q = torch.stack([torch.full((4, 8), 0.5), torch.full((4, 8), 2.0)])  # their min: 0.5
    return {"logits": torch.zeros(4, 8), "q": q.requires_grad_(True), "target_q": target_q, "v": V.clone().requires_grad_(True)}


def test_the_loss_on_a_hand_computed_batch():
    heads = hand_heads()
    t = transitions(LABELS, REWARD, CUT, 0.9)
    loss, parts = ilql_loss(heads, t, tau=0.8, cql_weight=0.5, bc_weight=1.0)
    targets = [1.8, 2.7, 2.0]  # the cut row's action is out of the Q loss
    q_loss = (sum((y - 1) ** 2 for y in targets) + sum(y**2 for y in targets)) / 3
    v_loss = 0.2 * sum((0.5 - v) ** 2 for v in V.tolist()) / 4  # every u < 0: weight 1 - tau
    cql = (math.log(math.e + 7) - 1) + math.log(8)  # head 1's mean CE + head 2's (uniform)
    bc = math.log(8)
    assert parts["q_loss"] == pytest.approx(q_loss, rel=1e-5)
    assert parts["v_loss"] == pytest.approx(v_loss, rel=1e-5)
    assert parts["cql_loss"] == pytest.approx(cql, rel=1e-5)
    assert parts["bc_loss"] == pytest.approx(bc, rel=1e-5)
    assert loss.item() == pytest.approx(q_loss + v_loss + 0.5 * cql + bc, rel=1e-5)
    # the default CQL weight is 0: the loss is Q + V + BC
    assert ilql_loss(hand_heads(), t, 0.8)[0].item() == pytest.approx(q_loss + v_loss + bc, rel=1e-5)


def test_q_of_a_cut_action_gets_no_bellman_gradient():
    heads = hand_heads()
    t = transitions(LABELS, REWARD, CUT, 0.9)
    ilql_loss(heads, t, tau=0.8, cql_weight=0.0, bc_weight=0.0)[0].backward()
    assert heads["q"].grad[:, 3].abs().sum() == 0 and heads["q"].grad[:, :3].abs().sum() > 0
    # V learns from the expectile only: its gradient is that of the V loss, not of the detached targets
    assert heads["v"].grad.tolist() == pytest.approx([-2 * 0.2 * (0.5 - v) / 4 for v in V.tolist()])




def test_only_agent_tokens_are_actions_on_a_real_chat(tiny_model_dir):
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    ex = tokenize_chats(tok, [CONV], 1024).examples[0]
    ids, labels = torch.tensor([ex["input_ids"]]), torch.tensor([ex["labels"]])
    t = transitions(labels, torch.tensor([1.0]), torch.tensor([False]), 0.99)
    assert tok.decode(t.actions) == "".join(m["content"] + tok.eos_token for m in CONV if m["role"] == "assistant")
    assert (ids[0, t.positions + 1] == t.actions).all()
    # the reward sits on the final turn's end-of-turn token; the closing user message is no action
    assert t.reward.nonzero().flatten().tolist() == [len(t.actions) - 1] and t.actions[-1] == tok.eos_token_id
    first_end = int((t.actions == tok.eos_token_id).nonzero()[0])
    # s' of the first turn's end is the state just before the second turn: the user's reply is in it
    state = tok.decode(ids[0, : t.positions[t.next[first_end]] + 1])
    assert state.endswith("Answer: yes. Turn 2 of 20." + tok.eos_token + "<|assistant|>")


@pytest.fixture(scope="module")
def ilql_model(tiny_model_dir):
    torch.manual_seed(0)
    return IlqlForCausalLM.from_policy(AutoModelForCausalLM.from_pretrained(tiny_model_dir), beta=2.0)


def test_targets_start_as_the_q_heads_and_move_by_polyak(ilql_model):
    model = ilql_model
    online, target = model.q_heads[0][0].weight, model.target_q_heads[0][0].weight
    assert torch.equal(online, target) and not target.requires_grad
    with torch.no_grad():
        before = target.clone()
        online.add_(1.0)
    model.polyak(0.005)
    assert torch.allclose(target, 0.005 * online + 0.995 * before, atol=1e-6)
    with torch.no_grad():
        online.sub_(1.0)
    model.sync_targets()


def test_the_extracted_policy_logits(ilql_model, tiny_model_dir):
    logits = torch.tensor([[0.0, 1.0, 2.0]])
    target_q = torch.tensor([[[1.0, 0.0, 3.0]], [[2.0, -1.0, 1.0]]])  # min: [1, -1, 1]
    v = torch.tensor([0.5])
    got = extract(logits, target_q, v, beta=2.0)
    expected = logits.log_softmax(-1) + 2.0 * (torch.tensor([[1.0, -1.0, 1.0]]) - 0.5)
    assert torch.allclose(got, expected)
    # the model's logits are that formula on its own heads; beta = 0 plays pi_beta, the Llama's LM head
    ids = torch.tensor([[1, 5, 9, 12]])
    with torch.no_grad():
        h = ilql_model.model(ids).last_hidden_state
        heads = ilql_model.heads(h)
        assert torch.allclose(ilql_model(ids).logits, extract(heads["logits"], heads["target_q"], heads["v"], 2.0), atol=1e-5)
        policy = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
        ilql_model.config.beta = 0.0
        try:
            assert torch.allclose(ilql_model(ids, logits_to_keep=1).logits, policy(ids).logits[:, -1:].log_softmax(-1), atol=1e-5)
        finally:
            ilql_model.config.beta = 2.0


def test_a_saved_model_reloads_with_its_heads_and_the_hf_backend_plays_it(ilql_model, tiny_model_dir, tmp_path):
    favoured = AutoTokenizer.from_pretrained(tiny_model_dir).convert_tokens_to_ids("Q")
    with torch.no_grad():
        for head in ilql_model.target_q_heads:  # both targets (their min is read): Q favours one token, pi_beta does not
            head[2].bias[favoured] += 100.0
    ilql_model.save_pretrained(tmp_path / "m")
    AutoTokenizer.from_pretrained(tiny_model_dir).save_pretrained(tmp_path / "m")
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "m")
    assert isinstance(loaded, IlqlForCausalLM) and loaded.config.beta == 2.0
    for a, b in zip(loaded.state_dict().values(), ilql_model.state_dict().values()):
        assert torch.equal(a, b)
    gen = HFGenerator(tmp_path / "m", batch_size=2)
    prompt = CONV[:2]
    ids = gen._ids(prompt, generation_prompt=True)
    with torch.no_grad():
        first = int(loaded(torch.tensor([ids])).logits[0, -1].argmax())
        plain = int(AutoModelForCausalLM.from_pretrained(tiny_model_dir)(torch.tensor([ids])).logits[0, -1].argmax())
    greedy = SamplingParams(temperature=0.0, top_p=1.0, max_new_tokens=4)
    text = gen.generate([prompt], greedy, seeds=[0])[0].text
    assert first == favoured != plain  # the heads change the choice, so the backend's text tells which policy played
    assert text.startswith(gen.tokenizer.decode([first], skip_special_tokens=True).strip()) and text


def test_ilql_settings_belong_to_ilql():
    assert MethodParams(algorithm="ilql").ilql is None
    with pytest.raises(ValueError, match="algorithm ilql only"):
        MethodParams(algorithm="refit", ilql={"beta": 2.0})


def test_train_stage_trains_ilql_and_saves_it_with_its_heads(tiny_model_dir, tmp_path):
    def row(i: str, reward: float | None, messages=CONV) -> dict:
        return {
            "trajectory_id": i, "task_id": "Dog", "split": "train", "source": "policy", "parent_id": None, "relabel_id": None,
            "messages": messages, "reward": reward, "standardized_reward": None if reward is None else 0.0,
            "weight": None if reward is None else reward, "group_size": 1, "group_mean": reward, "group_std": 0.0,
            "standardize_status": "no_reward" if reward is None else "singleton",
        }

    short = CONV[:3] + [{"role": "user", "content": "Answer: no. Game over."}]
    table = pl.DataFrame([row("a", 1.0), row("b", 0.0, short), row("c", 1.0), row("d", None)])
    write_table(table.to_arrow(), tmp_path / "train.parquet", "training")
    methods = {"ilql": {"algorithm": "ilql", "ilql": {"beta": 2.0, "polyak": 0.1}}}
    raw = tiny_params({"train": {"base_model": str(tiny_model_dir), "batch_size": 2, "epochs": 2}})
    raw["train"]["methods"] = methods  # ilql alone (tiny_params adds to params.yaml's methods)
    params = Params.model_validate(raw)
    from tasks.train import run_train

    m = run_train(params, tmp_path / "train.parquet", tmp_path / "out")["methods"]["ilql"]
    assert (m["algorithm"], m["rows"], m["rows_skipped"], m["trained"]) == ("ilql", 3, 1, True)  # d has no reward
    assert math.isfinite(m["final_loss"]) and json.loads((tmp_path / "out/loss/ilql.json").read_text())
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "out/models/ilql")
    assert isinstance(model, IlqlForCausalLM) and model.config.beta == 2.0
    online, target = model.q_heads[0][0].weight, model.target_q_heads[0][0].weight
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    assert not torch.equal(model.model.embed_tokens.weight, base.model.embed_tokens.weight)  # the trunk trained
    assert not torch.equal(online, target) and torch.isfinite(target).all()  # the targets lag the trained Q heads


def test_the_vllm_backend_refuses_an_ilql_model(ilql_model, tmp_path):
    pytest.importorskip("vllm")
    from models.vllm import VLLMGenerator

    ilql_model.config.save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="plays on the hf backend"):
        VLLMGenerator(tmp_path)


def test_the_trainer_reads_the_heads_at_agent_states_only(ilql_model, tiny_model_dir, tmp_path):
    from transformers import TrainingArguments

    from tasks.params import IlqlParams
    from tasks.train.ilql import IlqlCollator, IlqlTrainer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    short = CONV[:3] + [{"role": "user", "content": "Answer: no. Game over."}]
    examples = [{**ex, "reward": r, "truncated": False} for ex, r in zip(tokenize_chats(tok, [CONV, short], 1024).examples, [1.0, -1.0])]
    batch = IlqlCollator(tok.pad_token_id)(examples)
    captured = {}

    def keep(_, __, out):
        out.last_hidden_state.retain_grad()
        captured["hidden"] = out.last_hidden_state

    handle = ilql_model.model.register_forward_hook(keep)
    try:
        args = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to="none", remove_unused_columns=False)
        trainer = IlqlTrainer(model=ilql_model, args=args, ilql=IlqlParams(cql_weight=1.0))
        trainer.compute_loss(ilql_model, dict(batch)).backward()
    finally:
        handle.remove()
        ilql_model.zero_grad()
    grad = captured["hidden"].grad.abs().sum(-1)
    states = torch.zeros_like(grad, dtype=torch.bool)
    states[:, :-1] = batch["labels"][:, 1:] != IGNORE  # the state before each agent token
    assert (grad[~states] == 0).all() and (grad[states] > 0).all()  # system, user and padding positions are never read


def test_a_resumed_run_ends_where_the_uninterrupted_one_did(tiny_model_dir, tmp_path, monkeypatch):
    """The target heads are in the checkpoint: resuming from step 7 of 8 repeats the last step to the bit."""
    import shutil

    from tasks.train import ilql

    short = CONV[:3] + [{"role": "user", "content": "Answer: no. Game over."}]
    table = pl.DataFrame({"messages": [CONV, short, CONV, short], "reward": [1.0, -1.0, 0.5, 0.0]})
    raw = tiny_params({"train": {"base_model": str(tiny_model_dir), "batch_size": 1, "epochs": 2}})
    raw["train"]["methods"] = {"ilql": {"algorithm": "ilql"}}
    tp = Params.model_validate(raw).train
    cfg = tp.config_for(tp.methods["ilql"]).model_copy(update={"checkpoint_dir": tmp_path / "ckpt", "checkpoint_steps": 1})

    def run():
        torch.manual_seed(0)
        return ilql.train(AutoModelForCausalLM.from_pretrained(tiny_model_dir), AutoTokenizer.from_pretrained(tiny_model_dir), table, cfg, seed=0)["model"]

    steps = []
    loss = ilql.IlqlTrainer.compute_loss
    monkeypatch.setattr(ilql.IlqlTrainer, "compute_loss", lambda self, *a, **k: steps.append(1) or loss(self, *a, **k))
    whole = run()
    assert len(steps) == 8 and (tmp_path / "ckpt/checkpoint-7/complete").exists()
    shutil.rmtree(tmp_path / "ckpt/checkpoint-8")
    resumed = run()
    assert len(steps) == 9  # the resumed run trained step 8 alone
    for (name, a), b in zip(whole.state_dict().items(), resumed.state_dict().values()):
        assert torch.equal(a, b), name
    assert not torch.equal(whole.q_heads[0][0].weight, whole.target_q_heads[0][0].weight)


def test_the_extracted_policy_prefers_the_rewarded_reply_that_cloning_does_not(tiny_model_dir):
    """Two replies logged equally often, one rewarded 1 and one 0: pi_beta stays near 50/50, the
    extracted policy (beta 4) puts the rewarded one far ahead. About 240 steps of the tiny model."""
    from tasks.train import ilql

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)

    def chat(reply: str) -> list[dict]:
        return [CONV[0], {"role": "user", "content": "Turn 1 of 20."}, {"role": "assistant", "content": reply}]

    good, bad = "Is it an animal?", "Is it Dog?"
    table = pl.DataFrame({"messages": [chat(good), chat(bad)] * 16, "reward": [1.0, 0.0] * 16})
    raw = tiny_params({"train": {"base_model": str(tiny_model_dir), "batch_size": 8, "epochs": 60, "learning_rate": 3e-3, "warmup_ratio": 0.0}})
    raw["train"]["methods"] = {"ilql": {"algorithm": "ilql", "ilql": {"polyak": 0.1, "beta": 4.0}}}  # fast targets: a short run
    tp = Params.model_validate(raw).train
    torch.manual_seed(0)
    model = ilql.train(AutoModelForCausalLM.from_pretrained(tiny_model_dir), tok, table, tp.config_for(tp.methods["ilql"]), seed=0)["model"].eval()

    def logp(reply: str) -> float:
        prompt = tok.apply_chat_template(chat(reply)[:2], add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"]
        ids = tok.apply_chat_template(chat(reply), tokenize=True, return_dict=True)["input_ids"]
        with torch.no_grad():
            lp = model(torch.tensor([ids])).logits[0].log_softmax(-1)
        return sum(lp[i - 1, ids[i]].item() for i in range(len(prompt), len(ids)))

    model.config.beta = 0.0
    assert abs(logp(good) - logp(bad)) < 0.3  # pi_beta: both about log 1/2
    model.config.beta = 4.0
    assert logp(good) - logp(bad) > 2.0
