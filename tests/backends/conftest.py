"""The ``backend_ops`` fixture: every registered backend (``kvserve.model.backend``),
in every dtype its configuration accepts.

A backend joins the conformance suite by registering
(``register_backend``): the fixture builds it the way the engine does,
``create_backend(EngineConfig(backend=name, dtype=dtype))``. Today: ``cpu``
(float32), ``cuda`` (float32 and float16; under Numba's CUDA simulator on a
machine without a GPU, ``NUMBA_ENABLE_CUDASIM=1`` from ``tests/conftest.py``).
A backend that cannot run on this machine is skipped, saying why.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest

from kvserve.config import EngineConfig
from kvserve.model.backend import BackendUnavailable, create_backend, registered_backends
from kvserve.model.ops import Ops

#: Relative error allowed in float32 (max |out - ref| / max |ref|): float32
#: accumulation over at most a few dozen terms.
F32_REL = 1e-5
#: In float16: the references are computed from the float16-rounded inputs,
#: so what remains is the float32 computation plus one rounding of each
#: output to float16, half an ulp (2**-11 of the element).
F16_REL = 2.0**-11 + F32_REL
#: GIL switch interval while a simulated CUDA backend runs: the simulator
#: runs each CUDA thread as a Python thread and polls its barriers (see
#: ``tests/cuda/conftest.py``).
SIMULATOR_SWITCH_INTERVAL_S = 2e-4


def _params() -> list[tuple[str, str]]:
    """(backend, dtype) pairs the configuration accepts (``EngineConfig``
    refuses, e.g., a float16 CPU backend). A registered backend it accepts
    in no dtype gets the pair (name, ``UNCONFIGURABLE``), which fails."""
    pairs = []
    for name in registered_backends():
        dtypes = []
        for dtype in ("float32", "float16"):
            try:
                EngineConfig(model="unused", backend=name, dtype=dtype)
            except ValueError:
                continue
            dtypes.append(dtype)
        pairs += [(name, dtype) for dtype in dtypes or [UNCONFIGURABLE]]
    return pairs


@dataclass
class BackendUnderTest:
    """A backend's ops with what a test compares them by."""

    name: str
    ops: Ops
    dtype: np.dtype
    simulated: bool

    @property
    def rel(self) -> float:
        """The relative error allowed for this dtype (``F32_REL``, ``F16_REL``)."""
        return F16_REL if self.dtype == np.float16 else F32_REL

    def to(self, array: np.ndarray) -> Any:
        """``ops.to_device``."""
        return self.ops.to_device(np.asarray(array))

    def back(self, array: Any) -> np.ndarray:
        """``ops.to_numpy``."""
        return self.ops.to_numpy(array)

    def rounded(self, array: np.ndarray) -> np.ndarray:
        """``array`` as the backend stores it (rounded to its dtype), in float64."""
        return np.asarray(array, dtype=self.dtype).astype(np.float64)


#: The dtype of a registered backend that ``EngineConfig`` refuses in every dtype.
UNCONFIGURABLE = "unconfigurable"
_BUILT: dict[tuple[str, str], BackendUnderTest | str] = {}


def _build(name: str, dtype: str) -> BackendUnderTest | str:
    """The backend, built once per session, or why it cannot run here."""
    if (name, dtype) not in _BUILT:
        try:
            backend = create_backend(EngineConfig(model="unused", backend=name, dtype=dtype))
        except BackendUnavailable as exc:
            _BUILT[name, dtype] = f"{name} cannot run here: {exc}"
        else:
            _BUILT[name, dtype] = BackendUnderTest(name, backend.ops, np.dtype(backend.dtype),
                                                   bool(getattr(backend, "simulated", False)))
    return _BUILT[name, dtype]


@pytest.fixture(params=_params(), ids=lambda pair: "-".join(pair))
def backend_ops(request) -> BackendUnderTest:
    """One registered backend's ops (see the module doc)."""
    name, dtype = request.param
    if dtype == UNCONFIGURABLE:
        pytest.fail(f"backend {name!r} is registered but EngineConfig accepts it in no dtype "
                    "(kvserve.config.EngineConfig checks backend names)")
    built = _build(name, dtype)
    if isinstance(built, str):
        pytest.skip(built)
    if not built.simulated:
        yield built
        return
    previous = sys.getswitchinterval()
    sys.setswitchinterval(SIMULATOR_SWITCH_INTERVAL_S)
    yield built
    sys.setswitchinterval(previous)
