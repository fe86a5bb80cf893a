"""Every kernel signature the CUDA backend launches compiles for real GPUs,
with no GPU here (issue 46, item 1).

The simulator types nothing, so a kernel can pass every test of
``tests/cuda`` and still be refused by Numba's CUDA target on the first GPU
run. ``launch_signatures.MANIFEST`` holds each kernel with the argument
types ``CudaOps`` launched it with under the simulator (``tests/cuda/
conftest.py`` fails a run that launches one it lacks); here NVVM compiles
every entry to PTX for sm_80 (A100) and sm_90 (H100, H200), and the PTX
must be of an ISA version the lent machines' CUDA 13.0 driver (580) and
``ptxas`` accept. Where ``ptxas`` is on the machine it assembles each
sm_90 PTX too, and its register, stack-frame and spill figures are printed
(``-s`` shows them) for ``docs/gpu.md``'s model of the step."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from launch_signatures import MANIFEST, read_manifest

pytestmark = pytest.mark.slow

#: The compute capabilities compiled for: A100, H100/H200.
CAPABILITIES = ((8, 0), (9, 0))
#: The newest PTX ISA that CUDA 13.0 (driver 580, the lent machines' and this
#: image's ``ptxas``) accepts; CUDA 13.5's NVVM writes 9.5, which they refuse.
MAX_PTX_ISA = (9, 0)

_SCRIPT = r"""
import importlib, json, re, subprocess, sys, tempfile, types
sys.path.insert(0, sys.argv[1])
from numba import cuda
from numba.cuda import dispatcher
# device functions ask the current device for its compute capability: there is none
dispatcher.get_current_device = lambda: types.SimpleNamespace(compute_capability=(9, 0))
from launch_signatures import numba_type, read_manifest
ptxas = sys.argv[2] or None
for line in sorted(read_manifest()):
    entry = json.loads(line)
    module, name = entry["kernel"].rsplit(".", 1)
    kernel = getattr(importlib.import_module(module), name)
    sig = tuple(numba_type(a) for a in entry["args"])
    for cc in ((8, 0), (9, 0)):
        ptx, _ = cuda.compile_ptx(kernel.py_func, sig, cc=cc)
        version = re.search(r"^\.version (\d+)\.(\d+)", ptx, re.M)
        target = re.search(r"^\.target (\S+)", ptx, re.M)
        row = {"kernel": name, "cc": list(cc), "isa": [int(version[1]), int(version[2])],
               "target": target[1], "args": len(sig)}
        if ptxas and cc == (9, 0):
            with tempfile.NamedTemporaryFile("w", suffix=".ptx") as f:
                f.write(ptx)
                f.flush()
                done = subprocess.run([ptxas, "-arch=sm_90", "-v", f.name, "-o", "/dev/null"],
                                      capture_output=True, text=True)
            row["ptxas_rc"] = done.returncode
            info = done.stderr
            for key, pattern in (("registers", r"Used (\d+) registers"),
                                 ("stack_frame", r"(\d+) bytes stack frame"),
                                 ("spill_stores", r"(\d+) bytes spill stores"),
                                 ("spill_loads", r"(\d+) bytes spill loads")):
                found = re.search(pattern, info)
                row[key] = int(found[1]) if found else None
            if done.returncode:
                row["ptxas_error"] = info[-1500:]
        print(json.dumps(row), flush=True)
"""


def _nvvm_problem(env: dict) -> str | None:
    probe = "from numba.cuda.cudadrv import nvvm; nvvm.NVVM()"
    done = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True,
                          text=True, timeout=300)
    return done.stderr.strip().splitlines()[-1] if done.returncode else None


def test_every_launched_signature_compiles_for_sm80_and_sm90():
    entries = read_manifest()
    assert entries, f"{MANIFEST} is missing or empty"
    env = {**os.environ, "NUMBA_ENABLE_CUDASIM": "0"}
    problem = _nvvm_problem(env)
    if problem:
        pytest.skip(f"NVVM (libnvvm, a CUDA toolkit) not found, cannot compile PTX: {problem}")
    ptxas = shutil.which("ptxas") or ""
    done = subprocess.run([sys.executable, "-c", _SCRIPT, str(Path(__file__).parent), ptxas],
                          env=env, capture_output=True, text=True, timeout=1800)
    assert done.returncode == 0, done.stderr[-4000:]
    rows = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    assert len(rows) == len(entries) * len(CAPABILITIES)
    for row in rows:
        assert row["target"] == f"sm_{row['cc'][0]}{row['cc'][1]}", row
        assert tuple(row["isa"]) <= MAX_PTX_ISA, row
        assert row.get("ptxas_rc", 0) == 0, row
    for row in rows:
        if "registers" in row:
            print(f"{row['kernel']:32} args {row['args']:2}  registers {row['registers']:3}  "
                  f"stack {row['stack_frame']:4}  spills {row['spill_stores']}/"
                  f"{row['spill_loads']}")
