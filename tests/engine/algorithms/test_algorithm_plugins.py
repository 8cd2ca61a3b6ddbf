"""Algorithm plug-ins: ``rl.algorithm`` / ``rl.policy_loss`` given by import path.

The plug-ins of ``algorithm_plugins_example`` re-implement GRPO and the PPO clipped loss by
another formula path; resolved through the config at the points the RL phases resolve
them (``engine.rl.phases.compute_advantages``, ``engine.training.actor.actor_loss_fn``),
they give the built-ins' tensors. Bad paths and bad results fail naming the key and the path.
"""

from __future__ import annotations

import re
import typing

import pytest
import torch
from pydantic import ValidationError

from config.load import format_validation_error
from config.rl import BuiltinAdvantage, BuiltinPolicyLoss, DynamicSamplingConfig, KLConfig, RLConfig
from config.schema import PipelineConfig
from engine.algorithms.advantages import ADVANTAGE_ESTIMATORS, get_advantage_estimator, grpo_advantages
from engine.algorithms.aggregation import LOSS_AGG_MODES, global_norm
from engine.algorithms.policy_loss import POLICY_LOSSES, get_policy_loss, ppo_clip_loss

EXAMPLE = "tests.engine.algorithms.algorithm_plugins_example"
GRPO = f"{EXAMPLE}:grpo_by_hand"
PPO = f"{EXAMPLE}:ppo_clip_by_hand"


def test_the_configs_built_in_names_are_the_registries_keys():
    assert sorted(typing.get_args(BuiltinAdvantage)) == sorted(ADVANTAGE_ESTIMATORS)
    assert sorted(typing.get_args(BuiltinPolicyLoss)) == sorted(POLICY_LOSSES)


# ----------------------------------------------------------------------------- the config


def test_config_accepts_a_built_in_or_an_import_path():
    cfg = RLConfig(algorithm=GRPO, policy_loss=PPO)
    assert (cfg.algorithm, cfg.policy_loss) == (GRPO, PPO)
    assert RLConfig(algorithm="rloo", policy_loss="gspo").algorithm == "rloo"
    # a plug-in is a group-baseline estimator without a critic: dynamic sampling may be on, n_samples 1 may not
    assert RLConfig(algorithm=GRPO, dynamic_sampling=DynamicSamplingConfig(enabled=True)).policy_updates(5) == 5
    with pytest.raises(
        ValidationError,
        match=r"rl.n_samples: 1 with the plug-in estimator .*grpo_by_hand: a plug-in "
        r"is treated as a group-baseline estimator",
    ):
        RLConfig(algorithm=GRPO, n_samples=1)


@pytest.mark.parametrize(
    "key, value, message",
    [
        (
            "algorithm",
            "ppo",
            "rl.algorithm: Input should be 'grpo', 'dr_grpo', 'rloo', 'reinforce_plus_plus', "
            "'reinforce_plus_plus_baseline', 'gae' or 'on_policy_distill', or a plug-in's import path "
            "'package.module:function' (got 'ppo')",
        ),
        (
            "policy_loss",
            "dpo",
            "rl.policy_loss: Input should be 'ppo_clip' or 'gspo', or a plug-in's import path "
            "'package.module:function' (got 'dpo')",
        ),
        (
            "algorithm",
            "my_algos:",
            "rl.algorithm: expected an import path 'package.module:function' (module dotted, "
            "one colon, then the function's name) (got 'my_algos:')",
        ),
        ("policy_loss", "my-losses:ppo", "rl.policy_loss: expected an import path 'package.module:function'"),
        ("algorithm", 3, "rl.algorithm: Input should be 'grpo'"),
    ],
)
def test_config_errors_name_the_key(key, value, message):
    with pytest.raises(ValidationError) as err:
        PipelineConfig.model_validate({"run": {"name": "t"}, "data": {}, "model": {"source": "m"}, "rl": {key: value}})
    body = format_validation_error(err.value, "c.yaml").splitlines()[1:]
    assert len(body) == 1 and body[0].startswith(f"  {message}"), body


# ----------------------------------------------------------------------------- advantage estimators


def _reward_cases():
    mask = torch.tensor([[1, 1, 0], [1, 1, 1], [1, 0, 0], [1, 1, 0], [1, 1, 1]], dtype=torch.float32)
    groups = torch.tensor([7, 7, 7, 2, 9])  # a group of 3, one of 1 (advantage 0), one of 1
    scores = torch.tensor([1.0, 0.0, 0.5, 1.0, 0.0])
    token = torch.tensor([[0.0, 1.0, 9.0], [0.1, -0.1, 0.3], [0.2, 5.0, 5.0], [1.0, 0.0, 3.0], [0.0, 0.0, 1.0]])
    return [
        (scores, groups, None),
        (scores, groups, mask),
        (token, groups, mask),
        (torch.tensor([0.35, 0.35 + 1e-7, 0.35, 0.35]), torch.tensor([0, 0, 1, 1]), None),  # near-equal, equal
        (torch.tensor([1, 0, 0, 1]), torch.tensor([0, 0, 0, 0]), None),
    ]  # int rewards: float32 out


@pytest.mark.parametrize("case", range(5))
def test_plugin_estimator_resolved_through_the_config_equals_the_built_in(case):
    rewards, groups, mask = _reward_cases()[case]
    fn = get_advantage_estimator(RLConfig(algorithm=GRPO).algorithm)
    got, want = fn(rewards, groups, mask), grpo_advantages(rewards, groups, mask)
    assert got.dtype == want.dtype and got.shape == want.shape
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
    assert fn.__name__ == "grpo_by_hand"


def test_compute_advantages_of_the_rl_step_uses_the_plugin():
    from engine.rl.phases import compute_advantages

    traj = _trajectory()
    traj = traj.with_(rewards=torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 0.5]))
    built_in = compute_advantages(traj, RLConfig()).advantages
    plugin = compute_advantages(traj, RLConfig(algorithm=GRPO)).advantages
    assert plugin.dtype == built_in.dtype == torch.float32
    torch.testing.assert_close(plugin, built_in, rtol=0, atol=1e-6)
    assert built_in.abs().sum() > 1  # not trivially zero


def test_a_plugin_estimator_result_is_checked():
    fn = get_advantage_estimator(f"{EXAMPLE}:wrong_shape")
    mask = torch.ones(2, 3)
    with pytest.raises(
        ValueError, match=r"rl.algorithm plug-in .*:wrong_shape returned shape \[2\]; expected \[2, 3\]"
    ):
        fn(torch.tensor([1.0, 0.0]), torch.tensor([0, 0]), mask)
    assert fn(torch.tensor([1.0, 0.0]), torch.tensor([0, 0])).tolist() == [0.0, 0.0]  # [B] without a mask is right


# ----------------------------------------------------------------------------- policy losses


def _loss_inputs(seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0], [1, 1, 1, 1]], dtype=torch.float32)
    old = -1.0 - torch.rand(3, 4, generator=gen)
    logprobs = (old + 0.4 * torch.randn(3, 4, generator=gen)).requires_grad_()  # ratios well past the clip range
    adv = torch.randn(3, 1, generator=gen) * mask
    return logprobs, old, adv, mask


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
@pytest.mark.parametrize("clip", [{}, {"clip_ratio_low": 0.1, "clip_ratio_high": 0.28}])
def test_plugin_policy_loss_resolved_through_the_config_equals_the_built_in(mode, clip):
    cfg = RLConfig(policy_loss=PPO, loss_agg_mode=mode, **clip)
    results = []
    for fn in (get_policy_loss(cfg.policy_loss), ppo_clip_loss):
        logprobs, old, adv, mask = _loss_inputs()
        norm = global_norm(mask, max_response_length=6)
        out = fn(
            logprobs,
            old,
            adv,
            mask,
            cfg.clip_ratio,
            clip_ratio_low=cfg.clip_ratio_low,
            clip_ratio_high=cfg.clip_ratio_high,
            clip_ratio_c=None,
            tis_cap=None,
            rollout_logprobs=None,
            loss_agg_mode=mode,
            norm=norm,
        )
        out.pg_loss.backward()
        results.append((out, logprobs.grad))
    (got, got_grad), (want, want_grad) = results
    for field in ("pg_loss", "pg_clipfrac", "ppo_kl", "pg_clipfrac_lower"):
        torch.testing.assert_close(getattr(got, field), getattr(want, field), rtol=0, atol=1e-6)
    torch.testing.assert_close(got_grad, want_grad, rtol=0, atol=1e-6)
    assert 0 < float(want.pg_clipfrac) < 1 and want_grad.abs().sum() > 0  # both branches of the clip are exercised


def test_a_plugin_policy_loss_result_is_checked():
    logprobs, old, adv, mask = _loss_inputs()
    fn = get_policy_loss(f"{EXAMPLE}:returns_a_float")
    with pytest.raises(
        TypeError,
        match=r"rl.policy_loss plug-in .*:returns_a_float returned float; expected "
        r"engine.algorithms.policy_loss.PolicyLossOutput",
    ):
        fn(logprobs, old, adv, mask, 0.2)


VOCAB = 13


def _trajectory():
    from engine.rollout.base import RolloutOutput
    from engine.trajectory import Trajectory

    gen = torch.Generator().manual_seed(3)
    prompts = [[1, 5, 9], [2, 2]]
    lengths = [[3, 1, 4], [2, 4, 3]]
    outs = [
        [RolloutOutput(tuple(torch.randint(1, VOCAB, (n,), generator=gen).tolist()), (-2.5,) * n, "stop") for n in ns]
        for ns in lengths
    ]
    traj = Trajectory.from_rollout(prompts, outs, pad_id=0)
    mask = traj.response_mask
    adv = torch.randn(len(traj), 1, generator=gen) * mask
    old = (-2.6 + 0.4 * torch.randn(mask.shape, generator=gen)) * mask
    return traj.with_(advantages=adv, old_logprobs=old, ref_logprobs=old - 0.05 * mask)


def test_the_actor_loss_uses_the_plugin(monkeypatch):
    """``actor_loss_fn`` (what the actor worker runs per micro-batch) with the plug-in: the
    same loss, metrics and gradients as with ``ppo_clip``, a KL loss and an entropy bonus on."""
    import engine.models.forward as forward
    from engine.training.actor import actor_loss_fn

    monkeypatch.setattr(forward, "causal_logits", lambda model, ids: model(ids))  # a bigram "model": [B, T, V]
    traj = _trajectory()
    norm = global_norm(traj.response_mask)
    results = []
    for policy_loss in ("ppo_clip", PPO):
        torch.manual_seed(0)
        model = torch.nn.Embedding(VOCAB, VOCAB)
        cfg = RLConfig(policy_loss=policy_loss, clip_ratio_high=0.28, entropy_coef=0.01, kl=KLConfig(coef=0.1))
        loss, units, metrics = actor_loss_fn(cfg, 0.8, norm)(model, traj)
        loss.backward()
        results.append((loss.detach(), units, metrics, model.weight.grad))
    (loss_a, units_a, metrics_a, grad_a), (loss_b, units_b, metrics_b, grad_b) = results
    assert units_a == units_b == int(traj.response_mask.sum())
    torch.testing.assert_close(loss_b, loss_a, rtol=0, atol=1e-6)
    assert metrics_b == pytest.approx(metrics_a, abs=1e-6) and metrics_a["pg_clipfrac"] > 0
    torch.testing.assert_close(grad_b, grad_a, rtol=0, atol=1e-6)
    assert grad_a.abs().sum() > 0


# ----------------------------------------------------------------------------- bad paths


@pytest.mark.parametrize(
    "getter, key", [(get_advantage_estimator, "rl.algorithm"), (get_policy_loss, "rl.policy_loss")]
)
@pytest.mark.parametrize(
    "path, why",
    [
        ("no_such_module_xyz:fn", r"cannot import module 'no_such_module_xyz': ModuleNotFoundError"),
        (f"{EXAMPLE}:missing", r"has no attribute 'missing'"),
        (f"{EXAMPLE}:NOT_A_FUNCTION", r"is not callable \(type int\)"),
        (
            f"{EXAMPLE}:takes_nothing",
            r"takes_nothing\(\) cannot be called as \((rewards, group_index, mask\)|"
            r"logprobs, old_logprobs, advantages, mask, clip_ratio, clip_ratio_low=\.\.\.)",
        ),
    ],
)
def test_a_bad_path_names_the_key_and_the_path(getter, key, path, why):
    with pytest.raises(ImportError, match=rf"^{key}: cannot load the .* plug-in '{re.escape(path)}': .*{why}"):
        getter(path)


def test_built_in_names_still_resolve_to_the_registry():
    assert get_advantage_estimator("grpo") is grpo_advantages and get_policy_loss("ppo_clip") is ppo_clip_loss
    with pytest.raises(KeyError, match="unknown advantage estimator 'ppo'"):
        get_advantage_estimator("ppo")


def test_the_rl_run_checks_its_plugins_before_any_worker_starts():
    from engine.rl.plugins import check_algorithm_plugins

    check_algorithm_plugins(RLConfig())
    check_algorithm_plugins(RLConfig(algorithm=GRPO, policy_loss=PPO))
    with pytest.raises(ImportError, match=r"^rl.policy_loss: cannot load the policy loss plug-in 'nope_xyz:loss'"):
        check_algorithm_plugins(RLConfig(algorithm=GRPO, policy_loss="nope_xyz:loss"))
    with pytest.raises(ImportError, match=r"^rl.algorithm: cannot load the advantage estimator plug-in"):
        check_algorithm_plugins(RLConfig(algorithm=f"{EXAMPLE}:takes_nothing"))
