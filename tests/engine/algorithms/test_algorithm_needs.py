"""What each advantage estimator needs (``config.algorithms``): every built-in has an entry
and the config, the placement plan and the RL step act on it; a plug-in declares its needs
in its module (``ALGORITHM_NEEDS``, read without importing it) or gets the default."""

from __future__ import annotations

import itertools
import typing

import pytest
import torch
from pydantic import ValidationError

from config.algorithms import BUILTIN_NEEDS, PLUGIN_NEEDS, AlgorithmNeeds, algorithm_needs, loss_pairing_note
from config.placement_plan import training_roles
from config.rl import BuiltinAdvantage, CriticConfig, DynamicSamplingConfig, RLConfig
from engine.algorithms.advantages import ADVANTAGE_ESTIMATORS, ADVANTAGES_WITH_RETURNS, get_advantage_estimator
from engine.trajectory import Trajectory


def _cfg(name: str, **kw) -> RLConfig:
    teacher = {"teacher": {"model_dir": "t"}} if BUILTIN_NEEDS.get(name, PLUGIN_NEEDS).teacher else {}
    return RLConfig(algorithm=name, **teacher, **kw)


def _two_responses(mask: torch.Tensor, groups: list[int], **fields) -> Trajectory:
    """Two responses of 3 tokens (prompts of 2) with scores 1 and 0, in ``groups``, and ``fields``."""
    return Trajectory(
        input_ids=torch.ones(2, 5, dtype=torch.long),
        prompt_lengths=torch.tensor([2, 2]),
        response_ids=torch.ones(2, 3, dtype=torch.long),
        response_mask=mask,
        rollout_logprobs=torch.zeros(2, 3),
        group_index=torch.tensor(groups),
        rewards=torch.tensor([1.0, 0.0]),
        advantages=torch.zeros(2, 3),
        truncated=torch.tensor([False, False]),
        **fields,
    )


def test_every_built_in_estimator_has_needs_and_they_are_the_ones_known():
    assert list(BUILTIN_NEEDS) == list(typing.get_args(BuiltinAdvantage)) == list(ADVANTAGE_ESTIMATORS)
    assert {n for n, x in BUILTIN_NEEDS.items() if x.critic} == {"gae"}
    assert {n for n, x in BUILTIN_NEEDS.items() if x.teacher} == {"on_policy_distill"}
    assert {n for n, x in BUILTIN_NEEDS.items() if not x.group} == {"reinforce_plus_plus", "gae", "on_policy_distill"}
    assert not any(x.reference for x in BUILTIN_NEEDS.values())  # the built-ins use the reference only for a KL
    assert {n: x.loss_agg_mode for n, x in BUILTIN_NEEDS.items() if x.loss_agg_mode} == {
        "dr_grpo": "seq-mean-token-sum-norm"
    }
    # an estimator that makes its critic's targets itself needs a critic
    assert all(BUILTIN_NEEDS[n].critic for n in ADVANTAGES_WITH_RETURNS)


def test_the_validate_note_names_the_pairing_only_when_the_aggregation_differs():
    assert loss_pairing_note("dr_grpo", "seq-mean-token-sum-norm") is None
    assert loss_pairing_note("grpo", "seq-mean-token-sum") is None  # paired with any
    assert loss_pairing_note("dr_grpo", "token-mean") == (
        "rl.algorithm dr_grpo is paired with rl.loss_agg_mode: seq-mean-token-sum-norm (its source's loss); "
        "this config aggregates with token-mean"
    )


@pytest.mark.parametrize("name", list(BUILTIN_NEEDS))
def test_the_config_and_the_plan_follow_the_built_in_needs(name):
    needs = BUILTIN_NEEDS[name]
    cfg = _cfg(name, steps=10, critic=CriticConfig(warmup_steps=4))
    assert cfg.algorithm_needs is needs
    assert ("critic" in training_roles(cfg)) is needs.critic
    assert cfg.policy_updates(10) == (6 if needs.critic else 10)  # the critic's warm-up updates no policy
    assert cfg.precomputes_old_logprobs is needs.teacher  # distillation needs the student's log-probs first
    if needs.group:  # one response per prompt: a zero advantage, refused with the message it always had
        with pytest.raises(
            ValidationError,
            match=f"rl.n_samples: 1 gives every response a zero {name} advantage .*"
            "use n_samples >= 2 or algorithm reinforce_plus_plus, gae or "
            "on_policy_distill",
        ):
            _cfg(name, n_samples=1)
        assert _cfg(name, dynamic_sampling=DynamicSamplingConfig(enabled=True)).dynamic_sampling.enabled
    else:
        assert _cfg(name, n_samples=1).n_samples == 1
        with pytest.raises(
            ValidationError,
            match=r"only group-baseline estimators \(grpo, dr_grpo, rloo, "
            r"reinforce_plus_plus_baseline, plug-ins\)",
        ):
            _cfg(name, dynamic_sampling=DynamicSamplingConfig(enabled=True))
    if needs.critic:
        with pytest.raises(ValidationError, match=r"rl.critic.warmup_steps \(3\) must be below rl.steps \(3\)"):
            _cfg(name, steps=3, critic=CriticConfig(warmup_steps=3))
    if needs.teacher:
        with pytest.raises(ValidationError, match=f"rl.algorithm {name} needs rl.teacher"):
            RLConfig(algorithm=name)
    else:
        with pytest.raises(ValidationError, match=f"rl.teacher is set but rl.algorithm is {name}"):
            RLConfig(algorithm=name, teacher={"model_dir": "t"})


PLUGIN_MODULE = """
import torch

raise RuntimeError("imported")  # the config reads the declaration without importing the module

ALGORITHM_NEEDS = {"with_critic": {"critic": True}, "single": {"group": False}}


def with_critic(rewards, group_index, mask=None, *, values=None, **options):
    return (rewards[:, None] - values) * mask


def plain(rewards, group_index, mask=None, **options):
    return rewards[:, None] * mask
"""


_MODULES = itertools.count()


@pytest.fixture
def plugin_dir(tmp_path, monkeypatch, request):
    """A plug-in module, unique per test (so no cached parse or sys.modules entry is shared)."""
    name = f"needs_{request.node.originalname}_{next(_MODULES)}"
    monkeypatch.syspath_prepend(str(tmp_path))
    return tmp_path, name


def test_a_plugin_declares_its_needs_without_being_imported(plugin_dir):
    root, mod = plugin_dir
    (root / f"{mod}.py").write_text(PLUGIN_MODULE)
    critic = RLConfig(algorithm=f"{mod}:with_critic", steps=10, critic=CriticConfig(warmup_steps=4))
    assert critic.algorithm_needs == AlgorithmNeeds(critic=True, group=True)  # unnamed fields: the plug-in default
    assert "critic" in training_roles(critic) and critic.policy_updates(10) == 6
    with pytest.raises(ValidationError, match=r"rl.critic.warmup_steps \(3\) must be below rl.steps \(3\)"):
        RLConfig(algorithm=f"{mod}:with_critic", steps=3, critic=CriticConfig(warmup_steps=3))
    single = RLConfig(algorithm=f"{mod}:single", n_samples=1)  # group: False lets one response per prompt through
    assert single.algorithm_needs == AlgorithmNeeds() and "critic" not in training_roles(single)
    with pytest.raises(ValidationError, match="rl.dynamic_sampling.enabled drops groups of equal rewards"):
        RLConfig(algorithm=f"{mod}:single", dynamic_sampling=DynamicSamplingConfig(enabled=True))
    # a function the declaration does not name behaves as every plug-in did before: groups, no critic
    plain = RLConfig(algorithm=f"{mod}:plain")
    assert plain.algorithm_needs == PLUGIN_NEEDS and "critic" not in training_roles(plain)
    with pytest.raises(
        ValidationError,
        match=r"rl.n_samples: 1 with the plug-in estimator needs_.*:plain: a plug-in "
        r"is treated as a group-baseline estimator",
    ):
        RLConfig(algorithm=f"{mod}:plain", n_samples=1)
    assert mod not in __import__("sys").modules


def test_a_module_without_a_declaration_or_not_found_gets_the_default(plugin_dir):
    root, mod = plugin_dir
    (root / f"{mod}.py").write_text("def plain(rewards, group_index, mask=None):\n    return rewards\n")
    assert algorithm_needs(f"{mod}:plain") == PLUGIN_NEEDS == AlgorithmNeeds(group=True)
    assert algorithm_needs("no_such_module_anywhere:fn") == PLUGIN_NEEDS  # the driver's import reports it
    (root / f"{mod}_broken.py").write_text("def plain(:\n")
    assert algorithm_needs(f"{mod}_broken:plain") == PLUGIN_NEEDS  # so does a file that does not parse
    assert "critic" not in training_roles(RLConfig(algorithm=f"{mod}:plain"))


SHAPE = (
    r"a literal dict of function names to dicts of needs \(critic, teacher, group, reference: True or False; "
    r"loss_agg_mode: None or one of token-mean, seq-mean-token-sum, seq-mean-token-mean, seq-mean-token-sum-norm\)"
)


@pytest.mark.parametrize(
    ("declaration", "message"),
    [
        ('{"f": {"critic": 1}}', r"ALGORITHM_NEEDS\['f'\]\['critic'\]: 1 must be True or False"),
        ('{"f": {"reference": "yes"}}', r"ALGORITHM_NEEDS\['f'\]\['reference'\]: 'yes' must be True or False"),
        (
            '{"f": {"citric": True}}',
            r"ALGORITHM_NEEDS\['f'\]: unknown need 'citric' \(known: critic, teacher, group, reference, "
            r"loss_agg_mode\)",
        ),
        (
            '{"f": {"loss_agg_mode": "token_mean"}}',
            r"ALGORITHM_NEEDS\['f'\]\['loss_agg_mode'\]: 'token_mean' is not None or one of token-mean, ",
        ),
        ('{"f": True}', r"ALGORITHM_NEEDS\['f'\]: must be a function name mapped to a dict of needs; " + SHAPE),
        ("[1, 2]", r"ALGORITHM_NEEDS is a list; it must be " + SHAPE),
        ("dict(f={})", r"ALGORITHM_NEEDS must be " + SHAPE + r".*; it is read without importing the module"),
    ],
)
def test_a_malformed_declaration_names_the_file_line_entry_and_field(plugin_dir, declaration, message):
    root, mod = plugin_dir
    (root / f"{mod}.py").write_text(f"import os\n\nALGORITHM_NEEDS = {declaration}\n")
    with pytest.raises(ValidationError, match=rf"{mod}.py:3: " + message):
        RLConfig(algorithm=f"{mod}:f")


def test_the_last_declaration_is_the_one_read_as_python_binds_it(plugin_dir):
    root, mod = plugin_dir
    (root / f"{mod}.py").write_text(
        'ALGORITHM_NEEDS = {"f": {"critic": True}}\nALGORITHM_NEEDS = {"f": {"critic": False, "group": False}}\n'
    )
    assert algorithm_needs(f"{mod}:f") == AlgorithmNeeds()


def test_the_rl_step_passes_a_critic_plugin_the_values_and_trains_the_critic_on_a_plus_v(plugin_dir):
    from engine.rl.phases import compute_advantages

    root, mod = plugin_dir
    (root / f"{mod}.py").write_text(PLUGIN_MODULE.replace('raise RuntimeError("imported")', ""))
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    values = torch.tensor([[0.25, 0.5, 9.0], [0.5, 0.0, 1.0]])
    traj = _two_responses(mask, [0, 0], values=values)
    out = compute_advantages(traj, RLConfig(algorithm=f"{mod}:with_critic"))
    # A = (r - V) * mask; returns = (A + V) * mask = r on every mask token
    assert out.advantages.tolist() == [[0.75, 0.5, 0.0], [-0.5, 0.0, -1.0]]
    assert out.returns.tolist() == [[1.0, 1.0, 0.0], [0.0, 0.0, 0.0]]
    with pytest.raises(ValueError, match=f"rl.algorithm {mod}:with_critic needs the critic's values"):
        compute_advantages(traj.with_(values=None), RLConfig(algorithm=f"{mod}:with_critic"))
    plain = compute_advantages(traj, RLConfig(algorithm=f"{mod}:plain"))  # no critic: no values passed, no returns
    assert plain.advantages.tolist() == [[1.0, 1.0, 0.0], [0.0, 0.0, 0.0]] and plain.returns is None


def test_a_critic_plugin_that_cannot_take_the_values_fails_at_load(plugin_dir):
    root, mod = plugin_dir
    (root / f"{mod}.py").write_text(
        'ALGORITHM_NEEDS = {"f": {"critic": True}}\n\n\ndef f(rewards, group_index, mask=None):\n    return rewards\n'
    )
    with pytest.raises(
        ImportError,
        match=rf"rl.algorithm: cannot load the advantage estimator plug-in '{mod}:f': "
        r"f\(rewards, group_index, mask=None\) cannot be called as "
        r"\(rewards, group_index, mask, values=...\)",
    ):
        get_advantage_estimator(f"{mod}:f")


def test_the_rl_step_gives_a_teacher_estimator_the_log_probs_and_the_teachers_weights():
    from engine.algorithms.advantages import on_policy_distill_advantages
    from engine.rl.phases import compute_advantages

    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    teacher, student = torch.tensor([[-1.0, -2.0, 0.0], [-0.5, -1.5, -3.0]]), torch.full((2, 3), -1.0)
    traj = _two_responses(mask, [0, 1], teacher_logprobs=teacher, old_logprobs=student)
    cfg = RLConfig(
        algorithm="on_policy_distill", n_samples=1, teacher={"model_dir": "t", "kl_coef": 0.5, "reward_weight": 2.0}
    )
    out = compute_advantages(traj, cfg).advantages
    # 0.5 * (teacher - student) + 2.0 * score on every mask token
    assert out.tolist() == [[2.0, 1.5, 0.0], [0.25, -0.25, -1.0]]
    assert torch.equal(
        out,
        on_policy_distill_advantages(
            traj.rewards,
            traj.group_index,
            mask,
            teacher_logprobs=teacher,
            student_logprobs=student,
            kl_coef=0.5,
            reward_weight=2.0,
        ),
    )
    with pytest.raises(ValueError, match="rl.algorithm on_policy_distill needs the teacher's and the old log-probs"):
        compute_advantages(traj.with_(teacher_logprobs=None), cfg)


REFERENCE_MODULE = """
ALGORITHM_NEEDS = {"kl_shaped": {"reference": True, "group": False, "loss_agg_mode": "seq-mean-token-mean"}}


def kl_shaped(rewards, group_index, mask=None, *, ref_logprobs=None, **options):
    return (rewards[:, None] + ref_logprobs) * mask


def no_keyword(rewards, group_index, mask=None):
    return rewards
"""


def test_a_plugin_that_needs_the_reference_starts_it_without_a_kl_term_and_gets_its_log_probs(plugin_dir):
    from engine.rl.phases import compute_advantages

    root, mod = plugin_dir
    (root / f"{mod}.py").write_text(
        REFERENCE_MODULE.replace('"kl_shaped": {', '"no_keyword": {"reference": True}, "kl_shaped": {')
    )
    cfg = RLConfig(algorithm=f"{mod}:kl_shaped", n_samples=1)  # rl.kl.coef is 0: no KL term
    assert cfg.algorithm_needs == AlgorithmNeeds(reference=True, loss_agg_mode="seq-mean-token-mean")
    assert cfg.kl.coef == 0 and cfg.uses_reference and "reference" in training_roles(cfg)
    assert not RLConfig(algorithm="grpo").uses_reference  # without the need, only a KL term starts it
    assert loss_pairing_note(cfg.algorithm, cfg.loss_agg_mode) == (
        f"rl.algorithm {mod}:kl_shaped is paired with rl.loss_agg_mode: seq-mean-token-mean (its source's loss); "
        "this config aggregates with token-mean"
    )
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    ref = torch.tensor([[-0.5, -1.0, 0.0], [-0.25, -2.0, -4.0]])
    traj = _two_responses(mask, [0, 1], ref_logprobs=ref)
    out = compute_advantages(traj, cfg)
    assert out.advantages.tolist() == [[0.5, 0.0, 0.0], [-0.25, -2.0, -4.0]]  # (r + ref) * mask
    with pytest.raises(ValueError, match=f"rl.algorithm {mod}:kl_shaped needs the reference log-probs"):
        compute_advantages(traj.with_(ref_logprobs=None), cfg)
    with pytest.raises(ImportError, match=r"cannot be called as \(rewards, group_index, mask, ref_logprobs=...\)"):
        get_advantage_estimator(f"{mod}:no_keyword")
