"""StepAgent-Inverse (StepAgent Eq. 9-11, Algorithm 1's reflection): a discriminator's log D as the
step reward of a PPO update, the two alternating batch by batch.

    for each batch of practice rows (state s, the expert's action a_e, the agent's sampled a):
        D  <- one step of L_D: label 1 on (s, a_e), 0 on (s, a)              discriminator.py (Eq. 11)
        r  =  max(log D'(s, a), reward_floor), from the updated D'             Algorithm 1, line 10
        pi <- ppo_epochs steps of PPO on the one-step episodes (s, a, r)       ppo.py

The policy starts from the start-of-iteration policy, which is also pi_ref and pi_old (the policy
that practised); the discriminator from the same weights with a new head. An agent sample equal to
the expert's action stays in (unlike the implicit variant, whose DPO gradient is zero there):
it is the agent's own step, GAIL's agent distribution is everything the agent does, and its
reward tells the policy it was right. Failed samples are left out.

One process trains with torch's AdamW; on ranks (torchrun) each model is a DeepSpeed engine under
the stage's ZeRO config, every rank takes its share (rows r, r + N, ...) of every global batch of
N x batch_size rows (the last one padded by repeating its first rows, as PyTorch's
DistributedSampler pads), and DeepSpeed averages the gradients, so N ranks of batch_size b step as
one process of batch_size N x b does.
"""
from __future__ import annotations

import json
import math
import random
from pathlib import Path

import torch
from transformers import get_cosine_schedule_with_warmup

from tasks.train import discriminator, ppo
from tasks.train.distributed import rank, world_size
from tasks.train.sft import PadCollator, TrainingDiverged

MAX_GRAD_NORM = 1.0  # the HF Trainer's default, as the implicit variant trains


def teaching(rows: list[dict]) -> tuple[list[dict], dict[str, int]]:
    """The practice rows the variant learns from (every sample practised, equal ones included) and
    the counts."""
    kept = [r for r in rows if r["status"] == "ok"]
    return kept, {"rows": len(rows), "failed_dropped": len(rows) - len(kept), "equal_kept": sum(r["equal"] for r in kept), "kept": len(kept)}


def examples(start, tokenizer, pairs: list[tuple[dict, dict]]) -> list[dict]:
    """Each encoded (expert, agent) pair with the start-of-iteration policy's per-token
    log-probabilities of the agent's action (pi_old and pi_ref)."""
    old = ppo.behaviour_logps(start, tokenizer, [agent for _, agent in pairs])
    return [{"expert": e["input_ids"], "agent": a, "old": o} for (e, a), o in zip(pairs, old)]


def batches(n: int, batch_size: int, ranks: int, epochs: float, seed: int) -> list[list[int]]:
    """Global batches of row indices: each pass over the n rows in its own seeded order, cut into
    batches of ranks x batch_size, ceil(epochs x batches per pass) of them; each padded to a
    multiple of `ranks` by repeating its first rows."""
    size = batch_size * ranks
    plan: list[list[int]] = []
    for k in range(math.ceil(epochs)):
        order = list(range(n))
        random.Random(seed + k).shuffle(order)
        plan += [order[i : i + size] for i in range(0, n, size)]
    plan = plan[: math.ceil(epochs * math.ceil(n / size))]
    return [b + (b * ranks)[: -len(b) % ranks] for b in plan]


def zero_config(path: str, hidden: int, micro_batch: int, bf16: bool) -> dict:
    """The ZeRO config at `path` with its "auto" values filled as the HF Trainer fills them."""
    cfg = json.loads(Path(path).read_text())
    fill = {
        "train_micro_batch_size_per_gpu": micro_batch, "gradient_accumulation_steps": 1, "train_batch_size": micro_batch * world_size(),
        "gradient_clipping": MAX_GRAD_NORM, "bf16.enabled": bf16, "fp16.enabled": False,
        "zero_optimization.reduce_bucket_size": hidden * hidden, "zero_optimization.stage3_prefetch_bucket_size": int(0.9 * hidden * hidden),
        "zero_optimization.stage3_param_persistence_threshold": 10 * hidden,
    }

    def walk(node: dict, prefix: str) -> None:
        for k, v in node.items():
            if isinstance(v, dict):
                walk(v, f"{prefix}{k}.")
            elif v == "auto":
                if f"{prefix}{k}" not in fill:
                    raise ValueError(f"{path}: {prefix}{k} is 'auto', which the stepagent stage's inverse variant does not fill: give it a value")
                node[k] = fill[f"{prefix}{k}"]

    walk(cfg, "")
    return cfg


class Optimised:
    """A model with its AdamW and the HF Trainer's cosine schedule with warmup, gradients clipped
    at MAX_GRAD_NORM. Called, it runs the model's forward on the batch (moved to its device);
    step(loss) updates. In one process plain torch (bf16: autocast); on ranks a DeepSpeed engine."""

    def __init__(self, model, hidden: int, steps: int, micro_batch: int, *, learning_rate: float, weight_decay: float, warmup_ratio: float,
                 bf16: bool, deepspeed: str | None):
        optimizer = torch.optim.AdamW(model.parameters(), lr=learning_rate, weight_decay=weight_decay)

        def schedule(opt):
            return get_cosine_schedule_with_warmup(opt, int(warmup_ratio * steps), steps)

        self.module, self.engine, self.autocast = model, None, False
        if deepspeed and world_size() > 1:  # by the ranks launched, not a process group an earlier caller left behind
            import deepspeed as ds

            self.engine, *_ = ds.initialize(model=model, optimizer=optimizer, lr_scheduler=schedule, config=zero_config(deepspeed, hidden, micro_batch, bf16))
            self.device = self.engine.device
        else:
            self.device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
            self.optimizer, self.schedule, self.autocast = optimizer, schedule(optimizer), bf16
            model.to(self.device)

    def __call__(self, **batch):
        batch = {k: v.to(self.device) for k, v in batch.items()}
        with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.autocast):
            return (self.engine or self.module)(**batch)

    def step(self, loss: torch.Tensor) -> None:
        if self.engine is not None:
            self.engine.backward(loss)
            self.engine.step()
            return
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.module.parameters(), MAX_GRAD_NORM)
        self.optimizer.step()
        self.schedule.step()
        self.optimizer.zero_grad()


def _mean_over_ranks(point: dict, device: torch.device) -> dict:
    if not torch.distributed.is_initialized():
        return point
    values = torch.tensor(list(point.values()), dtype=torch.float64, device=device)
    torch.distributed.all_reduce(values)
    return dict(zip(point, (values / world_size()).tolist()))


def train(policy, judge, tokenizer, rows: list[dict], *, seed: int, epochs: float, batch_size: int, learning_rate: float,
          discriminator_learning_rate: float, warmup_ratio: float, weight_decay: float, bf16: bool, deepspeed: str | None,
          ppo_epochs: int, clip_epsilon: float, kl_coef: float, value_coef: float, reward_floor: float, whiten_advantages: bool) -> list[dict]:
    """Algorithm 1's reflection on `examples`' rows: trains `policy` and `judge` (the discriminator)
    in place; returns the curve, one point per global batch: the discriminator's loss (Eq. 11) and
    accuracy before its step, the mean reward of the batch's agent actions under the updated D, and
    the last PPO epoch's KL to pi_ref, policy and value losses and clipped share of tokens."""
    me, ranks = rank(), world_size()
    plan = batches(len(rows), batch_size, ranks, epochs, seed)
    hidden = policy.config.hidden_size
    common = {"weight_decay": weight_decay, "warmup_ratio": warmup_ratio, "bf16": bf16, "deepspeed": deepspeed}
    actor = Optimised(ppo.PolicyWithValue(policy), hidden, len(plan) * ppo_epochs, batch_size, learning_rate=learning_rate, **common)
    disc = Optimised(judge, hidden, len(plan), 2 * batch_size, learning_rate=discriminator_learning_rate, **common)
    collate = PadCollator(tokenizer.pad_token_id)
    curve = []
    for step, batch in enumerate(plan, 1):
        mine = [rows[i] for i in batch[me::ranks]]
        seen = discriminator.update(disc, collate, mine)
        r = ppo.rewards(discriminator.probabilities(disc, collate, mine), reward_floor)
        old = torch.tensor([t for e in mine for t in e["old"]])
        parts = ppo.update(actor, collate([e["agent"] for e in mine]), old, r, epochs=ppo_epochs, clip_epsilon=clip_epsilon,
                           kl_coef=kl_coef, value_coef=value_coef, whiten=whiten_advantages)
        point = _mean_over_ranks({**seen, "reward": r.mean().item(), **parts}, actor.device)
        for key in ("loss", "policy_loss", "value_loss"):
            if not math.isfinite(point[key]):
                raise TrainingDiverged(step, point[key], f"the {key.replace('_', ' ')} is {point[key]} at batch {step}")
        curve.append({"step": step, **{k: round(v, 6) for k, v in point.items()}})
    return curve
