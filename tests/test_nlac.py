"""NLAC (tasks/nlac.py, tasks/train/nlac.py, envs/nlac.py): the critique's parser, the backup's
targets, the EMA step, prioritised replay, L2's mask, the params, and one iteration end to end on
the oracle roles (the system test in test_nlac_iteration.py runs it as a DVC stage)."""
import json

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch
from pydantic import ValidationError
from transformers import AutoTokenizer

from conftest import CONV, tiny_params, twenty_questions
from envs.nlac import Critique, parse_critique
from tasks.nlac import merged, run_nlac_iteration, transitions
from tasks.params import Params
from tasks.rollout import new_episode
from tasks.train import nlac as algorithm
from tasks.train.sft import IGNORE

GOOD = "Future:\nThe answer will be no, leaving 12 objects.\nOptimality:\nNo. Ask whether it is alive, which splits them 6/6."


def test_a_critique_is_read_in_the_papers_format():
    c = parse_critique(GOOD)
    assert c == Critique("The answer will be no, leaving 12 objects.", False, "Ask whether it is alive, which splits them 6/6.")
    assert parse_critique(c.text) == c  # the text L1 trains on reads back as itself
    assert parse_critique("  Future: found at turn 5.\nOptimality: yes") == Critique("found at turn 5.", True, "")


@pytest.mark.parametrize("text, why", [
    ("Optimality: Yes\nFuture: it ends well.", "must begin with 'Future:'"),
    ("REASON: x\nQUESTION: Is it an animal?", "must begin with 'Future:'"),
    ("Future: it ends well.", "no 'Optimality:' after the future"),
    ("Future: ok.\nFuture: again.\nOptimality: Yes", "2 'Future:' tags"),
    ("Future: ok.\nOptimality: Yes\nOptimality: No", "2 'Optimality:' tags"),
    ("Future:\nOptimality: Yes", "the future is empty"),
    ("Future: it ends well.\nOptimality: Maybe.", "must begin with Yes or No"),
    ("Future: it ends well.\nOptimality: No.", "'No' without how the action could be improved"),
])
def test_a_malformed_critique_is_refused_with_its_reason(text, why):
    with pytest.raises(ValueError, match=why):
        parse_critique(text)


# ---- the backup's target on a hand-made transition ----

def _turn(action: str, observation: str, reward: float = -1.0) -> dict:
    return {"turn": 0, "reason": "Ask.", "action": action, "observation": observation, "reward": reward}


def test_the_oracle_backup_grounds_the_target_in_the_response_and_at_the_end_in_the_reward():
    env = twenty_questions(3)
    task = env.task("Dog")
    # Not terminal: the answer it got, the objects it leaves, the expert's ending; a weak first question is not optimal.
    middle = env.oracle_backup(task, [], _turn("Is it an animal?", "yes"), terminal=False, final_return=-3.0)
    assert middle.future.startswith("The answer will be yes, leaving ") and "Final reward" not in middle.future
    assert "found at turn" in middle.future or "not found" in middle.future
    assert not middle.optimal and "instead" in middle.reason
    # Terminal: the right guess on the last turn; the future is the outcome and the game's return.
    turns = [_turn("Is it an animal?", "yes"), _turn("Does it bark?", "unknown")]
    end = env.oracle_backup(task, turns, _turn("Is it Dog?", "yes", 0.0), terminal=True, final_return=-2.0)
    assert end.future == "The answer will be yes: it is Dog. The game is won at turn 3 of 3. Final reward (the return of the whole game): -2."
    lost = env.oracle_backup(task, turns, _turn("Is it Cat?", "no"), terminal=True, final_return=-3.0)
    assert lost.future.endswith("That was the last turn: the game is lost. Final reward (the return of the whole game): -3.")


def test_the_llm_backup_bootstraps_from_the_next_observation_and_at_the_end_reads_the_reward():
    env = twenty_questions(20)
    state, action = CONV[:2], CONV[2]
    observation = [CONV[3]]  # "Answer: yes. Turn 2 of 20."
    live = env.target_request(state, action, observation, "I find it by turn 6.", reward=-1.0, terminal=False)
    roles = [m["role"] for m in live.messages]
    assert roles == ["system", "user", "assistant", "user", "assistant", "user"]
    assert "Answer: yes. Turn 2 of 20." in live.messages[3]["content"] and live.messages[4]["content"] == "I find it by turn 6."
    assert "Reward for that turn: -1.0" in live.messages[5]["content"]
    end = env.target_request(state, action, [CONV[5]], None, reward=-2.0, terminal=True)
    assert [m["role"] for m in end.messages] == ["system", "user", "assistant", "user"]  # no future is bootstrapped
    assert "the game is over" in end.messages[3]["content"] and "Final reward (the return of the whole game): -2.0" in end.messages[3]["content"]
    assert end.parse(GOOD).optimal is False
    with pytest.raises(ValueError, match="needs the bootstrapped future"):
        env.target_request(state, action, observation, None, reward=-1.0, terminal=False)
    # The critic's prompt, under which L1 trains, never shows the response the target saw.
    assert all("Answer: yes. Turn 2" not in m["content"] for m in env.critic_request(state, action).messages)


def played(*questions: str, env=None):
    """A 3-question TwentyQuestions game (in `env`, or a new one) for Dog, played with these
    questions by policy "p"."""
    env = env or twenty_questions(3)
    ep = new_episode(env, env.task("Dog"), 0)
    for reason, question in zip("abc", questions, strict=True):
        ep.apply(f"REASON: {reason}\nQUESTION: {question}")
    ep.policy_id = "p"
    return ep


def test_transitions_cut_an_episode_at_its_actions_the_last_one_terminal():
    ep = played("Is it an animal?", "Is it Cat?", "Is it Dog?")
    row = {"trajectory_id": "t0", **ep.to_row()}
    rows = transitions([row], iteration=1)
    assert [r["step"] for r in rows] == [0, 1, 2] and [r["terminal"] for r in rows] == [False, False, True]
    assert rows[1]["state"] == ep.messages[:4] and rows[1]["action"] == ep.messages[4] and rows[1]["observation"] == [ep.messages[5]]
    assert [t["action"] for t in rows[2]["turns"]] == ["Is it an animal?", "Is it Cat?", "Is it Dog?"]
    assert [r["reward"] for r in rows] == [-1.0, -1.0, 0.0] and {r["return"] for r in rows} == {-2.0}


# ---- the target network ----

def test_the_ema_step_moves_the_target_a_tau_of_the_way():
    torch.manual_seed(0)
    model, target = torch.nn.Linear(3, 2), torch.nn.Linear(3, 2)
    before = [p.detach().clone() for p in target.parameters()]
    algorithm.ema_step(target, model, 0.25)
    for bar, old, theta in zip(target.parameters(), before, model.parameters()):
        assert torch.allclose(bar, 0.75 * old + 0.25 * theta)
    algorithm.ema_step(target, model, 1.0)  # tau 1: a copy
    assert all(torch.equal(bar, theta) for bar, theta in zip(target.parameters(), model.parameters()))


# ---- prioritised replay on a hand-computed buffer ----

def test_per_probabilities_weights_and_priority_updates():
    p = np.array([1.0, 4.0, 9.0, 16.0])
    probs = algorithm.probabilities(p, 0.5)  # sqrt: 1, 2, 3, 4 over 10
    assert np.allclose(probs, [0.1, 0.2, 0.3, 0.4])
    assert np.allclose(algorithm.probabilities(p, 0.0), 0.25)  # alpha 0: uniform
    w = algorithm.importance_weights(p, np.array([0, 3]), 0.5, 1.0)  # (N P)^-1 over its largest, (4 * 0.1)^-1
    assert np.allclose(w, [1.0, (4 * 0.4) ** -1 / (4 * 0.1) ** -1]) and np.allclose(algorithm.importance_weights(p, np.array([3]), 0.5, 0.0), 1.0)
    drawn = algorithm.draw(p, 20000, 0.5, np.random.default_rng(0))
    assert np.allclose(np.bincount(drawn, minlength=4) / 20000, probs, atol=0.01)
    # L1 + epsilon replaces a drawn priority (a repeat's last draw wins); no L1 keeps it
    assert np.allclose(algorithm.reprioritised(p, np.array([1, 2, 1]), [0.5, None, 2.0], 0.01), [1.0, 2.01, 9.0, 16.0])


def test_new_transitions_join_at_the_largest_priority_and_the_oldest_go_first():
    old = [{"transition_id": f"o{i}", "priority": v} for i, v in enumerate([0.2, 3.0, 1.5])]
    new = [{"transition_id": "n0", "priority": 0.0}, {"transition_id": "n1", "priority": 0.0}]
    out = merged(old, new, None)
    assert [r["priority"] for r in out] == [0.2, 3.0, 1.5, 3.0, 3.0]
    assert [r["transition_id"] for r in merged(old, new, 3)] == ["o2", "n0", "n1"]
    assert [r["priority"] for r in merged([], new, None)] == [1.0, 1.0]  # an empty buffer: 1


# ---- L2's mask ----

def test_l2s_mask_covers_the_refined_action_alone(tiny_model_dir):
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    state = CONV[:4]  # the state holds an earlier action of the agent's: no loss on it
    refined = "REASON: Known: animal.\nQUESTION: Is it Dog?"
    row = algorithm.encoded(tokenizer, state, refined, 1024)
    learnt = [t for t in row["labels"] if t != IGNORE]
    assert tokenizer.decode(learnt) == refined + tokenizer.eos_token
    assert len(row["labels"]) - len(learnt) == len(tokenizer.apply_chat_template(state, add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"])
    assert algorithm.encoded(tokenizer, state, None, 1024) is None  # a failed refinement: no L2 for it
    assert algorithm.encoded(tokenizer, state, refined, 8) is None  # longer than the context: none either


# ---- Algorithm 1's two steps ----

def _trained(model_dir, update: str, learning_rate: float, learning_rate_l2: float | None = None, with_targets: bool = True) -> list[torch.Tensor]:
    """The tiny model's weights after 2 NLAC steps on fixed examples: a long critique for L1, a short action for L2."""
    from transformers import AutoModelForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model, target = (AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32) for _ in range(2))
    critique = GOOD + " The game goes on for many turns with questions about its size, colour and habitat." * 3

    def examples_for(drawn, step):
        return [algorithm.Example([*CONV[:2], CONV[2], {"role": "user", "content": "Judge your last turn."}], critique if with_targets else None,
                                  CONV[:2], "REASON: Ask.\nQUESTION: Is it alive?") for _ in drawn]

    algorithm.train(model, target, tokenizer, np.ones(4), examples_for, steps=2, batch_size=2, learning_rate=learning_rate, weight_decay=0.0,
                    max_grad_norm=None, tau=0.005, alpha=0.1, beta=0.4, epsilon=1e-3, token_mean=True, bf16=False, seed=0,
                    update=update, learning_rate_l2=learning_rate_l2)
    return [p.detach().clone() for p in model.parameters()]


def test_separate_steps_give_l2_its_own_step_whatever_l1s_scale(tiny_model_dir):
    # Reference: L2's steps alone (no critique to learn) at 1e-3.
    alone = _trained(tiny_model_dir, "separate", 1e-3, with_targets=False)
    # Separate: L1's step at lambda1 ~ 0 moves nothing, and L2's at lambda2 = 1e-3 is the step L2 takes alone.
    separate = _trained(tiny_model_dir, "separate", 1e-12, learning_rate_l2=1e-3)
    assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(separate, alone))
    # Joint: one step on L1 + L2, whose direction the critique's larger NLL sets: far from L2's own step.
    joint = _trained(tiny_model_dir, "joint", 1e-3)
    assert max((a - b).abs().max().item() for a, b in zip(joint, alone)) > 1e-4
    # and a separate L1 step at lambda1 moves the weights too: both losses train theta.
    both = _trained(tiny_model_dir, "separate", 1e-3)
    assert max((a - b).abs().max().item() for a, b in zip(both, alone)) > 1e-4


# ---- the trained critic against the oracle ----

class _Says:
    """A critic that writes the given texts, one per request, in order."""

    def __init__(self, texts):
        self.texts, self.asked = list(texts), []

    def generate(self, conversations, sampling, seeds):
        from models.base import Completion

        self.asked.append(sampling)
        return [Completion(self.texts.pop(0)) for _ in conversations]


def test_critic_accuracy_compares_the_critics_verdict_with_the_oracles_on_undrawn_transitions():
    from tasks.nlac import critic_accuracy

    env = twenty_questions(3)
    ep = played("Is it an animal?", "Is it an animal?", "Is it Dog?", env=env)
    rows = [{**r, "trained": 0} for r in transitions([{"trajectory_id": "t0", **ep.to_row()}], 1)]
    truth = [env.oracle_critique(env.task("Dog"), r["turns"][:-1], r["action"]["content"]).optimal for r in rows]
    assert truth[1] is False  # a repeated question is never the best move
    verdict = {True: "Yes", False: "No. Ask something new."}
    said = [f"Future: it goes on.\nOptimality: {verdict[truth[0]]}", "QUESTION: Is it Dog?", f"Future: won.\nOptimality: {verdict[not truth[2]]}"]
    p = Params.model_validate(tiny_params({"env": {"max_turns": 3}}))
    critic = _Says(said)
    acc = critic_accuracy(p, env, critic, rows)
    assert critic.asked[0].temperature == 0.0  # greedy
    assert (acc["transitions"], acc["parsed"], acc["parse_rate"], acc["accuracy"], acc["agreement"]) == (3, 2, 0.6667, 0.5, 0.3333)
    no = sum(not t for t in truth) / 3
    assert acc["oracle_no_share"] == round(no, 4) and acc["majority"] == round(max(no, 1 - no), 4)
    assert acc["top_reasons"][0][1].startswith("unparseable after 1 attempts: the critique must begin with 'Future:'")
    # only transitions never drawn are asked; none: nothing to measure
    assert critic_accuracy(p, env, _Says(said[:1]), [rows[0], *({**r, "trained": 2} for r in rows[1:])])["transitions"] == 1
    assert critic_accuracy(p, env, _Says([]), [{**r, "trained": 1} for r in rows])["transitions"] == 0


# ---- params ----

def test_nlac_params_name_the_baselines_and_chain_the_iterations():
    p = Params.model_validate(tiny_params({"nlac": {"algorithm": "ppo"}}))
    assert p.nlac.baseline().algorithm == "ppo_returns"
    grpo = Params.model_validate(tiny_params({"nlac": {"algorithm": "grpo", "method": {"algorithm": "grpo", "grpo": {"reward_column": "return"}}}})).nlac
    assert grpo.baseline().grpo.reward_column == "return"
    assert grpo.episodes_per_task() == 4 and p.nlac.episodes_per_task() == 1  # GRPO's group (NLAC's 4); every other algorithm's m
    with pytest.raises(ValidationError, match="nlac.algorithm grpo trains with grpo"):
        Params.model_validate(tiny_params({"nlac": {"algorithm": "grpo", "method": {"algorithm": "rft"}}}))
    with pytest.raises(ValidationError, match="nlac.group"):
        Params.model_validate(tiny_params({"nlac": {"algorithm": "grpo", "group": 1}}))  # a lone episode is no group
    with pytest.raises(ValidationError, match="learning_rate_l2 is L2's own step, and update: joint"):
        Params.model_validate(tiny_params({"nlac": {"update": "joint", "learning_rate_l2": 1e-3}}))
    with pytest.raises(ValidationError, match="nlac.method sets a baseline's settings"):
        Params.model_validate(tiny_params({"nlac": {"method": {"algorithm": "rft"}}}))
    with pytest.raises(ValidationError, match="Input should be 'nlac', 'rft', 'grpo' or 'ppo'"):
        Params.model_validate(tiny_params({"nlac": {"algorithm": "sac"}}))
    with pytest.raises(ValueError, match="no baseline"):
        Params.model_validate(tiny_params()).nlac.baseline()
    two = {"1": {"policy": "data/bootstrap/model"}, "2": {"policy": "data/iteration1/nlac/model"}}
    assert list(Params.model_validate(tiny_params({"nlac_iterations": two})).nlac_iterations) == [1, 2]
    with pytest.raises(ValidationError, match="iteration 2 collects with iteration 1's policy, data/iteration1/nlac/model"):
        Params.model_validate(tiny_params({"nlac_iterations": {**two, "2": {"policy": "data/bootstrap/model"}}}))
    with pytest.raises(ValidationError, match="'2' where iteration 1 belongs"):
        Params.model_validate(tiny_params({"nlac_iterations": {"2": two["2"]}}))
    with pytest.raises(ValidationError, match="roles.language_critic.backend|language_critic.backend"):
        Params.model_validate(tiny_params({"roles": {"language_critic": {"backend": "learned"}}}))


# ---- one iteration, then the next from it ----

def test_two_iterations_carry_the_policy_target_and_buffer_on(tiny_model_dir, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    two = {"1": {"policy": str(tiny_model_dir)}, "2": {"policy": "data/iteration1/nlac/model"}}
    sampling = {"temperature": 1.0, "top_p": 1.0, "max_new_tokens": 16}
    p = Params.model_validate(tiny_params({"limit_tasks": 1, "env": {"max_turns": 4}, "nlac_iterations": two,
                                           "nlac": {"steps": 2, "batch_size": 3, "sampling": sampling}}))
    first = run_nlac_iteration(p, 1, tmp_path / "data/iteration1/nlac", tmp_path / "data/iteration1/nlac_collect")
    d = tmp_path / "data/iteration1/nlac"
    buffer = pq.read_table(d / "buffer.parquet").to_pylist()
    samples = pq.read_table(d / "samples.parquet").to_pylist()
    assert len(buffer) == first["buffer"]["added"] == 4 and {r["added"] for r in buffer} == {1}  # one game of 4 turns
    assert len(samples) == 6 and sum(r["trained"] for r in buffer) == 6
    assert all(s["target_status"] == s["critique_status"] == s["refined_status"] == "ok" for s in samples)  # the oracle's, every one
    assert all(s["target"].startswith("Future:") and s["l1"] is not None and s["l2"] is not None for s in samples)
    drawn = {s["transition_id"] for s in samples}
    assert {r["priority"] != 1.0 for r in buffer if r["transition_id"] in drawn} == {True}  # reprioritised by L1
    assert {r["priority"] for r in buffer if r["transition_id"] not in drawn} <= {1.0}
    for key in ("optimality_no_share", "refined_changed_share", "first_l1", "final_l1", "first_l2", "final_l2", "priority_histogram", "success_on_collect"):
        assert first[key] is not None, key
    assert first["roles"]["language_critic"]["requests"] == 6 and first["roles"]["refiner"]["invalid"] == 0
    assert json.loads((d / "metrics.json").read_text())["buffer"]["size"] == 4
    # The trained critic against the oracle, on the transitions never drawn (the untrained tiny model writes no critique)
    assert first["critic_accuracy"]["transitions"] == sum(r["trained"] == 0 for r in buffer)
    assert [e["step"] for e in json.loads((d / "loss.json").read_text())] == [1, 2]
    assert (d / "target/model.safetensors").read_bytes() != (d / "model/model.safetensors").read_bytes()  # theta-bar lags theta
    second = run_nlac_iteration(p, 2, tmp_path / "data/iteration2/nlac", tmp_path / "data/iteration2/nlac_collect")
    assert second["buffer"] == {"size": 8, "added": 4, "from_earlier_iterations": 4, "never_drawn": second["buffer"]["never_drawn"]}
    carried = pq.read_table(tmp_path / "data/iteration2/nlac/buffer.parquet").to_pylist()
    assert max(r["priority"] for r in buffer) in {r["priority"] for r in carried if r["added"] == 2}  # new ones at the largest
    assert second["collect"]["policy_id"].startswith("model@")  # collected by iteration 1's policy
