"""The CPU backend: Numba kernels and the ops that call them.

Numba's on-disk cache (``cache=True``) checks each compiled function against
its *own* source file only. A kernel that calls one of another module
(``decode_layer.decode_layers`` calls ``kernels._attend_tile``, and LLVM
inlines it) keeps the callee's old code after that module is edited, and
nothing says so: once, the fused decode step attended with an edited
module's old attention while the op path ran the new one. So the kernels of
this package are cached under a stamp that also covers every module of the
package they import, directly or not (:func:`dependency_stamp`): an edit
recompiles the kernels that can inline the edited code, and only those.
"""

from __future__ import annotations

import ast
import functools
import hashlib
from pathlib import Path

_HERE = Path(__file__).resolve().parent
_PACKAGE = "kvserve.cpu"


def _imported_modules(path: Path, folder: Path = _HERE) -> set[str]:
    """Names of this package's modules (files in ``folder``) that the file at
    ``path`` imports (``from kvserve.cpu.x import ...``, ``from kvserve.cpu
    import x``)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_bytes(), filename=str(path))):
        if not isinstance(node, ast.ImportFrom) or not node.module:
            continue
        if node.module == _PACKAGE:
            names.update(alias.name for alias in node.names)
        elif node.module.startswith(_PACKAGE + "."):
            names.add(node.module[len(_PACKAGE) + 1:].split(".")[0])
    return {name for name in names if (folder / f"{name}.py").exists()}


@functools.lru_cache(maxsize=None)
def dependency_stamp(module: str, folder: Path = _HERE) -> str:
    """SHA-256 (hex) over the bytes of the module ``module`` of this package
    (its files in ``folder``) and of every module of the package it imports,
    directly or not (each once, in name order). Raises FileNotFoundError for
    a module that is not there."""
    seen: set[str] = set()
    todo = [module]
    while todo:
        name = todo.pop()
        if name not in seen:
            seen.add(name)
            todo.extend(_imported_modules(folder / f"{name}.py", folder))
    digest = hashlib.sha256()
    for name in sorted(seen):
        digest.update(name.encode())
        digest.update((folder / f"{name}.py").read_bytes())
    return digest.hexdigest()


def _install_locator() -> None:
    """Put a cache locator first in Numba's list that stamps this package's
    kernels with :func:`dependency_stamp`; for every other file Numba's
    own locators decide. Without the internals it relies on (Numba 0.60 to
    0.68 have them), nothing changes."""
    try:
        from numba.core import caching
        base = caching.InTreeCacheLocator
        locators = caching.CacheImpl._locator_classes
    except (ImportError, AttributeError):  # pragma: no cover - another Numba
        return

    class DependencyStampedLocator(base):
        """Numba's in-tree locator (``__pycache__`` beside the source) whose
        stamp also covers the modules the source imports from this package."""

        def get_source_stamp(self):
            return (super().get_source_stamp(), dependency_stamp(Path(self._py_file).stem))

        @classmethod
        def from_function(cls, py_func, py_file):
            if Path(py_file).resolve().parent != _HERE:
                return None
            return super().from_function(py_func, py_file)

    if not any(loc.__name__ == DependencyStampedLocator.__name__ for loc in locators):
        locators.insert(0, DependencyStampedLocator)


_install_locator()
