"""generation_config.json: written with the default model, parsed, resolved
under ``--generation-config`` and logged (``kvserve.model.generation_config``)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from structlog.testing import capture_logs

from kvserve.config import EngineConfig
from kvserve.model import default_model as dm
from kvserve.model.default_model import (DEFAULT_GENERATION_CONFIG, convert_gguf,
                                         ensure_default_model, ensure_generation_config)
from kvserve.model.generation_config import (NO_DEFAULTS, GenerationConfigError,
                                             GenerationDefaults, describe,
                                             log_generation_defaults, read_generation_config,
                                             resolve_generation_defaults)
from test_default_model import hf_tensors, write_gguf


def write(folder: Path, data: object) -> Path:
    """``folder/generation_config.json`` holding ``data`` as JSON (folder created)."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "generation_config.json"
    path.write_text(json.dumps(data), encoding="utf-8")
    return path


# ---------------------------------------------------------------- parsing


def test_sampling_keys_are_read_and_every_other_key_ignored(tmp_path: Path) -> None:
    path = write(tmp_path, {"bos_token_id": 1, "eos_token_id": [2, 3], "do_sample": False,
                            "max_length": 20, "temperature": 0.6, "top_p": 0.9, "top_k": 20,
                            "min_p": 0.05, "repetition_penalty": 1.1, "max_new_tokens": 256,
                            "transformers_version": "4.42.3", "_from_model_config": True})
    defaults = read_generation_config(path)
    assert defaults == GenerationDefaults(temperature=0.6, top_p=0.9, top_k=20, min_p=0.05,
                                          repetition_penalty=1.1, max_tokens=256,
                                          source=str(path), cap_max_tokens=False)
    assert defaults.values() == {"temperature": 0.6, "top_p": 0.9, "top_k": 20, "min_p": 0.05,
                                 "repetition_penalty": 1.1, "max_tokens": 256}
    assert isinstance(defaults.top_k, int) and isinstance(defaults.temperature, float)


def test_null_values_and_a_file_without_sampling_keys_give_no_defaults(tmp_path: Path) -> None:
    path = write(tmp_path, {"bos_token_id": 1, "eos_token_id": 2, "temperature": None})
    defaults = read_generation_config(path)
    assert defaults.values() == {}
    assert describe(defaults) == "none"


def test_integral_floats_are_taken_for_integer_keys(tmp_path: Path) -> None:
    defaults = read_generation_config(write(tmp_path, {"top_k": 40.0, "max_new_tokens": 64.0}))
    assert (defaults.top_k, defaults.max_tokens) == (40, 64)


@pytest.mark.parametrize("data, words", [
    ({"temperature": -0.5}, "temperature must be >= 0, got -0.5"),
    ({"top_p": 0}, "top_p must be in (0.0, 1.0], got 0.0"),
    ({"top_p": 1.5}, "top_p must be in (0.0, 1.0], got 1.5"),
    ({"min_p": 2}, "min_p must be in [0.0, 1.0], got 2.0"),
    ({"top_k": -2}, "top_k must be >= -1"),
    ({"repetition_penalty": 0}, "repetition_penalty must be"),
    ({"max_new_tokens": 0}, "max_new_tokens must be >= 1, got 0"),
    ({"top_k": "40"}, "top_k must be a number, got '40'"),
    ({"temperature": True}, "temperature must be a number, got True"),
    ({"max_new_tokens": 12.5}, "max_new_tokens must be an integer, got 12.5"),
])
def test_a_bad_value_is_refused_naming_the_file_and_the_key(tmp_path: Path, data: dict,
                                                             words: str) -> None:
    path = write(tmp_path, data)
    with pytest.raises(GenerationConfigError) as info:
        read_generation_config(path)
    assert str(info.value).startswith(f"{path}: ")
    assert words in str(info.value)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("text, words", [("{", "not valid JSON"),
                                         ("[1, 2]", "must hold a JSON object, got list"),
                                         ("\"hot\"", "must hold a JSON object, got str")])
def test_a_file_that_is_not_a_json_object_is_refused_naming_it(tmp_path: Path, text: str,
                                                               words: str) -> None:
    path = tmp_path / "generation_config.json"
    path.write_text(text, encoding="utf-8")
    with pytest.raises(GenerationConfigError, match=f"^{path}: {words}"):
        read_generation_config(path)


# ---------------------------------------------------------------- applying


def test_defaults_fill_only_the_fields_a_request_left_out() -> None:
    defaults = GenerationDefaults(temperature=0.7, top_p=0.9, top_k=20, max_tokens=100)
    assert defaults.apply({"top_p": 0.5, "max_tokens": None}) == {
        "temperature": 0.7, "top_p": 0.5, "top_k": 20, "max_tokens": 100}
    # An explicit zero is a value, not an omission: temperature 0 stays greedy.
    assert defaults.apply({"temperature": 0.0, "top_k": 0, "max_tokens": 5}) == {
        "temperature": 0.0, "top_p": 0.9, "top_k": 0, "max_tokens": 5}
    assert NO_DEFAULTS.apply({"max_tokens": None}) == {"max_tokens": None}


def test_a_capping_default_bounds_max_tokens_a_request_sets() -> None:
    capped = GenerationDefaults(max_tokens=100, cap_max_tokens=True)
    assert capped.apply({"max_tokens": 5000}) == {"max_tokens": 100}
    assert capped.apply({"max_tokens": 20}) == {"max_tokens": 20}
    assert capped.apply({"max_tokens": None}) == {"max_tokens": 100}
    assert GenerationDefaults(temperature=0.5, cap_max_tokens=True).apply(
        {"max_tokens": 5000}) == {"max_tokens": 5000, "temperature": 0.5}


# ---------------------------------------------------------------- --generation-config


def test_auto_reads_the_model_folder_and_vllm_ignores_it(tmp_path: Path) -> None:
    model = tmp_path / "model"
    path = write(model, {"temperature": 0.3, "max_new_tokens": 50})
    auto = resolve_generation_defaults(model, "auto")
    assert auto == GenerationDefaults(temperature=0.3, max_tokens=50, source=str(path))
    assert resolve_generation_defaults(str(model)) == auto  # auto is the default
    assert resolve_generation_defaults(model, "vllm") is NO_DEFAULTS
    assert EngineConfig(model=str(model)).generation_config == "auto"


def test_auto_without_a_file_gives_no_defaults(tmp_path: Path) -> None:
    assert resolve_generation_defaults(tmp_path, "auto") is NO_DEFAULTS


def test_a_folder_path_reads_that_folders_file_and_caps_max_tokens(tmp_path: Path) -> None:
    write(tmp_path / "model", {"temperature": 0.3})
    path = write(tmp_path / "mine", {"temperature": 0.9, "max_new_tokens": 64})
    for setting in (str(tmp_path / "mine"), str(path)):
        defaults = resolve_generation_defaults(tmp_path / "model", setting)
        assert defaults == GenerationDefaults(temperature=0.9, max_tokens=64, source=str(path),
                                              cap_max_tokens=True)


def test_a_folder_path_that_is_missing_or_has_no_file_is_refused(tmp_path: Path) -> None:
    with pytest.raises(GenerationConfigError, match="no such folder; give auto .* vllm"):
        resolve_generation_defaults(tmp_path, str(tmp_path / "absent"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(GenerationConfigError, match="the folder has no generation_config.json"):
        resolve_generation_defaults(tmp_path, str(tmp_path / "empty"))


def test_a_bad_file_under_auto_is_refused_naming_it(tmp_path: Path) -> None:
    path = write(tmp_path, {"top_p": 3})
    with pytest.raises(GenerationConfigError, match=f"^{path}: top_p must be in"):
        resolve_generation_defaults(tmp_path, "auto")


@pytest.mark.parametrize("setting", ["", "   ", None, 3])
def test_engine_config_refuses_an_empty_or_non_string_setting(setting: object) -> None:
    with pytest.raises(ValueError, match="generation_config must be auto, vllm or a folder"):
        EngineConfig(model="m", generation_config=setting)


# ---------------------------------------------------------------- the start-up line


def test_the_start_up_line_lists_the_defaults_or_none(tmp_path: Path) -> None:
    path = write(tmp_path, {"temperature": 0.0, "top_p": 0.9, "max_new_tokens": 512})
    with capture_logs() as logs:
        log_generation_defaults(read_generation_config(path))
        log_generation_defaults(NO_DEFAULTS, "vllm")
        log_generation_defaults(NO_DEFAULTS, "auto")
    assert [line["event"] for line in logs] == ["generation_defaults"] * 3
    assert all(line["log_level"] == "info" for line in logs)
    found, vllm, auto = logs
    assert found["values"] == {"temperature": 0.0, "top_p": 0.9, "max_tokens": 512}
    assert found["source"] == str(path)
    assert f"from {path}: temperature=0, top_p=0.9, max_tokens=512" in found["message"]
    assert "--generation-config vllm" in found["message"]
    assert (vllm["values"], vllm["source"], vllm["generation_config"]) == ("none", None, "vllm")
    assert "(--generation-config vllm)" in vllm["message"]
    assert "(no generation_config.json)" in auto["message"]


# ---------------------------------------------------------------- the default model's file


def checkpoint_folder(folder: Path) -> Path:
    """A folder that passes ``_is_complete`` (placeholder files) with a real config.json."""
    folder.mkdir(parents=True)
    for name in dm._CHECKPOINT_FILES:
        (folder / name).write_text("{}", encoding="utf-8")
    (folder / "config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": 2}))
    return folder


def test_the_file_written_holds_the_ids_and_the_defaults_and_parses(tmp_path: Path) -> None:
    folder = checkpoint_folder(tmp_path / "ckpt")
    path = ensure_generation_config(folder)
    assert path == folder / "generation_config.json"
    assert json.loads(path.read_text()) == {"bos_token_id": 1, "eos_token_id": 2,
                                            **DEFAULT_GENERATION_CONFIG}
    assert path.stat().st_mode & 0o777 == 0o644
    assert read_generation_config(path).values() == {"temperature": 0.0, "top_p": 0.9,
                                                     "max_tokens": 512}
    assert sorted(p.name for p in folder.iterdir()) == sorted(
        (*dm._CHECKPOINT_FILES, "generation_config.json"))  # no temporary file left


def test_an_existing_file_is_kept(tmp_path: Path) -> None:
    folder = checkpoint_folder(tmp_path / "ckpt")
    mine = write(folder, {"temperature": 0.8})
    ensure_generation_config(folder)
    assert json.loads(mine.read_text()) == {"temperature": 0.8}


def test_a_folder_that_cannot_be_written_warns_and_serves_without(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    folder = checkpoint_folder(tmp_path / "ckpt")

    def read_only(*args, **kwargs):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(dm.tempfile, "mkstemp", read_only)
    with capture_logs() as logs:
        ensure_generation_config(folder)
    assert not (folder / "generation_config.json").exists()
    assert [(line["event"], line["log_level"]) for line in logs] == [
        ("generation_config_not_written", "warning")]
    assert resolve_generation_defaults(folder) is NO_DEFAULTS


def test_an_old_cache_folder_gets_the_file_without_converting_again(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    folder = checkpoint_folder(tmp_path / dm.DEFAULT_MODEL_NAME)

    def no_fetch(work: Path) -> Path:
        raise AssertionError("a complete folder must not be fetched again")

    monkeypatch.setattr(dm, "_fetch_gguf", no_fetch)
    assert ensure_default_model(tmp_path) == folder
    written = (folder / "generation_config.json").read_bytes()
    assert json.loads(written)["temperature"] == 0.0
    assert ensure_default_model(tmp_path) == folder  # idempotent: same file, same bytes
    assert (folder / "generation_config.json").read_bytes() == written


def test_conversion_writes_the_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def fake_fetch(work: Path) -> Path:
        write_gguf(work / "tiny.gguf", hf_tensors(np.random.default_rng(7)))
        return work / "tiny.gguf"

    monkeypatch.setattr(dm, "_fetch_gguf", fake_fetch)
    monkeypatch.setattr(dm, "convert_gguf", convert_gguf)
    folder = ensure_default_model(tmp_path)
    assert json.loads((folder / "generation_config.json").read_text()) == {
        "bos_token_id": 1, "eos_token_id": 2, **DEFAULT_GENERATION_CONFIG}
    assert resolve_generation_defaults(folder).values() == {
        "temperature": 0.0, "top_p": 0.9, "max_tokens": 512}
