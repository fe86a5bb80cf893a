"""Every kernel signature the CUDA backend launches, recorded under the
simulator and compiled by NVVM for real GPUs (issue 46, item 1).

The simulator types nothing: a kernel that runs there may still be refused
by Numba's CUDA target for the argument types ``CudaOps`` passes it (an
int64 where the kernel indexes a local array, a float64 scalar where a
float32 was meant). So while ``tests/cuda`` runs, ``Recorder`` notes each
launch's kernel and the Numba types of its arguments (``numba.typeof``:
what the GPU's dispatcher sees for CuPy arrays of the same dtype, rank and
layout, and for the same Python scalars). ``MANIFEST`` keeps them;
``tests/cuda/conftest.py`` fails the run when a launch is not in it (write
it again with ``KVSERVE_WRITE_LAUNCH_MANIFEST=1``), and
``test_cuda_ptx.py`` compiles every entry for sm_80 and sm_90.

An entry: ``{"kernel": "kvserve.cuda.kernels.rms_norm_kernel",
"args": [{"array": "float32", "ndim": 2, "layout": "C"}, {"scalar":
"float64"}, ...]}``.
"""

from __future__ import annotations

import importlib
import json
from pathlib import Path
from typing import Any

import numpy as np

#: The recorded signatures (sorted, one JSON object a line).
MANIFEST = Path(__file__).resolve().parent / "data" / "launch_signatures.jsonl"
#: The modules that define the backend's kernels.
KERNEL_MODULES = ("kvserve.cuda.kernels", "kvserve.cuda.gemv_kernels")


def describe(value: Any) -> dict:
    """One argument as the JSON object of an entry (see the module's docstring).
    Raises TypeError for an argument that is neither an array nor a scalar."""
    import numba

    value = getattr(value, "_ary", value)  # the simulator's device array holds a NumPy one
    numba_type = numba.typeof(value)
    if isinstance(numba_type, numba.types.Array):
        described = {"array": str(np.dtype(value.dtype)), "ndim": numba_type.ndim,
                     "layout": numba_type.layout}
        if not numba_type.mutable:
            described["readonly"] = True
        return described
    if isinstance(numba_type, (numba.types.Integer, numba.types.Float, numba.types.Boolean)):
        return {"scalar": str(numba_type)}
    raise TypeError(f"a kernel argument of type {numba_type} ({type(value).__name__})")


def numba_type(described: dict) -> Any:
    """The Numba type of an entry's argument (``describe``'s inverse)."""
    from numba import types

    if "scalar" in described:
        name = described["scalar"]
        return types.boolean if name == "bool" else getattr(types, name)
    dtype = numba_from_dtype(np.dtype(described["array"]))
    return types.Array(dtype, described["ndim"], described["layout"],
                       readonly=described.get("readonly", False))


def numba_from_dtype(dtype: np.dtype) -> Any:
    from numba import from_dtype

    return from_dtype(dtype)


def kernel_names() -> dict[int, str]:
    """``id(kernel object) -> "module.name"`` for every kernel of ``KERNEL_MODULES``."""
    names = {}
    for module_name in KERNEL_MODULES:
        module = importlib.import_module(module_name)
        for name, value in vars(module).items():
            if name.endswith("_kernel"):
                names[id(value)] = f"{module_name}.{name}"
    return names


class Recorder:
    """The set of launched signatures, fed by ``CudaOps._launch``'s wrapper."""

    def __init__(self) -> None:
        self.entries: set[str] = set()
        self._names = kernel_names()

    def record(self, kernel: Any, args: tuple) -> None:
        """Note a launch of ``kernel`` with ``args``. Raises KeyError for a
        kernel that no module of ``KERNEL_MODULES`` names."""
        name = self._names[id(kernel)]
        self.entries.add(json.dumps({"kernel": name, "args": [describe(a) for a in args]}))


def read_manifest() -> set[str]:
    """The manifest's entries (empty when it is missing)."""
    if not MANIFEST.exists():
        return set()
    return {line for line in MANIFEST.read_text(encoding="utf-8").splitlines() if line}


def write_manifest(entries: set[str]) -> None:
    MANIFEST.parent.mkdir(parents=True, exist_ok=True)
    MANIFEST.write_text("".join(f"{line}\n" for line in sorted(entries)), encoding="utf-8")
