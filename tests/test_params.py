from pathlib import Path

import pytest
import yaml

from tasks.params import ParamsError, load_params

ROOT = Path(__file__).resolve().parents[1]


def _write(tmp_path: Path, mutate) -> Path:
    raw = yaml.safe_load((ROOT / "params.yaml").read_text())
    mutate(raw)
    p = tmp_path / "params.yaml"
    p.write_text(yaml.safe_dump(raw))
    return p


def test_repository_params_are_valid():
    p = load_params(ROOT / "params.yaml")
    assert p.collect.m > 1  # Swift needs several trajectories per context
    assert p.bootstrap.model.head_dim >= 64


def test_unknown_key_is_named(tmp_path):
    path = _write(tmp_path, lambda r: r["collect"].update(temprature=0.5))
    with pytest.raises(ParamsError, match=r"collect\.temprature: unknown key"):
        load_params(path)


def test_wrong_type_is_named(tmp_path):
    path = _write(tmp_path, lambda r: r["collect"].update(m="many"))
    with pytest.raises(ParamsError, match=r"collect\.m:"):
        load_params(path)


def test_out_of_range_is_named(tmp_path):
    path = _write(tmp_path, lambda r: r["bootstrap"]["model"].update(head_dim=32))
    with pytest.raises(ParamsError, match=r"bootstrap\.model\.head_dim"):
        load_params(path)


def test_missing_file(tmp_path):
    with pytest.raises(ParamsError, match="not found"):
        load_params(tmp_path / "nope.yaml")
