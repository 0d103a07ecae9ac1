"""bench/train_throughput.py at --small on a tiny model, and bench/packed_throughput.py on a few pairs: the
tables, the ratios and the loss checks are printed and sane."""
import inspect
import json
import re
import subprocess
import sys
from pathlib import Path

import polars as pl
import pytest
from conftest import built, digest

pytestmark = pytest.mark.system

ROOT = Path(__file__).resolve().parents[1]


def _model_and_table(out: Path) -> None:
    """A tiny model whose tokenizer knows the table's words, and the table: built once per tree
    (conftest.built), so this process needs no torch of its own."""
    import torch

    from models.tiny import make_model, train_tokenizer

    chats = []
    for i in range(10):
        msgs = [{"role": "system", "content": "You play twenty questions."}]
        for t in range(1 + i % 4):
            msgs += [{"role": "user", "content": f"Turn {t + 1} of 20."}, {"role": "assistant", "content": f"REASON: Ask.\nQUESTION: Is it thing {i}{t}?"}]
        chats.append(msgs)
    # Row 1 has weight 0: Refit leaves it out, and so must the bench's TRL run.
    pl.DataFrame({"messages": chats, "weight": [1.0, 0.0] + [0.5] * 8}).write_parquet(out / "train.parquet")
    tok = train_tokenizer([m["content"] for c in chats for m in c] * 5, vocab_size=300)
    torch.manual_seed(0)
    make_model(tok, 64, 1, 1, 64, 128, 256).save_pretrained(out / "model")
    tok.save_pretrained(out / "model")


def test_train_throughput_bench_small(request, tmp_path):
    made = built(request, "bench-train-model", digest(ROOT / "models", inspect.getsource(_model_and_table)), _model_and_table)
    out = tmp_path / "bench.json"
    proc = subprocess.run(
        [sys.executable, "bench/train_throughput.py", "--small", "--model", str(made / "model"),
         "--table", str(made / "train.parquet"), "--out", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=300, check=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    text = proc.stdout
    assert re.search(r"^8 rows, \d+ tokens \(\d+ supervised\) over 1 epochs, batch 4, 2 optimizer steps", text, re.MULTILINE), text
    last_loss = {}
    for name in ("refit", "trl", "refit-padded"):
        row = re.search(rf"^{name}\s+(\S+)\s+(\S+)\s+(\S+)\s+(\S+)\s+(\S+)\s+(\S+)\s+(\S+)$", text, re.MULTILINE)
        assert row, text
        assert all(float(x) > 0 for x in row.groups()[:6]), row.group(0)
        last_loss[name] = float(row.group(7))
    # params.yaml packs; padded batches train the same model to float rounding.
    assert abs(last_loss["refit-padded"] - last_loss["refit"]) <= 1e-3 * abs(last_loss["refit"])
    assert re.search(r"^refit is packed \(train.padding_free: true\); refit-padded/TRL \(tokens/s, training loop\): \d+\.\d+; packed/padded: \d+\.\d+", text, re.MULTILINE), text
    ratio = re.search(r"^ratio ours/TRL \(tokens/s, training loop\): (\S+)", text, re.MULTILINE)
    assert ratio and float(ratio.group(1)) > 0, text
    loss = re.search(r"refit\[tokens\] = (\S+)\s+trl = (\S+)\s+diff = (\S+)", text)
    assert loss, text
    assert float(loss.group(1)) > 0 and abs(float(loss.group(1)) - float(loss.group(2))) <= 1e-5 * float(loss.group(2))
    saved = json.loads(out.read_text())
    assert saved["rows"] == 8 and saved["steps"] == 2 and saved["summary"]["trl"]["tokens_per_s"] > 0 and saved["padding_free"]
    assert abs(saved["ratio_ours_over_trl"] - float(ratio.group(1))) < 0.01


def test_packed_throughput_bench_small():
    proc = subprocess.run([sys.executable, "bench/packed_throughput.py", "--pairs", "16", "--repeats", "1"],
                          cwd=ROOT, capture_output=True, text=True, timeout=600, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    found = re.findall(r"^(critic|dpo)\s+(padded|packed)\s+(\S+)\s+(\S+)\s+(\S+)$", proc.stdout, re.MULTILINE)
    rows = {(t, k): [float(x) for x in rest] for t, k, *rest in found}
    assert set(rows) == {(t, k) for t in ("critic", "dpo") for k in ("padded", "packed")}, proc.stdout
    for trainer in ("critic", "dpo"):
        padded, packed = rows[trainer, "padded"], rows[trainer, "packed"]
        assert padded[0] > 0 and packed[0] > 0
        assert packed[1] == pytest.approx(padded[0] / packed[0], abs=0.01)
        # One step on the same rows: the same loss to bf16 rounding (a packed batch scored at the wrong token differs by far more).
        assert packed[2] == pytest.approx(padded[2], rel=1e-2), proc.stdout
