"""The model reference of chat, serve and push (flows/model_ref.py) on real published artifacts."""

from __future__ import annotations

import json
import shutil

import pytest
from e2e_support import tiny_config, write_config
from safetensors.torch import load_file

from config import ConfigError
from flows.model_ref import find_model_artifact, hf_model_dir


def test_an_rl_artifact_directory_is_converted_once_to_the_export_stages_weights(tiny_chat_artifacts, tmp_path):
    rl = tiny_chat_artifacts["rl"]
    found = find_model_artifact(str(rl["dir"]))
    assert (found.name, found.stage, found.path) == (rl["id"], "rl", rl["dir"])
    hf_dir = hf_model_dir(found, cache_dir=tmp_path)
    assert hf_dir.parent == tmp_path and hf_dir.name.startswith(rl["id"] + "-")
    # the same conversion as the export stage's: the same tensors, bit for bit
    exported = load_file(str(tiny_chat_artifacts["export"]["dir"] / "hf_model" / "model.safetensors"))
    converted = load_file(str(hf_dir / "model.safetensors"))
    assert sorted(converted) == sorted(exported)
    assert all(converted[k].equal(exported[k]) for k in exported)
    assert (hf_dir / "tokenizer_config.json").is_file()
    stamp = (hf_dir / "model.safetensors").stat().st_mtime_ns
    assert hf_model_dir(found, cache_dir=tmp_path) == hf_dir  # cached: not converted again
    assert (hf_dir / "model.safetensors").stat().st_mtime_ns == stamp


def test_an_artifact_id_is_looked_up_in_the_artifact_root(tiny_chat_artifacts):
    export = tiny_chat_artifacts["export"]
    found = find_model_artifact(export["id"], artifact_root=str(tiny_chat_artifacts["store"]))
    assert (found.name, found.stage, found.path) == (export["id"], "export", export["dir"])
    assert hf_model_dir(found) == export["dir"] / "hf_model"  # used in place, no copy
    with pytest.raises(
        ConfigError, match=r"is an artifact of stage export; this needs one of stage rl \(check --stage\)"
    ):
        find_model_artifact(export["id"], artifact_root=str(tiny_chat_artifacts["store"]), stage="rl")


def test_an_unknown_id_a_missing_path_and_a_stage_without_a_policy_are_one_clear_error(tiny_chat_artifacts, tmp_path):
    store = str(tiny_chat_artifacts["store"])
    with pytest.raises(
        ConfigError, match=rf"artifact rl-{'9' * 16} is not published under {store}; give --artifact-root"
    ):
        find_model_artifact(f"rl-{'9' * 16}", artifact_root=store)
    with pytest.raises(ConfigError, match=r"nowhere/model: no such artifact directory, config file or artifact id"):
        find_model_artifact("nowhere/model")
    rm = tmp_path / "rm-artifact"
    shutil.copytree(tiny_chat_artifacts["rl"]["dir"], rm)
    manifest = json.loads((rm / "manifest.json").read_text())
    (rm / "manifest.json").write_text(json.dumps({**manifest, "stage": "rm", "artifact_id": "rm-" + "1" * 16}))
    with pytest.raises(
        ConfigError, match=r"is an artifact of stage rm, which holds no policy model; give one of export, rl"
    ):
        find_model_artifact(str(rm))


def test_a_config_whose_stages_never_ran_says_which_command_to_run(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    config = write_config(tmp_path / "pipeline.yaml", tiny_config(tmp_path))
    with pytest.raises(ConfigError) as err:
        find_model_artifact(str(config), ["rl.steps=4"])
    assert str(err.value) == (
        f"{config}: no stage of export, rl, po, sft has a current artifact for this config; run "
        f"`posttrain run {config} rl.steps=4` first (`posttrain status {config} rl.steps=4` shows each stage)"
    )
    with pytest.raises(
        ConfigError, match=rf"stage sft has no current artifact for this config; run `posttrain run {config}`"
    ):
        find_model_artifact(str(config), stage="sft")
    with pytest.raises(ConfigError, match=r"stage po is switched off in this config \(po.enabled is false\)"):
        find_model_artifact(str(config), stage="po")
