"""Start-up probe of the CUDA stack: can this process really run the cuda backend?

CuPy seeing a device proves little: Numba must find NVVM and libdevice to
compile a kernel, the driver must accept the PTX they emit, and CuPy needs
cuBLAS and NVRTC (wheels only with ``cupy-cuda1Xx[ctk]``). Without the probe
each of these fails deep in loading the model. :func:`probe_cuda` runs the
steps below in order, once per process (about a second, mostly compiling):

==========  ================================================================
step        what it runs
==========  ================================================================
import      ``import cupy``, then ``numba.cuda`` (numba-cuda's when installed)
device      reads the driver's CUDA version and the current device's name,
            memory and compute capability (no device: fails here)
kernel      compiles one tiny ``@cuda.jit`` kernel (NVVM + libdevice: it calls
            ``math.sqrt``) and launches it on CuPy's current stream, as
            ``CudaOps`` launches every kernel
matmul      ``cupy.matmul`` of two 16x16 float16 matrices (cuBLAS)
readback    copies both results to the host and checks every value
==========  ================================================================

The first failure ends the probe; :func:`failure_reason` words it as one line
naming what is missing. Nothing CUDA is imported until the probe runs. Under
Numba's CUDA simulator the probe is not meant to run (the callers in
:mod:`kvserve.cuda.backend` skip it); it fails at ``import`` there.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import re
import time
import types
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import structlog

log = structlog.get_logger(__name__)

#: The probe's steps, in the order they run.
STEPS = ("import", "device", "kernel", "matmul", "readback")

#: Elements the probe kernel writes (one warp); rows = columns of the matmul.
_KERNEL_N = 32
_MATMUL_N = 16

#: A missing shared library (``libcublas.so.12``, ``libnvvm.so``) in an error text.
_LIBRARY = re.compile(r"lib(\w+?)\.so(?:\.(\d+))?")
#: Phrases of "a library or file could not be found or loaded".
_NOT_FOUND = re.compile(r"cannot be found|not found|cannot open shared object|no such file|"
                        r"failure finding|not available|missing|failed to load|"
                        r"could not (?:find|load)", re.IGNORECASE)
#: Numba's "Do `conda install cudatoolkit`:" after "libNVVM cannot be found."
_CONDA_ADVICE = re.compile(r"\s*Do `conda install[^`]*`:?")


@dataclass(frozen=True)
class ProbeResult:
    """What :func:`probe_cuda` found.

    ``step`` is the failing step (one of :data:`STEPS`) and ``reason`` one
    line saying what is missing, both ``None``/empty when ``ok``. The device
    fields are filled as far as the probe got (``None`` before the device
    step): ``memory_bytes`` is the device's total memory, ``driver_cuda`` the
    newest CUDA version the driver supports (``"13.0"``).
    """

    ok: bool
    step: str | None
    reason: str
    seconds: float
    device: str | None = None
    memory_bytes: int | None = None
    compute_capability: tuple[int, int] | None = None
    driver_cuda: str | None = None

    def describe(self) -> str:
        """One line for the start-up log."""
        if not self.ok:
            return f"CUDA probe failed at {self.step} ({self.seconds:.2f} s): {self.reason}"
        cc = ".".join(map(str, self.compute_capability or ()))
        return (f"CUDA probe passed in {self.seconds:.2f} s: {self.device}, "
                f"{(self.memory_bytes or 0) / 2**30:,.1f} GiB, compute capability {cc}, "
                f"driver CUDA {self.driver_cuda}")


class ProbeFailure(RuntimeError):
    """A failure the probe words itself: its message is the reason."""


@dataclass
class _State:
    """What the steps hand on to the next ones."""

    cupy: Any = None
    cuda: Any = None
    driver_version: int | None = None
    device: str | None = None
    memory_bytes: int | None = None
    compute_capability: tuple[int, int] | None = None
    kernel_out: Any = None
    matmul_out: Any = None
    matmul_expected: np.ndarray | None = None

    def result(self, step: str | None, reason: str, t0: float) -> ProbeResult:
        return ProbeResult(ok=step is None, step=step, reason=reason,
                           seconds=time.perf_counter() - t0, device=self.device,
                           memory_bytes=self.memory_bytes,
                           compute_capability=self.compute_capability,
                           driver_cuda=cuda_version_text(self.driver_version))


def cuda_version_text(version: int | None) -> str | None:
    """``12020`` (CUDA's ``major * 1000 + minor * 10``) -> ``"12.2"``; None for
    None or 0 (no driver)."""
    if not version:
        return None
    return f"{version // 1000}.{version % 1000 // 10}"


def _import_libraries(state: _State) -> None:
    from numba import config as numba_config

    if numba_config.ENABLE_CUDASIM:
        raise ProbeFailure("numba.cuda is Numba's CUDA simulator (NUMBA_ENABLE_CUDASIM=1), "
                           "not a GPU")
    try:
        import cupy
    except ModuleNotFoundError as exc:
        if exc.name != "cupy":
            raise
        raise ProbeFailure("CuPy is not installed: pip install -e '.[cuda12]' (CUDA 12 driver) "
                           "or '.[cuda13]' (CUDA 13)") from None
    from numba import cuda

    state.cupy, state.cuda = cupy, cuda


def _read_device(state: _State) -> None:
    runtime = state.cupy.cuda.runtime
    state.driver_version = runtime.driverGetVersion()
    if runtime.getDeviceCount() == 0:
        raise ProbeFailure("no CUDA device: CuPy sees none")
    device = state.cupy.cuda.Device()
    props = runtime.getDeviceProperties(device.id)
    name = props["name"]
    state.device = name.decode() if isinstance(name, bytes) else str(name)
    state.memory_bytes = int(props["totalGlobalMem"])
    state.compute_capability = (int(props["major"]), int(props["minor"]))


def _odd_numbers(out):  # the probe kernel: out[i] = 2i + 1, through libdevice's sqrt
    i = cuda.grid(1)  # noqa: F821 - ``cuda`` is bound by _probe_kernel (a lazy import)
    if i < out.shape[0]:
        out[i] = math.sqrt(float(4 * i * i)) + 1.0


def _probe_kernel(cuda: Any) -> Any:
    """``cuda.jit`` of :func:`_odd_numbers` with ``cuda`` as its global (Numba
    and its simulator both read a kernel's ``cuda`` from its globals; this
    module does not import numba.cuda at import time)."""
    scope = {"cuda": cuda, "math": math, "__name__": __name__}
    return cuda.jit(types.FunctionType(_odd_numbers.__code__, scope, "probe_odd_numbers"))


def _launch_kernel(state: _State) -> None:
    cupy, cuda = state.cupy, state.cuda
    out = cupy.zeros(_KERNEL_N, dtype=cupy.float32)
    stream = cuda.external_stream(cupy.cuda.get_current_stream().ptr)
    _probe_kernel(cuda)[1, _KERNEL_N, stream](out)
    state.kernel_out = out


def _matmul(state: _State) -> None:
    cupy = state.cupy
    a = (np.arange(_MATMUL_N**2) % 5).reshape(_MATMUL_N, _MATMUL_N).astype(np.float16)
    b = (np.arange(_MATMUL_N**2) % 3).reshape(_MATMUL_N, _MATMUL_N).astype(np.float16)
    # Sums of 16 products of at most 4 x 2: exact in float16 whatever cuBLAS accumulates in.
    state.matmul_expected = a.astype(np.float32) @ b.astype(np.float32)
    state.matmul_out = cupy.matmul(cupy.asarray(a), cupy.asarray(b))


def _check_results(state: _State) -> None:
    got = state.cupy.asnumpy(state.kernel_out)
    want = 2 * np.arange(_KERNEL_N, dtype=np.float32) + 1
    if not np.array_equal(got, want):
        raise ProbeFailure(f"the probe kernel wrote wrong values: {got[:4].tolist()}..., "
                           f"expected {want[:4].tolist()}...")
    product = state.cupy.asnumpy(state.matmul_out).astype(np.float32)
    if not np.array_equal(product, state.matmul_expected):
        wrong = int((product != state.matmul_expected).sum())
        raise ProbeFailure(f"cupy.matmul (cuBLAS, float16) got {wrong} of "
                           f"{product.size} values wrong")


def _steps() -> list[tuple[str, Callable[[_State], None]]]:
    """The steps (names of :data:`STEPS`), looked up when the probe runs."""
    return [("import", _import_libraries), ("device", _read_device),
            ("kernel", _launch_kernel), ("matmul", _matmul), ("readback", _check_results)]


def run_probe() -> ProbeResult:
    """Run the steps of :data:`STEPS` now (uncached; :func:`probe_cuda` caches).

    Never raises for a failing step (``Exception``): the result says which
    step failed and why (:func:`failure_reason`).
    """
    state = _State()
    t0 = time.perf_counter()
    for step, run in _steps():
        try:
            run(state)
        except Exception as exc:  # noqa: BLE001 - every failure becomes one line
            return state.result(step, failure_reason(step, exc, state.driver_version), t0)
    return state.result(None, "", t0)


@functools.cache
def probe_cuda() -> ProbeResult:
    """The probe's result, run on the first call of the process and logged
    (``cuda_probe``, with its seconds); later calls return the same result.
    ``probe_cuda.cache_clear()`` forgets it (tests)."""
    result = run_probe()
    fields = {k: v for k, v in dataclasses.asdict(result).items() if v not in (None, "")}
    log.info("cuda_probe", message=result.describe(), **fields)
    return result


def failure_reason(step: str, exc: BaseException, driver_version: int | None = None) -> str:
    """One line saying what a probe step's exception means and what to install.

    Recognised, in this order: the probe's own :class:`ProbeFailure` (its
    message); no driver (``driver_version`` 0, Numba's "CUDA driver library
    cannot be found"); NVVM or libdevice not found (numba-cuda's ``NvvmSupportError``,
    "Missing libdevice file"): install ``numba-cuda[cu12|cu13]``; a driver
    too old for the PTX (``CUDA_ERROR_UNSUPPORTED_PTX_VERSION``, code 222)
    or for CuPy's runtime (``cudaErrorInsufficientDriver``); cuBLAS or NVRTC
    not found (``libcublas.so.12: cannot open shared object file``): install
    ``cupy-cuda1Xx[ctk]`` (NVRTC at the kernel step: numba-cuda's extra); no
    device (``cudaErrorNoDevice``, ``CUDA_ERROR_NO_DEVICE``); anything else
    as its type and first line. ``driver_version`` (``12020``) picks
    cu12/cu13 and is quoted when the driver is too old.
    """
    if isinstance(exc, ProbeFailure):
        return _first_line(str(exc)) or "ProbeFailure"
    failure = _Failure.of(step, exc, driver_version)
    for rule in (_no_driver, _numpy_too_new, _nvvm_missing, _driver_too_old, _library_missing,
                 _no_device):
        reason = rule(failure)
        if reason:
            return reason
    return failure.where


@dataclass(frozen=True)
class _Failure:
    """An exception of a probe step, as :func:`failure_reason`'s rules read it."""

    step: str
    exc: BaseException
    text: str
    where: str
    """``"TypeName: first line"``."""
    missing: bool
    """The text says a library or file could not be found or loaded."""
    driver: str | None
    """The driver's CUDA version, ``"12.2"``."""
    no_driver: bool
    """CuPy read the driver's version as 0: there is no driver."""
    soname_major: str | None
    """``"12"`` of ``libcublas.so.12`` in the text."""
    major: str | None
    """The CUDA major version to install for: the driver's, else the soname's."""

    @classmethod
    def of(cls, step: str, exc: BaseException, driver_version: int | None) -> _Failure:
        text = str(exc)
        library = _LIBRARY.search(text)
        soname = library.group(2) if library else None
        major = (str(driver_version // 1000) if driver_version
                 else soname if soname in ("12", "13") else None)
        where = f"{type(exc).__name__}: {_first_line(text) or '(no message)'}"
        return cls(step, exc, text, where, _NOT_FOUND.search(text) is not None,
                   cuda_version_text(driver_version), driver_version == 0, soname, major)

    def mentions(self, word: str) -> bool:
        return word.lower() in self.text.lower()

    @property
    def cu(self) -> str:
        """numba-cuda's extra: ``cu12``, ``cu13``, or ``cu12|cu13`` when unknown."""
        return f"cu{self.major}" if self.major else "cu12|cu13"


def _numpy_too_new(f: _Failure) -> str | None:
    if isinstance(f.exc, AttributeError) and f.mentions("numpy") and f.mentions("has no attribute"):
        import numpy as np

        return (f"numba-cuda does not support this NumPy ({np.__version__}: {f.where}): "
                "pip install 'numpy<2.5' (kvserve's cuda12 / cuda13 extras pin it)")
    return None


def _nvvm_missing(f: _Failure) -> str | None:
    if type(f.exc).__name__ == "NvvmSupportError" or (
            f.missing and (f.mentions("nvvm") or f.mentions("libdevice"))):
        return (f"NVVM/libdevice not found, so Numba cannot compile a kernel ({f.where}): "
                f"install numba-cuda[{f.cu}] (NVVM)")
    return None


def _driver_too_old(f: _Failure) -> str | None:
    driver = f"CUDA {f.driver}" if f.driver else "version unknown"
    if f.mentions("UNSUPPORTED_PTX_VERSION") or _error_code(f.exc) == 222:
        return (f"the NVIDIA driver ({driver}) is too old for the PTX Numba generated "
                f"(CUDA_ERROR_UNSUPPORTED_PTX_VERSION): update the driver, or install the "
                f"numba-cuda[{f.cu}] and cuda-toolkit of a CUDA no newer than the driver's")
    if f.mentions("cudaErrorInsufficientDriver") or f.mentions("CUDA_ERROR_INSUFFICIENT_DRIVER"):
        return (f"the NVIDIA driver ({driver}) is missing or too old for CuPy's CUDA runtime "
                f"({f.where}): update the driver, or install the CuPy of the driver's CUDA")
    return None


def _library_missing(f: _Failure) -> str | None:
    if not f.missing:
        return None
    for lib, name in (("cublas", "cuBLAS"), ("nvrtc", "NVRTC")):
        if f.mentions(lib):
            if lib == "nvrtc" and f.step == "kernel":
                return f"NVRTC not found at the kernel step ({f.where}): install numba-cuda[{f.cu}]"
            x = f.soname_major or f.major or "1X"
            return f"{name} not found ({f.where}): install cupy-cuda{x}x[ctk]"
    return None


def _no_driver(f: _Failure) -> str | None:
    if f.no_driver or f.mentions("CUDA driver library cannot be found") or (
            f.missing and f.mentions("libcuda.so")):
        return f"no NVIDIA driver: libcuda.so cannot be found ({f.where})"
    return None


def _no_device(f: _Failure) -> str | None:
    if any(f.mentions(s) for s in ("cudaErrorNoDevice", "CUDA_ERROR_NO_DEVICE",
                                   "no CUDA-capable device")):
        return f"no CUDA device ({f.where})"
    return None


def _first_line(text: str) -> str:
    """The first non-blank line of ``text``, stripped (with the next one when
    it ends in a colon, as Numba's "Error at driver init:" does), without
    Numba's advice to ``conda install`` (the reason says what to pip install)."""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    line = " ".join(lines[:2]) if len(lines) > 1 and lines[0].endswith(":") else "".join(lines[:1])
    return _CONDA_ADVICE.sub("", line)


def _error_code(exc: BaseException) -> int | None:
    """The CUDA error code of a numba ``CudaAPIError`` (an int, or a
    ``CUresult`` enum in numba-cuda), else None."""
    code = getattr(exc, "code", None)
    try:
        return int(code) if code is not None else None
    except (TypeError, ValueError):
        return None
