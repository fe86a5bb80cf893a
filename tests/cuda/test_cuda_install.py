"""The CUDA extras and the install lines of docs/gpu.md agree with
``pyproject.toml`` (issue 26, item 1; the lines moved out of the README in
issue 29): ``cuda12``/``cuda13`` bring numba-cuda with NVVM and CuPy with
cuBLAS/NVRTC, ``cuda`` is ``cuda12``, and the command for an image that
already has CuPy and numba-cuda lists every serving dependency but NumPy and
Numba (which that image has)."""

from __future__ import annotations

import re
import shlex
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
#: What an image with CuPy and numba-cuda preinstalled already has.
IN_A_CUDA_IMAGE = {"numpy", "numba"}


def _project() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]


def _name(requirement: str) -> str:
    return re.split(r"[\[<>=!~; ]", requirement, maxsplit=1)[0].lower().replace("_", "-")


def test_the_cuda_extras_bring_nvvm_and_the_cupy_toolkit_wheels():
    extras = _project()["optional-dependencies"]
    assert extras["cuda"] == ["kvserve[cuda12]"]
    for major in ("12", "13"):
        names = sorted(r.split(">=")[0] for r in extras[f"cuda{major}"])
        # and NumPy below 2.5, which removed np.row_stack that numba-cuda compiles through
        assert names == [f"cupy-cuda{major}x[ctk]", f"numba-cuda[cu{major}]", "numpy<2.5"]


def test_the_gpu_page_installs_what_an_image_with_cupy_lacks():
    text = (ROOT / "docs" / "gpu.md").read_text(encoding="utf-8")
    start = text.index("## Installing for a GPU")
    section = text[start:text.index("\n## ", start + 1)]
    assert "pip install --no-deps -e ." in section
    [line] = [s for s in section.splitlines() if s.startswith("pip install 'safetensors")]
    listed = shlex.split(line)[2:]
    wanted = [r.split(";")[0].strip() for r in _project()["dependencies"]
              if _name(r) not in IN_A_CUDA_IMAGE]
    assert listed == wanted
