"""How good is a TwentyQuestions base policy, and where does it fail on held-out games?

    python bench/base_policy.py --out bench/out/base_policy/NAME [--set bootstrap.demos_per_task=6 ...]

Trains the bootstrap stage's policy with params.yaml and the overrides (skipped when OUT/model
exists: --retrain redoes it; with params.yaml's own keys bootstrap.checkpoint auto takes the shipped
base instead, and --set bootstrap.checkpoint=null trains it again), then plays one episode per task: greedy on every split, at T = 1.0 on
train (HOPE's bar for pi_0: half of train games) and at T = 0.7 on val and test. Of the held-out
games played greedy, it counts those where the policy asked exactly the scripted expert's
questions up to the expert's guess, and which split the object it then named comes from: a policy
that learnt the decision tree but cannot name an object it never played names a train object or
none. Then naming alone: after the expert's whole game, the model completes its guess's reason.
Prints one table; writes OUT/base_policy.json.
"""
from __future__ import annotations

import argparse
import json
import random
import sys
import time
from collections import Counter
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.hindsight_repro import override  # noqa: E402

PLAYS = [("greedy", 0.0, ["train", "val", "test"]), ("T=1.0", 1.0, ["train"]), ("T=0.7", 0.7, ["val", "test"])]


def followed_the_expert(episodes: list) -> Counter:
    """(split, outcome) counts: `off the tree` when the policy's questions left the expert's before
    its guess, else the split of the object it named at that point (`none`: no object)."""
    from envs.twenty_questions.game import Game
    from envs.twenty_questions.kb import load_kb
    from envs.twenty_questions.policies import ExpertPolicy, play

    kb = load_kb()
    expert = ExpertPolicy(kb)
    counts: Counter = Counter()
    for e in episodes:
        # The expert never samples (ties go to the first question), so any rng gives its one path.
        path = [a.question for a, _ in play(expert, Game(kb, e.task, max_turns=e.game.max_turns), e.game.candidates, random.Random(0))]
        asked = [m["content"].split("QUESTION:")[-1].strip() for m in e.messages if m["role"] == "assistant"]
        if asked[: len(path) - 1] != path[:-1] or len(asked) < len(path):
            counts[(e.split, "off the tree")] += 1
        else:
            named = kb.resolve_guess(asked[len(path) - 1])
            counts[(e.split, f"named a {named.split} object" if named else "named none")] += 1
    return counts


def named_after_the_expert(model_dir: Path, params, splits: list[str]) -> dict[str, dict[str, int]]:
    """Naming alone, with the tree taken out: the expert's whole game is given up to its guess's
    reason ("not hand-sized, outdoor, ...: only"), and the model writes the next words greedily.
    Counts per split: `right` (the secret), `other` (another object), `none`; games the expert
    ends without a unique object are skipped."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    env = params.env.environment()
    expert = env.policies(params.bootstrap.noisy.model_dump())["expert"]
    counts: dict[str, dict[str, int]] = {}
    for split in splits:
        c = counts.setdefault(split, {"right": 0, "other": 0, "none": 0})
        for task in env.tasks(split)[: params.bootstrap.limit_tasks]:
            game = env.game(task)
            messages, _ = game.reset()
            rng = random.Random(0)
            while True:
                text = expert.act(game, rng)
                step = game.step(text)
                if step.terminated or step.truncated:
                    break
                messages += [step.info["message"], *step.observation]
            # The guess's reason lists the answers ("...: only X fits.") or, when the observation
            # does (env.observation: known), only names the object ("Only X fits.").
            cue = ": only " if ": only " in text else "REASON: Only " if "REASON: Only " in text else None
            if cue is None:
                continue
            full = tok.apply_chat_template([*messages, {"role": "assistant", "content": text}], tokenize=False)
            prefix = full[: full.rindex(cue) + len(cue) - 1]
            ids = torch.tensor([tok(prefix, add_special_tokens=False)["input_ids"]])
            with torch.no_grad():
                out = model.generate(ids, max_new_tokens=12, do_sample=False, pad_token_id=tok.pad_token_id)
            said = tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True).strip()
            named = said.split(" fits")[0].strip()
            c["right" if named == task.name else "other" if named else "none"] += 1
    return counts


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--set", dest="sets", action="append", default=[], help="a params override, key.path=value")
    ap.add_argument("--retrain", action="store_true", help="train again even if OUT/model exists")
    args = ap.parse_args()

    from models.base import SamplingParams
    from models.hf import HFGenerator
    from tasks.bootstrap import _eval_episodes, run_bootstrap
    from tasks.params import Params
    from tasks.rollout import LMAgent, derive_seed, play, stats_by_split
    from tasks.runtime import apply

    raw = yaml.safe_load((ROOT / "params.yaml").read_text())
    for assignment in args.sets:
        override(raw, assignment)
    params = Params.model_validate(raw)
    apply(params.runtime)
    t0 = time.time()
    if args.retrain or not (args.out / "model").exists():
        run_bootstrap(params, args.out)
    boot = json.loads((args.out / "metrics.json").read_text())
    gen = HFGenerator(args.out / "model", batch_size=params.bootstrap.eval_batch_size, dtype=params.roles.policy.dtype)
    result: dict = {"overrides": args.sets, "parameters": boot["model"]["parameters"], "train_seconds": boot["model"]["train_seconds"],
                    "final_loss": boot["model"]["final_loss"], "success": {}}
    max_new_tokens = params.bootstrap.eval_sampling.max_new_tokens
    for name, temperature, splits in PLAYS:
        agent = LMAgent(gen, SamplingParams(temperature=temperature, top_p=1.0, max_new_tokens=max_new_tokens))
        episodes = play(_eval_episodes(params, splits, name), agent, derive_seed(params.seed, "base-policy", name), name)
        result["success"][name] = {split: s["success_rate"] for split, s in stats_by_split(episodes).items()}
        if name == "greedy":
            held_out = [e for e in episodes if e.split != "train"]
            result["held_out_greedy"] = {f"{split}: {outcome}": n for (split, outcome), n in sorted(followed_the_expert(held_out).items())}
    result["named_after_the_expert"] = named_after_the_expert(args.out / "model", params, ["train", "val", "test"])
    result["seconds"] = round(time.time() - t0)
    (args.out / "base_policy.json").write_text(json.dumps(result, indent=1) + "\n")

    print(f"\nbase policy in {args.out}: {result['parameters'] / 1e6:.2f}M parameters, SFT {result['train_seconds']:.0f} s, "
          f"final loss {result['final_loss']:.3f}; overrides: {args.sets or 'none'}")
    for name, by_split in result["success"].items():
        print(f"  success {name:<7}" + "".join(f"  {split} {rate:.3f}" for split, rate in by_split.items()))
    print("  held-out games played greedy, against the expert's path:")
    for outcome, n in result["held_out_greedy"].items():
        print(f"    {outcome}: {n}")
    print("  naming alone, after the expert's game up to its guess (right / other object / none):")
    for split, c in result["named_after_the_expert"].items():
        print(f"    {split}: {c['right']} / {c['other']} / {c['none']}")


if __name__ == "__main__":
    main()
