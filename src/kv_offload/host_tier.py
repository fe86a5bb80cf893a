"""The KV offload tier: a bounded store of KV blocks in host shared memory.

Prefix-cache blocks evicted from an engine's KV cache are saved here under
their block hash (``kvserve.core.block_hash``: SHA-256 of the whole prefix,
equal in every process), and any engine of the node that misses them in its
own cache loads them instead of recomputing them: LMCache's idea, and vLLM's
CPU offloading (``--kv-offloading-size``), shared across replicas.

One file in ``/dev/shm`` (a tmpfs: memory, never disk) holds everything,
mapped by every engine that uses it:

- a header: format, slot count, block shape and dtype, and a fingerprint of
  the model, so an engine of another model or dtype refuses to attach;
- per slot: the block hash, a state (empty / being written / ready), a
  generation bumped on every overwrite, a lease deadline and the time of
  last use (for LRU eviction);
- the slots' K/V: ``dtype[num_slots, *block_shape]``, one block each.

Concurrency: every change to the slot table happens under an exclusive
``flock`` on the file (between processes) and a thread lock (between the
scheduler's and the worker's threads of one engine); K/V bytes are copied
outside the lock. A look-up leases the blocks it finds for
``LEASE_SECONDS``; eviction skips leased slots, so the step that loads them
finds them. Leases are ``time.monotonic()`` deadlines: ``CLOCK_MONOTONIC``
is one clock for all processes of a Linux host. A reader checks the
generation after copying; if the slot was overwritten meanwhile (only
possible once its lease expired) ``read_into`` raises ``BlockLost`` and the
caller fails rather than use the bytes.
"""

from __future__ import annotations

import fcntl
import json
import os
import re
import secrets
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import structlog

from kvserve.core.block_hash import HASH_SIZE

#: How long a look-up keeps the blocks it found from eviction, in seconds.
LEASE_SECONDS = 60.0
_MAGIC = "kvserve-kv-offload-tier"
_VERSION = 1
_HEADER_BYTES = 4096
_PAGE = 4096
_EMPTY, _WRITING, _READY = 0, 1, 2
_NAME = re.compile(r"^kvserve-kv-(\d+)-[0-9a-f]+$")


class BlockLost(RuntimeError):
    """A block the tier held when it was looked up is gone (overwritten)."""


def default_directory() -> Path:
    """``/dev/shm`` where it exists (Linux), else the temp folder."""
    shm = Path("/dev/shm")
    return shm if shm.is_dir() else Path(tempfile.gettempdir())


def check_tier_size(size_bytes: int, directory: Path | None = None) -> None:
    """``ValueError`` when a tier of ``size_bytes`` would not fit in the free
    space of ``directory`` (``/dev/shm`` is memory: a tier larger than it
    fails when first used beyond it, with SIGBUS)."""
    directory = directory or default_directory()
    stat = os.statvfs(directory)
    free = stat.f_bavail * stat.f_frsize
    if size_bytes > free:
        raise ValueError(f"--kv-offloading-size {size_bytes / 2**30:g} GiB does not fit in the "
                         f"{free / 2**30:.1f} GiB free in {directory}")


def remove_stale_tiers(directory: Path) -> list[Path]:
    """Delete tier files left by processes that died without removing them
    (the owner's pid is part of the name). Returns the files deleted."""
    removed = []
    for path in directory.glob("kvserve-kv-*"):
        match = _NAME.match(path.name)
        if match is None or _pid_alive(int(match.group(1))):
            continue
        try:
            path.unlink()
            removed.append(path)
        except OSError:
            pass
    if removed:
        structlog.get_logger("kvserve.offload").info(
            "stale_offload_tiers_removed", paths=[str(p) for p in removed],
            message=f"Removed {len(removed)} KV offload tier file(s) of stopped servers")
    return removed


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class SharedHostTier:
    """A shared-memory store of ``num_slots`` KV blocks keyed by block hash.

    Build with ``create`` (the owner; it deletes the file in ``unlink``) or
    ``attach`` (another engine of the node). ``block_shape`` is one block's
    K/V as the offload connector lays it out:
    ``[num_layers, 2, block_size, num_kv_heads, head_dim]``.

    Attributes:
        path: the file.
        num_slots: blocks it holds at most.
        data: ``dtype[num_slots, *block_shape]``, the slots' K/V (a map of the file).
    """

    def __init__(self, path: Path, fd: int, header: dict) -> None:
        self.path = path
        self._fd = fd
        self._thread_lock = threading.Lock()
        self.num_slots = int(header["num_slots"])
        self.block_shape = tuple(header["block_shape"])
        self.dtype = np.dtype(header["dtype"])
        self.fingerprint = header["fingerprint"]
        s = self.num_slots
        layout = _layout(s, self.block_shape, self.dtype)
        self._map = np.memmap(path, dtype=np.uint8, mode="r+", shape=(layout["total"],))
        self._hashes = self._map[layout["hashes"]:layout["hashes"] + s * HASH_SIZE].reshape(
            s, HASH_SIZE)
        self._keys = self._hashes.view(np.uint64)[:, 0]  # first 8 bytes, for the search
        self._meta = self._map[layout["meta"]:layout["meta"] + s * 16].view(np.int64).reshape(s, 2)
        self._times = self._map[layout["times"]:layout["times"] + s * 16].view(
            np.float64).reshape(s, 2)
        data = self._map[layout["data"]:layout["data"] + s * layout["slot_bytes"]]
        self.data = data.view(self.dtype).reshape(s, *self.block_shape)

    # ------------------------------------------------------------ lifecycle

    @classmethod
    def create(cls, size_bytes: int, block_shape: Sequence[int], dtype, fingerprint: str,
               directory: Path | None = None) -> SharedHostTier:
        """A new, empty tier of ``size_bytes`` bytes of K/V (rounded down to
        whole blocks). Removes stale tier files first. Raises ``ValueError``
        when not even one block fits, when the size exceeds the folder's free
        space, or when the file cannot be made (nothing is left behind)."""
        directory = directory or default_directory()
        remove_stale_tiers(directory)
        dtype = np.dtype(dtype)
        slot_bytes = int(np.prod(block_shape)) * dtype.itemsize
        num_slots = int(size_bytes) // slot_bytes
        if num_slots < 1:
            raise ValueError(f"the KV offload tier of {size_bytes:,} bytes holds no block "
                             f"(one block is {slot_bytes:,} bytes)")
        header = {"magic": _MAGIC, "version": _VERSION, "num_slots": num_slots,
                  "block_shape": [int(d) for d in block_shape], "dtype": dtype.str,
                  "fingerprint": fingerprint}
        total = _layout(num_slots, block_shape, dtype)["total"]
        check_tier_size(total, directory)
        path = directory / f"kvserve-kv-{os.getpid()}-{secrets.token_hex(4)}"
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.ftruncate(fd, total)
            os.pwrite(fd, json.dumps(header).encode().ljust(_HEADER_BYTES, b"\0"), 0)
            return cls(path, fd, header)
        except OSError as exc:
            os.close(fd)
            path.unlink(missing_ok=True)
            raise ValueError(f"cannot create the KV offload tier at {path}: {exc}") from None

    @classmethod
    def attach(cls, path: str | Path, block_shape: Sequence[int], dtype,
               fingerprint: str) -> SharedHostTier:
        """Map an existing tier. Raises ``FileNotFoundError`` if it is gone and
        ``ValueError`` if it was made for another model, block shape or dtype."""
        path = Path(path)
        fd = os.open(path, os.O_RDWR)
        try:
            header = json.loads(os.pread(fd, _HEADER_BYTES, 0).rstrip(b"\0"))
            expected = ([int(d) for d in block_shape], np.dtype(dtype).str, fingerprint)
            found = (header.get("block_shape"), header.get("dtype"), header.get("fingerprint"))
            if header.get("magic") != _MAGIC or header.get("version") != _VERSION:
                raise ValueError(f"{path} is not a kvserve KV offload tier (version {_VERSION})")
            if found != expected:
                raise ValueError(f"the KV offload tier {path} holds blocks of shape, dtype and "
                                 f"model {found}, this engine needs {expected}")
        except BaseException:
            os.close(fd)
            raise
        return cls(path, fd, header)

    def close(self) -> None:
        """Unmap (the file stays for the other engines)."""
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def unlink(self) -> None:
        """Close and delete the file (the owner, at shutdown)."""
        self.close()
        self.path.unlink(missing_ok=True)

    @contextmanager
    def _locked(self):
        with self._thread_lock:
            fcntl.flock(self._fd, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(self._fd, fcntl.LOCK_UN)

    # ------------------------------------------------------------- queries

    @property
    def slot_bytes(self) -> int:
        """Bytes of K/V per block."""
        return int(np.prod(self.block_shape)) * self.dtype.itemsize

    def num_used(self) -> int:
        """Slots holding a block (ready or being written)."""
        return int(np.count_nonzero(self._meta[:, 0] != _EMPTY))

    def _find(self, block_hash: bytes) -> int:
        """The ready slot holding ``block_hash``, or -1. Caller holds the lock."""
        key = np.frombuffer(block_hash[:8], dtype=np.uint64)[0]
        for slot in np.flatnonzero(self._keys == key):
            if self._meta[slot, 0] == _READY and self._hashes[slot].tobytes() == block_hash:
                return int(slot)
        return -1

    def lookup(self, block_hashes: Sequence[bytes], lease_seconds: float = LEASE_SECONDS) -> int:
        """How many of ``block_hashes``, from the first, the tier holds;
        leases those for ``lease_seconds`` and marks them used."""
        now = time.monotonic()
        count = 0
        with self._locked():
            for block_hash in block_hashes:
                slot = self._find(block_hash)
                if slot < 0:
                    break
                self._times[slot] = (max(self._times[slot, 0], now + lease_seconds), now)
                count += 1
        return count

    def holds(self, block_hashes: Sequence[bytes]) -> list[bool]:
        """Whether each of ``block_hashes`` is ready in the tier now (no
        lease, no use: the caller reads those it leased earlier)."""
        with self._locked():
            return [self._find(block_hash) >= 0 for block_hash in block_hashes]

    def clear(self) -> None:
        """Forget every block (slots become empty; leases are dropped)."""
        with self._locked():
            self._meta[:, 0] = _EMPTY
            self._meta[:, 1] += 1  # a read in progress sees its block overwritten
            self._times[:] = 0.0

    # ---------------------------------------------------------------- store

    def store(self, block_hashes: Sequence[bytes],
              write: Callable[[np.ndarray, np.ndarray], None]) -> int:
        """Save blocks: for the hashes the tier lacks, claim slots (empty
        ones first, then the least recently used unleased ones), call
        ``write(slots, indices)`` to fill ``data[slots]`` with the K/V of
        ``block_hashes[indices]`` (both int64 arrays, outside the lock), then
        publish them. Hashes already held are marked used. Returns the
        number of blocks written (fewer when every slot is leased)."""
        now = time.monotonic()
        claimed: list[int] = []
        indices: list[int] = []
        with self._locked():
            for index, block_hash in enumerate(block_hashes):
                slot = self._find(block_hash)
                if slot >= 0:
                    self._times[slot, 1] = now
                    continue
                slot = self._victim(now, claimed)
                if slot < 0:
                    break
                self._meta[slot] = (_WRITING, self._meta[slot, 1] + 1)
                self._hashes[slot] = np.frombuffer(block_hash, dtype=np.uint8)
                self._times[slot] = (now + LEASE_SECONDS, now)  # a dead writer's claim expires
                claimed.append(slot)
                indices.append(index)
        if not claimed:
            return 0
        slots = np.asarray(claimed, dtype=np.int64)
        write(slots, np.asarray(indices, dtype=np.int64))
        generations = self._meta[slots, 1].copy()
        with self._locked():
            mine = (self._meta[slots, 1] == generations) & (self._meta[slots, 0] == _WRITING)
            self._meta[slots[mine], 0] = _READY
            self._times[slots[mine]] = (0.0, time.monotonic())
        return int(np.count_nonzero(mine))

    def _victim(self, now: float, taken: list[int]) -> int:
        """A slot to overwrite: an empty one, else the least recently used
        slot that is not leased (a claim older than its lease counts as
        abandoned); -1 if none. Caller holds the lock."""
        state = self._meta[:, 0]
        free = np.flatnonzero(state == _EMPTY)
        if len(free):
            return int(free[0])
        usable = self._times[:, 0] < now
        usable[taken] = False
        if not usable.any():
            return -1
        return int(np.argmin(np.where(usable, self._times[:, 1], np.inf)))

    # ----------------------------------------------------------------- load

    def read_into(self, block_hashes: Sequence[bytes],
                  read: Callable[[np.ndarray], None]) -> None:
        """Load blocks: find the slots of ``block_hashes``, call
        ``read(slots)`` (int64 array, in hash order; it copies from
        ``data[slots]``), then check that none was overwritten meanwhile.
        Raises ``BlockLost`` naming how many were missing or overwritten;
        the caller must then not use what it copied."""
        with self._locked():
            slots = np.asarray([self._find(h) for h in block_hashes], dtype=np.int64)
            generations = self._meta[slots, 1].copy()
        missing = int(np.count_nonzero(slots < 0))
        if missing:
            raise BlockLost(f"{missing} of {len(slots)} KV blocks left the offload tier "
                            "after they were looked up")
        read(slots)
        with self._locked():
            changed = (self._meta[slots, 1] != generations) | (self._meta[slots, 0] != _READY)
        if changed.any():
            raise BlockLost(f"{int(changed.sum())} of {len(slots)} KV blocks were overwritten "
                            "in the offload tier while they were read")


def _layout(num_slots: int, block_shape: Sequence[int], dtype) -> dict[str, int]:
    """Byte offsets of the tier file's regions (data page-aligned)."""
    slot_bytes = int(np.prod(block_shape)) * np.dtype(dtype).itemsize
    hashes = _HEADER_BYTES
    meta = hashes + num_slots * HASH_SIZE
    times = meta + num_slots * 16
    data = -(-(times + num_slots * 16) // _PAGE) * _PAGE
    return {"hashes": hashes, "meta": meta, "times": times, "data": data,
            "slot_bytes": slot_bytes, "total": data + num_slots * slot_bytes}
