"""STaR-GATE-D (a baseline of Refit/Swift): the base policy distilled from the STaR-GATE policy on
STaR-GATE's data, "as done in Andukuri et al.".

    loss = alpha * T^2 * KL( softmax(z_teacher / T) || softmax(z_student / T) ) + (1 - alpha) * CE(a_t, z_student)

per agent token, each term averaged over the agent's tokens (the SFT mask, sft.tokenize_chats): the
KL summed over the vocabulary at each token, CE the SFT loss on the logged action. z are the
logits at the token's position; T^2 keeps the soft term's gradients on the hard term's scale as T
grows (Hinton et al. 2015). The paper gives alpha 0.5 and T 2.0 (Table 27) but not the loss;
this is Hinton's, the standard one with those two knobs (`distill.alpha`, `distill.temperature`).

The teacher is STaR-GATE's model (`distill.teacher`: the star_gate method trained earlier in the
same stage, Table 27's "STaR-GATE last-checkpoint"), frozen; the student starts from
train.base_model, as every arm does, and the rows are STaR-GATE's (star_gate.select: each
question's best trajectory; Table 27's dataset "rl_reweight SFT"). The paper's student is the base
cut to 8 layers with LoRA on the teacher ("student_layers 8", "apply_lora_to_teacher"; both
unclear, gap 7): here the student is the whole base and the teacher is not trained, so the
arm differs from STaR-GATE by the soft targets alone.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers import Trainer

from storage.schema import from_table
from tasks.train.sft import IGNORE, tokenize_chats, train_sft
from tasks.train.star_gate import select


def distill_loss(student: torch.Tensor, teacher: torch.Tensor, labels: torch.Tensor, alpha: float, temperature: float):
    """student, teacher: logits [B, L, V]; labels [B, L] (IGNORE off the agent's tokens). Position i
    predicts token i + 1. Returns (loss, kl, ce), kl and ce each a mean over the agent's tokens."""
    target = labels[:, 1:]
    keep = target != IGNORE
    s, t = student[:, :-1][keep].float(), teacher[:, :-1][keep].float()
    ce = F.cross_entropy(s, target[keep])
    # batchmean: summed over the vocabulary, averaged over the tokens (rows) kept
    kl = F.kl_div(F.log_softmax(s / temperature, -1), F.log_softmax(t / temperature, -1), log_target=True, reduction="batchmean")
    return alpha * temperature**2 * kl + (1 - alpha) * ce, kl.detach(), ce.detach()


class DistillTrainer(Trainer):
    """The HF Trainer with the loss above, the teacher frozen beside the student."""

    loss_is_scaled_for_ga = False  # compute_loss returns a micro-batch mean (see refit.py)

    def __init__(self, *args, teacher, alpha: float, temperature: float, **kwargs):
        super().__init__(*args, **kwargs)
        self.teacher = teacher.eval().requires_grad_(False).to(self.args.device)
        self.alpha, self.temperature = alpha, temperature

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        labels = inputs.pop("labels")
        outputs = model(**inputs)
        with torch.no_grad():
            teacher_logits = self.teacher(**inputs).logits
        loss, _, _ = distill_loss(outputs.logits, teacher_logits, labels, self.alpha, self.temperature)
        return (loss, outputs) if return_outputs else loss


def train(model, tokenizer, table, cfg, seed: int, teacher) -> dict:
    """teacher: the STaR-GATE model (run_train loads distill.teacher), on the student's tokenizer."""
    if teacher.config.vocab_size != model.config.vocab_size:
        raise ValueError(f"star_gate_d: the teacher's vocabulary ({teacher.config.vocab_size}) is not the student's ({model.config.vocab_size}); "
                         "distillation compares their distributions token by token, so both need the base's tokenizer")
    kept = select(table)
    counts = {"questions": kept.height, "rows_skipped": table.height - kept.height, "alpha": cfg.distill.alpha, "temperature": cfg.distill.temperature}
    if kept.height == 0:
        return {"rows": 0, "truncated": 0, "curve": [], **counts}
    tokenized = tokenize_chats(tokenizer, [r["messages"] for r in from_table(kept.select("messages"))], model.config.max_position_embeddings)
    # padded batches: the teacher reads the same inputs, and the packed attention is the student's alone
    curve = train_sft(model, tokenizer, tokenized.examples, seed=seed, trainer_cls=DistillTrainer, teacher=teacher,
                      alpha=cfg.distill.alpha, temperature=cfg.distill.temperature, **{**cfg.trainer_kwargs(), "padding_free": False})
    return {"rows": kept.height, "truncated": tokenized.truncated, "curve": curve, **counts}
