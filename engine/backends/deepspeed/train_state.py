"""The DeepSpeed trainer's resumable train state (:class:`DeepSpeedTrainState`, a base of
``engine.backends.deepspeed.runtime.DeepSpeedTrainer``): the weights (fp32 masters under bf16) and
AdamW moments written to the repository's train-state file (``engine.storage.train_state``).
Under ZeRO 1-3 the moments are consolidated, each parameter's whole ``exp_avg`` /
``exp_avg_sq`` keyed as a plain AdamW over the module keys them, so a state resumes at any
data-parallel size (docs/scaling.md)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from engine.backends.deepspeed.world import DEEPSPEED_BF16, MASTER_WEIGHTS
from engine.models.master_weights import copy_masters_to_model
from engine.storage.train_state import load_train_state, restore_rng_state, save_train_state
from engine.training.optimizer_step import build_optimizer


class DeepSpeedTrainState:
    """Saving and loading :class:`engine.backends.deepspeed.runtime.DeepSpeedTrainer`'s train
    state; the trainer provides ``engine``, ``module``, ``zero_stage``, ``precision`` and its
    master-weight helpers."""

    if TYPE_CHECKING:  # what DeepSpeedTrainer (engine.backends.deepspeed.runtime) provides
        engine: Any
        module: torch.nn.Module
        world: int
        zero_stage: int
        scheme: str
        optim: Any
        total_steps: int
        optimizer: torch.optim.Optimizer
        scheduler: Any

        def gathered(self, params, modifier_rank: int | None = None) -> Any: ...
        def _repository_masters_by_name(self) -> dict[str, torch.nn.Parameter]: ...
        def _set_masters(self, weights: dict[str, torch.Tensor]) -> None: ...
        def _deepspeed_masters_in_params(self) -> Any: ...
        def _optimizer_param_groups(self) -> Any: ...

    def _state_module(self) -> torch.nn.Module:
        """What the train state reads and restores: the module, or, when some of its parameters are
        frozen (LoRA adapters on a frozen base), a module holding the trained parameters alone
        under their names (:func:`_parameter_tree`; at ZeRO-0 under bf16 their fp32 masters), so
        the state holds no frozen weight: those come from the model directory the run starts from."""
        if all(p.requires_grad for p in self.module.parameters()):
            return self.module
        trained = self._repository_masters_by_name() or {
            name: p for name, p in self.module.named_parameters() if p.requires_grad
        }
        return _parameter_tree(trained)

    def state_tag(self) -> dict[str, Any]:
        """What a saved state's layout depends on: the backend and the ZeRO stage."""
        return {"backend": "deepspeed", "zero_stage": self.zero_stage}

    # The train state under ZeRO 1-3: DeepSpeed's AdamW steps this rank's flat partitions only,
    # so the optimizer state is gathered into whole tensors per parameter (the state_dict() of a
    # plain AdamW over the module), which loads at any data-parallel size. States without this
    # marker hold one rank's flat partitions (written at DP=1 by earlier versions).
    CONSOLIDATED = "per_parameter"

    def save_state(self, directory: str | Path, tag_key: str, step: int, data_position, extra: dict[str, Any]) -> None:
        """Write ``directory/train_state.pt`` atomically (``engine.storage.train_state``): the module's
        weights by name, the AdamW state, the schedule, data position, RNG states and ``extra``
        plus ``extra[tag_key] =`` :meth:`state_tag`. Loads with ``torch.load(weights_only=True)``.
        Under bf16 the weights are the fp32 masters (module docstring); with frozen parameters
        (LoRA) the trained ones only (:meth:`_state_module`). At DP > 1 a collective: every rank
        calls it, rank 0 writes.

        Under ZeRO 1-3, at any data-parallel size, the AdamW state is consolidated: whole
        ``exp_avg`` / ``exp_avg_sq`` tensors per trained parameter (DeepSpeed's
        ``safe_get_full_optimizer_state``, gathered from the ranks' partitions), keyed as a plain
        AdamW over the module would key them, so the state resumes at any data-parallel size. At
        ZeRO-0 the AdamW is such a plain AdamW already and its own ``state_dict()`` is written."""
        saved = self._state_module()
        if self.zero_stage > 0:
            with self.gathered(saved.parameters()), self._deepspeed_masters_in_params():
                optimizer = _SavedOptimizer(self._consolidated_optimizer_state(saved))
                save_train_state(
                    directory,
                    step=step,
                    model=saved,
                    optimizer=optimizer,
                    scheduler=self.scheduler,
                    data_position=data_position,
                    extra={**extra, tag_key: self.state_tag()},
                )
            return
        with self.gathered(saved.parameters()), self._deepspeed_masters_in_params():
            save_train_state(
                directory,
                step=step,
                model=saved,
                optimizer=self.optimizer,
                scheduler=self.scheduler,
                data_position=data_position,
                extra={**extra, tag_key: self.state_tag()},
            )

    def _template_groups(self, module: torch.nn.Module) -> list[list[torch.nn.Parameter]]:
        """The trained parameters of ``module`` in the groups (and order) of a plain
        ``build_optimizer`` over them: the layout of a consolidated optimizer state. Under
        ZeRO-3 call it with the parameters gathered (the groups depend on their shapes)."""
        template, _ = build_optimizer([p for p in module.parameters() if p.requires_grad], self.optim, self.total_steps)
        return [list(group["params"]) for group in template.param_groups]

    def _consolidated_optimizer_state(self, module: torch.nn.Module) -> dict[str, Any]:
        """``{"state": {index: {"step", "exp_avg", "exp_avg_sq"}}, "param_groups": [...],
        "consolidated": CONSOLIDATED}``: whole fp32 moments per trained parameter of ``module``
        (a collective at DP > 1: each is gathered from the ranks' partitions), indices as
        :meth:`_template_groups`, hyper-parameters (lr, ...) the live optimizer's. Before the
        first step (torch creates AdamW's state lazily) ``"state"`` is empty, as a plain AdamW's."""
        # deepspeed: seconds to import; only the DeepSpeed backend needs it
        from deepspeed.utils import safe_get_full_optimizer_state

        groups = self._template_groups(module)
        stepped = any("exp_avg" in entry for entry in self.optimizer.state.values())
        step = next(e["step"] for e in self.optimizer.state.values() if "exp_avg" in e) if stepped else None
        if stepped:
            self._link_optimizer_state()
        state, index, param_groups = {}, 0, []
        for group, live in zip(groups, self.optimizer.param_groups):
            ids = []
            for p in group:
                if stepped:
                    state[index] = {
                        "step": torch.as_tensor(step).clone(),
                        **{
                            m: safe_get_full_optimizer_state(p, m).detach().clone().view(p.shape)
                            for m in ("exp_avg", "exp_avg_sq")
                        },
                    }
                ids.append(index)
                index += 1
            param_groups.append({**{k: v for k, v in live.items() if k != "params"}, "params": ids})
        return {"state": state, "param_groups": param_groups, "consolidated": self.CONSOLIDATED}

    def load_state(self, directory: str | Path, tag_key: str, config_keys: str):
        """Restore a state :meth:`save_state` wrote with the same ZeRO stage (weights,
        AdamW, schedule, RNG); returns the :class:`engine.storage.train_state.TrainState` with
        ``tag_key`` taken out of ``extra``. Under bf16 the fp32 masters take the saved weights
        exactly and the bf16 module weights their rounding. A state of this version loads at
        any data-parallel size (ZeRO 1-3: consolidated, each rank taking its own partition;
        ZeRO-0: a plain AdamW's); at DP > 1 every rank calls it. A ZeRO 1-3 state of an earlier
        version, written at DP=1 with the AdamW state of that rank's flat partitions, still
        loads at DP=1.

        Raises:
            FileNotFoundError / ValueError from :func:`engine.storage.train_state.load_train_state`.
            ValueError: the state was written by another backend or ZeRO stage (the message
                names ``config_keys``, e.g. ``"rl.backend and rl.deepspeed.zero_stage"``); an
                earlier version's partition state is loaded at DP > 1 (the message names the fix:
                resume it at data-parallel size 1 once, whose next save is consolidated).
        """
        state = load_train_state(directory)
        written_by = state.extra.pop(tag_key, {"backend": "megatron"})
        if written_by != self.state_tag():
            raise ValueError(
                f"{directory}: train state was written with {written_by}, this worker runs "
                f"{self.state_tag()}; resume with the same {config_keys}"
            )
        restored = self._state_module()
        if state.format_version == 1 and state.optimizer.get("consolidated") == self.CONSOLIDATED:
            self._restore_consolidated(state, restored)
            return state
        if self.world > 1 and self.zero_stage > 0:
            raise ValueError(
                f"{directory}: this train state holds one rank's flat ZeRO partitions (written at "
                f"data_parallel_size 1 by an earlier version) and loads at data_parallel_size 1 only; "
                f"resume it at data_parallel_size 1 until its next checkpoint, which is written in the "
                f"format that loads at any data_parallel_size"
            )
        with self.gathered(restored.parameters(), modifier_rank=0), self._optimizer_param_groups():
            state.restore(restored, self.optimizer, self.scheduler)
        if self.scheme == MASTER_WEIGHTS:  # the bf16 weights: the restored masters' rounding
            copy_masters_to_model(self.module)
        elif self.scheme == DEEPSPEED_BF16:  # DeepSpeed's fp32 masters: the saved fp32 weights exactly
            self._set_masters(state.model)
        elif self.zero_stage > 0:  # ZeRO's fp32 master partitions follow the restored weights
            self.engine.optimizer.refresh_fp32_params()
        return state

    def _restore_consolidated(self, state, restored: torch.nn.Module) -> None:
        """Load a consolidated state (:meth:`save_state` under ZeRO 1-3, any DP size) into this
        layout: the weights (and the fp32 masters: DeepSpeed's partitions take them exactly), each parameter's
        moments into this rank's partition (``safe_set_full_optimizer_state``), the step count,
        the groups' hyper-parameters, the schedule and the RNG states.

        Raises:
            ValueError: the saved weights or parameter groups do not match the module's."""
        opt = state.optimizer
        with self.gathered(restored.parameters(), modifier_rank=0):
            result = restored.load_state_dict(state.model, strict=False)
            if result.missing_keys or result.unexpected_keys:
                raise ValueError(
                    f"{state.path}: train state does not match the model: mismatched keys "
                    f"{(result.missing_keys + result.unexpected_keys)[:5]}"
                )
            groups = self._template_groups(restored)
        if [len(g) for g in groups] != [len(g["params"]) for g in opt["param_groups"]]:
            raise ValueError(f"{state.path}: train state has other optimizer parameter groups than the model's")
        if self.scheme == DEEPSPEED_BF16:
            self._set_masters(state.model)
        else:
            self.engine.optimizer.refresh_fp32_params()
        if not opt["state"]:  # saved before the first step: AdamW starts afresh, as a plain one would
            self.optimizer.state.clear()
        else:
            self._restore_moments(opt["state"], [p for group in groups for p in group])
        for live, saved in zip(self.optimizer.param_groups, opt["param_groups"]):
            live.update({k: v for k, v in saved.items() if k != "params"})
        self.scheduler.load_state_dict(state.scheduler)
        restore_rng_state(state.rng)

    def _restore_moments(self, saved: dict[int, dict[str, Any]], params: list[torch.nn.Parameter]) -> None:
        """Put each parameter's whole saved moments (``saved[index]``, ``params[index]``, in
        :meth:`_template_groups` order) into this rank's partition and the saved step count
        into every flat partition's AdamW state."""
        # deepspeed: seconds to import; only the DeepSpeed backend needs it
        from deepspeed.utils import safe_set_full_optimizer_state

        # A trainer that has not stepped yet has no AdamW state (torch creates it in the first
        # step): its flat partitions get zero moments to be overwritten below.
        with self._optimizer_param_groups():
            for group in self.optimizer.param_groups:
                for flat in group["params"]:
                    entry = self.optimizer.state[flat]
                    if "exp_avg" not in entry:
                        entry.update(
                            step=torch.tensor(0.0), exp_avg=torch.zeros_like(flat), exp_avg_sq=torch.zeros_like(flat)
                        )
        self._link_optimizer_state()
        for index, p in enumerate(params):
            for moment in ("exp_avg", "exp_avg_sq"):
                safe_set_full_optimizer_state(p, saved[index][moment].reshape(-1).to(torch.float32), moment)
        step = saved[0]["step"]
        for entry in self.optimizer.state.values():
            entry["step"] = torch.as_tensor(step).clone()

    def _link_optimizer_state(self) -> None:
        """ZeRO 1-2 (DeepSpeed's bf16 optimizer at ZeRO-1 too): point each parameter's views of the
        AdamW state, which ``safe_get_full_optimizer_state`` / ``safe_set_full_optimizer_state``
        read and write, at the flat partitions' current state tensors. DeepSpeed 0.19.8 links
        them once, after the first parameter group's first step, when the other groups have no
        state yet: their views stay empty (the no-weight-decay group's: "exp_avg not found in
        optimizer state fragment"), and a trainer that has not stepped has none. A no-op under
        ZeRO-3, which reads its flat state directly."""
        opt = self.engine.optimizer
        if self.zero_stage in (1, 2) and hasattr(opt, "_lazy_init_hp_params_optimizer_state"):
            opt._hp_optimizer_states_linked = False
            opt._lazy_init_hp_params_optimizer_state()


class _SavedOptimizer:
    """What ``save_train_state`` reads of an optimizer (``state_dict()``), for a consolidated state."""

    def __init__(self, state: dict[str, Any]):
        self._state = state

    def state_dict(self) -> dict[str, Any]:
        return self._state


def _parameter_tree(named: dict[str, torch.nn.Parameter]) -> torch.nn.Module:
    """A module holding exactly ``named``'s Parameter objects under their dotted names (the
    same objects, no copy): its ``state_dict()`` reads them and ``load_state_dict`` writes into
    them."""
    root = torch.nn.Module()
    for name, p in named.items():
        *path, leaf = name.split(".")
        owner = root
        for part in path:
            if part not in dict(owner.named_children()):
                owner.add_module(part, torch.nn.Module())
            owner = owner.get_submodule(part)
        owner.register_parameter(leaf, p)
    return root
