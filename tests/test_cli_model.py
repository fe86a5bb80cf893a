"""``kvserve serve --model``: what is not a servable checkpoint (a file that
is not a GGUF, a GGUF the converter cannot read, a missing path, a hub model
id) is one line on stderr and exit status 2 before any model loads (issues
25 and 30), not a traceback or a missing ``config.json``."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ACCEPTS = "pass a Hugging Face-layout folder (config.json, *.safetensors, tokenizer.json)"


def serve_errors(model: str, *extra: str) -> list[str]:
    """The non-JSON stderr lines of ``kvserve serve --model model``; asserts exit status 2."""
    done = subprocess.run([sys.executable, "-m", "kvserve.cli", "serve", "--model", model,
                           "--port", "0", *extra], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done
    assert "Traceback" not in done.stderr, done.stderr
    return [line for line in done.stderr.splitlines() if not line.startswith("{")]


def make_gguf(path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"GGUF\x03\x00\x00\x00")  # the magic is enough: nothing reads it
    return path


def test_an_unreadable_gguf_file_is_one_line_naming_it(tmp_path: Path) -> None:
    gguf = make_gguf(tmp_path / "model-q4_0.gguf")
    errors = serve_errors(str(gguf))
    assert len(errors) == 1, errors
    assert errors[0].startswith(f"kvserve: error: --model {gguf}: cannot convert it: {gguf}: "
                                "not a readable GGUF file")


def test_a_folder_holding_only_an_unreadable_gguf_says_the_same(tmp_path: Path) -> None:
    gguf = make_gguf(tmp_path / "only-gguf" / "model.gguf")
    errors = serve_errors(str(tmp_path / "only-gguf"))
    assert len(errors) == 1, errors
    assert f"{gguf}: not a readable GGUF file" in errors[0]


def test_a_missing_gguf_is_no_such_file(tmp_path: Path) -> None:
    missing = tmp_path / "absent.gguf"
    assert serve_errors(str(missing)) == [
        f"kvserve: error: --model {missing}: no such file; {ACCEPTS} of a llama, mistral, "
        "qwen2, qwen3, phi3 or gemma3 model, or a .gguf file"]


def test_a_missing_folder_is_one_line(tmp_path: Path) -> None:
    missing = tmp_path / "no-such-model"
    assert serve_errors(str(missing)) == [
        f"kvserve: error: --model {missing}: no such folder; {ACCEPTS} of a llama, mistral, "
        "qwen2, qwen3, phi3 or gemma3 model, or a .gguf file, or leave --model out for the default model "
        "(SmolLM2-135M-Instruct)"]


def test_a_hub_model_id_is_not_fetched(tmp_path: Path) -> None:
    errors = serve_errors("HuggingFaceTB/SmolLM2-135M-Instruct")
    assert errors == ["kvserve: error: --model HuggingFaceTB/SmolLM2-135M-Instruct: no such "
                      "folder; kvserve serves local folders and does not fetch model ids from a "
                      "hub: download the checkpoint (config.json, *.safetensors, tokenizer.json) "
                      "and pass its folder, or leave --model out to serve the default model "
                      "(SmolLM2-135M-Instruct) (`kvserve fetch-model` fetches it)"]


@pytest.mark.parametrize("present, missing", [
    (("config.json", "model.safetensors"), "tokenizer.json"),
    (("config.json", "tokenizer.json"), "*.safetensors"),
    (("notes.txt",), "config.json, *.safetensors, tokenizer.json"),
])
def test_a_folder_missing_checkpoint_files_names_them(tmp_path: Path, present: tuple[str, ...],
                                                      missing: str) -> None:
    for name in present:
        (tmp_path / name).write_text("{}", encoding="utf-8")
    errors = serve_errors(str(tmp_path))
    assert errors == [f"kvserve: error: --model {tmp_path}: no {missing} in this folder; "
                      f"{ACCEPTS} of a llama, mistral, qwen2, qwen3, phi3 or gemma3 model, or a .gguf file"]


def test_quantization_auto_serves_a_gguf_on_its_own_blocks(tmp_path: Path) -> None:
    """``--quantization auto`` (the default): a .gguf file, a folder of one
    and a registered GGUF name take their blocks (w4a8 on the CPU; none on a
    GPU, which has no K-quant kernels); a checkpoint folder and the default
    model stay float; an explicit scheme is kept."""
    from kvserve.cli import default_quantization

    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    folder = tmp_path / "holds"
    folder.mkdir()
    (folder / "x.gguf").write_bytes(b"GGUF")
    checkpoint = tmp_path / "ckpt"
    checkpoint.mkdir()
    (checkpoint / "config.json").write_text("{}")
    assert default_quantization("auto", str(gguf), "cpu") == "w4a8"
    assert default_quantization("auto", str(folder), "cpu") == "w4a8"
    assert default_quantization("auto", "gemma-3-270m", "cpu") == "w4a8"
    assert default_quantization("auto", str(gguf), "cuda") == "none"
    assert default_quantization("auto", str(checkpoint), "cpu") == "none"
    assert default_quantization("auto", None, "cpu") == "none"
    assert default_quantization("q4", str(checkpoint), "cpu") == "q4"
