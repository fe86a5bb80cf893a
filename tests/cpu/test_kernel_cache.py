"""The on-disk kernel cache is stamped with what a kernel can inline: a
kernel of ``decode_layer`` is recompiled when ``kernels`` or
``vector_math`` change, not only when its own file does (Numba alone
checks a function's own file; the fused decode step once ran an edited
module's old attention)."""

from __future__ import annotations

import shutil
from pathlib import Path

import kvserve.cpu as cpu
from kvserve.cpu import decode_layer, kernels


def test_a_modules_stamp_covers_the_package_modules_it_imports() -> None:
    imported = cpu._imported_modules(Path(decode_layer.__file__))
    assert {"kernels", "vector_math", "panel_kernels", "block_kernels"} <= imported
    assert "decode_path" not in imported  # the caller of decode_layer, not a callee
    assert cpu._imported_modules(Path(cpu.__file__).parent / "vector_math.py") == set()
    # transitively: decode_layer's stamp moves with vector_math (through kernels too)
    assert cpu.dependency_stamp("decode_layer") != cpu.dependency_stamp("vector_math")


def test_an_edit_moves_the_stamps_of_the_modules_that_import_it(tmp_path: Path) -> None:
    folder = Path(cpu.__file__).parent
    for path in folder.glob("*.py"):
        shutil.copy2(path, tmp_path / path.name)
    before = {m: cpu.dependency_stamp(m, tmp_path) for m in ("decode_layer", "kernels",
                                                             "panel_kernels")}
    with open(tmp_path / "vector_math.py", "a", encoding="utf-8") as f:
        f.write("# an edit\n")
    cpu.dependency_stamp.cache_clear()  # memoized per process: files do not change in one
    after = {m: cpu.dependency_stamp(m, tmp_path) for m in before}
    assert after["kernels"] != before["kernels"]  # imports vector_math
    assert after["decode_layer"] != before["decode_layer"]  # imports it, and kernels
    assert after["panel_kernels"] == before["panel_kernels"]  # imports neither


def test_the_kernels_are_cached_under_the_dependency_stamp() -> None:
    for fn, module in ((decode_layer.decode_layers, "decode_layer"),
                       (kernels._attend_tile, "kernels")):
        locator = fn._cache._impl.locator
        assert type(locator).__name__ == "DependencyStampedLocator"
        own, closure = locator.get_source_stamp()
        assert closure == cpu.dependency_stamp(module)
        assert own  # Numba's own stamp of the file stays in it
