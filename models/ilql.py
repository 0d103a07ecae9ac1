"""An ILQL model (tasks/train/ilql.py trains it) as a causal LM whose logits are the extracted policy.

    logits(a | s) = log pi_beta(a | s) + beta * (min_k Q_targ_k(s, a) - V(s))

so pi(a | s) is proportional to pi_beta(a | s) * exp(beta * (Q(s, a) - V(s))) (Hindsight Regenerations
4.3, after Snell et al. 2022). pi_beta is the Llama's own LM head; the Q and V heads read the same
hidden states. The advantage uses the target Q heads, the min of the two, as ILQL's reference code
decodes: they are the Polyak-smoothed, pessimistic estimate. V(s) is the same for every token, so it
does not change the sampled distribution; it is kept so the logits are the formula's.

The model type is registered with transformers' Auto classes when this module is imported (models.hf
imports it), so AutoModelForCausalLM loads a saved ILQL directory with its heads and every caller
that reads `.logits` (the hf backend's sampler, evaluate) plays the extracted policy. `beta` is in
the config: beta = 0 plays pi_beta alone. The vllm backend refuses it (it would play the LM head alone).
"""
from __future__ import annotations

import torch
from huggingface_hub.dataclasses import strict
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM
from transformers.modeling_outputs import CausalLMOutputWithPast


@strict
class IlqlConfig(LlamaConfig):
    model_type = "retrosight_ilql"
    beta: float = 1.0  # the extraction temperature (HR's alpha in pi's formula; not given by the paper)


def _head(hidden: int, out: int) -> nn.Sequential:
    # ILQL's heads: a two-layer MLP of width 2h on the transformer's last hidden state.
    return nn.Sequential(nn.Linear(hidden, 2 * hidden), nn.ReLU(), nn.Linear(2 * hidden, out))


def extract(logits: torch.Tensor, target_q: torch.Tensor, v: torch.Tensor, beta: float) -> torch.Tensor:
    """logits [..., V], target_q [2, ..., V], v [...] -> the extracted policy's logits [..., V]."""
    return logits.float().log_softmax(-1) + beta * (target_q.float().min(0).values - v.float().unsqueeze(-1))


class IlqlForCausalLM(LlamaForCausalLM):
    config_class = IlqlConfig

    def __init__(self, config: IlqlConfig):
        super().__init__(config)
        h, vocab = config.hidden_size, config.vocab_size
        self.q_heads = nn.ModuleList([_head(h, vocab) for _ in range(2)])  # double Q
        self.target_q_heads = nn.ModuleList([_head(h, vocab) for _ in range(2)])  # Polyak copies, never trained
        self.v_head = _head(h, 1)
        self.target_q_heads.requires_grad_(False)
        self.post_init()

    @classmethod
    def from_policy(cls, policy: LlamaForCausalLM, beta: float) -> IlqlForCausalLM:
        """New heads on `policy`'s weights (its trunk and LM head, pi_beta), targets equal to the Q heads."""
        config = policy.config.to_dict()
        config.pop("model_type", None)
        model = cls(IlqlConfig(**{**config, "beta": beta, "architectures": [cls.__name__]})).to(policy.dtype)
        missing, unexpected = model.load_state_dict(policy.state_dict(), strict=False)
        assert not unexpected and all(k.split(".")[0] in ("q_heads", "target_q_heads", "v_head") for k in missing), (missing, unexpected)
        model.sync_targets()
        return model

    def heads(self, hidden: torch.Tensor) -> dict[str, torch.Tensor]:
        """At hidden states [..., h]: the LM head's logits [..., V], both Q heads and both target Q
        heads [2, ..., V] (targets without gradient), V [...]."""
        with torch.no_grad():
            target_q = torch.stack([head(hidden) for head in self.target_q_heads])
        return {
            "logits": self.lm_head(hidden),
            "q": torch.stack([head(hidden) for head in self.q_heads]),
            "target_q": target_q,
            "v": self.v_head(hidden).squeeze(-1),
        }

    @torch.no_grad()
    def sync_targets(self) -> None:
        for target, online in zip(self.target_q_heads.parameters(), self.q_heads.parameters()):
            target.copy_(online)

    @torch.no_grad()
    def polyak(self, rate: float) -> None:
        """target <- rate * online + (1 - rate) * target (HR Table 3: rate 0.005)."""
        for target, online in zip(self.target_q_heads.parameters(), self.q_heads.parameters()):
            target.lerp_(online, rate)

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, past_key_values=None, inputs_embeds=None,
                use_cache=None, logits_to_keep: int | torch.Tensor = 0, **kwargs) -> CausalLMOutputWithPast:
        out = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, past_key_values=past_key_values,
                         inputs_embeds=inputs_embeds, use_cache=use_cache, **kwargs)
        keep = slice(-logits_to_keep, None) if isinstance(logits_to_keep, int) else logits_to_keep
        hidden = out.last_hidden_state[:, keep]
        target_q = torch.stack([head(hidden) for head in self.target_q_heads])  # the online Q heads are not needed to play
        logits = extract(self.lm_head(hidden), target_q, self.v_head(hidden).squeeze(-1), self.config.beta)
        return CausalLMOutputWithPast(logits=logits, past_key_values=out.past_key_values)


AutoConfig.register(IlqlConfig.model_type, IlqlConfig)
AutoModelForCausalLM.register(IlqlConfig, IlqlForCausalLM)
