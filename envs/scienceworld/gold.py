"""The gold paths of the default task types' variations, generated once and kept in
data/gold_paths.json, so that the expert's demonstrations are the same from run to run.

The simulator's gold path for a variation is not a function of the variation: from one load to
the next it may pick another thing of the kind asked for (the dove egg, then the blue jay egg)
or another route, and seeding Scala's random generator does not fix it. The world itself is
(the same observations for the same actions), so with its path fixed an expert episode is too.
Paths for other task types, or another `simplifications`, are generated on load as before. The
table is written by

    python -m envs.scienceworld.gold

(one JVM, a few minutes) and a system test plays some of its paths to score 100.
"""
from __future__ import annotations

import json

from .tables import GOLD


def main() -> None:
    import scienceworld

    from .simulator import Jvm, find_java
    from .tables import DEFAULT_TASK_TYPES, table

    simplifications = "easy"
    jvm = Jvm(find_java(), 512, 120.0)
    paths = {}
    try:
        server = jvm.interface()
        for task_type in DEFAULT_TASK_TYPES:
            for split in ("train", "val", "test"):
                for v in table()[task_type][split]:
                    jvm.call(server.load, task_type, v, simplifications, True)
                    paths[f"{task_type}-{v}"] = list(jvm.call(server.getGoldActionSequence))
    finally:
        jvm.close()
    lines = [f"  {json.dumps(k)}: {json.dumps(p)}" for k, p in paths.items()]  # one line a task
    GOLD.write_text(f'{{"source": "scienceworld {scienceworld.__version__} (python -m envs.scienceworld.gold)",\n'
                     f' "simplifications": {json.dumps(simplifications)},\n "paths": {{\n' + ",\n".join(lines) + "\n}}\n")
    print(f"wrote {GOLD}: the gold paths of {len(paths)} tasks ({', '.join(DEFAULT_TASK_TYPES)})")


if __name__ == "__main__":
    main()
