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
