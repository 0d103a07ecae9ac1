"""How well does each scripted behaviour policy of an environment play? The figures bootstrap's
demonstrations are read against.

    python bench/scripted_policies.py --env persuasion [--episodes 3] [--splits train val test]

Plays every scripted policy of the environment (its defaults, and bootstrap's noise settings
from params.yaml) on every task of each split, --episodes times with seeds derived from (policy,
task, episode), against the environment's oracle. Prints mean return ± standard error, the share
of games won (Environment.won) and mean turns per policy and split; no model is involved.
"""
from __future__ import annotations

import argparse
import random
import statistics
import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def play(env, policy, task, rng: random.Random) -> tuple[float, int]:
    game = env.game(task)
    game.reset()
    total, turns = 0.0, 0
    while True:
        step = game.step(policy.act(game, rng))
        total, turns = total + step.reward, turns + 1
        if step.terminated or step.truncated:
            return total, turns


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--env", required=True, help="an environment name (envs.registry)")
    ap.add_argument("--episodes", type=int, default=3, help="episodes per task and policy")
    ap.add_argument("--splits", nargs="+", default=["train", "val", "test"])
    args = ap.parse_args()

    from envs import registry
    from tasks.rollout import derive_seed

    noise = yaml.safe_load((ROOT / "params.yaml").read_text())["bootstrap"]["noisy"]
    env = registry.make(args.env, {})
    print(f"{args.env}: {args.episodes} episodes per task, oracle roles; return mean ± standard error")
    print(f"{'split':<6} {'policy':<8} {'games':>6} {'return':>16} {'won':>6} {'turns':>6}")
    for split in args.splits:
        for name, policy in env.policies(noise).items():
            results = [play(env, policy, task, random.Random(derive_seed(0, "scripted", name, task.id, e)))
                       for task in env.tasks(split) for e in range(args.episodes)]
            returns = [r for r, _ in results]
            se = statistics.stdev(returns) / len(returns) ** 0.5 if len(returns) > 1 else 0.0
            won = sum(env.won(r) for r in returns) / len(returns)
            turns = statistics.mean(t for _, t in results)
            print(f"{split:<6} {name:<8} {len(returns):>6} {statistics.mean(returns):>8.3f} ± {se:<5.3f} {won:>6.2f} {turns:>6.1f}")


if __name__ == "__main__":
    main()
