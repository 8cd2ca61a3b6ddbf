"""The shared training loop (engine.training.loop.run_loop) on a real trainer
(engine.training.model_trainer.ModelTrainer: AdamW, schedule, train state) and a tiny
least-squares stage: the data order, the log / evaluation / checkpoint cadence, the stage's
own counters in the train state, a crash and resume to bit-identical weights and draws, and the
refusal of a train state written by another run."""

from __future__ import annotations

import pytest
import torch

from config.training import OptimConfig
from engine.batching.sampler import EpochSampler
from engine.storage.train_state import load_train_state
from engine.training.loop import LoopResult, StepInfo, StepTrainer, run_loop
from engine.training.model_trainer import ModelTrainer
from engine.training.optimizer_step import build_model_optimizer

NUM_EXAMPLES, BATCH = 10, 4


class Crash(RuntimeError):
    pass


class Cfg:
    """The loop's part of a stage config."""

    def __init__(self, steps: int = 5, log_every: int = 2, checkpoint_every: int = 2):
        self.steps, self.log_every, self.checkpoint_every, self.global_batch_size = (
            steps,
            log_every,
            checkpoint_every,
            BATCH,
        )


def squared_error(model: torch.nn.Module, batch: tuple[torch.Tensor, torch.Tensor]):
    x, y = batch
    return ((model(x).squeeze(-1) - y) ** 2).sum(), x.size(0), {}


class Regression:
    """A least-squares stage: example ``i`` is ``(x_i, y_i)``; two micro-batches of 2 per step.
    Records the drawn indices, the evaluated steps and a counter kept in the train state."""

    def __init__(self):
        g = torch.Generator().manual_seed(0)
        self.x, self.y = torch.randn(NUM_EXAMPLES, 3, generator=g), torch.randn(NUM_EXAMPLES, generator=g)
        self.drawn: list[list[int]] = []
        self.evaluated: list[int] = []
        self.infos: list[StepInfo] = []
        self.rows = 0

    def batch(self, indices):
        self.drawn.append(list(indices))
        return [(self.x[indices[:2]], self.y[indices[:2]]), (self.x[indices[2:]], self.y[indices[2:]])]

    def step(self, trainer, micro):
        return trainer.step(micro)

    def metrics(self, out, micro, info):
        self.rows += sum(m[0].size(0) for m in micro)
        self.infos.append(info)
        return {"train/loss": out["loss"], "train/grad_norm": out["grad_norm"], "train/rows": float(self.rows)}

    def evaluate(self, model):
        self.evaluated.append(len(self.drawn))
        with torch.no_grad():
            return {"eval/loss": float(((model(self.x).squeeze(-1) - self.y) ** 2).mean())}

    def state_extra(self):
        return {"rows": self.rows}

    def resume(self, extra):
        self.rows = int(extra["rows"])


def make_trainer(steps: int) -> ModelTrainer:
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1)
    optimizer, scheduler = build_model_optimizer(model, OptimConfig(lr=0.1, warmup_steps=1), steps)
    return ModelTrainer(model, optimizer, scheduler, squared_error, grad_clip=1.0)


def run(cfg: Cfg, resume_dir, log=None, identity=None) -> tuple[LoopResult, Regression, ModelTrainer]:
    stage, trainer = Regression(), make_trainer(cfg.steps)
    result = run_loop(
        trainer,
        stage,
        cfg,
        num_examples=NUM_EXAMPLES,
        seed=7,
        identity=identity or {"run": "a"},
        resume_dir=resume_dir,
        log_metrics=log,
        desc="test",
        label="the test run",
    )
    return result, stage, trainer


def test_model_trainer_is_a_step_trainer():
    assert isinstance(make_trainer(1), StepTrainer)


def test_cadence_data_order_and_state(tmp_path):
    """Draws follow the sampler from the seed; logs and evaluations at every log_every-th step and
    the last; the last checkpoint holds step, position, identity, the stage's counter and metrics."""
    logged: list[tuple[int, dict]] = []
    result, stage, trainer = run(Cfg(steps=5), tmp_path / "state", log=lambda m, s: logged.append((s, m)))
    sampler = EpochSampler(NUM_EXAMPLES, 7)
    assert stage.drawn == [sampler.next_indices(BATCH) for _ in range(5)]
    assert [s for s, _ in logged] == [2, 4, 5] and stage.evaluated == [2, 4, 5]
    assert "eval/loss" in logged[0][1] and [i.step for i in stage.infos] == [1, 2, 3, 4, 5]
    assert [i.epoch for i in stage.infos] == [0.4, 0.8, 1.2, 1.6, 2.0]  # 4 of 10 rows a step
    assert result.summary() == {"train/steps": 5.0, "train/resumed_from_step": 0.0, "train/steps_run": 5.0}
    assert result.metrics == logged[-1][1] and result.metrics["train/rows"] == 20.0
    state = load_train_state(tmp_path / "state")
    assert state.step == 5 and (state.data_position.epoch, state.data_position.offset) == (2, 0)
    assert list(state.extra) == ["run", "rows", "metrics"]
    assert state.extra["rows"] == 20 and state.extra["metrics"] == result.metrics
    assert torch.equal(state.model["weight"], trainer.model.weight.detach())


def test_crash_and_resume_are_bit_identical(tmp_path):
    """Crash after step 3 is logged (last checkpoint: step 2); the resumed run redoes step 3 with the
    same rows and ends with the uninterrupted run's weights, metrics and counter, bit for bit."""
    cfg = Cfg(steps=5, log_every=1, checkpoint_every=2)
    straight, s_stage, s_trainer = run(cfg, tmp_path / "a")

    def crash_at_3(metrics, step):
        if step == 3:
            raise Crash()

    with pytest.raises(Crash):
        run(cfg, tmp_path / "b", log=crash_at_3)
    seen: list[int] = []
    resumed, r_stage, r_trainer = run(cfg, tmp_path / "b", log=lambda m, s: seen.append(s))
    assert seen == [3, 4, 5] and resumed.start == 2 and resumed.summary()["train/steps_run"] == 3.0
    assert r_stage.drawn == s_stage.drawn[2:]
    assert resumed.metrics == straight.metrics
    for a, b in zip(s_trainer.model.parameters(), r_trainer.model.parameters(), strict=True):
        assert torch.equal(a, b)
    # A finished state: no step runs, the saved metrics come back.
    again, a_stage, _ = run(cfg, tmp_path / "b")
    assert a_stage.drawn == [] and again.metrics == straight.metrics and again.start == 5


def test_a_state_of_another_run_is_refused(tmp_path):
    run(Cfg(steps=2), tmp_path / "s")
    with pytest.raises(ValueError, match="different run.*run: 'a' -> 'b'"):
        run(Cfg(steps=2), tmp_path / "s", identity={"run": "b"})
