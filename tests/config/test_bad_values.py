"""A sweep of bad config values across the sections: each is refused before any stage
starts, by `posttrain validate` and by `posttrain run`'s up-front checks, with a message
that names the key. Each value is one a stage would refuse (or silently misuse) later.

The base is the quickstart config, run from an empty directory (the prepare step has not
run: its section says what the model and data will be), each case one or more
``KEY=VALUE`` overrides as the command line takes them.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from config import ConfigError, load_config

REPO = Path(__file__).resolve().parents[2]
QUICKSTART = REPO / "configs" / "quickstart.yaml"

# (overrides, the key the message must name)
CASES = [
    (["sft.optim.lr=0"], "sft.optim.lr"),
    (["rl.optim.lr=-1e-4"], "rl.optim.lr"),
    (["rm.optim.min_lr=0.5"], "rm.optim"),
    (["sft.global_batch_size=500"], "sft.global_batch_size"),
    (["rm.micro_batch_size=64"], "rm.micro_batch_size"),
    (["po.enabled=true", "po.micro_batch_size=64"], "po.micro_batch_size"),
    (["sft.max_tokens_per_micro_batch=0"], "sft.max_tokens_per_micro_batch"),
    (["sft.lora.enabled=true", "sft.lora.rank=0"], "sft.lora.rank"),
    (["rl.lora.alpha=0"], "rl.lora.alpha"),
    (["sft.optim.warmup_steps=400"], "sft.optim.warmup_steps"),
    (["rl.optim.warmup_steps=200"], "rl.optim.warmup_steps"),
    (["rl.kl.coef=-0.1"], "rl.kl.coef"),
    (["rl.clip_ratio=0"], "rl.clip_ratio"),
    (["rl.clip_ratio_c=0.5"], "rl.clip_ratio_c"),
    (["rl.n_samples=0"], "rl.n_samples"),
    (["rl.prompts_per_step=0"], "rl.prompts_per_step"),
    (["rl.rollout.top_p=1.5"], "rl.rollout.top_p"),
    (["rl.rollout.temperature=-1"], "rl.rollout.temperature"),
    (["rl.rollout.max_new_tokens=0"], "rl.rollout.max_new_tokens"),
    (["rl.rollout.max_new_tokens=200"], "rl.rollout.max_new_tokens"),
    (["sft.max_seq_len=512"], "sft.max_seq_len"),
    (["sft.parallel.tensor_model_parallel_size=3"], "sft.parallel.tensor_model_parallel_size"),
    (["rl.parallel.actor.tensor_model_parallel_size=8"], "rl.parallel.actor.tensor_model_parallel_size"),
    (["rm.parallel.data_parallel_size=4"], "rm.parallel.data_parallel_size"),
    (["rl.algorithm=reinforce_plus"], "rl.algorithm"),
    (["rl.policy_loss=clipped"], "rl.policy_loss"),
    (["rl.eval_every=5", "rl.eval_benchmark=gsm8k"], "rl.eval_benchmark"),
    (["rl.kl.target=0.1"], "rl.kl.target"),
    (["rl.clip_ratio_low=-0.1"], "rl.clip_ratio_low"),
    (["rl.steps=0"], "rl.steps"),
    (["rl.ppo_epochs=0"], "rl.ppo_epochs"),
    (["rl.checkpoint_every=0"], "rl.checkpoint_every"),
    (["rl.critic.gamma=1.5"], "rl.critic.gamma"),
    (["rl.entropy_coef=-0.01"], "rl.entropy_coef"),
    (["rl.reward.verifier=regex"], "rl.reward.verifier"),
    (["rl.dynamic_sampling.max_rounds=0"], "rl.dynamic_sampling.max_rounds"),
    (["rm.eval_fraction=1"], "rm.eval_fraction"),
    (["sft.optim.adam_beta2=1"], "sft.optim.adam_beta2"),
    (["evaluate.max_new_tokens=0"], "evaluate.max_new_tokens"),
    (["evaluate.samples_per_prompt=8", "evaluate.temperature=0"], "evaluate.samples_per_prompt"),
    (["evaluate.k=[16]"], "evaluate.k"),
    (["data.max_bad_fraction=1.5"], "data.max_bad_fraction"),
    (["data.rl_train.path=/nonexistent/rl_train.jsonl"], "data.rl_train.path"),
    (["data.sft.format=chatml"], "data.sft.format"),
    (["model.source=/nonexistent/model"], "model.source"),
    (["model.tokenizer=/nonexistent/tokenizer"], "model.tokenizer"),
    (["rl.algorithm=on_policy_distill", "rl.teacher.model_dir=/nonexistent/teacher"], "rl.teacher.model_dir"),
    (["run.seed=-1"], "run.seed"),
    (["export.dtype=int8"], "export.dtype"),
    (["prepare.num_attention_heads=3"], "prepare.num_attention_heads"),
    (["prepare.num_key_value_heads=3"], "prepare.num_key_value_heads"),
    (["rl.engine.num_cpus=0"], "rl.engine.num_cpus"),
    (
        ["sft.parallel.data_parallel_size=2", "sft.micro_batch_size=256", "sft.parallel.cpus_per_rank=4"],
        "sft.parallel.cpus_per_rank",
    ),
    (["rl.parallel.actor.cpus_per_rank=8"], "rl.parallel.actor.cpus_per_rank"),
    (
        ["rl.prompts_per_step=1", "rl.n_samples=2", "rl.parallel.actor.data_parallel_size=4"],
        "rl.parallel.actor.data_parallel_size",
    ),
    (["evaluate.max_new_tokens=128"], "evaluate.max_new_tokens"),
    (["rl.reward.functions=[{path: no_such_rewards:score}]"], "rl.reward.functions[0].path"),
    (["rl.reward.reward_model_weight=1", "rm.enabled=false"], "rl.reward.reward_model_weight"),
    (["rm.backend=deepspeed", "rm.packing=true"], "rm.packing"),
    (["wandb.mode=cloud"], "wandb.mode"),
    (["run.name=my run"], "run.name"),
    (["data.rl_eval.limit=0"], "data.rl_eval.limit"),
]


def up_front(overrides: list[str], command: str) -> str:
    """What `posttrain <command>` says before any stage starts: the config error, else the
    problems of its checks (validate: check_inputs, check_contents, check_layouts and
    check_rl_placement; run: check_inputs, W&B and before_first_stage), joined;
    "" when it would go on."""
    from flows import cli

    try:
        cfg = load_config(QUICKSTART, overrides)
    except ConfigError as exc:
        return str(exc)
    problems = cli._load(str(QUICKSTART), overrides)[1]
    if command == "validate":
        seen: dict = {}
        problems += cli.check_contents(cfg, seen)[0] + cli.check_layouts(cfg, seen)[0] + cli.check_rl_placement(cfg)[0]
    else:
        problems += cli.before_first_stage(cfg)
    return "\n".join(problems)


@pytest.fixture(autouse=True)
def _empty_project(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the quickstart's relative paths: a project where prepare never ran


def test_the_base_config_passes():
    assert up_front([], "validate") == "" and up_front([], "run") == ""


@pytest.mark.parametrize("command", ["validate", "run"])
@pytest.mark.parametrize("overrides, key", CASES, ids=[" ".join(o) for o, _ in CASES])
def test_a_bad_value_is_refused_up_front_naming_its_key(overrides, key, command):
    said = up_front(overrides, command)
    assert said, f"{' '.join(overrides)}: accepted by {command}"
    assert key in said, said


def test_the_new_refusals_say_what_to_change(tmp_path):
    """The values the sweep once found accepted, each with its whole message."""

    def said(*overrides: str, command: str = "run") -> str:
        return up_front(list(overrides), command)

    model = "work/quickstart/base_model"
    assert said("prepare.num_attention_heads=3").splitlines()[1] == (
        "  prepare.addition: prepare.num_attention_heads: 3 does not divide prepare.hidden_size 128 (each head gets "
        "hidden_size / heads dimensions); use a divisor, e.g. 4 heads of 32"
    )
    assert said("rl.prompts_per_step=1", "rl.n_samples=2", "rl.parallel.reference.data_parallel_size=4").splitlines()[
        1
    ] == (
        "  rl: rl.parallel.reference.data_parallel_size=4 is more than the 2 rows of a step (rl.prompts_per_step 1 x "
        "rl.n_samples 2): every rank needs at least one; lower it or raise rl.prompts_per_step (set on the command line: "
        "rl.prompts_per_step=1 rl.n_samples=2 rl.parallel.reference.data_parallel_size=4)"
    )
    # the critic and the reward model's ranks count only where they run
    assert said("rl.prompts_per_step=1", "rl.n_samples=2", "rl.parallel.critic.data_parallel_size=4") == ""
    for command in ("validate", "run"):
        assert said("sft.parallel.tensor_model_parallel_size=3", command=command) == (
            f"sft.parallel.tensor_model_parallel_size=3 does not divide num_attention_heads 4, num_key_value_heads 2, "
            f"intermediate_size 256 of {model}: megatron-core splits each evenly across the tensor-parallel ranks; use "
            "a size that divides them"
        )
        assert said("evaluate.max_new_tokens=128", command=command) == (
            f"evaluate.max_new_tokens: 128 leaves no room for a prompt in the context of {model} "
            "(max_position_embeddings 128)"
        )
        assert said(
            "rl.engine.num_cpus=2",
            "rm.parallel.data_parallel_size=2",
            "rm.micro_batch_size=16",
            "rm.parallel.cpus_per_rank=1.5",
            command=command,
        ) == (
            "rm.parallel.cpus_per_rank: 2 ranks x 1.5 CPUs is more than the local Ray cluster's 2 CPUs "
            "(rl.engine.num_cpus); lower it (or unset it: each rank gets an equal share), or lower "
            "rm.parallel.data_parallel_size"
        )
    (tmp_path / "teacher").mkdir()
    assert said("rl.algorithm=on_policy_distill", f"rl.teacher.model_dir={tmp_path / 'teacher'}") == (
        f"rl.teacher.model_dir: {tmp_path / 'teacher'} is not a model directory (no hf/config.json); give the model/ "
        "directory of an sft or rl artifact"
    )
