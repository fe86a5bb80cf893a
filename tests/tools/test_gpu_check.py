"""tools/gpu_check.py on a CPU-only machine: it cannot pass what it did not
measure (a missing model, a raising section, a skip: exit status 1, and the
JSON says why, written after each section); the GGUF split / assemble round
trip and its refusal of a corrupted or missing part; the pure pieces of the
golden rule and the per-step figures."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from tools_support import load_tool

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "tools" / "gpu_check.py"


@pytest.fixture(scope="module")
def gc():
    """The script as a module (registered, as its dataclasses need)."""
    module = load_tool("gpu_check")
    yield module
    del sys.modules[module.__name__]


def run_script(tmp_path: Path, *args: str, **env: str) -> tuple[subprocess.CompletedProcess, dict]:
    out = tmp_path / "check.json"
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--out", str(out), *args], cwd=REPO, text=True,
        capture_output=True, timeout=120,
        env={**os.environ, "NUMBA_ENABLE_CUDASIM": "1", **env})
    return proc, json.loads(out.read_text())


# --------------------------------------------------------------------------- model missing


def test_missing_model_fails_and_says_why(tmp_path):
    proc, data = run_script(tmp_path, "--model", "/nonexistent", "--sections", "golden")
    assert proc.returncode == 1, proc.stderr
    golden = data["sections"]["golden"]
    assert golden["status"] == "failed"
    assert "/nonexistent is not a checkpoint folder" in golden["reason"]
    assert data["model"] == {"path": None, "missing": golden["reason"]}
    assert data["summary"]["ok"] is False and data["summary"]["failed"] == ["golden"]
    assert data["sections"]["kernels"] == {"status": "skipped",
                                           "reason": "not selected (--sections)"}
    assert "# gpu_check: FAILED" in (tmp_path / "check.md").read_text()


def test_default_model_is_never_downloaded(tmp_path):
    cache = tmp_path / "cache"
    proc, data = run_script(tmp_path, "--sections", "golden,decode_step",
                            KVSERVE_CACHE=str(cache))
    assert proc.returncode == 1, proc.stderr
    for name in ("golden", "decode_step"):
        reason = data["sections"][name]["reason"]
        assert "never downloads" in reason and "--assemble-gguf" in reason
        assert "--split-gguf" in reason and "--model PATH" in reason
    assert not cache.exists()  # no fetch was even started


# --------------------------------------------------------------------------- verdicts


def _fake_sections(monkeypatch, gc, sections):
    monkeypatch.setattr(gc, "SECTIONS", sections)
    monkeypatch.setattr(sys, "setswitchinterval", lambda _: None)  # the simulator's, not ours


def test_a_raising_section_fails_the_run_and_is_written_at_once(gc, tmp_path, monkeypatch):
    out = tmp_path / "r.json"
    on_disk = {}

    def boom(check):
        raise RuntimeError("kaput\nsecond line")

    def after(check):
        on_disk.update(json.loads(out.read_text()))
        return {"read": True}
    _fake_sections(monkeypatch, gc, [("first", lambda c: {"x": 1}), ("boom", boom),
                                     ("after", after)])
    assert gc.main(["--out", str(out)]) == 1
    seen = on_disk["sections"]
    assert seen["boom"]["status"] == "error" and seen["boom"]["reason"] == "RuntimeError: kaput"
    assert seen["after"]["status"] == "running"  # a run killed here would say so
    assert on_disk["summary"]["ok"] is False and on_disk["summary"]["finished"] is False
    final = json.loads(out.read_text())
    assert [final["sections"][n]["status"] for n in ("first", "boom", "after")] == [
        "passed", "error", "passed"]
    assert "Traceback" in final["sections"]["boom"]["traceback"]
    assert final["sections"]["first"]["data"] == {"x": 1}
    assert {"started", "ended", "start_s", "end_s", "seconds"} <= set(final["sections"]["first"])
    assert final["summary"]["ok"] is False and final["summary"]["error"] == ["boom"]


def test_a_failed_environment_skips_the_rest_at_once(gc, tmp_path, monkeypatch):
    """Issue 46, item 6: fail fast. Once the first section (environment,
    with the start-up probe) fails, nothing else runs: each later section is
    skipped naming why."""
    ran = []

    def no_gpu(check):
        raise gc.SectionFailed("the CUDA probe failed: no NVVM", {"numpy": "2.5.2"})
    _fake_sections(monkeypatch, gc, [("environment", no_gpu),
                                     ("golden", lambda c: ran.append("golden") or {})])
    out = tmp_path / "r.json"
    assert gc.main(["--out", str(out)]) == 1
    sections = json.loads(out.read_text())["sections"]
    assert sections["environment"]["status"] == "failed" and ran == []
    assert sections["golden"] == {"status": "skipped", "reason": "environment failed: the CUDA "
                                                                 "probe failed: no NVVM"}


def test_every_section_passed_is_ok(gc, tmp_path, monkeypatch):
    _fake_sections(monkeypatch, gc, [("a", lambda c: {}), ("b", lambda c: {})])
    assert gc.main(["--out", str(tmp_path / "r.json")]) == 0
    assert json.loads((tmp_path / "r.json").read_text())["summary"]["ok"] is True


def test_a_failed_verdict_keeps_its_figures(gc, tmp_path, monkeypatch):
    def fails(check):
        raise gc.SectionFailed("too slow", {"tok_s": 3.0})
    _fake_sections(monkeypatch, gc, [("a", fails)])
    assert gc.main(["--out", str(tmp_path / "r.json")]) == 1
    entry = json.loads((tmp_path / "r.json").read_text())["sections"]["a"]
    assert (entry["status"], entry["reason"], entry["data"]) == ("failed", "too slow",
                                                                 {"tok_s": 3.0})


def test_a_skip_fails_unless_allowed(gc, tmp_path, monkeypatch):
    _fake_sections(monkeypatch, gc, [("a", lambda c: {}), ("b", lambda c: {})])
    out = tmp_path / "r.json"
    assert gc.main(["--out", str(out), "--sections", "a"]) == 1
    data = json.loads(out.read_text())
    assert data["sections"]["b"]["status"] == "skipped"
    assert data["summary"]["skipped_not_allowed"] == ["b"]
    assert gc.main(["--out", str(out), "--sections", "a", "--allow-skip", "b"]) == 0
    data = json.loads(out.read_text())
    assert data["allowed_skips"] == ["b"] and data["summary"]["ok"] is True


def test_past_the_budget_sections_are_skipped(gc, tmp_path, monkeypatch):
    _fake_sections(monkeypatch, gc, [("a", lambda c: {}), ("b", lambda c: {})])
    out = tmp_path / "r.json"
    assert gc.main(["--out", str(out), "--budget-s", "0"]) == 1
    sections = json.loads(out.read_text())["sections"]
    assert all(e["status"] == "skipped" and e["reason"].startswith("time budget")
               for e in sections.values())


def test_unknown_section_names_are_refused(gc, capsys):
    with pytest.raises(SystemExit):
        gc.parse_args(["--sections", "golden,nope"])
    assert "unknown section(s) ['nope']" in capsys.readouterr().err


# --------------------------------------------------------------------------- GGUF parts


@pytest.fixture
def fake_gguf(tmp_path):
    path = tmp_path / "model.gguf"
    path.write_bytes(np.random.default_rng(0).integers(0, 256, 2500, np.uint8).tobytes())
    golden = tmp_path / "smollm2_greedy.json"
    golden.write_text("[]")
    return path, golden


def test_split_and_join_round_trip(gc, tmp_path, fake_gguf):
    path, golden = fake_gguf
    parts = tmp_path / "parts"
    manifest = gc.split_file(path, parts, part_bytes=1000, extras=(golden,))
    assert [p["bytes"] for p in manifest["parts"]] == [834, 834, 832]
    assert all(p["bytes"] <= 1000 for p in manifest["parts"])
    assert [p["name"] for p in manifest["parts"]] == [f"model.gguf.part{i}of3" for i in (1, 2, 3)]
    assert json.loads((parts / "manifest.json").read_text()) == manifest
    assert (parts / golden.name).read_text() == "[]"
    dest = tmp_path / "joined.gguf"
    gc.join_parts(parts, dest)
    assert dest.read_bytes() == path.read_bytes()


@pytest.mark.parametrize("damage, words", [
    (lambda p: p.write_bytes(b"x" + p.read_bytes()[1:]), "SHA-256 differs"),
    (lambda p: p.write_bytes(p.read_bytes()[:-1]), "an incomplete copy"),
    (lambda p: p.unlink(), "is missing"),
])
def test_a_damaged_part_is_refused(gc, tmp_path, fake_gguf, damage, words):
    path, _ = fake_gguf
    parts = tmp_path / "parts"
    gc.split_file(path, parts, part_bytes=1000)
    damage(parts / "model.gguf.part2of3")
    dest = tmp_path / "joined.gguf"
    with pytest.raises(gc.PartsError, match=f"model.gguf.part2of3.*{words}"):
        gc.join_parts(parts, dest)
    assert not dest.exists() and not list(tmp_path.glob(".joined*"))


def test_assemble_refuses_a_corrupted_part_before_converting(gc, tmp_path, fake_gguf, capsys):
    path, _ = fake_gguf
    parts = tmp_path / "parts"
    gc.split_file(path, parts, part_bytes=1000)
    (parts / "model.gguf.part3of3").write_bytes(b"\0" * 832)
    target = tmp_path / "model"
    assert gc.main(["--assemble-gguf", str(parts), "--model", str(target)]) == 1
    assert "model.gguf.part3of3: SHA-256 differs from the manifest" in capsys.readouterr().err
    assert not target.exists()


def test_a_manifest_naming_another_folder_is_refused(gc, tmp_path, fake_gguf):
    path, _ = fake_gguf
    parts = tmp_path / "parts"
    manifest = gc.split_file(path, parts, part_bytes=1000)
    manifest["parts"][0]["name"] = "../elsewhere"
    (parts / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(gc.PartsError, match="a file name with a folder"):
        gc.join_parts(parts, tmp_path / "joined.gguf")


# --------------------------------------------------------------------------- pure pieces


def _entry(tokens):
    return {"case": {"name": "c"}, "prompt_token_ids": [1, 2], "output_token_ids": tokens,
            "output_text": "t", "first_step_top5_ids": [10, 11, 12, 13, 14],
            "first_step_top5_logits": [5.0, 4.0, 3.0, 2.0, 1.0]}


@pytest.mark.parametrize("gap, passes", [(0.1, True), (0.4, False)])
def test_golden_divergence_allowed_only_at_a_near_tie(gc, gap, passes):
    top = [(t, v + 0.05) for t, v in zip([10, 11, 12, 13, 14], [5.0, 4.0, 3.0, 2.0, 1.0])]
    got = gc.Stream(prompt_ids=(1, 2), tokens=[10, 99], finish="length",
                    logprobs=[(10, top), (99, [(99, 3.0), (20, 3.0 - gap)])])
    verdict = gc.judge_golden(_entry([10, 20, 2]), got, tol=0.25)
    assert verdict["top5_ok"] and verdict["first_divergence"] == 1
    assert verdict["pass"] is passes


def _step(gc, step_id, kv_tokens, launches, batch=2):
    return gc.StepRecord(step_id=step_id, seconds=0.004, end=step_id * 0.005,
                         phases={"forward": 0.003}, batch_size=batch, prefill_tokens=0,
                         kv_tokens=kv_tokens, counters=(launches, step_id, 2 * step_id))


def test_step_summary_floor_and_counters(gc):
    steps = [gc.StepRecord(0, 0.01, 0.0, {"forward": 0.01}, 2, 64, 64, (0, 0, 0))]  # prefill
    steps += [_step(gc, i, 66 + 2 * i, 100 * i) for i in range(1, 6)]
    info = {"weights_bytes": 2_000_000, "kv_bytes_per_token": 1000}
    out = gc.step_summary(steps, 2, info, copy_gbs=1.0)  # 1e9 bytes/s
    assert out["decode_steps"] == 5 and out["interval_s"] == pytest.approx(0.005)
    assert out["tok_s"] == pytest.approx(2 / 0.005)  # batch / interval
    assert out["kv_tokens_read"] == 72  # median of 68 .. 76
    assert out["hbm_floor_s"] == pytest.approx((2_000_000 + 72 * 1000) / 1e9)
    assert out["per_step"] == {"launches": 100.0, "h2d": 1.0, "d2h": 2.0, "over_steps": 2}


def test_counters_skip_a_gap_in_the_steps(gc):
    steps = [_step(gc, i, 10, 7 * i) for i in (1, 2, 5, 6, 7)]
    assert gc.step_summary(steps, 2, {}, None)["per_step"]["over_steps"] == 2
    assert gc.step_summary(steps, 2, {}, None)["per_step"]["launches"] == 7.0


def test_every_flag_is_in_the_readme(gc):
    text = (REPO / "tools" / "README.md").read_text(encoding="utf-8")
    start = text.index("## gpu_check.py")
    section = text[start:text.find("\n## ", start + 1)]
    flags = [max(a.option_strings, key=len) for a in gc.build_parser()._actions
             if a.option_strings and a.dest != "help"]
    assert [f for f in flags if f"`{f}" not in section] == []


def test_the_step_recorder_reads_the_cuda_ops_counters(gc):
    """The names it reads are CudaOps's (simulator): launches, h2d, d2h."""
    from types import SimpleNamespace

    from kvserve.cuda.ops import CudaOps

    ops = CudaOps(dtype=np.float32)
    observer = SimpleNamespace(on_step=lambda output, start, end, times=None: SimpleNamespace(
        seconds=end - start, times=SimpleNamespace(as_dict=lambda: {"forward": 0.5}),
        batch_size=1, num_prefill_tokens=0))
    runner = SimpleNamespace(execute=lambda output: ops.to_device(np.ones(3, np.float32)))
    recorder = gc.StepRecorder(SimpleNamespace(core=SimpleNamespace(
        backend=SimpleNamespace(ops=ops), runner=runner), stats=SimpleNamespace(observer=observer)))
    assert recorder.missing == []
    output = SimpleNamespace(step_id=7, scheduled=[SimpleNamespace(start_position=9,
                                                                   num_tokens=1)])
    runner.execute(output)  # the worker's call: the counters are read here
    ops.to_device(np.ones(3, np.float32))  # after the step: not the step's
    observer.on_step(output, 1.0, 2.0)
    (step,) = recorder.steps
    assert (step.step_id, step.kv_tokens, step.seconds) == (7, 10, 1.0)
    assert step.counters[1] == 1  # the step's upload, not the later one
    recorder.reset_counters()
    assert recorder.read() == (0, 0, 0)
