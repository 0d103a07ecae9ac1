"""The shipped base: packed with its provenance, verified on load, taken only when the run's
training keys are the ones it was trained with."""
import json
import shutil
from pathlib import Path

import pytest

from conftest import tiny_params
from models.checkpoint import CheckpointError, pack, verify
from tasks import bootstrap
from tasks.bootstrap import run_bootstrap, shipped_base, training_keys
from tasks.params import Params

ROOT = Path(__file__).resolve().parents[1]


def packed(tiny_model_dir: Path, tmp_path: Path, params: Params) -> Path:
    """The tiny model packed as a checkpoint trained with `params`' keys."""
    source = tmp_path / "trained"
    shutil.copytree(tiny_model_dir, source / "model")
    (source / "loss.json").write_text(json.dumps([{"step": 1, "loss": 2.0}]))
    metrics = {"model": {"success": {"train": {"success_rate": 0.5}}}}
    pack(source, tmp_path / "ckpt", {"command": "python bench/base_checkpoint.py",
                                     "params": {"seed": 0, "threads": 1, "training": training_keys(params)}, "metrics": metrics})
    return tmp_path / "ckpt"


def with_checkpoint(raw: dict, value) -> Params:
    raw = json.loads(json.dumps(raw))
    raw["bootstrap"]["checkpoint"] = value
    return Params.model_validate(raw)


def test_a_packed_checkpoint_verifies_and_a_changed_byte_names_the_file(tiny_model_dir, tmp_path):
    ckpt = packed(tiny_model_dir, tmp_path, Params.model_validate(tiny_params()))
    provenance = verify(ckpt)
    assert set(provenance["files"]) >= {"model/model.safetensors", "model/config.json", "loss.json"}
    weights = ckpt / "model/model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 1
    weights.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=r"model/model.safetensors: SHA-256 .* is not the recorded"):
        verify(ckpt)


def test_a_missing_or_extra_file_is_an_error(tiny_model_dir, tmp_path):
    ckpt = packed(tiny_model_dir, tmp_path, Params.model_validate(tiny_params()))
    (ckpt / "notes.txt").write_text("hand-added")
    with pytest.raises(CheckpointError, match="notes.txt: not part of the checkpoint"):
        verify(ckpt)
    (ckpt / "notes.txt").unlink()
    (ckpt / "loss.json").unlink()
    with pytest.raises(CheckpointError, match="loss.json: missing"):
        verify(ckpt)


def test_auto_takes_the_checkpoint_only_with_the_same_training_keys(tiny_model_dir, tmp_path, monkeypatch):
    raw = tiny_params()
    params = Params.model_validate(raw)
    ckpt = packed(tiny_model_dir, tmp_path, params)
    monkeypatch.setattr(bootstrap, "SHIPPED", tmp_path / "shipped")
    shutil.copytree(ckpt, tmp_path / "shipped" / params.env.name)

    # the same keys, another quick-look size and seed: the shipped base
    same = json.loads(json.dumps(raw)) | {"seed": 3, "limit_tasks": 2}
    path, _, why = shipped_base(with_checkpoint(same, "auto"))
    assert path == tmp_path / "shipped" / params.env.name and "starting from the shipped base" in why
    # a training key differs: auto trains, naming the key; an explicit path is an error naming it
    other = json.loads(json.dumps(raw))
    other["bootstrap"]["demos_per_task"] += 1
    path, _, why = shipped_base(with_checkpoint(other, "auto"))
    assert path is None and "bootstrap.demos_per_task" in why and "training a base" in why
    with pytest.raises(ValueError, match=r"bootstrap.demos_per_task: 3 here, 2 in the checkpoint"):
        shipped_base(with_checkpoint(other, str(ckpt)))
    # null always trains; an environment with no shipped base trains
    assert shipped_base(with_checkpoint(raw, None))[0] is None
    gmc = json.loads(json.dumps(raw)) | {"env": {"name": "guess_my_city"}}
    assert "no shipped base for guess_my_city" in shipped_base(with_checkpoint(gmc, "auto"))[2]


def test_bootstrap_from_a_checkpoint_writes_what_training_writes(tiny_model_dir, tmp_path, monkeypatch):
    raw = tiny_params()
    params = with_checkpoint(raw, None)
    ckpt = packed(tiny_model_dir, tmp_path, params)
    monkeypatch.chdir(tmp_path)
    metrics = run_bootstrap(with_checkpoint(raw, str(ckpt)), tmp_path / "out")
    assert metrics["checkpoint"]["path"] == "ckpt" and metrics["model"]["success"]["train"]["success_rate"] == 0.5
    assert (tmp_path / "out/model/model.safetensors").read_bytes() == (tiny_model_dir / "model.safetensors").read_bytes()
    assert json.loads((tmp_path / "out/loss.json").read_text()) == [{"step": 1, "loss": 2.0}]
    assert (tmp_path / "out/demos.parquet").exists()
    assert json.loads((tmp_path / "out/metrics.json").read_text()) == metrics


def test_the_shipped_base_verifies_and_matches_params_yaml():
    """models/base/twenty_questions: every file its provenance records, and the training keys
    params.yaml gives, so `make run` starts from it."""
    import yaml

    params = Params.model_validate(yaml.safe_load((ROOT / "params.yaml").read_text()))
    provenance = verify(ROOT / "models/base/twenty_questions")
    path, _, why = shipped_base(params)
    assert path == ROOT / "models/base/twenty_questions", why
    assert provenance["command"].startswith("python bench/base_checkpoint.py")
    size = sum(p.stat().st_size for p in path.rglob("*") if p.is_file())
    assert size < 12e6, f"the shipped base is {size / 1e6:.1f} MB"


def test_the_shipped_scienceworld_base_serves_its_preset_and_only_it():
    """models/base/scienceworld: its files verify, StepAgent's ScienceWorld preset starts from it,
    and ScienceWorld under params.yaml's bootstrap keys trains its own, naming a difference."""
    import yaml

    from tasks.params import lay_preset, read_preset

    raw = yaml.safe_load((ROOT / "params.yaml").read_text())
    lay_preset(raw, read_preset(ROOT / "bench/presets/stepagent_scienceworld.yaml"))
    provenance = verify(ROOT / "models/base/scienceworld")
    path, _, why = shipped_base(Params.model_validate(raw))
    assert path == ROOT / "models/base/scienceworld", why
    assert provenance["command"] == "python bench/base_checkpoint.py --preset=bench/presets/stepagent_scienceworld.yaml"
    plain = yaml.safe_load((ROOT / "params.yaml").read_text()) | {"env": {"name": "scienceworld"}}
    path, _, why = shipped_base(Params.model_validate(plain))
    assert path is None and "trained with other keys" in why and "demos_per_task" in why
