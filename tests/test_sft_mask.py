"""The loss must fall on the agent's tokens only, and a broken mask must fail loudly."""
import pytest
import torch

from models.tiny import CHAT_TEMPLATE, make_model, train_tokenizer
from tasks.train.sft import IGNORE, MaskError, PadCollator, tokenize_chats

CONV = [
    {"role": "system", "content": "You play twenty questions."},
    {"role": "user", "content": "Turn 1 of 20. Ask a yes-no question."},
    {"role": "assistant", "content": "REASON: Known: nothing yet.\nQUESTION: Is it an animal?"},
    {"role": "user", "content": "Answer: yes. Turn 2 of 20."},
    {"role": "assistant", "content": "REASON: Known: animal.\nQUESTION: Is it a dog?"},
    {"role": "user", "content": "Answer: yes. You found it."},
]


@pytest.fixture(scope="module")
def tokenizer():
    return train_tokenizer([m["content"] for m in CONV] * 20, vocab_size=400)


def test_labels_cover_exactly_the_assistant_turns(tokenizer):
    ex = tokenize_chats(tokenizer, [CONV], max_length=512).examples[0]
    supervised = [t for t in ex["labels"] if t != IGNORE]
    assert tokenizer.decode(supervised) == "".join(
        m["content"] + tokenizer.eos_token for m in CONV if m["role"] == "assistant"
    )
    # No system or user text carries loss.
    masked_text = tokenizer.decode([t for t, l in zip(ex["input_ids"], ex["labels"]) if l == IGNORE])
    for m in CONV:
        if m["role"] != "assistant":
            assert m["content"] in masked_text


def test_model_loss_is_the_mean_over_agent_tokens_only(tokenizer):
    """The trainer's loss equals cross-entropy over the supervised tokens alone."""
    torch.manual_seed(0)
    model = make_model(tokenizer, 64, 1, 1, 64, 128, 256)
    ex = tokenize_chats(tokenizer, [CONV], max_length=512).examples[0]
    batch = PadCollator(tokenizer.pad_token_id)([ex])
    base = model(**batch).loss.item()
    assert (batch["labels"] == IGNORE).sum() > 0
    logits = model(input_ids=batch["input_ids"]).logits[0, :-1]
    targets = batch["labels"][0, 1:]
    manual = torch.nn.functional.cross_entropy(logits[targets != IGNORE], targets[targets != IGNORE])
    assert abs(manual.item() - base) < 1e-5
    everything = torch.nn.functional.cross_entropy(logits, batch["input_ids"][0, 1:])
    assert abs(everything.item() - base) > 1e-3  # the mask changes the loss


def test_template_without_generation_tags_fails_loudly(tokenizer):
    broken = CHAT_TEMPLATE.replace("{% generation %}", "").replace("{% endgeneration %}", "")
    tokenizer2 = train_tokenizer([m["content"] for m in CONV] * 20, vocab_size=400)
    tokenizer2.chat_template = broken
    with pytest.raises(MaskError, match="mask is empty"):
        tokenize_chats(tokenizer2, [CONV], max_length=512)


def test_split_digits_makes_a_copied_price_the_same_tokens():
    """A tool result's "msrp=$57000" and the reply's " 57000" share no token when BPE merges the
    number; split, the reply's price is the listing's digits, and text still decodes exactly."""
    listing, reply = "1. brand=Bmw, msrp=$57000, 5% off=$54150", "PROPOSED CAR MSRP: 57000 for $54,150."
    corpus = [listing, reply] * 50

    def digits(tok, text):
        return [t for t in tok.tokenize(text) if any(c.isdigit() for c in t)]

    merged, split = train_tokenizer(corpus, vocab_size=400), train_tokenizer(corpus, vocab_size=400, split_digits=True)
    assert not set(digits(merged, listing)) & set(digits(merged, reply))
    assert digits(split, "msrp=$57000") == digits(split, " 57000") == list("57000")
    for text in (listing, reply, "Turn 10 of 20: 2% off 3.5"):
        assert split.decode(split(text)["input_ids"]) == text


def test_a_copy_drill_repeats_a_span_after_a_gap_and_supervises_only_the_copy(tokenizer):
    """Random tokens in which a span comes again after a gap of varying length; the loss falls on
    the copy's tokens after its first, which alone the context cannot foretell; no special token;
    the same seed gives the same drills, another seed others."""
    from models.tiny import copy_drills

    drills = copy_drills(tokenizer, 200, 96, seed=3)
    assert drills == copy_drills(tokenizer, 200, 96, seed=3) != copy_drills(tokenizer, 200, 96, seed=4)
    gaps = set()
    for d in drills:
        ids, labels = d["input_ids"], d["labels"]
        assert len(ids) == len(labels) <= 96 and not set(ids) & set(tokenizer.all_special_ids)
        supervised = [i for i, t in enumerate(labels) if t != IGNORE]
        n = len(supervised) + 1  # the span's length
        assert 8 <= n <= 32 and supervised == list(range(len(ids) - n + 1, len(ids)))
        assert ids[-n:] == ids[:n] and [labels[i] for i in supervised] == ids[-n + 1:]
        gaps.add(len(ids) - 2 * n)
    assert min(gaps) < 10 and max(gaps) > 40  # the copy is not at one distance


def test_bootstrap_drills_before_the_demonstrations_and_reports_the_copying(tmp_path):
    """bootstrap.drill.sequences > 0 trains on copy drills first; the metrics give the drill's
    loss and held-out copy accuracy before and after the demonstrations. Off by default."""
    from conftest import tiny_params
    from tasks.bootstrap import run_bootstrap
    from tasks.params import Params

    assert Params.model_validate(tiny_params()).bootstrap.drill.sequences == 0
    raw = tiny_params({"bootstrap": {"drill": {"sequences": 64, "length": 48, "batch_size": 16}, "eval_splits": ["val"], "limit_tasks": 2}})
    drill = run_bootstrap(Params.model_validate(raw), tmp_path)["drill"]
    assert drill["sequences"] == 64 and drill["final_loss"] > 0 and drill["seconds"] > 0
    assert 0 <= drill["copy_accuracy"] <= 1 and 0 <= drill["copy_accuracy_after_demonstrations"] <= 1
