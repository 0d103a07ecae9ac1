"""A few real ScienceWorld episodes, recorded once, and a simulator that plays them back, so the
fast tests run the environment's whole game (the format, the score map, the step limit, the
scripted expert, a JVM's death and the replay after it) with no JVM. Record them again with

    python -m envs.scienceworld.record tests/data/scienceworld_episodes.json

(one JVM, a few seconds). The recording holds, per episode, the task, its description and gold
path (the stored one, tables.py, where there is one), the first observation, the valid actions at the start, and each action's observation,
score and completion as the simulator answered them.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

from .tables import stored
from .policies import expert_path
from .simulator import Pool, Settings, SimulatorCrashed

SIMPLIFICATIONS = "easy"
# (task type, variation, actions: None for the expert's: the gold path, its door openings left out)
EPISODES = [
    ("find-animal", 0, None),  # train: to score 100
    ("lifespan-longest-lived", 62, None),  # val: completes one action before the gold path's last
    ("find-animal", 0, ["look around", "dance wildly", "open door", "0", "teleport to kitchen", "focus on red box"]),  # a wrong focus: -100
    ("find-non-living-thing", 225, None),  # test
]
GOLD_ERROR = "ERROR: Gold path was not generated.  Set `generateGoldPath` flag to true when calling load()."


def record(out: Path) -> None:
    from .simulator import Jvm, find_java

    jvm = Jvm(find_java(), 512, 120.0)
    try:
        server = jvm.interface()
        episodes = []
        for task_type, variation, actions in EPISODES:
            jvm.call(server.load, task_type, variation, SIMPLIFICATIONS, True)
            # the path the environment's expert plays: the stored one where tables.py has it
            gold = stored(task_type, variation, SIMPLIFICATIONS) or list(jvm.call(server.getGoldActionSequence))
            first = jvm.call(server.step, "look around")
            valid = sorted(jvm.call(server.getValidActionObjectCombinations))
            steps = []
            for action in expert_path(gold, doors_open=True) if actions is None else actions:
                observation = jvm.call(server.step, action)
                score, completed = int(round(100 * jvm.call(server.getScore))), bool(jvm.call(server.getCompleted))
                steps.append({"action": action, "observation": observation, "score": score, "completed": completed})
                if completed or score < 0:
                    break
            episodes.append({"task_type": task_type, "variation": variation, "description": jvm.call(server.getTaskDescription),
                             "gold_path": gold, "first": first, "valid_actions": valid, "steps": steps})
    finally:
        jvm.close()
    import scienceworld

    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"source": f"scienceworld {scienceworld.__version__} (python -m envs.scienceworld.record)",
                               "simplifications": SIMPLIFICATIONS, "episodes": episodes}, indent=1) + "\n")
    print(f"wrote {out}: " + ", ".join(f"{e['task_type']}-{e['variation']} ({len(e['steps'])} steps, score {e['steps'][-1]['score']})" for e in episodes))


class RecordedWorld:
    """A world that answers from the recording: an action sequence must follow a recorded one."""

    def __init__(self, backend: Recorded):
        self.backend, self.alive = backend, True
        self.episodes: list[dict] = []
        self.played: list[str] = []
        self.gold = self.looked = False

    def load(self, task_type: str, variation: int, simplifications: str, gold: bool) -> None:
        self.episodes = [e for e in self.backend.episodes if (e["task_type"], e["variation"]) == (task_type, variation)]
        if not self.episodes:
            raise KeyError(f"{task_type}-{variation} was not recorded")
        self.played, self.gold, self.looked = [], gold, False
        self.backend.loads += 1

    def step(self, action: str) -> tuple[str, int, bool]:
        self.backend.steps += 1
        if self.backend.steps == self.backend.crash_at:
            self.alive = False
            raise SimulatorCrashed("the recorded JVM died (as the test asked)")
        if not self.looked and action == "look around":  # the look after each load: the first observation
            self.looked = True
            return self.episodes[0]["first"], 0, False
        played = self.played + [action]
        for e in self.episodes:
            actions = [s["action"] for s in e["steps"]]
            if actions[: len(played)] == played:
                self.played = played
                s = e["steps"][len(played) - 1]
                return s["observation"], s["score"], s["completed"]
        raise KeyError(f"no recorded episode plays {played}")

    def task_description(self) -> str:
        return self.episodes[0]["description"]

    def gold_path(self) -> list[str]:
        return list(self.episodes[0]["gold_path"]) if self.gold else [GOLD_ERROR]  # the package's own answer

    def valid_actions(self) -> list[str]:
        if self.played:
            raise KeyError("valid actions were recorded at the start only")
        return list(self.episodes[0]["valid_actions"])


class Recorded:
    """A backend of recorded worlds (tests). `crash_at`: the step number (counted over every
    world) at which the world dies, as a JVM would."""

    def __init__(self, path: Path, capacity: int = 8, crash_at: int | None = None):
        data = json.loads(Path(path).read_text())
        self.episodes, self.capacity, self.crash_at = data["episodes"], capacity, crash_at
        self.simplifications = data["simplifications"]
        self.steps = self.loads = 0
        self.closed = False

    def new_world(self) -> RecordedWorld:
        return RecordedWorld(self)

    def close(self) -> None:
        self.closed = True

    def pool(self, restarts: int = 2, simplifications: str | None = None) -> Pool:
        """A pool of these worlds. Another `simplifications` than the recording's makes the pool
        use no stored gold path (gold.py): it loads each task with its gold path instead."""
        return Pool(self, Settings(simplifications=simplifications or self.simplifications, restarts=restarts))


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python -m envs.scienceworld.record OUT.json")
    record(Path(sys.argv[1]))
