"""The disk KV offload tier: full KV blocks in files that outlive a restart.

It sits under the shared-memory tier (``host_tier``): blocks the engine saves
there are also written here (write-through, by a background thread), and a
prefix the memory tier misses is looked up here before it is recomputed.
LMCache's ``local_disk`` backend and vLLM's disk offloading do the same.

Layout: one file per block, ``DIR/<layout key>/<block hash hex>.kv``. The
layout key (``layout_key``) is a SHA-256 of what makes a block reusable: the
model fingerprint the memory tier checks, the cache dtype and the block
shape ``(layers, 2, block_size, kv_heads, width)`` (width = ``head_dim``, or
``head_dim + 4`` for an int8 cache with its scales). A folder of another
layout belongs to another model or dtype and is never touched. A file is a
``HEADER_BYTES`` header (magic, version, layout key, block hash, payload
bytes, CRC-32 of the payload) and the block's bytes as the cache stores them.

Ownership, when several servers share ``DIR``: each tier holds an owner
token (8 random bytes) for its lifetime, written into the header of every
file it writes and held as an ``flock`` on ``.owner-<token>.lock`` in the
folder. The size bound counts, and eviction removes, only the files this
tier *owns*: those it wrote, and those whose owner is gone (no lock file, or
one nobody holds: a stopped or killed server, whose files the next start
adopts). Another live server's files are indexed and served but never
evicted here, so a server with a smaller bound cannot empty a larger one's
tier; the folder as a whole may hold up to the sum of the live servers'
bounds.

Safety, also when several processes share ``DIR``:

- a write goes to a temp file that ``os.replace`` renames into place (atomic:
  a reader sees the whole old file, the whole new one, or none);
- at start-up the folder is scanned: a truncated or foreign file (wrong
  size, bad magic, other layout key, a name that is not its hash) is removed
  and never served; so are temp files of processes that died;
- a read checks size, header and checksum; a file that fails is removed and
  the read raises ``BlockLost`` (the step fails, the block is never used; the
  next look-up misses it, so it is recomputed); so does a file another
  process removed after the look-up.

The in-memory index answers look-ups with no file I/O (they run on the event
loop); files are read on the worker's step thread and written on the writer
thread. Every ``RESCAN_SECONDS`` of idle time the writer re-lists the folder,
so the index learns other processes' blocks and forgets removed files, and
the size bound holds for this tier's own files.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import queue
import re
import secrets
import struct
import threading
import time
import zlib
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import structlog

from kvserve.kv_offload.host_tier import LEASE_SECONDS, BlockLost, _pid_alive

log = structlog.get_logger("kvserve.offload")

MAGIC = b"KVSDISK\0"
VERSION = 1
#: Header: magic, version, header bytes, layout key (32), block hash (32),
#: payload bytes, CRC-32 of the payload, owner token (8; zeros: written
#: before owners existed, adopted by whoever scans it); zero-padded to
#: ``HEADER_BYTES``.
_HEADER = struct.Struct("<8sII32s32sQI")
_OWNER = struct.Struct("<8s")
NO_OWNER = bytes(8)
HEADER_BYTES = 128
#: Bytes of blocks the writer queue may hold; a save beyond it is dropped.
WRITE_QUEUE_BYTES = 256 * 2**20
#: Seconds of writer idleness between two listings of the folder.
RESCAN_SECONDS = 30.0
#: Age in seconds past which a temp file is abandoned even if its pid lives.
STALE_TEMP_SECONDS = 600.0
_BLOCK_NAME = re.compile(r"^([0-9a-f]{64})\.kv$")
_TEMP_NAME = re.compile(r"^\.tmp-(\d+)-[0-9a-f]+-[0-9a-f]{64}$")
_OWNER_NAME = re.compile(r"^\.owner-([0-9a-f]{16})\.lock$")


def layout_key(block_shape: Sequence[int], dtype, fingerprint: str) -> bytes:
    """SHA-256 (32 bytes) of a block layout: ``fingerprint`` (the model, its
    quantization, backend and dtype: ``startup.model_fingerprint``), the
    NumPy ``dtype`` of the cache and ``block_shape``. Blocks are reusable
    between engines exactly when their keys are equal."""
    text = json.dumps({"fingerprint": fingerprint, "dtype": np.dtype(dtype).str,
                       "block_shape": [int(d) for d in block_shape]}, sort_keys=True)
    return hashlib.sha256(text.encode()).digest()


def encode_block(key: bytes, block_hash: bytes, payload: bytes,
                 owner: bytes = NO_OWNER) -> bytes:
    """A block file's header for ``payload`` (``HEADER_BYTES`` bytes),
    written by the tier whose owner token is ``owner`` (8 bytes)."""
    header = _HEADER.pack(MAGIC, VERSION, HEADER_BYTES, key, block_hash, len(payload),
                          zlib.crc32(payload)) + _OWNER.pack(owner)
    return header.ljust(HEADER_BYTES, b"\0")


def owner_of(head: bytes) -> bytes:
    """The owner token (8 bytes) in a block file's header ``head``."""
    return _OWNER.unpack_from(head, _HEADER.size)[0]


class OwnerLock:
    """This process's claim on the files it writes in ``folder``: an
    ``flock`` held on ``.owner-<token>.lock`` until ``release`` (or the
    process's death: the kernel drops the lock, so a killed server's files
    become adoptable at once, with no pid to outlive)."""

    def __init__(self, folder: Path) -> None:
        self.token = secrets.token_bytes(8)
        self.path = lock_path(folder, self.token)
        # Locked under a temp name, then renamed: no other tier ever sees the
        # lock file unheld (it would take it for a dead owner's and remove it).
        tmp = folder / f".owner-new-{self.token.hex()}"
        self._fd: int | None = os.open(tmp, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o644)
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            os.replace(tmp, self.path)
        except BaseException:
            os.close(self._fd)
            tmp.unlink(missing_ok=True)
            raise

    def release(self) -> None:
        """Give the files up: remove the lock file, then drop the lock."""
        if self._fd is None:
            return
        self.path.unlink(missing_ok=True)
        os.close(self._fd)
        self._fd = None


def lock_path(folder: Path, token: bytes) -> Path:
    """The lock file of owner ``token`` in ``folder``."""
    return folder / f".owner-{token.hex()}.lock"


def owner_alive(folder: Path, token: bytes) -> bool:
    """Whether a live tier holds owner ``token``'s lock in ``folder``. A lock
    file nobody holds (its owner died) is removed; ``NO_OWNER`` is never
    alive."""
    if token == NO_OWNER:
        return False
    path = lock_path(folder, token)
    try:
        fd = os.open(path, os.O_RDWR)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        return True  # held: its owner lives
    else:
        path.unlink(missing_ok=True)
        return False
    finally:
        os.close(fd)


@dataclass
class DiskCounters:
    """Cumulative counts of a disk tier (blocks, bytes, seconds); ``dropped``:
    saves refused by a full writer queue; ``corrupt``: files that failed the
    read-time check (removed); ``lost``: looked-up files gone at read time."""

    reads: list[float] = field(default_factory=lambda: [0, 0, 0.0])
    writes: list[float] = field(default_factory=lambda: [0, 0, 0.0])
    dropped: list[float] = field(default_factory=lambda: [0, 0, 0.0])
    evicted: int = 0
    corrupt: int = 0
    lost: int = 0


@dataclass
class ScanReport:
    """What the start-up scan found: blocks kept (and their bytes) and files
    removed, by reason."""

    blocks: int = 0
    bytes: int = 0
    removed: dict[str, int] = field(default_factory=dict)
    #: Files whose header passed, whose payload checksums were still to be
    #: checked when the scan returned (0 once ``DiskTier.verified`` is set).
    unverified: int = 0

    def remove(self, path: Path, reason: str) -> None:
        try:
            path.unlink()
        except FileNotFoundError:
            return
        except OSError:
            return
        self.removed[reason] = self.removed.get(reason, 0) + 1


class DiskTier:
    """KV blocks of one layout in files under ``directory``, keyed by block hash.

    Args:
        directory: the tier's folder (``--kv-offloading-path``); created if
            missing. Blocks live in its subfolder named by the layout key.
        block_shape: one block as the offload connector lays it out,
            ``(num_layers, 2, block_size, num_kv_heads, width)``.
        dtype: the cache's NumPy dtype (float32, float16, or int8 with the
            scales in the last 4 bytes of each vector).
        fingerprint: the model fingerprint (``KVLayout.fingerprint``).
        max_bytes: bound of the total size (headers included) of the files
            this tier owns (see the module docstring); least recently used
            ones (a read counts as a use) are removed first.

    Raises ``ValueError`` when not one block fits in ``max_bytes`` and
    ``OSError`` when the folder cannot be made. The constructor scans the
    folder (``scan``: the result is in ``scan_report``) and starts the
    writer thread; ``close`` stops it after the queued writes.
    """

    def __init__(self, directory: str | Path, block_shape: Sequence[int], dtype,
                 fingerprint: str, max_bytes: int, verify_in_background: bool = False) -> None:
        self.block_shape = tuple(int(d) for d in block_shape)
        self.dtype = np.dtype(dtype)
        self.key = layout_key(self.block_shape, self.dtype, fingerprint)
        self.root = Path(directory)
        self.folder = self.root / self.key.hex()
        self.block_bytes = int(np.prod(self.block_shape)) * self.dtype.itemsize
        self.file_bytes = HEADER_BYTES + self.block_bytes
        self.max_blocks = int(max_bytes) // self.file_bytes
        if self.max_blocks < 1:
            raise ValueError(f"the disk KV tier of {int(max_bytes):,} bytes holds no block "
                             f"(one block file is {self.file_bytes:,} bytes)")
        self.folder.mkdir(parents=True, exist_ok=True)
        self._write_layout_note(fingerprint)
        self.owner = OwnerLock(self.folder)
        self._lock = threading.Lock()
        self._index: OrderedDict[bytes, None] = OrderedDict()  # least recently used first
        #: Indexed files of other live tiers: block hash -> owner token. Served,
        #: never evicted here, not counted against ``max_blocks``.
        self._foreign: dict[bytes, bytes] = {}
        self._leases: dict[bytes, float] = {}  # hash -> monotonic deadline
        self._pending: set[bytes] = set()  # queued for writing
        self.counters = DiskCounters()
        self._queue: queue.Queue = queue.Queue(maxsize=max(1, WRITE_QUEUE_BYTES
                                                           // self.block_bytes))
        #: Set when every file the scan found has had its checksum checked.
        self.verified = threading.Event()
        self._closing = False
        try:
            self.scan_report = self.scan(verify=not verify_in_background)
        except BaseException:
            self.owner.release()
            raise
        self._verifier: threading.Thread | None = None
        if verify_in_background and self._to_verify:
            self._verifier = threading.Thread(target=self._verify, name="kvserve-disk-verify",
                                              daemon=True)
            self._verifier.start()
        else:
            self.verified.set()
        self._writer = threading.Thread(target=self._write_loop, name="kvserve-disk-writer",
                                        daemon=True)
        self._writer.start()

    # ------------------------------------------------------------ helpers

    def path_of(self, block_hash: bytes) -> Path:
        """The file of ``block_hash``."""
        return self.folder / f"{block_hash.hex()}.kv"

    @property
    def num_blocks(self) -> int:
        """Blocks indexed."""
        with self._lock:
            return len(self._index)

    def snapshot(self) -> tuple[list[float], list[float]]:
        """Copies of ``counters.writes`` and ``counters.dropped`` (the writer
        thread adds to them)."""
        with self._lock:
            return list(self.counters.writes), list(self.counters.dropped)

    @property
    def num_bytes(self) -> int:
        """Bytes of the indexed files."""
        return self.num_blocks * self.file_bytes

    def _write_layout_note(self, fingerprint: str) -> None:
        """``layout.json``: what the folder's key stands for (for people)."""
        note = self.folder / "layout.json"
        if note.exists():
            return
        text = json.dumps({"fingerprint": fingerprint, "dtype": self.dtype.str,
                           "block_shape": list(self.block_shape), "version": VERSION}, indent=1)
        tmp = self.folder / f".note-{os.getpid()}-{secrets.token_hex(4)}"
        try:
            tmp.write_text(text)
            os.replace(tmp, note)
        except OSError:
            tmp.unlink(missing_ok=True)

    # --------------------------------------------------------------- scan

    def scan(self, verify: bool = True) -> ScanReport:
        """Index the folder's valid block files (oldest modification time =
        least recently used) and remove the others: wrong size
        (``truncated``), bad magic, version or header (``foreign``), another
        layout key (``other_layout``), a name that is not its block hash
        (``foreign``), temp files of dead processes or older than
        ``STALE_TEMP_SECONDS`` (``stale_temp``), a payload whose CRC-32 is
        not the header's (``checksum``). Then trim to the size bound.

        Reads each file's header here; with ``verify`` also its payload,
        else the files that passed wait in ``_to_verify`` for
        :meth:`_verify` (the constructor's background thread), which
        indexes each one only after its checksum: a look-up never finds a
        file not yet checked."""
        report = ScanReport()
        found: list[tuple[float, bytes]] = []
        alive: dict[bytes, bool] = {}  # owner token -> holds its lock
        self._scan_foreign: dict[bytes, bytes] = {}  # files of other live tiers
        for entry in os.scandir(self.folder):
            name, path = entry.name, Path(entry.path)
            if name == "layout.json" or name.startswith((".note-", ".owner-")):
                continue
            temp = _TEMP_NAME.match(name)
            if temp is not None:  # a dead writer's, or one far too old (a reused pid)
                try:
                    old = time.time() - entry.stat().st_mtime > STALE_TEMP_SECONDS
                except OSError:
                    continue
                if old or not _pid_alive(int(temp.group(1))):
                    report.remove(path, "stale_temp")
                continue
            match = _BLOCK_NAME.match(name)
            if match is None:
                report.remove(path, "foreign")
                continue
            try:
                stat = entry.stat()
                with open(path, "rb") as f:
                    head = f.read(HEADER_BYTES)
            except OSError:
                continue  # removed meanwhile by another process
            if stat.st_size != self.file_bytes:
                report.remove(path, "truncated")
                continue
            reason = self._check_header(head, bytes.fromhex(match.group(1)))
            if reason is not None:
                report.remove(path, reason)
                continue
            block_hash = bytes.fromhex(match.group(1))
            found.append((stat.st_mtime, block_hash))
            owner = owner_of(head)
            if owner != self.owner.token:
                if owner not in alive:
                    alive[owner] = owner_alive(self.folder, owner)
                if alive[owner]:
                    self._scan_foreign[block_hash] = owner
        found.sort()
        self._to_verify: list[bytes] = [block_hash for _, block_hash in found]
        if verify:
            self._verify(report)
        else:
            report.unverified = len(found)
        return report

    def _verify(self, report: ScanReport | None = None) -> None:
        """Check the payload checksum of every file in ``_to_verify``, newest
        first; index each good one behind those already indexed (so the
        oldest end least recently used) and remove a bad one
        (``checksum``). Then trim, complete ``report`` (default
        ``scan_report``) and set ``verified``; in the background, log
        ``kv_offload_disk_verified``. Stops early (indexing nothing more)
        when the tier is closed."""
        background = report is None
        report = report if report is not None else self.scan_report
        bad = 0
        for block_hash in reversed(self._to_verify):
            if self._closing:
                break
            path = self.path_of(block_hash)
            try:
                raw = path.read_bytes()
            except OSError:
                continue  # removed meanwhile (another process's bound)
            crc = _HEADER.unpack_from(raw)[6] if len(raw) >= _HEADER.size else None
            if len(raw) != self.file_bytes or zlib.crc32(memoryview(raw)[HEADER_BYTES:]) != crc:
                report.remove(path, "checksum")
                bad += 1
                continue
            with self._lock:
                if block_hash not in self._index:
                    self._index[block_hash] = None
                    self._index.move_to_end(block_hash, last=False)
                    if block_hash in self._scan_foreign:
                        self._foreign[block_hash] = self._scan_foreign[block_hash]
        removed = self._trim()
        with self._lock:
            for reason, n in removed.items():
                report.removed[reason] = report.removed.get(reason, 0) + n
            report.blocks = len(self._index)
            report.bytes = report.blocks * self.file_bytes
            report.unverified = 0
        self._to_verify = []
        self.verified.set()
        if background:
            why = ", ".join(f"{n} {reason}" for reason, n in sorted(report.removed.items()))
            log.info("kv_offload_disk_verified", path=str(self.folder), num_blocks=report.blocks,
                     bytes=report.bytes, removed=dict(report.removed),
                     message=f"KV disk tier checked: {report.blocks:,} blocks "
                             f"({report.bytes / 2**20:,.1f} MiB) ready; removed "
                             f"{sum(report.removed.values())} file(s)"
                             f"{f' ({why})' if why else ''}")

    def wait_verified(self, timeout: float | None = None) -> bool:
        """Wait until the start-up checksums are checked (``verified``);
        False on ``timeout`` (seconds)."""
        return self.verified.wait(timeout)

    def _check_header(self, head: bytes, block_hash: bytes) -> str | None:
        """None when ``head`` is this layout's header of ``block_hash``, else why not."""
        if len(head) < _HEADER.size:
            return "truncated"
        magic, version, header_bytes, key, found_hash, payload, _ = _HEADER.unpack_from(head)
        if magic != MAGIC or version != VERSION or header_bytes != HEADER_BYTES:
            return "foreign"
        if key != self.key:
            return "other_layout"
        if found_hash != block_hash or payload != self.block_bytes:
            return "foreign"
        return None

    def rescan(self) -> None:
        """Re-list the folder: index block files of the right size that other
        processes wrote (as least recently used; their headers are checked
        when read; a live owner's file as foreign), adopt the files of owners
        that died since, and forget files that are gone; then trim. Nothing
        while the start-up check runs (it would index files not yet checked)."""
        if not self.verified.is_set():
            return
        try:
            listed = {}
            for entry in os.scandir(self.folder):
                match = _BLOCK_NAME.match(entry.name)
                if match is not None:
                    try:
                        stat = entry.stat()
                    except OSError:
                        continue
                    if stat.st_size == self.file_bytes:
                        listed[bytes.fromhex(match.group(1))] = stat.st_mtime
        except OSError:
            return
        with self._lock:
            unseen = [h for h in listed if h not in self._index]
            owners = dict(self._foreign)
        for block_hash in unseen:
            try:
                with open(self.path_of(block_hash), "rb") as f:
                    owners[block_hash] = owner_of(f.read(HEADER_BYTES).ljust(HEADER_BYTES,
                                                                              b"\0"))
            except OSError:
                listed.pop(block_hash)  # removed meanwhile
        alive = {token: token != self.owner.token and owner_alive(self.folder, token)
                 for token in set(owners.values())}
        with self._lock:
            for block_hash in [h for h in self._index if h not in listed]:
                if block_hash not in self._pending:
                    del self._index[block_hash]
                    self._foreign.pop(block_hash, None)
            new = sorted((t, h) for h, t in listed.items() if h not in self._index)
            for _, block_hash in reversed(new):
                self._index[block_hash] = None
                self._index.move_to_end(block_hash, last=False)
            for block_hash, token in owners.items():
                if block_hash not in self._index:
                    continue
                if alive[token]:
                    self._foreign[block_hash] = token
                else:
                    self._foreign.pop(block_hash, None)  # its owner died: adopted
        self._trim()

    # ------------------------------------------------------------- queries

    def lookup(self, block_hashes: Sequence[bytes], lease_seconds: float = LEASE_SECONDS) -> int:
        """How many of ``block_hashes``, from the first, the index holds;
        marks those used and leases them for ``lease_seconds`` (this
        process's eviction skips them). No file I/O."""
        now = time.monotonic()
        count = 0
        with self._lock:
            for block_hash in block_hashes:
                if block_hash not in self._index:
                    break
                self._index.move_to_end(block_hash)
                self._leases[block_hash] = now + lease_seconds
                count += 1
        return count

    def contains(self, block_hash: bytes) -> bool:
        """Whether the block is indexed or queued for writing."""
        with self._lock:
            return block_hash in self._index or block_hash in self._pending

    # -------------------------------------------------------------- writes

    def put(self, block_hash: bytes, data: np.ndarray) -> bool:
        """Queue ``data`` (``block_shape`` of ``dtype``; the caller hands over
        its own copy) to be written under ``block_hash``. Returns False, and
        counts a dropped write, when the queue is full; True when queued or
        already held (then marked used)."""
        with self._lock:
            if block_hash in self._index:
                self._index.move_to_end(block_hash)
                return True
            if block_hash in self._pending:
                return True
            self._pending.add(block_hash)
        try:
            self._queue.put_nowait((block_hash, data))
        except queue.Full:
            with self._lock:
                self._pending.discard(block_hash)
                _add(self.counters.dropped, 1, self.block_bytes, 0.0)
            return False
        return True

    def write(self, block_hash: bytes, data: np.ndarray) -> None:
        """Write one block now (the writer thread's job; tests call it):
        temp file, then an atomic rename; index it as most recently used and
        trim to the bound. Raises ``ValueError`` for data of another shape or
        dtype, ``OSError`` when the file cannot be written."""
        if data.shape != self.block_shape or data.dtype != self.dtype:
            raise ValueError(f"a disk tier block is {self.block_shape} {self.dtype}, got "
                             f"{data.shape} {data.dtype}")
        t0 = time.perf_counter()
        payload = np.ascontiguousarray(data).tobytes()
        tmp = self.folder / f".tmp-{os.getpid()}-{secrets.token_hex(4)}-{block_hash.hex()}"
        try:
            with open(tmp, "wb") as f:
                f.write(encode_block(self.key, block_hash, payload, self.owner.token))
                f.write(payload)
            os.replace(tmp, self.path_of(block_hash))
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        with self._lock:
            self._index[block_hash] = None
            self._index.move_to_end(block_hash)
            self._foreign.pop(block_hash, None)
            _add(self.counters.writes, 1, self.file_bytes, time.perf_counter() - t0)
        self._trim()

    def _trim(self) -> dict[str, int]:
        """Remove least recently used, unleased files of this tier's own
        until it owns at most ``max_blocks``; other live tiers' files are
        never touched. Returns ``{"over_size": n}``."""
        now = time.monotonic()
        victims = []
        with self._lock:
            excess = len(self._index) - len(self._foreign) - self.max_blocks
            if excess > 0:
                for block_hash in self._index:
                    if block_hash in self._foreign or self._leases.get(block_hash, 0.0) >= now:
                        continue
                    victims.append(block_hash)
                    if len(victims) == excess:
                        break
                for block_hash in victims:
                    del self._index[block_hash]
                    self._leases.pop(block_hash, None)
                self.counters.evicted += len(victims)
            for block_hash in [h for h, t in self._leases.items() if t < now]:
                del self._leases[block_hash]
        for block_hash in victims:
            self.path_of(block_hash).unlink(missing_ok=True)
        return {"over_size": len(victims)} if victims else {}

    def _write_loop(self) -> None:
        while True:
            try:
                item = self._queue.get(timeout=RESCAN_SECONDS)
            except queue.Empty:
                try:
                    self.rescan()
                except OSError as exc:  # the writer must outlive a failed listing
                    log.warning("kv_disk_rescan_failed", error=repr(exc))
                continue
            if item is None:
                return
            if isinstance(item, threading.Event):  # flush
                item.set()
                continue
            block_hash, data = item
            try:
                self.write(block_hash, data)
            except Exception as exc:  # noqa: BLE001 - a failed write loses one block, no more
                log.warning("kv_disk_write_failed", error=repr(exc))
                with self._lock:
                    _add(self.counters.dropped, 1, self.block_bytes, 0.0)
            finally:
                with self._lock:
                    self._pending.discard(block_hash)

    def flush(self) -> None:
        """Wait until every queued write is done."""
        if not self._writer.is_alive():
            return
        done = threading.Event()
        self._queue.put(done)
        done.wait()

    def close(self) -> None:
        """Stop the start-up check (what it has not checked stays unindexed),
        finish the queued writes, then stop the writer thread."""
        self._closing = True
        if self._verifier is not None:
            self._verifier.join()
        if self._writer.is_alive():
            self._queue.put(None)
            self._writer.join()
        self.owner.release()

    # --------------------------------------------------------------- reads

    def read(self, block_hash: bytes) -> np.ndarray:
        """The block's data, ``block_shape`` of ``dtype`` (a new array).
        Raises ``BlockLost`` when the file is gone or fails the check (size,
        header, CRC-32; such a file is removed). Marks the block used (also
        on disk: the file's modification time orders the next start-up's
        LRU)."""
        t0 = time.perf_counter()
        path = self.path_of(block_hash)
        buf = bytearray(self.file_bytes)
        try:
            with open(path, "rb") as f:
                size = f.readinto(buf)
                extra = f.read(1)
        except FileNotFoundError:
            self._forget(block_hash, "lost")
            raise BlockLost("a KV block left the disk tier after it was looked up") from None
        view = memoryview(buf)
        reason = None
        if size != self.file_bytes or extra:
            reason = "truncated"
        else:
            reason = self._check_header(bytes(view[:HEADER_BYTES]), block_hash)
        if reason is None:
            crc = _HEADER.unpack_from(buf)[6]
            if zlib.crc32(view[HEADER_BYTES:]) != crc:
                reason = "checksum"
        if reason is not None:
            self._forget(block_hash, "corrupt")
            path.unlink(missing_ok=True)
            log.warning("kv_disk_block_removed", path=str(path), reason=reason)
            raise BlockLost(f"a KV block file of the disk tier failed its check ({reason}); "
                            "removed")
        data = np.frombuffer(buf, dtype=self.dtype, offset=HEADER_BYTES).reshape(
            self.block_shape)
        try:
            os.utime(path)
        except OSError:
            pass
        with self._lock:
            if block_hash in self._index:
                self._index.move_to_end(block_hash)
            _add(self.counters.reads, 1, self.file_bytes, time.perf_counter() - t0)
        return data

    def _forget(self, block_hash: bytes, counter: str) -> None:
        with self._lock:
            self._index.pop(block_hash, None)
            self._foreign.pop(block_hash, None)
            self._leases.pop(block_hash, None)
            setattr(self.counters, counter, getattr(self.counters, counter) + 1)


def _add(entry: list[float], blocks: int, nbytes: int, seconds: float) -> None:
    entry[0] += blocks
    entry[1] += nbytes
    entry[2] += seconds

