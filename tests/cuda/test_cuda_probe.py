"""The CUDA start-up probe (``kvserve.cuda.probe``) without a GPU (issue 26, item 2).

The steps run for real under Numba's CUDA simulator, with NumPy standing in
for CuPy; each failure is a step monkeypatched to raise what the real
library raises (numba-cuda's ``NvvmSupportError``, CuPy's
``CUDARuntimeError``, a cuBLAS import error, a ``CudaAPIError`` 222), checked
for its one-line reason. Then what the backends do with the result: ``auto``
falls back to the CPU with one warning, ``cuda`` is refused in one line, and
on a machine without CuPy ``auto`` imports nothing CUDA.
"""

from __future__ import annotations

import enum
import importlib.util
import os
import subprocess
import sys
import types

import numpy as np
import pytest
from numba import cuda
from structlog.testing import capture_logs

from kvserve.config import EngineConfig
from kvserve.cuda import backend as cuda_backend
from kvserve.cuda import probe
from kvserve.model.backend import BackendUnavailable, create_backend, resolve_backend


# What the libraries raise, as they define it (numba.cuda.cudadrv.error and
# .driver, cupy_backends.cuda.api.runtime): the probe reads type names and
# messages only, so these stand in without the libraries installed.
class NvvmSupportError(ImportError):
    pass


class CudaAPIError(Exception):
    def __init__(self, code, msg):
        self.code, self.msg = code, msg
        super().__init__(code, msg)

    def __str__(self):
        return f"[{self.code}] {self.msg}"


class CUDARuntimeError(RuntimeError):
    pass


class CudaSupportError(ImportError):
    pass


class CUresult(enum.IntEnum):
    """numba-cuda's error codes are cuda.bindings' ``CUresult`` enum."""

    CUDA_ERROR_UNSUPPORTED_PTX_VERSION = 222


def _fake_cupy(device_count: int = 1, driver: int = 13000, matmul=np.matmul,
               count_error: Exception | None = None):
    """NumPy dressed as the parts of CuPy the probe uses (an H200's
    properties); ``count_error``: what ``getDeviceCount`` raises."""
    props = {"name": b"NVIDIA H200", "totalGlobalMem": 150_000_000_000, "major": 9, "minor": 0}

    def device_count_or_raise():
        if count_error is not None:
            raise count_error
        return device_count

    runtime = types.SimpleNamespace(driverGetVersion=lambda: driver,
                                    getDeviceCount=device_count_or_raise,
                                    getDeviceProperties=lambda i: props)
    return types.SimpleNamespace(
        zeros=np.zeros, float32=np.float32, asarray=np.asarray, asnumpy=np.asarray,
        matmul=matmul,
        cuda=types.SimpleNamespace(runtime=runtime, Device=lambda: types.SimpleNamespace(id=0),
                                   get_current_stream=lambda: types.SimpleNamespace(ptr=0)))


@pytest.fixture
def simulated(monkeypatch):
    """The probe's import step replaced: CuPy is ``_fake_cupy()``, numba.cuda
    the simulator (given the ``external_stream`` it lacks); returns a setter
    for another fake CuPy. The probe's cache is cleared before and after."""
    monkeypatch.setattr(cuda, "external_stream", lambda ptr: cuda.stream(), raising=False)
    fake = {"cupy": _fake_cupy()}

    def import_libraries(state):
        state.cupy, state.cuda = fake["cupy"], cuda

    monkeypatch.setattr(probe, "_import_libraries", import_libraries)
    probe.probe_cuda.cache_clear()
    yield lambda cupy: fake.update(cupy=cupy)
    probe.probe_cuda.cache_clear()


def _raise(exc):
    def step(state):
        raise exc
    return step


def test_every_step_passes_on_the_simulator_and_reports_the_device(simulated):
    result = probe.run_probe()
    assert result.ok and result.step is None and result.reason == "", result
    assert result.device == "NVIDIA H200" and result.memory_bytes == 150_000_000_000
    assert result.compute_capability == (9, 0) and result.driver_cuda == "13.0"
    assert result.seconds > 0  # measured; how long it took is no test's business
    assert result.describe().startswith("CUDA probe passed in ")
    assert "NVIDIA H200, 139.7 GiB, compute capability 9.0, driver CUDA 13.0" in result.describe()


def test_a_wrong_matmul_value_fails_the_readback(simulated):
    simulated(_fake_cupy(matmul=lambda a, b: np.matmul(a, b) + np.eye(16, dtype=a.dtype)))
    result = probe.run_probe()
    assert (result.ok, result.step) == (False, "readback")
    assert result.reason == "cupy.matmul (cuBLAS, float16) got 16 of 256 values wrong"


def test_a_wrong_kernel_value_fails_the_readback(simulated, monkeypatch):
    monkeypatch.setattr(probe, "_probe_kernel", lambda cuda: _NoOpKernel())
    result = probe.run_probe()
    assert (result.ok, result.step) == (False, "readback")
    assert result.reason.startswith("the probe kernel wrote wrong values: [0.0, 0.0, 0.0, 0.0]")


class _NoOpKernel:
    def __getitem__(self, config):
        return lambda out: None


def test_no_device_fails_at_the_device_step(simulated):
    simulated(_fake_cupy(device_count=0))
    result = probe.run_probe()
    assert (result.ok, result.step, result.reason) == (False, "device",
                                                       "no CUDA device: CuPy sees none")
    assert result.driver_cuda == "13.0" and result.device is None


#: (step, exception, what the one-line reason must say), the driver at CUDA 12.4.
FAILURES = [
    ("kernel", NvvmSupportError("libNVVM cannot be found. Do `conda install cudatoolkit`:\n"
                                "libnvvm.so: cannot open shared object file: No such file "
                                "or directory"),
     "NVVM/libdevice not found, so Numba cannot compile a kernel (NvvmSupportError: libNVVM "
     "cannot be found. libnvvm.so: cannot open shared object file: No such file or directory)"
     ": install numba-cuda[cu12] (NVVM)"),
    ("kernel", RuntimeError("Missing libdevice file.\nPlease ensure you have a CUDA Toolkit "
                            "11.2 or higher.\nFor CUDA 12, ``cuda-nvcc`` and ``cuda-nvrtc`` "
                            "are required:"),
     "NVVM/libdevice not found, so Numba cannot compile a kernel (RuntimeError: Missing "
     "libdevice file.): install numba-cuda[cu12] (NVVM)"),
    ("kernel", CudaAPIError(222, "Call to cuModuleLoadDataEx results in "
                                 "CUDA_ERROR_UNSUPPORTED_PTX_VERSION"),
     "the NVIDIA driver (CUDA 12.4) is too old for the PTX Numba generated "
     "(CUDA_ERROR_UNSUPPORTED_PTX_VERSION): update the driver, or install the "
     "numba-cuda[cu12] and cuda-toolkit of a CUDA no newer than the driver's"),
    ("kernel", CudaAPIError(CUresult.CUDA_ERROR_UNSUPPORTED_PTX_VERSION,
                            "Call to cuLinkAddData failed"),
     "the NVIDIA driver (CUDA 12.4) is too old for the PTX"),
    ("kernel", ImportError("libnvrtc.so.12: cannot open shared object file: No such file or "
                           "directory"),
     "NVRTC not found at the kernel step (ImportError: libnvrtc.so.12: cannot open shared "
     "object file: No such file or directory): install numba-cuda[cu12]"),
    ("matmul", ImportError("libcublas.so.12: cannot open shared object file: No such file or "
                           "directory"),
     "cuBLAS not found (ImportError: libcublas.so.12: cannot open shared object file: No such "
     "file or directory): install cupy-cuda12x[ctk]"),
    ("matmul", RuntimeError("CuPy failed to load libnvrtc.so.13: OSError: libnvrtc.so.13: "
                            "cannot open shared object file: No such file or directory"),
     "NVRTC not found (RuntimeError: CuPy failed to load libnvrtc.so.13: OSError: "
     "libnvrtc.so.13: cannot open shared object file: No such file or directory): "
     "install cupy-cuda13x[ctk]"),
    ("device", CUDARuntimeError("cudaErrorNoDevice: no CUDA-capable device is detected"),
     "no CUDA device (CUDARuntimeError: cudaErrorNoDevice: no CUDA-capable device is "
     "detected)"),
    ("device", CUDARuntimeError("cudaErrorInsufficientDriver: CUDA driver version is "
                                "insufficient for CUDA runtime version"),
     "the NVIDIA driver (CUDA 12.4) is missing or too old for CuPy's CUDA runtime"),
    ("kernel", CudaSupportError("Error at driver init: \n\nCUDA driver library cannot be "
                                "found.\nIf you are sure that a CUDA driver is installed,"),
     "no NVIDIA driver: libcuda.so cannot be found (CudaSupportError: Error at driver init: "
     "CUDA driver library cannot be found.)"),
    # numba-cuda 0.30.4 compiling beside NumPy 2.5 without kvserve.cuda's shim
    ("kernel", AttributeError("module 'numpy' has no attribute 'row_stack'"),
     "numba-cuda does not support this NumPy ("),
    ("readback", CudaAPIError(700, "Call to cuMemcpyDtoH results in "
                                   "CUDA_ERROR_ILLEGAL_ADDRESS\nmore detail"),
     "CudaAPIError: [700] Call to cuMemcpyDtoH results in CUDA_ERROR_ILLEGAL_ADDRESS"),
]


@pytest.mark.parametrize("step, exc, reason", FAILURES,
                         ids=[f"{s}-{type(e).__name__}-{i}" for i, (s, e, _) in
                              enumerate(FAILURES)])
def test_each_failure_is_one_line_naming_what_is_missing(simulated, monkeypatch, step, exc,
                                                        reason):
    if step == "device":  # CuPy's device count raises, after the driver's version is read
        simulated(_fake_cupy(driver=12040, count_error=exc))
    else:
        simulated(_fake_cupy(driver=12040))
        monkeypatch.setattr(probe, dict(probe._steps())[step].__name__, _raise(exc))
    result = probe.run_probe()
    assert (result.ok, result.step) == (False, step)
    assert result.reason.startswith(reason), result.reason
    assert "\n" not in result.reason
    assert result.driver_cuda == "12.4"
    assert result.device == (None if step == "device" else "NVIDIA H200")


def test_no_driver_is_named_whatever_failed_then():
    """CuPy's wheel without a driver: ``driverGetVersion()`` is 0 and the
    device count raises cudaErrorInsufficientDriver (seen with cupy-cuda12x
    14.2 on a machine without a GPU)."""
    exc = CUDARuntimeError("cudaErrorInsufficientDriver: CUDA driver version is insufficient "
                           "for CUDA runtime version")
    assert probe.failure_reason("device", exc, driver_version=0) == (
        "no NVIDIA driver: libcuda.so cannot be found (CUDARuntimeError: "
        "cudaErrorInsufficientDriver: CUDA driver version is insufficient for CUDA runtime "
        "version)")


def test_without_a_known_driver_the_advice_names_both_cuda_generations():
    exc = NvvmSupportError("libNVVM is not available")
    assert probe.failure_reason("kernel", exc).endswith("install numba-cuda[cu12|cu13] (NVVM)")
    exc = ImportError("Failure finding \"libcublas.so\": not found in site-packages")
    assert probe.failure_reason("matmul", exc).endswith("install cupy-cuda1Xx[ctk]")


def test_the_import_step_names_a_missing_cupy_and_the_simulator(monkeypatch):
    from numba import config as numba_config

    assert probe.failure_reason("import", probe.ProbeFailure("x\ny")) == "x"
    with pytest.raises(probe.ProbeFailure, match="Numba's CUDA simulator"):
        probe._import_libraries(probe._State())
    monkeypatch.setattr(numba_config, "ENABLE_CUDASIM", 0)
    monkeypatch.setitem(sys.modules, "cupy", None)  # `import cupy` fails as if absent
    result = probe.run_probe()
    assert (result.ok, result.step) == (False, "import")
    assert result.reason == ("CuPy is not installed: pip install -e '.[cuda12]' (CUDA 12 "
                             "driver) or '.[cuda13]' (CUDA 13)")


def test_the_probe_runs_once_per_process_and_logs_its_seconds(simulated, monkeypatch):
    runs = []
    monkeypatch.setattr(probe, "_matmul", lambda state: runs.append(1) or _matmul(state))
    with capture_logs() as logs:
        first, second = probe.probe_cuda(), probe.probe_cuda()
    assert first is second and first.ok and runs == [1]
    [line] = [e for e in logs if e["event"] == "cuda_probe"]
    assert line["log_level"] == "info" and line["seconds"] == first.seconds
    assert line["device"] == "NVIDIA H200" and line["message"] == first.describe()


_matmul = probe._matmul


@pytest.fixture
def failing_probe(simulated, monkeypatch):
    """CuPy installed, the simulator off for the backends' decision, and the
    probe's kernel step failing for want of NVVM."""
    monkeypatch.setattr(cuda_backend, "cupy_installed", lambda: True)
    monkeypatch.setattr(cuda_backend, "simulator_enabled", lambda: False)
    monkeypatch.setattr(probe, "_launch_kernel", _raise(NvvmSupportError(
        "libNVVM cannot be found. Do `conda install cudatoolkit`:\nlibnvvm.so: cannot open")))


def test_auto_falls_back_to_the_cpu_with_one_warning(failing_probe):
    with capture_logs() as logs:
        assert resolve_backend("auto") == "cpu"
    [warning] = [e for e in logs if e["log_level"] == "warning"]
    assert warning["event"] == "cuda_probe_failed" and warning["step"] == "kernel"
    assert warning["reason"].endswith("install numba-cuda[cu13] (NVVM)")
    assert [e["event"] for e in logs] == ["cuda_probe", "cuda_probe_failed"]


def test_backend_cuda_is_refused_in_one_line_when_the_probe_fails(failing_probe):
    with pytest.raises(BackendUnavailable) as raised:
        create_backend(EngineConfig(model="unused", backend="cuda"))
    message = str(raised.value)
    assert "\n" not in message
    assert message.startswith("--backend cuda needs a working CUDA stack; the start-up probe "
                              "failed at kernel: NVVM/libdevice not found")
    assert message.endswith("install numba-cuda[cu13] (NVVM); or use --backend cpu")


def test_auto_picks_cuda_when_the_probe_passes(simulated, monkeypatch):
    monkeypatch.setattr(cuda_backend, "cupy_installed", lambda: True)
    monkeypatch.setattr(cuda_backend, "simulator_enabled", lambda: False)
    with capture_logs() as logs:
        assert resolve_backend("auto") == "cuda"
    assert [e["event"] for e in logs] == ["cuda_probe"]
    cuda_backend.check_available()  # the cached result: no second probe, no error
    assert probe.probe_cuda.cache_info().misses == 1


def test_under_the_simulator_the_probe_does_not_run(monkeypatch):
    monkeypatch.setattr(probe, "run_probe", _raise(AssertionError("the probe ran")))
    monkeypatch.setattr(cuda_backend, "cupy_installed", lambda: True)
    monkeypatch.setattr(cuda_backend, "cuda_device_present", lambda: False)
    probe.probe_cuda.cache_clear()
    cuda_backend.check_available()
    assert resolve_backend("auto") == "cpu"  # today's rule: CuPy sees no device


@pytest.mark.skipif(importlib.util.find_spec("cupy") is not None,
                    reason="CuPy is installed here: auto probes it")
def test_auto_without_cupy_imports_nothing_cuda():
    code = ("import sys\n"
            "from kvserve.model.backend import resolve_backend\n"
            "assert resolve_backend('auto') == 'cpu'\n"
            "print(sorted(m for m in sys.modules if m == 'cupy' or m.startswith('numba.cuda')))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env={**os.environ, "NUMBA_ENABLE_CUDASIM": "0"}, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"
    assert "cuda_probe" not in done.stderr
