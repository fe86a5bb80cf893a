"""The backend registry (``kvserve.model.backend``): backends found by
name, imported only when asked for, ``auto`` by their registered checks."""

from __future__ import annotations

import subprocess
import sys
from types import SimpleNamespace

import pytest

from kvserve.model import backend as registry


@pytest.fixture
def empty_registry(monkeypatch):
    """The registry emptied for one test (the real one restored after)."""
    monkeypatch.setattr(registry, "_REGISTRY", {})


class FakeBackend:
    """A third backend's factory."""

    name = "fake"

    def __init__(self, config) -> None:
        self.config = config


def test_cpu_and_cuda_are_registered_in_that_order():
    assert registry.registered_backends()[:2] == ("cpu", "cuda")


def test_a_registered_factory_builds_its_backend(empty_registry):
    registry.register_backend("fake", FakeBackend)
    config = SimpleNamespace(backend="fake")  # EngineConfig knows the built-in names only
    backend = registry.create_backend(config)
    assert isinstance(backend, FakeBackend) and backend.config is config
    assert registry.resolve_backend("fake") == "fake"


def test_a_lazy_factory_is_imported_only_when_asked_for(empty_registry):
    registry.register_backend("cpu", "kvserve.cpu.backend:CpuBackend")
    registry.register_backend("missing", "kvserve.no_such_module:Backend")
    assert registry.resolve_backend("missing") == "missing"  # nothing imported yet
    config = SimpleNamespace(backend="missing")
    with pytest.raises(ModuleNotFoundError, match="kvserve.no_such_module"):
        registry.create_backend(config)


def test_auto_takes_the_first_backend_whose_check_passes(empty_registry):
    checked = []
    registry.register_backend("cpu", FakeBackend)
    registry.register_backend("no", FakeBackend, auto_check=lambda: checked.append("no"))
    registry.register_backend("yes", FakeBackend, auto_check=lambda: not checked.append("yes"))
    registry.register_backend("later", FakeBackend, auto_check=lambda: checked.append("later"))
    assert registry.resolve_backend("auto") == "yes" and checked == ["no", "yes"]


def test_auto_falls_back_to_the_default_backend(empty_registry):
    registry.register_backend("cpu", FakeBackend)
    registry.register_backend("never", FakeBackend, auto_check=lambda: False)
    assert registry.resolve_backend("auto") == registry.DEFAULT_BACKEND == "cpu"


def test_unknown_names_are_refused(empty_registry):
    registry.register_backend("cpu", FakeBackend)
    with pytest.raises(ValueError, match="backend must be one of auto, cpu, got 'tpu'"):
        registry.resolve_backend("tpu")
    with pytest.raises(ValueError):
        registry.register_backend("auto", FakeBackend)


def test_the_registry_imports_no_backend():
    code = ("import sys\n"
            "import kvserve.model.backend\n"
            "print(sorted(m for m in sys.modules if m.startswith(('kvserve.cpu', 'kvserve.cuda'))))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"
