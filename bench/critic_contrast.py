"""Does a critic learn which action of one state is better? Read off a buffer's branch states.

    python bench/critic_contrast.py --buffer SEED/buffer/pairs.parquet [--critic NAME=PATH ...]
                                    [--base MODEL [--probe] [--fit-epochs N [--pair-loss]]] [--json OUT]

A branch state is a prompt where a logged (on-policy) action and a hindsight counterfactual
meet: the only place the buffer compares two actions of one state. It prints:

- how often the Monte Carlo target prefers the counterfactual there, at the states the critic
  trained on (any pair of the state `selected`) and at the others;
- for each --critic, how often its scores order those pairs as their targets do;
- with --probe, heads on the frozen --base fit by 5-fold cross-validation over states (the last
  token's hidden state, which the critic's head reads; the mean over the action's tokens; both),
  and how they order the pairs of every state with two actions of different targets;
- with --fit-epochs N, a critic on --base trained on 80% of the branch states with different
  targets (head fit first, as `critic.head_init: probe`, then Eq. 1 over each state's actions at
  a time, AdamW at 1e-4), and how it orders the pairs of its own states and of the 20% held out
  after every epoch: whether the comparison carries to states it has not seen; --pair-loss adds
  a Bradley-Terry term over each state's pairs of different targets.

Concordance counts pairs whose targets differ; a pair the scores tie counts as half.
"""
from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def by_state(rows: list[dict]) -> list[list[dict]]:
    """The buffer's pairs grouped by state (the exact prompt), in order of first appearance."""
    groups: dict[str, list[dict]] = {}
    for r in rows:
        groups.setdefault(json.dumps(r["prompt"], sort_keys=True, default=str), []).append(r)
    return list(groups.values())


def is_branch(state: list[dict]) -> bool:
    return len({r["source"] for r in state}) == 2


def ordered(a: float, b: float, ta: float, tb: float) -> float:
    """1 when scores a, b order the pair as targets ta != tb do, 0 when the other way, 1/2 when tied."""
    return 0.5 if a == b else float((a > b) == (ta > tb))


def concordance(states: list[list[dict]], score: dict[int, float], only_branch_pairs: bool = False) -> tuple[float | None, int]:
    """Share of pairs of one state with different targets that `score` (id(row) -> score) orders as
    the targets do, and the number of pairs. only_branch_pairs: a counterfactual against a
    logged action only."""
    got = []
    for state in states:
        for i, a in enumerate(state):
            for b in state[i + 1:]:
                if a["target"] == b["target"] or (only_branch_pairs and a["source"] == b["source"]):
                    continue
                got.append(ordered(score[id(a)], score[id(b)], a["target"], b["target"]))
    return (round(sum(got) / len(got), 3) if got else None), len(got)


def split_trained(states: list[list[dict]]) -> dict[str, list[list[dict]]]:
    return {"trained on": [s for s in states if any(r["selected"] for r in s)],
            "not trained on": [s for s in states if not any(r["selected"] for r in s)]}


def branch_figures(states: list[list[dict]], critics: dict[str, dict[int, float]]) -> dict:
    """At branch states, trained on or not: the target's preference for the counterfactual and
    each critic's concordance, over counterfactual-against-logged pairs."""
    branch = [s for s in states if is_branch(s)]
    out: dict = {"branch_states": len(branch)}
    hindsight = {id(r): float(r["source"] == "hindsight") for s in branch for r in s}
    for part, group in split_trained(branch).items():
        share, n = concordance(group, hindsight, only_branch_pairs=True)
        out[part] = {"states": len(group), "pairs": n, "target_prefers_counterfactual": share,
                     **{name: concordance(group, score, only_branch_pairs=True)[0] for name, score in critics.items()}}
    return out


def _encode(tokenizer, row: dict) -> tuple[list[int], int]:
    """The critic's input for a pair and where its action starts."""
    from storage.schema import chat_message
    from tasks.train import critic

    prompt = [chat_message(m) for m in row["prompt"]]
    ids = critic.encode(tokenizer, prompt, chat_message(row["action"]))
    state = tokenizer.apply_chat_template(prompt, tokenize=True, return_dict=True)["input_ids"]
    return ids, len(state)


def _features(model, tokenizer, rows: list[dict]):
    """[n, 2 * hidden]: the last token's hidden state, then the mean over the action's tokens."""
    import torch

    out = []
    with torch.no_grad():
        for r in rows:
            ids, start = _encode(tokenizer, r)
            context = model.config.max_position_embeddings
            start, ids = max(0, start - max(0, len(ids) - context)), ids[-context:]
            h = model.model(input_ids=torch.tensor([ids])).last_hidden_state[0]
            out.append(torch.cat([h[-1], h[start:].mean(0)]))
    return torch.stack(out)


def probe(base: str, states: list[list[dict]], folds: int = 5) -> dict:
    """Frozen-feature heads, cross-validated over states, at every state with two actions of
    different targets."""
    import torch

    from tasks.train import critic

    model, tokenizer = critic.load_critic(base, base=True)
    model.eval()
    multi = [s for s in states if len({r["target"] for r in s}) > 1]
    rows = [r for s in multi for r in s]
    x = _features(model, tokenizer, rows)
    y = torch.tensor([r["target"] for r in rows], dtype=torch.float32)
    fold = torch.tensor([i % folds for i, s in enumerate(multi) for _ in s])
    d = x.shape[1] // 2
    out = {"states": len(multi)}
    for name, f in (("last token", x[:, :d]), ("action mean", x[:, d:]), ("both", x)):
        s = torch.zeros(len(rows))
        for k in range(folds):
            w, b = critic.fit_linear(f[fold != k], y[fold != k], l2=1e-2, bias=True, max_iter=300)
            s[fold == k] = f[fold == k] @ w + b
        share, n = concordance(multi, dict(zip(map(id, rows), s.tolist())))
        out[name], out["pairs"] = share, n
    return out


def fit_on_branches(base: str, states: list[list[dict]], epochs: int, pair_loss: bool = False, seed: int = 0, lr: float = 1e-4, log=print) -> dict:
    """A critic on `base` trained on 80% of the branch states with different targets; concordance
    on its states and on the held-out 20% at the start and after each epoch. pair_loss adds a
    Bradley-Terry term over each state's pairs, -log sigmoid(score(better) - score(worse))."""
    import torch
    import torch.nn.functional as F

    from tasks.train import critic

    branch = [s for s in states if is_branch(s) and len({r["target"] for r in s}) > 1]
    random.Random(seed).shuffle(branch)
    cut = int(0.8 * len(branch))
    train, held = branch[:cut], branch[cut:]
    torch.manual_seed(seed)
    model, tokenizer = critic.load_critic(base, base=True)
    ids = {id(r): _encode(tokenizer, r)[0] for s in branch for r in s}

    def measure() -> dict:
        out = {}
        for part, group in (("train", train), ("held_out", held)):
            rows = [r for s in group for r in s]
            scores = critic.score(model, tokenizer, [ids[id(r)] for r in rows])
            out[part] = concordance(group, dict(zip(map(id, rows), scores)))
        return out

    critic.fit_head(model, tokenizer, [{"input_ids": ids[id(r)], "target": r["target"]} for s in train for r in s])
    curve = [{"epoch": 0, **measure()}]
    log(f"fit: {len(branch)} branch states, {len(train)} trained on, {len(held)} held out; epoch 0: {curve[-1]}")
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    for epoch in range(1, epochs + 1):
        model.train()
        random.Random(seed + epoch - 1).shuffle(train)
        for state in train:
            batch, mask, _ = next(critic._batches(model, tokenizer, [ids[id(r)] for r in state], len(state)))
            scores = model(input_ids=batch, attention_mask=mask).logits.squeeze(-1)
            loss = critic.soft_bce(scores, torch.tensor([r["target"] for r in state]))
            if pair_loss:
                better, worse = zip(*[(i, j) for i, a in enumerate(state) for j, b in enumerate(state) if a["target"] > b["target"]])
                loss = loss + (-F.logsigmoid(scores[list(better)] - scores[list(worse)])).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
        curve.append({"epoch": epoch, **measure()})
        log(f"fit: epoch {epoch}: {curve[-1]}")
    return {"states": len(branch), "train_states": len(train), "held_out_states": len(held), "pair_loss": pair_loss, "curve": curve}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--buffer", type=Path, required=True, help="a buffer stage's pairs.parquet")
    ap.add_argument("--critic", nargs="*", default=[], metavar="NAME=PATH", help="critics to read (a critic stage's model directory)")
    ap.add_argument("--base", help="the policy the critics start from (for --probe and --fit-epochs)")
    ap.add_argument("--probe", action="store_true", help="cross-validated heads on the frozen --base")
    ap.add_argument("--fit-epochs", type=int, default=0, help="train a critic on 80%% of the branch states for N epochs")
    ap.add_argument("--pair-loss", action="store_true", help="--fit-epochs with a Bradley-Terry term over each state's pairs beside Eq. 1")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (pinned: figures are compared side by side)")
    ap.add_argument("--json", type=Path, help="write the figures here")
    args = ap.parse_args()
    if (args.probe or args.fit_epochs) and not args.base:
        ap.error("--probe and --fit-epochs need --base")
    import polars as pl
    import torch

    from tasks.train import critic

    torch.set_num_threads(args.threads)
    if not args.buffer.is_file():
        ap.error(f"--buffer {args.buffer}: no such file")
    states = by_state(pl.read_parquet(args.buffer).to_dicts())
    critics = {}
    for spec in args.critic:
        name, sep, path = spec.partition("=")
        if not sep or not Path(path).is_dir():
            ap.error(f"--critic {spec}: expected NAME=PATH with PATH a critic's model directory")
        model, tokenizer = critic.load_critic(path)
        rows = [r for s in states if is_branch(s) for r in s]
        critics[name] = dict(zip(map(id, rows), critic.score(model, tokenizer, [_encode(tokenizer, r)[0] for r in rows])))
    out = {"buffer": str(args.buffer), "pairs": sum(map(len, states)), "states": len(states), "branch": branch_figures(states, critics)}
    print(f"{out['pairs']} pairs at {out['states']} states; {out['branch']['branch_states']} branch states")
    print("counterfactual against logged action, pairs with different targets: share of them the target / each critic orders as the target does")
    for part in ("trained on", "not trained on"):
        b = out["branch"][part]
        cols = ", ".join(f"{name} {b[name]}" for name in critics)
        print(f"  {part:15s} {b['states']} states, {b['pairs']} pairs: target prefers the counterfactual {b['target_prefers_counterfactual']}" + (f"; {cols}" if cols else ""))
    if args.probe:
        out["probe"] = probe(args.base, states)
        p = out["probe"]
        print(f"frozen-base heads, 5-fold over {p['states']} states with two actions of different targets ({p['pairs']} pairs): "
              + ", ".join(f"{k} {p[k]}" for k in ("last token", "action mean", "both")))
    if args.fit_epochs:
        out["fit"] = fit_on_branches(args.base, states, args.fit_epochs, pair_loss=args.pair_loss)
    if args.json:
        args.json.write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
