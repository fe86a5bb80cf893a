"""The test process's memory: what it holds now and at its peak, and how a
stopped engine's memory is given back before the next one starts (issue 33's
suite bound, ``conftest.MAX_RSS_BYTES``).

Used by ``conftest`` (a collection before each module's first test, and
after growth) and by ``engine_harness.EngineLoop.start`` (a collection
before each engine starts: a test that stops an engine and starts another
held both until CPython's own collection ran)."""

from __future__ import annotations

import gc
import os

#: An engine is a web of reference cycles (its actors and the engine point at
#: each other; the KV cache's free-block list is doubly linked), so a stopped
#: engine's ~1 GiB (weights, KV cache) is freed only by a cyclic collection,
#: which CPython runs when its allocation counters say, not when memory is
#: large: the four engines of ``tests/e2e/test_e2e_faults.py`` (one per test)
#: were all resident at once (3,743 MiB). A collection at the end of a module
#: came too early: the last test's fixture values (engine handles) are
#: dropped only after its teardown, so the module's engines outlived it and
#: ``tests/engine`` reached 3,902 MiB (2,603 MiB collecting before each test).
#: Within a test, an engine stopped and another started (a restart on the
#: same disk tier) were both resident: CI's ``make test`` peaked at 4,258 MiB
#: in ``tests/engine/test_engine_kv_disk.py``, hence the collection in
#: ``EngineLoop.start`` too.
COLLECT_AFTER_GROWTH_BYTES = 512 * 2**20
_LAST_COLLECT: dict = {"rss": 0}


def current_rss_bytes() -> int:
    """This process's resident bytes now (``/proc/self/statm``; 0 where absent)."""
    try:
        with open("/proc/self/statm") as statm:
            return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def peak_rss_bytes() -> tuple[int, int]:
    """``(this process's peak resident bytes, the largest waited-for child's)``
    (``getrusage``'s ``ru_maxrss``: KiB on Linux)."""
    import resource

    return (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
            resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024)


def _libc():
    """glibc through ctypes, or None (another C library)."""
    import ctypes
    import ctypes.util

    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        return libc if hasattr(libc, "malloc_trim") else None
    except OSError:
        return None


_LIBC = _libc()


def collect_garbage() -> None:
    """Free what stopped engines hold (a cyclic collection) and give the
    freed heap back to the OS (glibc's ``malloc_trim``)."""
    gc.collect()
    if _LIBC is not None:
        _LIBC.malloc_trim(0)
    _LAST_COLLECT["rss"] = current_rss_bytes()


def grown_since_the_last_collection() -> bool:
    """Whether the process has grown by ``COLLECT_AFTER_GROWTH_BYTES`` since
    ``collect_garbage`` last ran."""
    return current_rss_bytes() - _LAST_COLLECT["rss"] > COLLECT_AFTER_GROWTH_BYTES


def release_freed_memory_to_the_os() -> None:
    """glibc's malloc raises its mmap threshold each time a large block is
    freed, so after an engine shuts down the next engine's arrays of a few
    MiB come from the heap, which keeps freed memory: each engine started and
    stopped in this process left about 900 MiB behind (measured with
    ``malloc_trim``), and the suite's process reached 14 GiB (issue 33). A
    fixed 1 MiB threshold (larger arrays are their own mappings, returned
    on free) and a trim after each collection keep it to what is alive."""
    if _LIBC is not None:
        _LIBC.mallopt(-3, 1 << 20)  # M_MMAP_THRESHOLD
