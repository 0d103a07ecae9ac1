"""ScienceWorld's simulator: steps per second, one simulator against two at once, and how an
episode's time splits between the simulator and the policy.

    python bench/scienceworld_sim.py [--episodes 28] [--model DIR] [--small]

Every row plays the expert's actions (each task's stored gold path, less its door openings) on the first --episodes train tasks
of the environment's default task types (find-*, lifespan-*), after one untimed warm-up episode
per simulator (the JVM's first steps are several times slower):
- package step: the `scienceworld` package's own `ScienceWorldEnv.step`, one JVM, as ETO calls
  it (load with the gold path, reset, step): each step also lists every valid action and looks
  around, which the environment's pool leaves out;
- pool, 1 simulator: the environment's games (reset, then step) on a pool of one JVM;
- pool, 2 simulators at once: the same episodes split between two threads, each its own half,
  on a pool of two JVMs (py4j waits outside the GIL, so the two JVMs run on two cores).
Then the time of an episode of the pool's rows split into its reset (loading the task), the
simulator's steps and the policy's turns: the scripted expert's, and with --model the policy's
own generation (an hf model writing a whole turn from the episode's chat, all live episodes in
one batch as collect generates) while the expert's action is played, so the simulator does the
work of a successful episode. JVM start is timed apart. Prints the tables and the ratios; writes
bench/out/scienceworld_sim.json. Run with two cores free for the two-simulator row to mean
anything: on a loaded machine its ratio falls toward 1.
"""
from __future__ import annotations

import argparse
import json
import platform
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from envs.scienceworld import simulator  # noqa: E402
from envs.scienceworld.env import ScienceWorld, ScienceWorldOptions  # noqa: E402
from envs.scienceworld.policies import Expert, expert_path  # noqa: E402
from envs.scienceworld.tables import stored  # noqa: E402


def clock() -> float:
    return time.perf_counter()


class Timed:
    """Wall seconds spent in reset, simulator steps and policy turns, and the steps taken."""

    def __init__(self):
        self.reset = self.sim = self.policy = 0.0
        self.steps = self.episodes = self.successes = 0
        self.lock = threading.Lock()

    def add(self, other: Timed) -> None:
        with self.lock:
            for k in ("reset", "sim", "policy", "steps", "episodes", "successes"):
                setattr(self, k, getattr(self, k) + getattr(other, k))


def play(env: ScienceWorld, task_ids: list[str], generate=None) -> Timed:
    """Play the expert on each task, timing reset, simulator steps and the policy's turns.
    `generate`, if given, is the policy: called with the chat, its time counts as the policy's."""
    t, expert, rng = Timed(), Expert(), None
    for tid in task_ids:
        game = env.game(env.task(tid))
        t0 = clock()
        messages, _ = game.reset()
        t.reset += clock() - t0
        while not game.done:
            t0 = clock()
            if generate is not None:
                generate(messages)
            text = expert.act(game, rng)
            t.policy += clock() - t0
            t0 = clock()
            step = game.step(text)
            t.sim += clock() - t0
            messages += [step.info["message"], *step.observation]
            t.steps += 1
        t.episodes += 1
        t.successes += game.success
    return t


def package_steps(task_ids: list[str], simplifications: str) -> tuple[Timed, float]:
    """The package's ScienceWorldEnv as ETO drives it: load with the gold path, reset, step
    through the gold path until done; (times, wall seconds), after a warm-up episode."""
    jvm = simulator.Jvm(simulator.find_java(), 1024, 120.0)
    env, t = jvm.env, Timed()
    try:
        for i, tid in enumerate([task_ids[0], *task_ids]):
            if i == 1:  # the first was the warm-up
                t, wall0 = Timed(), clock()
            task_type, _, variation = tid.rpartition("-")
            t0 = clock()
            env.load(task_type, int(variation), simplifications, generateGoldPath=True)
            env.reset()
            t.reset += clock() - t0
            # the expert's path, as the pool's rows play it
            path = expert_path(stored(task_type, int(variation), simplifications) or env.get_gold_action_sequence(), doors_open=True)
            for action in path:
                t0 = clock()
                _, _, done, info = env.step(action)
                t.sim += clock() - t0
                t.steps += 1
                if done:
                    break
            t.episodes += 1
            t.successes += info["score"] >= 100
        wall = clock() - wall0
    finally:
        jvm.close()
    return t, wall


def pool_rows(task_ids: list[str], simulators: int, generate=None) -> tuple[Timed, float, float]:
    """(times, wall seconds of the timed episodes, JVM start seconds) on a fresh pool of
    `simulators` JVMs, one thread each, the episodes dealt out in turn."""
    env = ScienceWorld(ScienceWorldOptions(simulators=simulators))
    t0 = clock()
    env.pool.backend.warm()
    start = clock() - t0
    shares = [task_ids[i::simulators] for i in range(simulators)]
    total = Timed()
    try:
        with ThreadPoolExecutor(simulators) as ex:  # warm-up: one episode per simulator, untimed
            list(ex.map(lambda share: play(env, share[:1]), shares))
            t0 = clock()
            for t in ex.map(lambda share: play(env, share, generate), shares):
                total.add(t)
            wall = clock() - t0
    finally:
        env.pool.close()
    return total, wall, start


def model_policy(model: Path, max_new_tokens: int):
    """A policy's generation, hf on one thread: one turn from the episode's chat, greedy."""
    import torch

    from models.base import SamplingParams
    from models.hf import HFGenerator

    torch.set_num_threads(1)
    gen = HFGenerator(str(model), batch_size=1)
    sampling = SamplingParams(temperature=0.0, top_p=1.0, max_new_tokens=max_new_tokens)
    return lambda messages: gen.generate([messages], sampling, [0])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--episodes", type=int, default=28, help="the first N train tasks (the default types interleaved: 4 of each at 28)")
    ap.add_argument("--model", type=Path, default=None, help="also time an hf policy's generation (a model directory)")
    ap.add_argument("--max-new-tokens", type=int, default=48, help="the policy's turn length, with --model")
    ap.add_argument("--small", action="store_true", help="CI size: 4 episodes")
    ap.add_argument("--out", type=Path, default=ROOT / "bench/out/scienceworld_sim.json")
    args = ap.parse_args()
    if args.small:
        args.episodes = 4
    env = ScienceWorld(ScienceWorldOptions())
    task_ids = [t.id for t in env.tasks("train")[: args.episodes]]

    pkg, pkg_wall = package_steps(task_ids, env.options.simplifications)
    one, one_wall, one_start = pool_rows(task_ids, 1)
    two, two_wall, two_start = pool_rows(task_ids, 2)
    rows = [
        ("package step (ScienceWorldEnv.step)", 1, pkg, pkg_wall),
        ("pool, 1 simulator", 1, one, one_wall),
        ("pool, 2 simulators at once", 2, two, two_wall),
    ]
    rate = {name: t.steps / wall for name, _, t, wall in rows}
    base = rate["pool, 1 simulator"]
    print(f"\n{len(task_ids)} episodes (first train tasks of {', '.join(env.options.task_types)}), the expert's actions, "
          f"simplifications {env.options.simplifications!r}; JVM start: {one_start:.2f} s (1), {two_start:.2f} s (2 at once)")
    print("steps/s: steps over the wall time of the episodes, loading included; ms/step: the time inside one step call")
    print(f"{'row':<38}{'JVMs':>5}{'episodes':>9}{'steps':>7}{'seconds':>9}{'steps/s':>9}{'x pool 1':>9}{'ms/step':>9}")
    for name, jvms, t, wall in rows:
        print(f"{name:<38}{jvms:>5}{t.episodes:>9}{t.steps:>7}{wall:>9.2f}{t.steps / wall:>9.1f}{t.steps / wall / base:>9.2f}{1000 * t.sim / t.steps:>9.1f}")
    print(f"pool 1 / package step (steps/s): {base / rate['package step (ScienceWorldEnv.step)']:.2f}")
    print(f"package / pool (ms in a step call): {(pkg.sim / pkg.steps) / (one.sim / one.steps):.2f}")
    print(f"pool 2 at once / pool 1 (steps/s): {rate['pool, 2 simulators at once'] / base:.2f}")
    succeeded = all(t.successes == t.episodes for _, _, t, _ in rows)
    print(f"every episode reached score 100: {succeeded}")

    splits = [("scripted expert", one)]
    if args.model:
        lm, _, _ = pool_rows(task_ids, 1, model_policy(args.model, args.max_new_tokens))
        splits.append((f"{args.model}, {args.max_new_tokens} tokens", lm))
    print(f"\nan episode's time (pool, 1 simulator), mean over {one.episodes} episodes:")
    print(f"{'policy':<48}{'reset s':>9}{'sim s':>9}{'policy s':>10}{'sim share':>11}{'sim s/step':>12}")
    split_rows = []
    for name, t in splits:
        total = t.reset + t.sim + t.policy
        share = (t.reset + t.sim) / total
        print(f"{name:<48}{t.reset / t.episodes:>9.3f}{t.sim / t.episodes:>9.3f}{t.policy / t.episodes:>10.3f}{share:>11.2f}{t.sim / t.steps:>12.4f}")
        split_rows.append({"policy": name, "episodes": t.episodes, "steps": t.steps, "reset": t.reset, "sim": t.sim, "policy_seconds": t.policy, "sim_share": share})
    print("sim share: (reset + steps) / (reset + steps + policy)")
    print(f"JVMs left running: {len(simulator.running_jvms())}")

    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({
        "episodes": len(task_ids), "task_ids": task_ids, "machine": platform.platform(),
        "rows": [{"row": n, "jvms": j, "episodes": t.episodes, "steps": t.steps, "seconds": wall, "steps_per_s": t.steps / wall,
                  "ms_per_step": 1000 * t.sim / t.steps} for n, j, t, wall in rows],
        "pool_over_package": base / rate["package step (ScienceWorldEnv.step)"], "two_over_one": rate["pool, 2 simulators at once"] / base,
        "jvm_start": {"1": one_start, "2": two_start}, "split": split_rows, "all_succeeded": succeeded,
    }, indent=1))


if __name__ == "__main__":
    main()
