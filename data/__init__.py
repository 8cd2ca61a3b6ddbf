"""Data layer: read dataset files, normalize them into the sft / preference / rl kinds and
check them (``validate``), encode chats with loss masks (``chat``) and score responses
(``rewards``; your own reward functions by import path: ``reward_plugins``, loaded with
``import_path``, which also loads RL environments). Imports nothing from engine, tasks or flows."""
