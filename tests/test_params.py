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


def test_a_role_switches_backend_by_an_edit(tmp_path):
    def to_openai(r):
        r["roles"]["summarizer"] = {"backend": "openai", "model": "llama-3.2-3b", "base_url": "http://127.0.0.1:8000/v1", "api_key_env": "MY_KEY"}

    p = load_params(_write(tmp_path, to_openai))
    assert p.roles.summarizer.backend == "openai" and p.roles.summarizer.api_key_env == "MY_KEY"
    assert p.roles.summarizer.sampling.max_new_tokens > 0  # defaults fill the rest


@pytest.mark.parametrize(
    "role, entry, message",
    [
        ("summarizer", {"backend": "vllm"}, r"roles\.summarizer.*needs a model"),
        ("proposer", {"backend": "openai", "model": "m"}, r"roles\.proposer.*needs a base_url"),
        ("policy", {"backend": "oracle"}, r"roles\.policy\.backend"),
        ("forward", {"backend": "oracle"}, r"roles\.forward.*use backend: policy"),
        ("labeler", {"backend": "hf", "model": "m", "api_key": "sk-123"}, r"roles\.labeler\.api_key: unknown key"),
    ],
)
def test_bad_roles_are_named(tmp_path, role, entry, message):
    with pytest.raises(ParamsError, match=message):
        load_params(_write(tmp_path, lambda r: r["roles"].update({role: entry})))
