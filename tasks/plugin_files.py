"""What of the user's code and data the rl stage's plug-ins bring into its fingerprint.

A plug-in (reward function, multi-turn environment, advantage estimator or policy loss
given by import path) enters the rl fingerprint by the content of its module, of every
module of the user's own code it imports, recursively, wherever on ``sys.path`` it lies
(``tasks.fingerprint.user_modules``), and of the data files those modules declare in a
module-level ``DATA_FILES`` list (``tasks.fingerprint.declared_data_files``). A file a
plug-in reads without declaring it is NOT tracked: editing it reuses the cached rl artifact.
"""

from __future__ import annotations

from pathlib import Path

from config.schema import PipelineConfig
from tasks.fingerprint import declared_data_files, user_modules


def plugin_paths(cfg: PipelineConfig) -> dict[str, str]:
    """Key -> ``module:function`` of each plug-in the rl stage runs: ``reward_function_<i>``
    (``rl.reward.functions``), ``environment`` (``rl.environment``), ``algorithm`` and
    ``policy_loss`` (``rl.algorithm`` / ``rl.policy_loss`` when given by import path)."""
    paths = {f"reward_function_{i}": fn.path for i, fn in enumerate(cfg.rl.reward.functions)}
    if cfg.rl.environment is not None:
        paths["environment"] = cfg.rl.environment
    for key in ("algorithm", "policy_loss"):  # a built-in's name has no colon and no file
        if ":" in getattr(cfg.rl, key):
            paths[key] = getattr(cfg.rl, key)
    return paths


def plugin_files(cfg: PipelineConfig) -> dict[str, str]:
    """Key -> path of every file the plug-ins bring into the rl fingerprint: ``<key>`` for the
    module :func:`plugin_paths` names, ``<key>/<module>`` for each user module it imports,
    ``<module key>:<entry>`` for each ``DATA_FILES`` entry of one of those modules (the path
    joined to the module's directory). A module that cannot be found is left out (the run
    then fails naming the config key).

    Raises:
        ValueError: a module's ``DATA_FILES`` is not a literal list of strings.
    """
    files: dict[str, str] = {}
    for key, path in plugin_paths(cfg).items():
        module = path.partition(":")[0]
        for name, file in sorted(user_modules(module).items()):
            module_key = key if name == module else f"{key}/{name}"
            files[module_key] = str(file)
            for entry, data in declared_data_files(Path(file)):
                files[f"{module_key}:{entry}"] = str(data)
    return files
