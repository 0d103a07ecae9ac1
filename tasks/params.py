"""params.yaml, validated. A misspelt key or a wrong type is an error naming it."""
from __future__ import annotations

import copy
import difflib
from pathlib import Path
from types import UnionType
from typing import Literal, Union, get_args, get_origin

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from envs import registry
from envs.base import Environment

Split = Literal["train", "val", "test"]


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class EnvParams(BaseModel):
    """`env.name` picks the environment (envs/registry.py); the other keys are its own params,
    validated by the environment (its Options), so a misspelt one is an error naming it."""

    model_config = ConfigDict(extra="allow", frozen=True)
    name: str = "twenty_questions"

    @model_validator(mode="after")
    def _valid(self) -> EnvParams:
        self.environment()
        return self

    def environment(self) -> Environment:
        try:
            return registry.make(self.name, self.model_extra or {})
        except KeyError as e:
            raise ValueError(e.args[0]) from None
        except ValidationError as e:
            raise ValueError("; ".join(
                f"env.{'.'.join(map(str, err['loc']))}: {'unknown key' if err['type'] == 'extra_forbidden' else err['msg']}" for err in e.errors()
            )) from None

    @staticmethod
    def known_keys() -> dict[str, object]:
        """Every key an installed environment takes, for checking `-S env.<key>=...` overrides.
        (Not `keys`: dict() would take the model for a mapping, as Prefect's parameter walk does.)"""
        return {"name": str} | {k: f.annotation for n in registry.available() for k, f in registry.get(n).Options.model_fields.items()}


Backend = Literal["oracle", "hf", "vllm", "openai"]


class RoleSampling(Strict):
    temperature: float = Field(0.7, ge=0)
    top_p: float = Field(1.0, gt=0, le=1)
    max_new_tokens: int = Field(256, ge=1)


class RoleParams(Strict):
    """One role: the environment's own oracle, or an LLM on a backend. Switching a role between
    them is an edit of `backend` (and `model`) here."""

    backend: Backend
    model: str | None = None  # hf/vllm: a model directory (or hub id where a hub is reachable); openai: the served name
    base_url: str | None = None  # openai: the endpoint, e.g. http://127.0.0.1:8000/v1
    # openai: the NAME of the environment variable holding the key, never the key (which dvc.lock would record)
    api_key_env: str | None = Field(None, pattern=r"^[A-Za-z_][A-Za-z0-9_]*$")
    dtype: Literal["auto", "float32", "bfloat16"] = "auto"  # hf/vllm; auto: bfloat16 only where the hardware runs it
    sampling: RoleSampling = RoleSampling()  # every role but the policy (whose sampling is per stage)
    seed: int = 0  # mixed into every request's seed, so a role can be resampled alone
    batch_size: int = Field(64, ge=1)  # hf/vllm: requests generated together
    concurrency: int = Field(8, ge=1)  # openai: requests in flight
    timeout: float = Field(60.0, gt=0)  # openai: seconds per attempt
    max_retries: int = Field(4, ge=0)  # openai: retries with backoff on 429, 5xx, timeouts
    parse_attempts: int = Field(3, ge=1)  # an output that does not parse is sampled again, this many times in all
    max_failure_rate: float = Field(0.05, ge=0, le=1)  # the stage fails when more of its calls fail than this
    gpu_memory_utilization: float = Field(0.5, gt=0, le=1)  # vllm: share of GPU memory (on CPU, sizes the KV cache)
    max_model_len: int | None = Field(None, ge=64)  # vllm
    tensor_parallel_size: int = Field(1, ge=1)  # vllm on several GPUs
    kv_cache_memory_bytes: int | None = Field(None, ge=1)  # vllm: the KV cache's size, over gpu_memory_utilization (on CPU, set this)
    enforce_eager: bool = False  # vllm: no torch.compile or CUDA graphs: slower steps, much faster start

    @model_validator(mode="after")
    def _backend_needs(self) -> RoleParams:
        if self.backend in ("hf", "vllm", "openai") and not self.model:
            raise ValueError(f"backend {self.backend} needs a model")
        if self.backend == "openai" and not self.base_url:
            raise ValueError("backend openai needs a base_url")
        return self


class PolicyRole(RoleParams):
    backend: Literal["hf", "vllm", "openai"]


class ForwardRole(RoleParams):
    # policy: the current policy plays on from the spliced action against the simulator (HOPE);
    # an LLM backend writes the rest of the dialogue itself, both sides (HR's forward model);
    # learned: the forward stage's fine-tuned models (HR's), served in process as hf models:
    # `model` for most regenerations, `hard_model` (the bottom quarter by reward) for a
    # `hard_share` of them, chosen by a seeded hash of the relabel.
    backend: Literal["policy", "oracle", "hf", "vllm", "openai", "learned"]  # type: ignore[assignment]
    hard_model: str | None = None  # learned: the model trained on the hard (lowest-reward) dialogues
    hard_share: float = Field(0.0, ge=0, le=1)  # learned: the share of regenerations the hard model writes (HR: "occasionally")

    @model_validator(mode="after")
    def _policy_is_builtin(self) -> ForwardRole:
        if self.backend == "oracle":
            raise ValueError("the forward role has no oracle; use backend: policy")
        if self.backend == "learned":
            if not self.model:
                raise ValueError("backend learned needs a model (the forward stage's: data/forward/models/model)")
            if self.hard_share > 0 and not self.hard_model:
                raise ValueError(f"hard_share {self.hard_share:g} needs a hard_model (the forward stage's: data/forward/models/hard_model)")
        elif self.hard_model is not None or self.hard_share:
            raise ValueError(f"hard_model and hard_share apply to backend learned only, not {self.backend}")
        return self


class LabelerRole(RoleParams):
    mode: Literal["few_shot", "rubric"] = "few_shot"  # an LLM labeler: HR's few-shot reward, or Refit's rubric judge
    few_shot: int = Field(4, ge=0)  # few_shot: labelled examples sampled from the original trajectories


class NlacRole(RoleParams):
    # NLAC's roles (tasks/nlac.py). policy: the model being trained, in this process, as the paper
    # runs all four roles on one LLM (the critic and the refiner at the current weights theta, the
    # backup at the target network theta-bar); oracle: the environment's (it sees the secret; the
    # refiner's is the hindsight proposer given the action); hf, vllm, openai: a fixed LLM at
    # `model`, not trained (a larger model serving the role zero-shot)
    backend: Literal["policy", "oracle", "hf", "vllm", "openai"]  # type: ignore[assignment]


class Roles(Strict):
    policy: PolicyRole
    simulator: RoleParams
    summarizer: RoleParams
    proposer: RoleParams
    forward: ForwardRole = ForwardRole(backend="policy")
    labeler: LabelerRole
    # NLAC's (tasks/nlac.py): the oracle by default, since a tiny model cannot critique zero-shot;
    # policy on all three is the paper's form. Left out of a params file, they are the oracle.
    language_critic: NlacRole = NlacRole(backend="oracle")  # Q_L(s_t, a_t): Future, then Optimality (A.1)
    backup: NlacRole = NlacRole(backend="oracle")  # L1's target: p_pred at s_t+1, then p_tpred (A.2)
    refiner: NlacRole = NlacRole(backend="oracle")  # a_t^r from a_t and its critique (A.3)


class CacheParams(Strict):
    path: str = ".retrosight/cache/responses.sqlite"  # every LLM role's responses; a memo, not versioned data


class RuntimeParams(Strict):
    """How this machine runs torch, not what the pipeline computes: no DVC stage depends on it."""

    threads: int | None = Field(None, ge=1)  # torch threads per stage process; null: the cores this process may use
    # passive: a thread waiting at an OpenMP join sleeps and frees its core (tasks/runtime.py says why)
    omp_wait_policy: Literal["passive", "active"] = "passive"
    # Processes evaluate plays its policies in side by side, runtime.threads split among them; null:
    # one per core with the hf backend (a small model's decoding is latency-bound), else one.
    processes: int | None = Field(None, ge=1)
    # `retrosight run` starts a server that imports every stage's modules once and forks each stage
    # from it (flows/preload.py); false: each stage process imports them itself
    preload: bool = True


class NoisyParams(Strict):
    p_random: float = Field(ge=0, le=1)
    p_repeat: float = Field(ge=0, le=1)
    p_early_guess: float = Field(ge=0, le=1)


class TokenizerParams(Strict):
    vocab_size: int = Field(ge=300, le=65536)
    split_digits: bool = False  # one token a digit, so numbers copy digit by digit (models/tiny.py)


class ModelParams(Strict):
    hidden_size: int = Field(ge=64)
    num_layers: int = Field(ge=1)
    num_heads: int = Field(ge=1)
    head_dim: int = Field(ge=64)  # vLLM's CPU attention kernels need head_dim >= 64
    intermediate_size: int = Field(ge=64)
    max_length: int = Field(ge=128)


class TrainParams(Strict):
    epochs: float = Field(gt=0)
    batch_size: int = Field(ge=1)
    learning_rate: float = Field(gt=0)
    warmup_ratio: float = Field(ge=0, lt=1)
    weight_decay: float = Field(ge=0)
    # bfloat16 autocast. auto: on where the hardware runs it (CUDA, AMX, AVX512-BF16), where it
    # is faster; elsewhere it is emulated and slower than float32.
    bf16: bool | Literal["auto"] = "auto"
    # Pack each batch into one row, attention run per sequence: no padding tokens. Same loss and
    # gradients to float rounding, not to the bit (tests/test_packed.py); faster where padding is a
    # large share (bench/train_throughput.py). params.yaml turns it on for train, critic, actor and
    # stepagent (ILQL and STaR-GATE-D pad regardless). The default, absent, is padded: how every
    # run before this key trained (bootstrap's base; the committed seeds' params read so).
    padding_free: bool = False


class DrillParams(Strict):
    """Copy drills before the demonstrations (models/tiny.py copy_drills): what pretraining gives
    an LLM, copying from its context. Off (sequences 0) by default."""

    sequences: int = Field(0, ge=0)
    length: int = Field(192, ge=24)  # tokens a drill, at most
    batch_size: int = Field(32, ge=1)
    learning_rate: float = Field(2.0e-3, gt=0)


class SamplingParams(Strict):
    temperature: float = Field(ge=0)
    top_p: float = Field(gt=0, le=1)
    max_new_tokens: int = Field(ge=1)


class BootstrapParams(Strict):
    # auto: the environment's shipped base (models/base/<env.name>) when it was trained with these
    # env and bootstrap keys, else train one; a path: that checkpoint (an error if its keys differ);
    # null: train one. tasks/bootstrap.py: shipped_base.
    checkpoint: str | None = "auto"
    demo_splits: list[Split] = Field(min_length=1)
    demos_per_task: int = Field(ge=1)
    # per-episode weights of the environment's scripted policies, by the names it offers
    # (env.policies: expert, noisy, random; persuasion's pushy too), checked when bootstrap runs
    behaviour_mix: dict[str, float] = Field(min_length=1)
    noisy: NoisyParams
    tokenizer: TokenizerParams
    model: ModelParams
    train: TrainParams
    drill: DrillParams = DrillParams()
    eval_splits: list[Split]
    eval_sampling: SamplingParams
    eval_batch_size: int = Field(ge=1)
    curve_every: int | None = Field(None, ge=1)  # also evaluate a snapshot every N epochs: the learning curve
    limit_tasks: int | None = Field(None, ge=1)  # first N tasks per split: quick smoke runs

    @model_validator(mode="after")
    def _mix(self) -> BootstrapParams:
        if any(w < 0 for w in self.behaviour_mix.values()) or sum(self.behaviour_mix.values()) <= 0:
            raise ValueError("behaviour_mix weights must be >= 0 and not all zero")
        return self


class ScaleParams(Strict):
    """Generation shards (flows/collect.py). The table depends on the shard count, never on the runner."""

    shards: int = Field(1, ge=1)  # episodes cut into N deterministic shards; 1: one process, the default run
    runner: Literal["local", "dask"] = "local"  # local: shards one after another here; dask: a Prefect task each on Dask
    address: str | None = None  # dask: an existing scheduler, e.g. tcp://scheduler-host:8786; null: a LocalCluster
    workers: int | None = Field(None, ge=1)  # dask LocalCluster worker processes; null: one per shard

    @model_validator(mode="after")
    def _dask_only(self) -> ScaleParams:
        if self.runner != "dask" and (self.address or self.workers):
            raise ValueError("address and workers apply to runner: dask only")
        if self.address and self.workers:
            raise ValueError("workers sizes a LocalCluster; with an address the cluster is already sized")
        return self


class CollectParams(Strict):
    splits: list[Split] = Field(min_length=1)
    m: int = Field(ge=1)
    sampling: SamplingParams
    # Refit/Swift log each question at several temperatures (m = 3, one each): trajectory k of a
    # task samples at temperatures[k % len], the rest of `sampling` alike; null: all at sampling's
    temperatures: list[float] | None = Field(None, min_length=1)
    batch_size: int = Field(ge=1)
    limit_tasks: int | None = Field(None, ge=1)  # first N tasks per split: quick smoke runs
    scale: ScaleParams = ScaleParams()

    @model_validator(mode="after")
    def _temperatures(self) -> CollectParams:
        if self.temperatures is not None:
            if any(t < 0 for t in self.temperatures):
                raise ValueError(f"temperatures must be >= 0, got {self.temperatures}")
            if self.m % len(self.temperatures):
                raise ValueError(f"m ({self.m}) must be a multiple of the {len(self.temperatures)} temperatures, so each logs as many trajectories a task")
        return self


class RelabelParams(Strict):
    mode: Literal["hope", "hr"]
    splits: list[Split] = Field(min_length=1)
    k: int = Field(ge=1)  # hope: trajectories per task
    t: int = Field(ge=1)  # hope: timesteps per trajectory
    n: int = Field(ge=1)  # hope: distinct counterfactuals per timestep
    window: tuple[float, float] | None = None  # hope: timesteps j with a*T <= j < b*T; null: the environment's window
    hr_top: int = Field(ge=1)  # hr: places the controller names
    # hr: of those, the distinct places each dialogue is regenerated from (HR App. B.1 uses one; its
    # 5x aggregation needs about 4 regenerations per dialogue and does not say how they are had)
    hr_suggestions: int = Field(1, ge=1)

    @model_validator(mode="after")
    def _valid(self) -> RelabelParams:
        if self.hr_suggestions > self.hr_top:
            raise ValueError(f"hr_suggestions ({self.hr_suggestions}) must not exceed hr_top ({self.hr_top}), the places they are drawn from")
        if self.window is None:
            return self
        a, b = self.window
        if not 0 <= a < b <= 1:
            raise ValueError(f"window must satisfy 0 <= a < b <= 1, got {list(self.window)}")
        return self


class RegenerateParams(Strict):
    sampling: SamplingParams
    batch_size: int = Field(ge=1)


class StandardizeParams(Strict):
    splits: list[Split] = Field(min_length=1)
    mode: Literal["per_context", "global", "min_max"]
    # Swift's statistics: logged: each context's logged rows (its m independent samples), every
    # row scored against them; pooled: every row of the context, regenerations included
    stats: Literal["logged", "pooled"] = "logged"
    # Refit's weight, one map for every arm: return_range: the environment's reward range onto
    # [0, 1] (TwentyQuestions: (r + max_turns) / max_turns); identity: r, already in [0, 1] (a rubric judge's Overall / 10)
    weight: Literal["return_range", "identity"] = "return_range"
    clip: float | None = Field(None, gt=0)


class BufferParams(Strict):
    splits: list[Split] = Field(["train"], min_length=1)
    gamma: float = Field(0.95, gt=0, le=1)  # HOPE's code; the paper gives none
    # the critic's targets in [0, 1]: outcome: 0.5 * (1 + gamma^(T-1-t) * (+1 won / -1 lost)), the
    # reference code's; return_range: Eq. 3's return-to-go mapped from the environment's reward range
    target: Literal["outcome", "return_range"] = "outcome"
    size: int = Field(10000, ge=1)  # pairs the critic trains on (HOPE: 10k for 20Q and GMC)
    low_share: float | None = Field(0.5, gt=0, lt=1)  # share of targets < 0.5 (HOPE: 0.5); null: no balancing
    alpha: float | None = Field(0.4, ge=0, le=1)  # hindsight share of the high half (HOPE 20Q: 0.4); 0: PRM+RL, no regenerations


class CriticParams(Strict):
    base_model: str = "data/bootstrap/model"  # the policy the critic starts from (HOPE: pi_0)
    epochs: float = Field(2, gt=0)  # HOPE: 1 (lr 5e-6, batch 64, a 3B model)
    batch_size: int = Field(16, ge=1)
    learning_rate: float = Field(1.0e-4, gt=0)
    warmup_ratio: float = Field(0.05, ge=0, lt=1)
    weight_decay: float = Field(0.0, ge=0)
    bf16: bool | Literal["auto"] = "auto"
    padding_free: bool = False  # as train.padding_free: each batch packed into one row, scored at each sequence's end
    # the scalar head before fine-tuning: random (HOPE) | probe, fit by logistic regression on the
    # frozen policy's features first (LP-FT; tasks/train/critic.py)
    head_init: Literal["random", "probe"] = "probe"
    heldout_share: float = Field(0.1, ge=0, lt=1)  # selected pairs kept out of training: the calibration's
    deepspeed: str | None = "tasks/train/deepspeed_zero3.json"  # as train.deepspeed
    nproc_per_node: int = Field(1, ge=1)
    max_loss_ratio: float | None = Field(10.0, gt=1)
    # which checkpoint is the critic: last | best_of_n_val, HOPE's: the critic is saved after every
    # epoch and each plays best-of-select_n with the policy (roles.policy) on the val games; the
    # highest success wins, ties going to the lower held-out error
    select: Literal["last", "best_of_n_val"] = "last"
    select_n: int = Field(4, ge=1)  # HOPE: 15
    select_sampling: SamplingParams = SamplingParams(temperature=0.7, top_p=1.0, max_new_tokens=112)  # HOPE: 0.7


class ActorParams(Strict):
    base_model: str = "data/bootstrap/model"  # the actor's starting weights and DPO's frozen reference (HOPE: pi_0)
    critic: str = "data/critic/model"  # ranks the candidates (the critic stage's model)
    prompts: int = Field(10000, ge=1)  # buffer states trained on, each once (HOPE: 10000 episodes)
    rounds: int = Field(4, ge=1)  # generate-then-update cycles; each round's candidates come from the actor as it stands
    candidates: int = Field(2, ge=2)  # per state; the critic's best is chosen, its worst rejected (HOPE's code: 2)
    sampling: SamplingParams = SamplingParams(temperature=0.7, top_p=1.0, max_new_tokens=112)  # HOPE: 0.7
    explore_prob: float = Field(0.0, ge=0, le=1)  # HOPE's beta: candidates from the hindsight proposer (0 main, 0.5 ablation)
    kl_beta: float = Field(0.03, gt=0)  # DPO's KL coefficient (HOPE's code: 0.03)
    epochs: float = Field(1, gt=0)  # passes over each round's pairs (HOPE: 1)
    batch_size: int = Field(8, ge=1)  # pairs per step (HOPE: 2 x 6 accumulation)
    learning_rate: float = Field(1.0e-4, gt=0)  # HOPE: 8e-8 on a 3B model
    warmup_ratio: float = Field(0.0, ge=0, lt=1)
    weight_decay: float = Field(0.0, ge=0)
    bf16: bool | Literal["auto"] = "auto"
    padding_free: bool = False  # as train.padding_free: each batch of pairs packed into one row
    max_loss_ratio: float | None = Field(10.0, gt=1)
    select: Literal["last", "val"] = "last"  # val: the round whose actor wins most val games (HOPE); last: the last round's
    deepspeed: str | None = "tasks/train/deepspeed_zero3.json"  # as train.deepspeed: the DPO update on GPUs and on ranks
    nproc_per_node: int = Field(1, ge=1)  # > 1: the stage relaunches itself under torchrun; each round's update runs on every rank


class ProposerParams(Strict):
    base_model: str = "data/bootstrap/model"  # the model fine-tuned into the proposer (HOPE: the base LLM, Llama-3.2-3B-Instruct)
    epochs: float = Field(2, gt=0)  # phase 1, every counterfactual (HOPE: 2)
    learning_rate: float = Field(2.0e-3, gt=0)  # phase 1 (HOPE: 3e-5 on a 3B model)
    success_epochs: float = Field(1, ge=0)  # phase 2, only counterfactuals whose regeneration succeeded (HOPE: 1); 0 skips it
    success_learning_rate: float = Field(1.0e-4, gt=0)  # phase 2 (HOPE: 3e-6, a tenth of phase 1's)
    batch_size: int = Field(8, ge=1)  # sites per step (HOPE: as its SFT, 4 x 16 accumulation x 2 GPUs)
    warmup_ratio: float = Field(0.05, ge=0, lt=1)  # HOPE: not given
    weight_decay: float = Field(0.0, ge=0)  # HOPE: not given (OpenInstruct's default, 0)
    bf16: bool | Literal["auto"] = "auto"
    heldout_share: float = Field(0.1, ge=0, lt=1)  # sites kept out of training: the parse rate and agreement are measured on them
    max_loss_ratio: float | None = Field(10.0, gt=1)  # as train.max_loss_ratio


class ForwardParams(Strict):
    """The forward stage (tasks/forward.py): HR's forward models fine-tuned on the logged dialogues."""

    base_model: str = "data/bootstrap/model"  # fine-tuned into both forward models (HR: GPT-3.5)
    dialogues: int | None = Field(100, ge=1)  # logged train dialogues sampled to train on (HR: 100); null: every one
    cuts_per_dialogue: int | None = Field(2, ge=1)  # prefixes per dialogue, drawn by seed; null: every prefix (HR's)
    hard_fraction: float = Field(0.25, gt=0, le=1)  # the hard model's dialogues: this lowest share by reward (HR: 25%)
    epochs: float = Field(2, gt=0)
    hard_epochs: float = Field(2, gt=0)
    learning_rate: float = Field(2.0e-3, gt=0)
    batch_size: int = Field(8, ge=1)
    warmup_ratio: float = Field(0.05, ge=0, lt=1)
    weight_decay: float = Field(0.0, ge=0)
    bf16: bool | Literal["auto"] = "auto"
    max_loss_ratio: float | None = Field(10.0, gt=1)
    heldout_share: float = Field(0.1, ge=0, lt=1)  # dialogues kept out of training: fidelity is measured on their prefixes


class IlqlParams(Strict):
    """ILQL's settings (tasks/train/ilql.py); the values are Hindsight Regenerations' Table 3 where it gives them."""

    tau: float = Field(0.8, gt=0, lt=1)  # the expectile V regresses to (Table 3 "ILQL tau")
    cql_weight: float = Field(0.0, ge=0)  # the CQL term's weight (Table 3 "ILQL alpha" = 0: off)
    gamma: float = Field(0.99, gt=0, le=1)  # discount (Table 3)
    discount_per: Literal["token", "turn"] = "token"  # token: the paper's token-level MDP; turn: gamma once per agent turn
    polyak: float = Field(0.005, gt=0, le=1)  # target Q heads <- polyak * Q heads + (1 - polyak) * targets, every step (Table 3)
    beta: float = Field(1.0, ge=0)  # extraction temperature: logits + beta * (Q - V); not given by the paper
    bc_weight: float = Field(1.0, ge=0)  # the LM head's cross-entropy on agent tokens: pi_beta, fine-tuned on the same data
    reward_column: Literal["reward", "weight", "standardized_reward"] = "reward"  # the terminal reward (HR: the labelled reward)


class PolicyGradientParams(Strict):
    """What grpo and ppo_returns share (tasks/train/grpo.py, ppo_returns.py): NLAC's RL baselines,
    which it ran in verl without giving their clip, KL or epochs (notes/nlac.md section 6)."""

    # the episode's terminal reward. weight: the labelled reward scaled to [0, 1], NLAC's r in [0, 1],
    # so kl_coef weighs the same against it in every environment; return: a trajectory table's (collect's)
    reward_column: Literal["weight", "reward", "return"] = "weight"
    ppo_epochs: int = Field(ge=1)  # optimizer steps on each batch (each method's default below)
    clip_epsilon: float = Field(0.2, gt=0, lt=1)  # the ratio clip (PPO's, DeepSeekMath's GRPO and TRL: 0.2)
    kl_coef: float = Field(ge=0)  # the per-token k3 KL to the reference, in the loss (each method's default below)
    # optimizer steps per call whatever the table's size (NLAC gives every method the same count,
    # 30,720); null: train.epochs passes over the episodes, ppo_epochs steps on each batch
    gradient_steps: int | None = Field(None, ge=1)


class GrpoParams(PolicyGradientParams):
    ppo_epochs: int = Field(1, ge=1)  # DeepSeekMath's mu = 1 (and TRL's num_iterations)
    kl_coef: float = Field(0.04, ge=0)  # DeepSeekMath's beta
    # divide by the group's std (DeepSeekMath) or not (Dr. GRPO: the division overweights groups that
    # nearly agree); NLAC describes the baseline as the group's mean reward alone, so off
    scale_rewards: bool = False


class PpoReturnsParams(PolicyGradientParams):
    ppo_epochs: int = Field(4, ge=1)  # TRL's and CleanRL's 4, as stepagent's inverse variant
    kl_coef: float = Field(0.05, ge=0)  # TRL PPO's 0.05, as stepagent's inverse variant
    value_coef: float = Field(0.1, ge=0)  # the value head's loss weight on the shared body (TRL's vf_coef 0.1)
    # per agent turn; 1: every turn's tokens target the episode's reward, the sparse terminal reward undiscounted (NLAC gives no gamma)
    gamma: float = Field(1.0, gt=0, le=1)
    whiten_advantages: bool = True  # (G - V) standardised per global batch, as TRL and CleanRL do


class DistillParams(Strict):
    """STaR-GATE-D's knowledge distillation (tasks/train/star_gate_d.py; Refit/Swift's Table 27)."""

    # the teacher: a method of train.methods listed before this one (its model, trained earlier in
    # the stage: Table 27's "STaR-GATE last-checkpoint"), or a model directory
    teacher: str = "star_gate"
    alpha: float = Field(0.5, ge=0, le=1)  # the KL term's share, (1 - alpha) the SFT loss's (Table 27: distillation_alpha 0.5)
    temperature: float = Field(2.0, gt=0)  # both distributions softened by it, the KL scaled by its square (Table 27: 2.0)


class StepDPOParams(Strict):
    """StepDPO's per-step pairs (tasks/train/step_dpo.py)."""

    # branches: from each step of each logged trajectory the base policy plays a new continuation
    # with the same teacher and the labeler judges it (the paper's); logs: pairs among a question's
    # logged trajectories that share a prefix and differ at a step, no rollout and no judge call
    pairs_from: Literal["branches", "logs"] = "branches"
    # branches: (trajectory, step) sites drawn by seed; null: every step of every logged train
    # trajectory (the paper's; 3 x the logged trajectories at n = 3)
    sites: int | None = Field(None, ge=1)
    sampling: SamplingParams | None = None  # branches: the branch's sampling; null: collect.sampling (the logging policy's)
    batch_size: int = Field(512, ge=1)  # branches: episodes generated together

    @model_validator(mode="after")
    def _branches_only(self) -> StepDPOParams:
        if self.pairs_from == "logs" and (self.sites is not None or self.sampling is not None):
            raise ValueError("sites and sampling size and sample the branch rollouts; pairs_from: logs rolls none out")
        return self


DPO_FAMILY = ("eto", "dpo", "step_dpo")  # the methods on the shared DPO loss (tasks/train/online_dpo.py) that take `beta`


class MethodParams(Strict):
    # leap: relabel's counterfactuals, not the table; eto: the expert's trajectories against collect's failures, not the table
    algorithm: Literal["sft", "refit", "swift", "filtered_bc", "ilql", "leap", "rft", "eto", "grpo", "ppo_returns", "star_gate", "star_gate_d", "dpo",
                       "step_dpo"]
    data: Literal["all", "logged"] = "all"  # logged: leave the hindsight regenerations out (rft: always)
    # HOPE's alpha: the regenerations' share of this method's rows (tasks/train: training_rows); null: every row
    alpha: float | None = Field(None, ge=0, lt=1)
    top_fraction: float = Field(0.25, gt=0, le=1)  # filtered_bc only
    ilql: IlqlParams | None = None  # ilql only; null: IlqlParams' defaults
    # HR's aggregation: every logged row and regenerations until the rows are this multiple of
    # the logged ones (HR: 5, originals included); with too few, every regeneration. null: off
    aggregate_multiple: float | None = Field(None, ge=1)
    learning_rate: float | None = Field(None, gt=0)  # this method's own; null: train.learning_rate
    # rft only: a success is a weight (the reward scaled to [0, 1] over the environment's range) at
    # least this; null: the environment's own win rule on the labelled reward (Environment.won)
    success_threshold: float | None = Field(None, ge=0, le=1)
    # eto, dpo and step_dpo: DPO's beta; null: ETO's 0.1 (its later iterations 0.5), TRL's default
    # too, which Refit/Swift's DPO baselines presumably kept (the paper gives no beta)
    beta: float | None = Field(None, gt=0)
    distill: DistillParams | None = None  # star_gate_d only; null: DistillParams' defaults (the paper's)
    step_dpo: StepDPOParams | None = None  # step_dpo only; null: StepDPOParams' defaults
    grpo: GrpoParams | None = None  # grpo only; null: GrpoParams' defaults
    ppo_returns: PpoReturnsParams | None = None  # ppo_returns only; null: PpoReturnsParams' defaults
    # rft, filtered_bc and sft (the SFT trainer's methods): exactly this many optimizer steps (the HF
    # Trainer's max_steps), passes over the rows repeated or cut short, so an NLAC baseline takes as
    # many as the others; null: train.epochs passes. grpo's and ppo_returns' is under their own keys
    gradient_steps: int | None = Field(None, ge=1)

    @model_validator(mode="before")
    @classmethod
    def _rft_is_logged(cls, raw):
        # RFT clones the policy's own rollouts: the regenerations are not, so its default is logged.
        if isinstance(raw, dict) and raw.get("algorithm") == "rft":
            if raw.get("data", "logged") != "logged" or raw.get("alpha") is not None or raw.get("aggregate_multiple") is not None:
                raise ValueError("rft clones the policy's own successful rollouts, the logged rows: data: all, alpha and aggregate_multiple do not apply to it")
            raw = {**raw, "data": "logged"}
        # On-policy RL: a regeneration is not the policy's sample, and in a GRPO group it would not be one of the task's rollouts.
        if isinstance(raw, dict) and raw.get("algorithm") in ("grpo", "ppo_returns"):
            if raw.get("data", "logged") != "logged" or raw.get("alpha") is not None or raw.get("aggregate_multiple") is not None:
                raise ValueError(f"{raw['algorithm']} learns from the policy's own rollouts, the logged rows: data: all, alpha and aggregate_multiple do not apply to it")
            raw = {**raw, "data": "logged"}
        return raw

    @model_validator(mode="after")
    def _alpha_needs_hindsight(self) -> MethodParams:
        if self.alpha is not None and self.data == "logged":
            raise ValueError("alpha is the share of hindsight rows, and data: logged has none; use data: all with alpha")
        if self.aggregate_multiple is not None and self.data == "logged":
            raise ValueError("aggregate_multiple adds hindsight rows, and data: logged has none; use data: all with aggregate_multiple")
        if self.aggregate_multiple is not None and self.alpha is not None:
            raise ValueError("alpha and aggregate_multiple both size the hindsight rows; set one")
        for own in ("ilql", "grpo", "ppo_returns"):
            if getattr(self, own) is not None and self.algorithm != own:
                raise ValueError(f"{own} settings apply to algorithm {own} only, not {self.algorithm}")
        if self.algorithm == "leap" and (self.alpha is not None or self.aggregate_multiple is not None or self.data != "all"):
            raise ValueError("leap trains on relabel's counterfactuals, not on the training table's rows: data, alpha and aggregate_multiple do not apply to it")
        if self.algorithm == "eto" and (self.alpha is not None or self.aggregate_multiple is not None or self.data != "all"):
            raise ValueError("eto trains on the expert's and collect's trajectories, not on the training table's rows: data, alpha and aggregate_multiple do not apply to it")
        for key, algorithms in (("success_threshold", ("rft",)), ("beta", DPO_FAMILY), ("distill", ("star_gate_d",)), ("step_dpo", ("step_dpo",))):
            if getattr(self, key) is not None and self.algorithm not in algorithms:
                which = f"algorithm {algorithms[0]}" if len(algorithms) == 1 else f"algorithms {', '.join(algorithms)}"
                raise ValueError(f"{key} applies to {which} only, not {self.algorithm}")
        if self.gradient_steps is not None and self.algorithm not in SFT_STEPPED:
            own = f": set {self.algorithm}.gradient_steps" if self.algorithm in ("grpo", "ppo_returns") else ""
            raise ValueError(f"gradient_steps applies to algorithms {', '.join(SFT_STEPPED)} only, not {self.algorithm}{own}")
        return self


SFT_STEPPED = ("rft", "filtered_bc", "sft")  # MethodParams.gradient_steps: tasks/train/sft.py's train, with max_steps
ETO_BETA = 0.1  # ETO's first iteration (Song et al. 2024); StepAgent gives none


class MethodConfig(Strict):
    """What one algorithm sees: the shared trainer settings and its method's own."""

    train: TrainParams
    norm: Literal["sequences", "tokens"]
    push_down_floor: float | None
    deepspeed: str | None
    top_fraction: float
    ilql: IlqlParams = IlqlParams()
    grpo: GrpoParams = GrpoParams()
    ppo_returns: PpoReturnsParams = PpoReturnsParams()
    success_threshold: float | None = None
    beta: float = ETO_BETA
    distill: DistillParams = DistillParams()
    step_dpo: StepDPOParams = StepDPOParams()
    gradient_steps: int | None = None  # rft, filtered_bc, sft: the SFT trainer's max_steps
    max_loss_ratio: float | None
    checkpoint_steps: int
    checkpoint_dir: Path | None = None  # where this method's run checkpoints; set by run_train

    def trainer_kwargs(self) -> dict:
        return {
            **self.train.model_dump(), "deepspeed": self.deepspeed, "max_loss_ratio": self.max_loss_ratio,
            "checkpoint_steps": self.checkpoint_steps, "checkpoint_dir": self.checkpoint_dir,
        }


class TrainStageParams(TrainParams):
    base_model: str
    methods: dict[str, MethodParams] = Field(min_length=1)
    norm: Literal["sequences", "tokens"] = "sequences"  # Refit/Swift: mean over trajectories or tokens
    push_down_floor: float | None = Field(1.0e-3, gt=0, lt=1)  # Swift: negative weights stop at this probability
    deepspeed: str | None = None  # a ZeRO config, used on CUDA GPUs and in every multi-rank run (CPU too)
    nproc_per_node: int = Field(1, ge=1)  # > 1: the stage relaunches itself under torchrun with this many ranks
    # Stop when a logged loss's magnitude exceeds this multiple of the first logged loss's; null: never.
    max_loss_ratio: float | None = Field(10.0, gt=1)
    checkpoint_steps: int = Field(10, ge=1)  # a resumable checkpoint every N optimizer steps

    @model_validator(mode="after")
    def _teachers_come_first(self) -> TrainStageParams:
        names = list(self.methods)
        for i, (name, m) in enumerate(self.methods.items()):
            teacher = (m.distill or DistillParams()).teacher if m.algorithm == "star_gate_d" else None
            if teacher in names[i:]:
                raise ValueError(f"train.methods.{name}: its teacher {teacher} must be listed before it (methods train in order)")
        return self

    def config_for(self, method: MethodParams) -> MethodConfig:
        shared = TrainParams(**{k: getattr(self, k) for k in TrainParams.model_fields})
        if method.learning_rate is not None:
            shared = shared.model_copy(update={"learning_rate": method.learning_rate})
        return MethodConfig(
            train=shared, norm=self.norm, push_down_floor=self.push_down_floor, deepspeed=self.deepspeed, top_fraction=method.top_fraction,
            ilql=method.ilql or IlqlParams(), grpo=method.grpo or GrpoParams(), ppo_returns=method.ppo_returns or PpoReturnsParams(),
            success_threshold=method.success_threshold, beta=method.beta or ETO_BETA, distill=method.distill or DistillParams(),
            step_dpo=method.step_dpo or StepDPOParams(), gradient_steps=method.gradient_steps, max_loss_ratio=self.max_loss_ratio,
            checkpoint_steps=self.checkpoint_steps,
        )


class ExpertParams(Strict):
    """The expert stage (tasks/expert.py): StepAgent's expert trajectories, played by the
    environment's scripted expert or imported from a user's file."""

    # null: the environment's scripted expert plays; a JSONL or Parquet file of chat-format
    # trajectories (as `retrosight import` reads): imported instead, every row checked
    source: str | None = None
    splits: list[Split] = Field(["train"], min_length=1)  # StepAgent's (ETO's) expert trajectories are the train split's
    m: int = Field(1, ge=1)  # episodes per task (StepAgent: one expert trajectory per task)
    limit_tasks: int | None = Field(None, ge=1)  # first N tasks per split: quick smoke runs


class PracticeParams(Strict):
    """The practice stage (tasks/practice.py): StepAgent's inspection (Eq. 4) and practice (Eq. 5)."""

    model: str = "data/bootstrap/model"  # the policy that practises, pi_theta_i (iteration 1: the SFT base, pi_theta_0)
    # prefixes drawn by seed from every successful expert trajectory's n (Algorithm 1's "sampled
    # step-wise expert trajectory"); null: every prefix, Eq. 4's T_sample whole
    prefixes: int | None = Field(32, ge=1)
    k: int = Field(3, ge=1)  # practice number: actions sampled per prefix (StepAgent Fig. 4b: 3 is best, more does not help)
    # StepAgent decodes greedily, which would make the k samples one; it gives no sampling. T = 1:
    # the policy's own distribution, so a sample's log-probability is its behaviour log-probability
    sampling: SamplingParams = SamplingParams(temperature=1.0, top_p=1.0, max_new_tokens=112)
    # what counts as the agent matching the expert (such pairs are flagged, counted, and left out
    # of the loss): action, the same move by the environment's own normalisation (same_action on
    # the parsed actions, as relabel drops a counterfactual equal to the original) or the identical
    # text; text, the identical text only (the one case whose DPO gradient is exactly zero)
    equal: Literal["action", "text"] = "action"
    batch_size: int = Field(512, ge=1)  # prompts generated together


STEPAGENT_VARIANTS = ("implicit", "inverse")


class StepAgentParams(Strict):
    """The stepagent stage (tasks/stepagent.py): StepAgent's reflection on the practice pairs."""

    # implicit: step-level DPO of the expert's action over the agent's (Eq. 6); inverse: a
    # discriminator's log D as a step reward for PPO, alternating per batch (Eq. 9-11, Algorithm 1)
    variant: Literal[STEPAGENT_VARIANTS] = "implicit"
    base_model: str = "data/bootstrap/model"  # the starting weights, and DPO's frozen reference pi_ref: the policy that practised
    # Eq. 6's beta; StepAgent gives none. ETO, whose setup it follows: 0.1 in iteration 1, 0.5 after
    beta: float = Field(0.1, gt=0)
    epochs: float = Field(1, gt=0)  # ETO: 1 per iteration
    batch_size: int = Field(8, ge=1)  # pairs per step (ETO: 16)
    learning_rate: float = Field(1.0e-4, gt=0)  # ETO: 1e-6, then 5e-7, on 7B models; the tiny model needs more (the actor's)
    warmup_ratio: float = Field(0.0, ge=0, lt=1)
    weight_decay: float = Field(0.0, ge=0)
    bf16: bool | Literal["auto"] = "auto"
    padding_free: bool = False  # implicit: each batch of pairs packed into one row (as train.padding_free)
    max_loss_ratio: float | None = Field(10.0, gt=1)  # implicit's (LossGuard); inverse stops on a NaN/inf loss only
    deepspeed: str | None = "tasks/train/deepspeed_zero3.json"  # as train.deepspeed: GPUs and multi-rank runs
    nproc_per_node: int = Field(1, ge=1)  # > 1: the stage relaunches itself under torchrun, as train does
    # inverse only (tasks/train/stepagent_inverse.py, ppo.py, discriminator.py). StepAgent gives none
    # of these; learning_rate is the policy's, epochs and batch_size count practice rows.
    discriminator_learning_rate: float = Field(1.0e-4, gt=0)  # the critic's: the same model, policy body and scalar head
    ppo_epochs: int = Field(4, ge=1)  # PPO steps per batch (TRL's and CleanRL's 4)
    clip_epsilon: float = Field(0.2, gt=0, lt=1)  # PPO's ratio clip (PPO paper and TRL: 0.2)
    kl_coef: float = Field(0.05, ge=0)  # per-token KL to pi_ref in the loss (TRL PPO's 0.05)
    value_coef: float = Field(0.1, ge=0)  # the value head's loss weight on the shared body (TRL's vf_coef 0.1)
    reward_floor: float = Field(-5.0, lt=0)  # log D no lower: D = e^-5 = 0.7% is as sure as "the agent's" counts (log 0 = -inf)
    whiten_advantages: bool = True  # (r - V) standardised per global batch, as TRL and CleanRL do


class BestOfNParams(Strict):
    critic: str = "data/critic/model"  # the critic that picks (the critic stage's model)
    n: int = Field(15, ge=1)  # actions sampled per turn (HOPE: 15)
    sampling: SamplingParams = SamplingParams(temperature=0.7, top_p=1.0, max_new_tokens=112)  # HOPE: 0.7
    policies: list[str] = ["bootstrap"]  # each also played best-of-n; [] turns it off
    # more critics, each also picking for every policy above, as "<policy>+best_of_<n>[<name>]"
    # (the bench's critic without hindsight, PRM+RL's, beside HOPE's)
    critics: dict[str, str] = {}


class EvaluateParams(Strict):
    splits: list[Split] = Field(min_length=1)
    episodes_per_task: int = Field(ge=1)
    sampling: SamplingParams
    batch_size: int = Field(ge=1)
    limit_tasks: int | None = Field(None, ge=1)
    best_of_n: BestOfNParams = BestOfNParams()
    actor: str | None = "data/actor/model"  # HOPE's actor (the actor stage's model), played as "actor"; null: not played
    # StepAgent's policy (the stepagent stage's model), played as "stepagent"; null: not played.
    # params.yaml names it; left out, it is null, so a params file from before StepAgent (a
    # committed seed's) reads as it was run
    stepagent: str | None = None
    extra: dict[str, str] = {}  # more policies to play, name: model directory (the bench's PRM+RL actor)


class IterationParams(Strict):
    """One of HOPE's later iterations (Algorithm 1, i >= 2): DVC's foreach item, so its deps can name
    the model it collects with."""

    policy: str  # the previous iteration's actor: data/actor/model for 2, data/iteration<i-1>/actor/model after


def iteration_dir(i: int) -> str:
    return "data" if i == 1 else f"data/iteration{i}"


class StepAgentIterationParams(Strict):
    """One of StepAgent's later iterations (Algorithm 1's outer loop, i >= 2): DVC's foreach item."""

    policy: str  # the previous iteration's policy: data/stepagent/model for 2, data/iteration<i-1>/stepagent/model after
    beta: float | None = Field(None, gt=0)  # this iteration's Eq. 6 beta; null: stepagent.beta (ETO: 0.1 in iteration 1, 0.5 after)


class StepAgentSelectParams(Strict):
    """The stepagent_select stage (tasks/stepagent_select.py)."""

    # the last iteration's policy, data/iteration<K>/stepagent/model (data/stepagent/model with no
    # stepagent_iterations): DVC cannot compute it, and as this stage's dep it runs every iteration first
    last: str = "data/stepagent/model"


def stepagent_policy(i: int) -> str:
    """StepAgent's policy after iteration i."""
    return f"{iteration_dir(i)}/stepagent/model"


# NLAC's update per iteration: its own (L1 + L2), or a baseline of its Table 1 on the iteration's
# episodes, by its train.methods algorithm (tasks/train/rft.py, grpo.py, ppo_returns.py)
NLAC_BASELINES = {"rft": "rft", "grpo": "grpo", "ppo": "ppo_returns"}


class NlacParams(Strict):
    """NLAC's iterations (tasks/nlac.py, tasks/train/nlac.py; notes/nlac.md). The paper's values
    are for Qwen2.5-7B; where it gives none, the choice and its reason are beside the key."""

    algorithm: Literal["nlac", "rft", "grpo", "ppo"] = "nlac"  # the update after collecting (NLAC_BASELINES)
    # a baseline's own settings, as train.methods writes a method (its algorithm: rft, grpo or
    # ppo_returns); null: that method's defaults. Its trainer keys are train's (epochs, learning_rate, ...)
    method: MethodParams | None = None
    # collection with the current policy (Algorithm 1, lines 3-6); the paper gives no count
    splits: list[Split] = Field(["train"], min_length=1)
    m: int = Field(1, ge=1)  # episodes per task, every algorithm's but grpo's (the paper gives none)
    group: int = Field(4, ge=2)  # episodes per task for grpo, its group: the baseline is their mean reward (NLAC 6.2: 4)
    limit_tasks: int | None = Field(None, ge=1)  # first N tasks per split; null: the run's limit_tasks
    sampling: SamplingParams = SamplingParams(temperature=1.0, top_p=1.0, max_new_tokens=112)  # on-policy rollouts; the paper gives no temperature
    generation_batch_size: int = Field(512, ge=1)  # prompts generated together (rollouts and in-process roles)
    # training (Algorithm 1, lines 7-11): `steps` optimizer steps of `batch_size` transitions drawn
    # by PER. The paper's 30 x 1024 "gradient steps" reads either way; here a step is one update
    # on a drawn batch, every method's count in the miniature
    steps: int = Field(16, ge=1)
    batch_size: int = Field(8, ge=1)  # transitions per step (paper: 1024)
    # Algorithm 1's update. separate (its lines 8-9): a step on L1 at lambda1, then one on L2 at
    # lambda2, each with an AdamW of its own, so neither loss's scale sets the other's step: in one
    # joint step the critique's NLL (8-12 a token on the tiny model, text it never saw) swamped the
    # refined actions' (0.01-0.2) and the policy got worse. joint: one AdamW step on L1 + L2 at
    # learning_rate (lambda1 = lambda2 taken together; this stage's first form)
    update: Literal["separate", "joint"] = "separate"
    learning_rate: float = Field(1.0e-4, gt=0)  # lambda1, L1's step (joint: the one step's); paper: 5e-6 on 7B, AdamW; the tiny model needs more
    learning_rate_l2: float | None = Field(None, gt=0)  # lambda2, L2's step (separate only); null: learning_rate, the paper's lambda1 = lambda2
    weight_decay: float = Field(0.0, ge=0)  # paper: not given
    max_grad_norm: float | None = Field(1.0, gt=0)  # paper: not given; the HF Trainer's default
    tau: float = Field(0.005, gt=0, le=1)  # theta-bar <- tau * theta + (1 - tau) * theta-bar after every step (paper: 0.005)
    per_alpha: float = Field(0.1, ge=0)  # P(i) = p_i^alpha / sum_k p_k^alpha, p_i the last L1 (paper: 0.1)
    # importance weights (N P(i))^-beta / max, on both losses; paper: not given. PER's own annealing
    # starts at 0.4; at alpha 0.1 the weights stay near 1 whatever beta is
    per_beta: float = Field(0.4, ge=0, le=1)
    per_epsilon: float = Field(1.0e-3, gt=0)  # added to L1 so no transition's priority reaches 0 (PER's epsilon)
    buffer_size: int | None = Field(None, ge=1)  # transitions kept, the oldest dropped first; paper: not given. null: all
    # a_t for L2 (Eq. 6): fresh, sampled from the current policy at s_t, as Eq. 6 reads; stored: the
    # buffer's own action (cheaper, the behaviour policy's)
    action: Literal["fresh", "stored"] = "fresh"
    # L1 and L2 per sample: the mean NLL over the target's tokens (priorities not biased to long
    # texts) or the sum (the sequence's log-likelihood); paper: not given
    nll: Literal["token_mean", "sequence_sum"] = "token_mean"
    bf16: bool | Literal["auto"] = "auto"
    # the trained critic against the oracle after the iteration's steps: theta, at the critic's
    # prompt and greedy, on up to this many buffer transitions never drawn for training; does it say
    # the oracle's Optimality (metrics: critic_accuracy)? 0: not measured
    critic_eval: int = Field(64, ge=0)

    @model_validator(mode="after")
    def _method_is_the_baselines(self) -> NlacParams:
        if self.algorithm == "nlac" and self.method is not None:
            raise ValueError("nlac.method sets a baseline's settings; nlac.algorithm nlac has its own keys here")
        if self.method is not None and self.method.algorithm != NLAC_BASELINES[self.algorithm]:
            raise ValueError(f"nlac.method.algorithm: {self.method.algorithm}, but nlac.algorithm {self.algorithm} trains with {NLAC_BASELINES[self.algorithm]}")
        if self.learning_rate_l2 is not None and self.update == "joint":
            raise ValueError("nlac.learning_rate_l2 is L2's own step, and update: joint takes one step on L1 + L2 at learning_rate: use update: separate")
        return self

    def episodes_per_task(self) -> int:
        """What the iteration collects per task: grpo's group, every other algorithm's m."""
        return self.group if self.algorithm == "grpo" else self.m

    def baseline(self) -> MethodParams:
        """The baseline's method settings; refused for nlac."""
        if self.algorithm == "nlac":
            raise ValueError("nlac.algorithm nlac is no baseline")
        return self.method or MethodParams(algorithm=NLAC_BASELINES[self.algorithm])


class NlacIterationParams(Strict):
    """One NLAC iteration (Algorithm 1's outer loop): DVC's foreach item, so its deps can name the
    policy it collects with."""

    policy: str  # iteration 1: the base (data/bootstrap/model); K: iteration K-1's, data/iteration<K-1>/nlac/model


def nlac_dir(k: int) -> str:
    """NLAC iteration k's outputs (its episodes beside them, in nlac_collect): under data/iterationK as
    the other iterations' stages, so the catalog shows its tables (iterationK_nlac.buffer)."""
    return f"data/iteration{k}/nlac"


# What quick_look may size: the stages dvc.yaml reruns when limit_tasks or quick_look change.
QUICK_LOOK_SIZES = ("bootstrap", "collect", "critic", "actor", "evaluate")


class Params(Strict):
    seed: int
    # The first N tasks of every split in every stage that plays tasks (bootstrap, collect,
    # expert, evaluate, the val games of the critic's and actor's checkpoint choice): a quick look. A
    # stage's own limit_tasks, where it has one, wins.
    limit_tasks: int | None = Field(None, ge=1)
    # A quick look's sizes, laid over the stages' keys when limit_tasks is set (as a preset is):
    # less training and fewer plays, the same stages and the same table.
    quick_look: dict = {}
    env: EnvParams
    roles: Roles
    cache: CacheParams = CacheParams()
    runtime: RuntimeParams = RuntimeParams()
    bootstrap: BootstrapParams
    collect: CollectParams
    relabel: RelabelParams
    regenerate: RegenerateParams
    standardize: StandardizeParams
    buffer: BufferParams = BufferParams()
    critic: CriticParams = CriticParams()
    actor: ActorParams = ActorParams()
    proposer: ProposerParams = ProposerParams()
    forward: ForwardParams = ForwardParams()
    expert: ExpertParams = ExpertParams()
    practice: PracticeParams = PracticeParams()
    stepagent: StepAgentParams = StepAgentParams()
    train: TrainStageParams
    evaluate: EvaluateParams
    # HOPE's iterations after the first (the stages collect ... actor are iteration 1), by number
    # from 2, each collecting with the previous iteration's actor: dvc.yaml's `iteration` foreach.
    iterations: dict[int, IterationParams] = {}
    # StepAgent's iterations after the first (expert, practice and stepagent are iteration 1), by
    # number from 2, each practising and reflecting from the previous one's policy: dvc.yaml's
    # `stepagent_iteration` foreach, into data/iterationK/practice and data/iterationK/stepagent.
    stepagent_iterations: dict[int, StepAgentIterationParams] = {}
    stepagent_select: StepAgentSelectParams = StepAgentSelectParams()
    nlac: NlacParams = NlacParams()
    # NLAC's iterations by number from 1, each collecting with the previous one's policy and
    # carrying its target network and replay buffer on: dvc.yaml's `nlac_iteration` foreach, into
    # data/iterationK/nlac and nlac_collect. {}: NLAC off (bench/presets/nlac_20q.yaml turns it on)
    nlac_iterations: dict[int, NlacIterationParams] = {}


    @model_validator(mode="before")
    @classmethod
    def _limit_every_stage(cls, data):
        if isinstance(data, dict) and data.get("quick_look"):
            quick = data["quick_look"]
            if not isinstance(quick, dict):
                raise ValueError(f"quick_look: expected a mapping of params keys, got {type(quick).__name__}")
            for key in _leaves(quick):  # checked whether or not this run is a quick look
                try:
                    check_key(f"quick_look.{key}")
                except ParamsError as e:
                    raise ValueError(str(e)) from None
        if isinstance(data, dict) and data.get("limit_tasks") is not None:
            data = copy.deepcopy(data)
            lay_preset(data, data.get("quick_look") or {})
            for stage in ("bootstrap", "collect", "expert", "evaluate"):
                section = data.get(stage, {} if stage == "expert" else None)  # expert's section may be left out: its defaults
                if isinstance(section, dict) and section.get("limit_tasks") is None:
                    data[stage] = {**section, "limit_tasks": data["limit_tasks"]}
        return data

    @field_validator("iterations", "stepagent_iterations", "nlac_iterations", mode="before")
    @classmethod
    def _iteration_keys_are_strings(cls, value):
        if isinstance(value, dict) and (numbers := [k for k in value if not isinstance(k, str)]):
            raise ValueError(f"write iteration {numbers[0]} as '{numbers[0]}' (quoted): DVC's foreach skips a number key, so that iteration would never run")
        return value

    @model_validator(mode="after")
    def _iterations_follow_each_other(self) -> Params:
        for k, (key, it) in enumerate(self.iterations.items(), start=2):
            if key != k:
                raise ValueError(f"iterations: '{key}' where iteration {k} belongs (they count 2, 3, ... in order; 1 is the stages collect ... actor)")
            if it.policy != f"{iteration_dir(k - 1)}/actor/model":
                raise ValueError(f"iterations.{key}.policy: {it.policy}, but iteration {k} collects with iteration {k - 1}'s actor, {iteration_dir(k - 1)}/actor/model")
        return self

    @model_validator(mode="after")
    def _stepagent_iterations_follow_each_other(self) -> Params:
        for k, (key, it) in enumerate(self.stepagent_iterations.items(), start=2):
            if key != k:
                raise ValueError(f"stepagent_iterations: '{key}' where iteration {k} belongs (they count 2, 3, ... in order; 1 is the stages expert, practice and stepagent)")
            if it.policy != stepagent_policy(k - 1):
                raise ValueError(f"stepagent_iterations.{key}.policy: {it.policy}, but iteration {k} practises with iteration {k - 1}'s policy, {stepagent_policy(k - 1)}")
        last = stepagent_policy(max(self.stepagent_iterations, default=1))
        if self.stepagent_select.last != last:
            raise ValueError(f"stepagent_select.last: {self.stepagent_select.last}, but the last StepAgent iteration's policy is {last}: "
                             f"set stepagent_select.last to {last} (the stage's DVC dependency, which runs every iteration before it)")
        return self

    @model_validator(mode="after")
    def _nlac_iterations_follow_each_other(self) -> Params:
        for k, (key, it) in enumerate(self.nlac_iterations.items(), start=1):
            if key != k:
                raise ValueError(f"nlac_iterations: '{key}' where iteration {k} belongs (they count 1, 2, ... in order)")
            if k > 1 and it.policy != f"{nlac_dir(k - 1)}/model":
                raise ValueError(f"nlac_iterations.{key}.policy: {it.policy}, but iteration {k} collects with iteration {k - 1}'s policy, {nlac_dir(k - 1)}/model")
        return self

    @model_validator(mode="after")
    def _best_of_n_plays_known_policies(self) -> Params:
        known = ["bootstrap", *self.train.methods, *(["actor"] if self.evaluate.actor else []),
                 *(["stepagent"] if self.evaluate.stepagent else []), *self.evaluate.extra]
        if unknown := [p for p in self.evaluate.best_of_n.policies if p not in known]:
            raise ValueError(f"evaluate.best_of_n.policies: {', '.join(unknown)} is not a policy evaluate plays ({', '.join(known)})")
        return self


class ParamsError(ValueError):
    pass


# A preset's arms are the arms: its train.methods replaces params.yaml's rather than adding to them.
PRESET_REPLACES = {"train.methods"}


def lay_preset(raw: dict, preset: dict, at: tuple[str, ...] = ()) -> None:
    """Lay a preset (a params file, bench/presets/) over params in place, key by key: a mapping
    merges, anything else replaces, and train.methods is replaced whole. A preset naming another
    environment replaces env: params.yaml's env keys are the old one's (as -S env.name=... drops them)."""
    if not at and (preset.get("env") or {}).get("name", (raw.get("env") or {}).get("name")) != (raw.get("env") or {}).get("name"):
        raw["env"] = {}
    for key, value in preset.items():
        if isinstance(value, dict) and isinstance(raw.get(key), dict) and ".".join((*at, key)) not in PRESET_REPLACES:
            lay_preset(raw[key], value, (*at, key))
        else:
            raw[key] = value


def _leaves(tree: dict, at: str = "") -> list[str]:
    """The dotted keys of a nested mapping's values (`{"critic": {"epochs": 1}}`: critic.epochs)."""
    return [k for key, value in tree.items()
            for k in (_leaves(value, f"{at}{key}.") if isinstance(value, dict) and value else [f"{at}{key}"])]


def read_preset(path: str | Path) -> dict:
    """A preset file: a YAML mapping of params keys (ParamsError naming the file otherwise)."""
    path = Path(path)
    preset = _read_yaml(path, f"preset {path}")
    if not isinstance(preset, dict):
        raise ParamsError(f"preset {path}: expected a mapping of params keys, got {type(preset).__name__}")
    return preset


def _read_yaml(path: Path, what: str) -> object:
    """The YAML at path; ParamsError saying `what` is not found or not valid YAML."""
    try:
        return yaml.safe_load(path.read_text())
    except FileNotFoundError:
        raise ParamsError(f"{what}: not found") from None
    except yaml.YAMLError as e:
        raise ParamsError(f"{what}: not valid YAML: {e}") from None


def load_params(path: str | Path = "params.yaml") -> Params:
    path = Path(path)
    raw = _read_yaml(path, str(path))
    try:
        return Params.model_validate(raw or {})
    except ValidationError as e:
        lines = []
        for err in e.errors():
            key = ".".join(str(p) for p in err["loc"]) or "(top level)"
            msg = "unknown key" if err["type"] == "extra_forbidden" else err["msg"]
            lines.append(f"  {key}: {msg}")
        raise ParamsError(f"{path}: invalid parameters\n" + "\n".join(lines)) from None


def check_key(key: str) -> None:
    """ParamsError unless the dotted `key` (as in `-S relabel.k=8`) names a param of the model:
    a section or a field, where a dict-valued field (train.methods) takes a name of the user's
    own. The error offers the closest valid names, so a typo is caught before Hydra's advice to
    append it."""
    node: object = Params
    parts = key.split(".")
    if parts[0] == "quick_look" and len(parts) > 1:  # a quick look's size: a stage's key, under quick_look
        if parts[1] not in QUICK_LOOK_SIZES:
            raise ParamsError(f"unknown param '{key}': a quick look sizes {', '.join(QUICK_LOOK_SIZES)} (the stages that depend on it in dvc.yaml)")
        try:
            return check_key(".".join(parts[1:]))
        except ParamsError as e:
            raise ParamsError(f"{e} (under quick_look)") from None
    for i, part in enumerate(parts):
        here = ".".join(parts[:i])
        names = _keys_under(node)
        if names is None:
            raise ParamsError(f"unknown param '{key}': {here} is a value, with no keys under it")
        if names == "*" and part:  # a dict of the user's own names
            node = _dict_value(node)
            continue
        if part in names:
            node = names[part]
            continue
        close = difflib.get_close_matches(part, list(names), n=3, cutoff=0.6)
        rest = parts[i + 1 :]
        hint = (
            f"did you mean {' or '.join('.'.join([*parts[:i], c, *rest]) for c in close)}?" if close
            else f"{here or 'params.yaml'} has: {', '.join(names)}"
        )
        raise ParamsError(f"unknown param '{key}' ({hint})")


def _members(annotation: object) -> list[object]:
    """The types an annotation allows: `X | None` is X (None has no keys)."""
    if get_origin(annotation) in (Union, UnionType):
        return [a for a in get_args(annotation) if a is not type(None)]
    return [annotation]


def _keys_under(annotation: object) -> dict[str, object] | str | None:
    """The keys one level below a field of this type: a model's fields, a dict's Literal keys,
    "*" for a dict of free names; None for a value."""
    for a in _members(annotation):
        if a is EnvParams:
            return EnvParams.known_keys()
        if isinstance(a, type) and issubclass(a, BaseModel):
            return {name: f.annotation for name, f in a.model_fields.items()}
        if get_origin(a) is dict:
            k = get_args(a)[0]
            return {str(v): get_args(a)[1] for v in get_args(k)} if get_origin(k) is Literal else "*"
    return None


def _dict_value(annotation: object) -> object:
    return next(get_args(a)[1] for a in _members(annotation) if get_origin(a) is dict)
