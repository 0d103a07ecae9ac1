"""Does a CarDealer seller copy from its context? Teacher-forced on the expert's sales.

    python bench/seller_copy.py data/bootstrap [--sales 10]

Reads a bootstrap output (DIR/model, DIR/demos.parquet: the sales it was trained on) and, in the
first N scripted-expert sales, at every field the seller fills by copying from the dialogue (the
brand and type the buyer asked for, the listed car it proposes, its price), gives the model the
expert's text up to the field and lets it complete greedily. A field counts as right when the
completion starts with the expert's value. A seller that cannot copy these does not make a valid
sale (docs/environments.md, CarDealer). Prints hits per field; writes DIR/seller_copy.json.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

# where the expert's text copies a value from the dialogue (its value runs to the line's end or a full stop)
FIELDS = ("API BRAND:", "API TYPE:", "CAR INDEX:", "PROPOSED CAR BRAND:", "PROPOSED CAR MSRP:", " for $")
EMPTY = ("None", "0", "")  # nothing to copy: a greeting's reply, a no_op call


def probe(model, tokenizer, sales: list[list[dict]], max_length: int, show: int = 0) -> dict:
    """Hits per field; prints the first `show` misses of each."""
    import torch

    hits = {f: [0, 0] for f in FIELDS}
    for messages in sales:
        for i, m in enumerate(messages):
            if m["role"] != "assistant":
                continue
            prefix = tokenizer.apply_chat_template(messages[:i], tokenize=False, add_generation_prompt=True)
            for field in FIELDS:
                at = m["content"].find(field)
                want = m["content"][at + len(field):].split("\n")[0].split(".")[0].strip() if at >= 0 else ""
                if at < 0 or want in EMPTY:
                    continue
                ids = tokenizer(prefix + m["content"][: at + len(field)], add_special_tokens=False, return_tensors="pt")["input_ids"]
                with torch.no_grad():
                    out = model.generate(ids[:, -max_length:], max_new_tokens=8, do_sample=False, pad_token_id=tokenizer.pad_token_id)
                got = tokenizer.decode(out[0, min(ids.shape[1], max_length):], skip_special_tokens=True)
                right = got.strip().startswith(want[:6])
                hits[field][0] += right
                hits[field][1] += 1
                if not right and hits[field][1] - hits[field][0] <= show:
                    print(f"miss at {field!r}: wrote {got.strip()!r}, the expert {want!r}")
    return {f: {"right": a, "of": b} for f, (a, b) in hits.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("bootstrap", type=Path, help="a bootstrap output: model/ and demos.parquet")
    ap.add_argument("--sales", type=int, default=10, help="the first N scripted-expert sales")
    ap.add_argument("--show", type=int, default=0, help="print the first N misses of each field")
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()

    import polars as pl
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(args.threads)
    tokenizer = AutoTokenizer.from_pretrained(args.bootstrap / "model")
    model = AutoModelForCausalLM.from_pretrained(args.bootstrap / "model").eval()
    demos = pl.read_parquet(args.bootstrap / "demos.parquet").filter(pl.col("policy_id") == "scripted:expert", pl.col("success"))
    if demos.height < args.sales:
        sys.exit(f"{args.bootstrap / 'demos.parquet'} holds {demos.height} expert sales, fewer than --sales {args.sales}")
    # The tool's results are read as the chat template renders them for the policy.
    sales = [[{"role": m["role"], "content": m["content"]} for m in msgs] for msgs in demos["messages"].to_list()[: args.sales]]
    hits = probe(model, tokenizer, sales, model.config.max_position_embeddings, args.show)
    for field, h in hits.items():
        print(f"{field.strip(' :$') or field:<22} {h['right']:>3} / {h['of']}")
    (args.bootstrap / "seller_copy.json").write_text(json.dumps({"sales": args.sales, "fields": hits}, indent=1) + "\n")


if __name__ == "__main__":
    main()
