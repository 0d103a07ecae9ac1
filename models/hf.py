"""`hf` backend: transformers in process, batched with left padding."""
from __future__ import annotations

import hashlib
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from models.base import Message, SamplingParams


def model_fingerprint(path: str | Path) -> str:
    """Content hash of a model directory's weights: the id of the policy that generated a row."""
    h = hashlib.sha256()
    for f in sorted(Path(path).glob("*.safetensors")):
        h.update(f.read_bytes())
    return h.hexdigest()[:12]


class HFGenerator:
    def __init__(self, path: str | Path, batch_size: int = 64, dtype: str = "float32"):
        self.path = Path(path)
        if not (self.path / "config.json").exists():
            raise FileNotFoundError(f"{self.path}: not a Hugging Face model directory (no config.json)")
        self.tokenizer = AutoTokenizer.from_pretrained(self.path)
        self.tokenizer.padding_side = "left"
        self.model = AutoModelForCausalLM.from_pretrained(self.path, dtype=getattr(torch, dtype)).eval()
        self.batch_size = batch_size
        self.model_id = f"{self.path.name}@{model_fingerprint(self.path)}"

    @torch.inference_mode()
    def generate(
        self, conversations: list[list[Message]], sampling: SamplingParams, seed: int
    ) -> list[str]:
        prompts = [
            self.tokenizer.apply_chat_template(c, add_generation_prompt=True, tokenize=False)
            for c in conversations
        ]
        encoded = [self.tokenizer(p, add_special_tokens=False)["input_ids"] for p in prompts]
        # Similar lengths share a batch: less padding. The order is a pure function of the
        # inputs, so a fixed seed still gives the same texts.
        order = sorted(range(len(encoded)), key=lambda i: (len(encoded[i]), i))
        out: list[str] = [""] * len(encoded)
        for b, start in enumerate(range(0, len(order), self.batch_size)):
            idx = order[start : start + self.batch_size]
            batch = self.tokenizer.pad({"input_ids": [encoded[i] for i in idx]}, return_tensors="pt")
            torch.manual_seed(seed * 1_000_003 + b)
            greedy = sampling.temperature == 0
            gen = self.model.generate(
                **batch,
                max_new_tokens=sampling.max_new_tokens,
                do_sample=not greedy,
                temperature=None if greedy else sampling.temperature,
                top_p=None if greedy else sampling.top_p,
                top_k=None,
                pad_token_id=self.tokenizer.pad_token_id,
                eos_token_id=self.tokenizer.eos_token_id,
            )
            new = gen[:, batch["input_ids"].shape[1] :]
            for i, row in zip(idx, new):
                out[i] = self.tokenizer.decode(row, skip_special_tokens=True).strip()
        return out
