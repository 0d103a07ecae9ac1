"""Training faults: a NaN or diverging loss stops the train stage with one clear error and no model;
a killed train stage resumes from its last checkpoint and ends byte-identical to an uninterrupted run."""
import hashlib
import inspect
import json
import random
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import polars as pl
import pytest
from transformers import TrainerControl, TrainerState

from conftest import CODE, ROOT, TINY, built, digest, tiny_params
from storage.parquet import read_table, write_table
from tasks.params import Params
from tasks.train import run_train
from tasks.train.sft import LossGuard, TrainingDiverged

WORDS = ["Dog", "Cat", "Apple", "Chair", "River", "Violin", "Lemon", "Train"]


def conversation(i: int) -> list[dict]:
    """1 to 4 turns: trajectories of different lengths, so the length-grouped batch order matters."""
    messages = [{"role": "system", "content": "You play twenty questions."}]
    for t in range(1 + i % 4):
        messages += [
            {"role": "user", "content": f"Turn {t + 1} of 20. Ask a yes-no question."},
            {"role": "assistant", "content": f"REASON: Narrow it down.\nQUESTION: Is it {WORDS[(i + t) % len(WORDS)]}?"},
        ]
    return messages + [{"role": "user", "content": "Answer: no. Game over."}]


def training_table(path: Path, n: int, weight: float | None = None) -> Path:
    rows = [{
        "trajectory_id": f"t{i:03d}", "task_id": WORDS[i // 2 % len(WORDS)], "split": "train", "source": "policy",
        "parent_id": None, "relabel_id": None, "messages": conversation(i), "reward": -1.0 - i % 3,
        "standardized_reward": 0.7 if i % 2 else -0.7, "weight": (0.2 + 0.8 * (i % 2)) if weight is None else weight,
        "group_size": 2, "group_mean": -2.0, "group_std": 1.0, "standardize_status": "ok",
    } for i in range(n)]
    write_table(pl.DataFrame(rows).to_arrow(), path, "training")
    return path


def train_params(model_dir: Path, methods: dict, **train) -> dict:
    raw = tiny_params({"train": {"base_model": str(model_dir), **train}})
    raw["train"]["methods"] = methods  # only these, not params.yaml's as well
    return raw


def test_a_nan_loss_stops_the_stage_naming_method_and_step_and_saves_no_model(tiny_model_dir, tmp_path, faults):
    table = training_table(tmp_path / "train.parquet", 8)
    # Refit's steps are so large that the weights overflow after the first: the loss turns NaN/inf.
    methods = {"sft": {"algorithm": "sft"}, "refit": {"algorithm": "refit", "learning_rate": 1.0e38}}
    params = Params.model_validate(train_params(tiny_model_dir, methods, checkpoint_steps=1))
    with pytest.raises(TrainingDiverged) as err:
        run_train(params, table, tmp_path / "out", tmp_path / "ckpt")
    message = str(err.value)
    faults(training_runs_stopped=1)
    assert re.match(r"train refit: the loss is (nan|inf) at step \d+;", message), message
    assert "no model was saved" in message and "lower learning_rate" in message
    assert (tmp_path / "out/models/sft/model.safetensors").exists()
    assert not (tmp_path / "out/models/refit").exists() and not (tmp_path / "out/loss/refit.json").exists()
    # Checkpoints from before the bad step may stay; none holds the weights that gave it.
    assert all(int(c.name.split("-")[1]) < err.value.step for c in tmp_path.glob("ckpt/refit/*/trainer/checkpoint-*"))


def test_nan_weights_are_quarantined_before_training(tiny_model_dir, tmp_path):
    table = training_table(tmp_path / "train.parquet", 8, weight=float("nan"))
    params = Params.model_validate(train_params(tiny_model_dir, {"refit": {"algorithm": "refit"}}))
    m = run_train(params, table, tmp_path / "out")
    assert m["inputs"][str(table)] == {"rows_in": 8, "kept": 0, "quarantined": 8}
    q = read_table(tmp_path / "out/quarantine.parquet", "quarantine").to_pylist()
    assert {(r["field"], r["reason"]) for r in q} == {("weight", "nan is not a finite number")}
    assert m["methods"]["refit"]["trained"] is False  # nothing left to train on; the base model is kept


def test_a_diverging_loss_stops_past_max_loss_ratio(tiny_model_dir, tmp_path, faults):
    # A learning rate of 10 takes the loss from about 6 to thousands at the second step, and it stays there.
    table = training_table(tmp_path / "train.parquet", 8)
    raw = train_params(tiny_model_dir, {"sft": {"algorithm": "sft"}}, learning_rate=10.0, epochs=3)
    with pytest.raises(TrainingDiverged) as err:
        run_train(Params.model_validate(raw), table, tmp_path / "out")
    e = err.value
    faults(training_runs_stopped=1)
    assert e.method == "sft"
    first = re.search(r"first logged loss \(([\d.]+) at step 1\)", str(e))
    assert first and abs(e.loss) > 10 * float(first.group(1))
    assert f"the median of the last 5 logged losses diverged to {e.loss:.4g} at step {e.step}, more than max_loss_ratio = 10 times" in str(e)
    assert not (tmp_path / "out/models/sft").exists()
    raw["train"]["max_loss_ratio"] = None  # the rule, not a NaN, stopped it: without the rule the run ends
    run_train(Params.model_validate(raw), table, tmp_path / "out")
    assert (tmp_path / "out/models/sft/model.safetensors").exists()


def guarded(losses: list[float], max_loss_ratio: float | None = 10.0) -> int | None:
    """The step at which LossGuard stops a run that logs `losses` one a step (None: it runs to
    the end), fed as the HF Trainer feeds it: the log is in the state's history first."""
    guard, state = LossGuard(max_loss_ratio), TrainerState()
    for step, loss in enumerate(losses, 1):
        state.global_step = step
        state.log_history.append({"loss": loss, "step": step})
        try:
            guard.on_log(None, state, TrainerControl(), logs={"loss": loss})
        except TrainingDiverged as e:
            return e.step
    return None


def test_one_noisy_batch_does_not_stop_training():
    # The critic on four pairs that stopped at its second step: 0.198, then 2.63.
    assert guarded([0.198, 2.63]) is None
    assert guarded([0.198, 2.63, 0.21, 0.19, 0.2, 0.18, 0.17, 3.1, 0.16, 0.15, 0.15]) is None
    assert guarded([0.5, 0.45, 0.4, 9.0, 8.0, 0.35, 0.3, 0.3]) is None  # two noisy batches in a window of five


def test_a_loss_that_keeps_rising_or_turns_nan_stops_training():
    assert guarded([1.0, 1.2, 1.5, 2.0, 3.0, 5.0, 8.0, 13.0, 21.0, 34.0]) == 10  # the median of steps 6-10 (13) tops 10
    assert guarded([6.0, 1660.0, 2267.0, 2164.0, 3467.0, 2403.0]) == 5  # a jump that stays, once five losses are logged
    assert guarded([-60.0, -80.0, -200.0, -651.0, -700.0, -900.0]) == 6  # Swift's, falling without bound
    assert guarded([1.0, float("nan")]) == 2  # NaN/inf at once, before any window
    assert guarded([1.0, 1.2, 1.5, 2.0, 3.0, 5.0, 8.0, 13.0, 21.0, 34.0], max_loss_ratio=None) is None


def test_a_finished_method_is_reused_only_while_its_inputs_are_unchanged(tiny_model_dir, tmp_path, capsys):
    table = training_table(tmp_path / "train.parquet", 8)
    # 3 epochs: six logged losses, past the guard's window of five, so hot's diverged loss stops it
    raw = train_params(tiny_model_dir, {"sft": {"algorithm": "sft"}, "hot": {"algorithm": "sft", "learning_rate": 10.0}}, epochs=3)
    ckpt = tmp_path / "ckpt"
    with pytest.raises(TrainingDiverged):  # sft finishes, then hot fails
        run_train(Params.model_validate(raw), table, tmp_path / "first", ckpt)
    (stale,) = (ckpt / "sft").iterdir()
    assert (stale / "result.json").exists() and (stale / "model/model.safetensors").exists()

    training_table(table, 9)  # the training table changed: the finished sft is stale
    capsys.readouterr()
    with pytest.raises(TrainingDiverged):
        run_train(Params.model_validate(raw), table, tmp_path / "second", ckpt)
    assert "train sft: sft on 9 trajectories" in capsys.readouterr().out
    (key,) = (ckpt / "sft").iterdir()
    assert key.name != stale.name

    raw["train"]["methods"]["hot"]["learning_rate"] = 1e-3  # what the error advises
    run_train(Params.model_validate(raw), table, tmp_path / "third", ckpt)
    out = capsys.readouterr().out
    assert "train sft: finished before the run was interrupted; its model is reused" in out and "train sft: sft on" not in out
    assert (tmp_path / "third/models/sft/model.safetensors").read_bytes() == (tmp_path / "second/models/sft/model.safetensors").read_bytes()
    assert (tmp_path / "third/models/hot/model.safetensors").exists()
    assert not ckpt.exists()  # removed once the stage has succeeded


# The train stage as `retrosight stage train` runs it, in its own process, so it can be killed.
STAGE = """
import json, sys
from pathlib import Path
from tasks.params import Params
from tasks.train import run_train
raw, table, out, ckpt = sys.argv[1:]
run_train(Params.model_validate(json.loads(raw)), Path(table), Path(out), Path(ckpt) if ckpt else None)
"""


class Stage:
    """One run of the stage; its output goes to a file (progress bars would fill a pipe and block it)."""

    def __init__(self, raw: dict, table: Path, out: Path, ckpt: Path | None, log: Path):
        self.log = log
        with log.open("w") as f:
            self.proc = subprocess.Popen(
                [sys.executable, "-c", STAGE, json.dumps(raw), str(table), str(out), str(ckpt or "")],
                cwd=ROOT, stdout=f, stderr=subprocess.STDOUT,
            )

    def kill_after_checkpoint(self, ckpt: Path, method: str, step: int) -> str:
        """SIGKILL the stage as soon as `method` has a complete checkpoint at `step`."""
        deadline = time.monotonic() + 120
        while not list(ckpt.glob(f"{method}/*/trainer/checkpoint-{step}/complete")):
            assert self.proc.poll() is None, f"the stage ended before checkpoint {step} of {method}:\n{self.output()[-3000:]}"
            assert time.monotonic() < deadline, f"no checkpoint {step} of {method} after 120 s"
            time.sleep(0.01)
        self.proc.send_signal(signal.SIGKILL)
        assert self.proc.wait() == -signal.SIGKILL
        return self.output()

    def output(self) -> str:
        return self.log.read_text()


def _killed_run_params(model_dir: Path) -> dict:
    # 48 trajectories, batch 2, 2 epochs: 48 steps per method, logged every 2; checkpoint_steps 5
    # becomes every 6 steps (a multiple of the logging interval), so checkpoints 6, 12, ..., 42.
    return train_params(model_dir, {"sft": {"algorithm": "sft"}, "swift": {"algorithm": "swift"}},
                        epochs=2, batch_size=2, learning_rate=1e-3, checkpoint_steps=5)


def _uninterrupted(made: Path, model_dir: Path) -> None:
    table = training_table(made / "train.parquet", 48)
    run_train(Params.model_validate(_killed_run_params(model_dir)), table, made / "reference")  # no checkpoints, as before they existed


@pytest.mark.system
def test_a_killed_train_stage_resumes_and_ends_byte_identical(tiny_model_dir, tmp_path, capsys, faults, request):
    table = training_table(tmp_path / "train.parquet", 48)
    raw = _killed_run_params(tiny_model_dir)
    params = Params.model_validate(raw)
    # The uninterrupted run, built once per tree (conftest.built): the same code on the same rows
    # trains the same weights in any process.
    key = digest(*CODE, ROOT / "params.yaml", TINY, WORDS, str(tiny_model_dir),
                 *map(inspect.getsource, (conversation, training_table, train_params, _killed_run_params, _uninterrupted)))
    made = built(request, "train-uninterrupted", key, lambda made: _uninterrupted(made, tiny_model_dir))
    assert (made / "train.parquet").read_bytes() == table.read_bytes()  # trained on these very rows
    reference = made / "reference"

    # Killed twice, the second time while resuming: in sft's second epoch (steps 25-48), where
    # the Trainer alone resumes with the wrong batch order, then in swift.
    rng = random.Random(20)
    kills = [("sft", rng.choice([30, 36, 42])), ("swift", rng.choice([6, 12, 18, 24, 30, 36, 42]))]
    out, ckpt = tmp_path / "out", tmp_path / "ckpt"
    logs = []
    for i, (method, step) in enumerate(kills):
        logs.append(Stage(raw, table, out, ckpt, tmp_path / f"run{i}.log").kill_after_checkpoint(ckpt, method, step))
        assert not (out / "models" / method).exists()  # killed before that method finished
        shutil.rmtree(out, ignore_errors=True)  # as DVC does before it reruns a stage
    capsys.readouterr()
    run_train(params, table, out, ckpt)  # in this process: starting one costs seconds of imports
    logs.append(capsys.readouterr().out)

    # Each rerun resumed at or after its kill point (a retrain from scratch would match too).
    def resumed_at(log: str, method: str) -> int:
        (step,) = re.findall(rf"train {method}: resuming from its checkpoint at step (\d+)", log)
        return int(step)

    faults(sigkills=len(kills), runs_resumed=len(kills))
    assert kills[0][1] <= resumed_at(logs[1], "sft") < 48
    assert "train sft: finished before the run was interrupted; its model is reused" in logs[2]
    assert "train sft: sft on" not in logs[2]
    assert kills[1][1] <= resumed_at(logs[2], "swift") < 48
    for name in ("sft", "swift"):
        weights = [hashlib.sha256((d / f"models/{name}/model.safetensors").read_bytes()).hexdigest() for d in (out, reference)]
        assert weights[0] == weights[1], f"{name}: the resumed model's weights differ from the uninterrupted run's"
        assert (out / f"loss/{name}.json").read_text() == (reference / f"loss/{name}.json").read_text()
    assert not ckpt.exists()
