"""Does a critic pick the better of the policy's candidates? (TwentyQuestions.)

    python bench/critic_choice.py --params PARAMS --policy MODEL --critic NAME=PATH [NAME=PATH ...]
                                  [--n 4] [--splits val test] [--limit-tasks K] [--json OUT]

The policy plays the games of --splits; at every turn it samples n candidates as best-of-N does
(evaluate.best_of_n.sampling) and every critic scores them. Each candidate is also scored by the
environment's oracle `worth` (envs/twenty_questions/proposer.py: what the action is worth from
the answers alone; for a question, how many still-consistent objects it rules out at worst). The
game goes on with a candidate drawn at random, so no critic steers the states the others see.

Over the turns whose candidates differ in worth, it prints the mean worth of each critic's
choice beside a random candidate's, the best's and the worst's, the choice's gain over random
with a 95% interval over those turns, and the share of candidate pairs (differing in worth and
in score) the critic orders as worth does. Best-of-N can only help where a critic's choice beats
random here; a critic whose choice does not has learnt the state's value, not the action's.
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tasks.evaluate import mean_se  # noqa: E402
from tasks.params import Params  # noqa: E402


def turn_figures(worths: list[int], scores: dict[str, list[float]]) -> dict | None:
    """One turn's figures, or None when its candidates are all worth the same (nothing to choose).
    A critic's choice is its first highest-scored candidate, as BestOfNAgent plays it."""
    if len(set(worths)) < 2:
        return None
    out = {"random": statistics.mean(worths), "best": max(worths), "worst": min(worths), "critics": {}}
    for name, s in scores.items():
        ordered = [(s[a] > s[b]) == (worths[a] > worths[b])
                   for a in range(len(worths)) for b in range(a + 1, len(worths)) if worths[a] != worths[b] and s[a] != s[b]]
        out["critics"][name] = {"choice": worths[max(range(len(s)), key=s.__getitem__)], "ordered": ordered}
    return out


def summary(turns: list[dict]) -> dict:
    """Means over the turns (turn_figures), each critic's gain over random with its 95% interval."""
    out = {"turns": len(turns), **{k: round(statistics.mean(t[k] for t in turns), 4) if turns else None for k in ("random", "best", "worst")}}
    names = turns[0]["critics"] if turns else {}
    for name in names:
        gain = [t["critics"][name]["choice"] - t["random"] for t in turns]
        m, se = mean_se(gain)
        pairs = [o for t in turns for o in t["critics"][name]["ordered"]]
        out[name] = {
            "choice": round(statistics.mean(t["critics"][name]["choice"] for t in turns), 4),
            "gain_over_random": round(m, 4), "ci95": [round(m - 1.96 * se, 4), round(m + 1.96 * se, 4)],
            "pairs": len(pairs), "concordance": round(sum(pairs) / len(pairs), 4) if pairs else None,
        }
    return out


def main() -> None:
    from envs.twenty_questions.proposer import worth
    from models.base import SamplingParams
    from tasks.roles import policy_generator
    from tasks.rollout import BestOfNAgent, derive_seed, new_episode, play
    from tasks.simulator import make_simulator
    from tasks.train import critic

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--params", type=Path, default=ROOT / "params.yaml")
    ap.add_argument("--policy", required=True, help="the policy's model directory")
    ap.add_argument("--critic", nargs="+", required=True, metavar="NAME=PATH", help="critics (a critic stage's model directory)")
    ap.add_argument("--n", type=int, default=4, help="candidates per turn (best-of-N's n)")
    ap.add_argument("--splits", nargs="+", default=["val", "test"])
    ap.add_argument("--limit-tasks", type=int, help="the first K games of each split")
    ap.add_argument("--json", type=Path, help="write the figures here")
    args = ap.parse_args()

    params = Params.model_validate(yaml.safe_load(args.params.read_text()))
    if params.env.name != "twenty_questions":
        sys.exit(f"--params: env.name is {params.env.name!r}; the oracle worth exists for twenty_questions only")
    critics = dict(c.split("=", 1) for c in args.critic)
    env = params.env.environment()
    generator = policy_generator(params, args.policy, params.evaluate.batch_size)
    scorers = {name: critic.scorer(path) for name, path in critics.items()}
    sampling = SamplingParams(**params.evaluate.best_of_n.sampling.model_dump())
    turns: list[dict] = []

    class Probe(BestOfNAgent):  # best-of-N's candidates; every critic and the oracle score them, a random one is played
        def act(self, episodes, step_seed):
            for ep in episodes:
                ep.policy_id = "critic-choice"
            played = []
            for ep, texts in zip(episodes, self.candidates(episodes)):
                if not texts:
                    played.append("")
                    continue
                view = ep.game.view()
                worths = [worth(env.kb, view, ep.game.read(t)[1]) for t in texts]
                if len(set(worths)) > 1:
                    pairs = [(ep.messages, ep.game.message(t)) for t in texts]
                    turns.append(turn_figures(worths, {name: s(pairs) for name, s in scorers.items()}))
                played.append(texts[random.Random(derive_seed(ep.seed, "critic-choice", len(ep.turns))).randrange(len(texts))])
            return played

    tasks = [t for split in args.splits for t in env.tasks(split)[: args.limit_tasks]]
    episodes = [new_episode(env, t, derive_seed(params.seed, "critic-choice", t.id)) for t in tasks]
    play(episodes, Probe(generator, sampling, args.n, None), derive_seed(params.seed, "critic-choice"), f"critic choice: {len(episodes)} games, {args.n} candidates a turn", make_simulator(params))
    out = summary(turns)
    print(f"\nTurns whose {args.n} candidates differ in worth: {out['turns']} of {sum(len(e.turns) for e in episodes)} "
          f"({len(episodes)} games of {', '.join(args.splits)}). Worth of the candidate played:")
    print(f"  {'random':<24}{out['random']}\n  {'best':<24}{out['best']}\n  {'worst':<24}{out['worst']}")
    for name in critics:
        c = out.get(name)
        if c:
            print(f"  {name:<24}{c['choice']}  (gain over random {c['gain_over_random']:+.3f} [{c['ci95'][0]:+.3f}, {c['ci95'][1]:+.3f}]; "
                  f"pairs ordered as worth: {c['concordance']} of {c['pairs']})")
    if args.json:
        args.json.write_text(json.dumps(out, indent=2) + "\n")


if __name__ == "__main__":
    main()
