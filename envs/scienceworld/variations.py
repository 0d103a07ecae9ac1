"""ScienceWorld's task types and each one's variations per split, as the simulator gives them
(`get_variations_train`, `_dev`, `_test`), kept in data/variations.json so that listing tasks
starts no JVM. The table is generated from the simulator by

    python -m envs.scienceworld.variations

(one JVM, a few seconds) and a system test checks it against the simulator. The splits map as
ETO's do: the simulator's train variations train, its dev variations ("seen": the same task
types, other variations) are val, its test variations test.
"""
from __future__ import annotations

import json

from .tables import VARIATIONS, expand, runs


def from_simulator() -> dict:
    """The table as the running simulator gives it (one JVM, closed before returning)."""
    from .simulator import Jvm, find_java

    jvm = Jvm(find_java(), 512, 120.0)
    try:
        server = jvm.interface()
        import scienceworld

        out = {}
        for t in jvm.call(server.getTaskNames):
            jvm.call(server.load, t, 0, "", False)
            out[t] = {s: runs(sorted(jvm.call(getattr(server, f"getVariations{s.capitalize()}")))) for s in ("train", "dev", "test")}
        return {"source": f"scienceworld {scienceworld.__version__} (python -m envs.scienceworld.variations)", "task_types": out}
    finally:
        jvm.close()


def main() -> None:
    data = from_simulator()
    lines = [f"  {json.dumps(t)}: {json.dumps(s)}" for t, s in data["task_types"].items()]  # one line a task type
    VARIATIONS.write_text(f'{{"source": {json.dumps(data["source"])},\n "task_types": {{\n' + ",\n".join(lines) + "\n}}\n")
    counts = {t: [len(expand(s[k])) for k in ("train", "dev", "test")] for t, s in data["task_types"].items()}
    print(f"wrote {VARIATIONS}: {len(counts)} task types; train / dev / test variations:")
    for t, c in counts.items():
        print(f"  {t}: {c[0]} / {c[1]} / {c[2]}")


if __name__ == "__main__":
    main()
