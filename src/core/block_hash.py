"""Prefix-cache block hashes (the hash chain of vLLM v1's automatic prefix caching).

A full KV block is identified by ``hash(parent_block_hash, token_ids_of_block,
extra_keys)``: the parent hash makes the identity depend on the whole prefix,
so two blocks with the same tokens at different positions or after different
prefixes never alias (see vLLM's design doc "Automatic Prefix Caching" and
Kwon et al. 2023, "Efficient Memory Management for Large Language Model
Serving with PagedAttention").

We use SHA-256 over a stable byte encoding rather than Python's ``hash()``:
``hash()`` is salted per process (PYTHONHASHSEED), so hashes would not survive
a restart or match across processes (tools replaying logs, several workers),
and it is only 64 bits, so with many cached blocks from many requests an
accidental collision -- which would silently serve one request another's K/V
-- is not negligible. SHA-256 makes collisions practically impossible and
costs about a microsecond per 16-token block.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

#: Domain separator, bumped if the encoding ever changes.
_VERSION = b"kvserve-block-v1"
HASH_SIZE = 32


def hash_block_tokens(parent_hash: bytes | None, token_ids: Sequence[int],
                      extra_keys: tuple = ()) -> bytes:
    """SHA-256 digest (32 bytes) identifying one block of tokens after a prefix.

    ``parent_hash`` is the previous block's digest (None for the first block),
    ``token_ids`` the block's token ids (signed 64-bit integers), and
    ``extra_keys`` anything else the K/V depend on (LoRA name, cache salt, ...);
    extra keys must be built of str/int/float/bool/None/tuples so that their
    ``repr`` is stable across processes. Every part is length-prefixed, so
    different inputs never share an encoding. Raises ``struct.error`` for a
    token id outside the signed 64-bit range.
    """
    digest = hashlib.sha256(_VERSION)
    if parent_hash is None:
        digest.update(b"\x00")
    else:
        digest.update(b"\x01" + struct.pack("<I", len(parent_hash)) + parent_hash)
    digest.update(struct.pack(f"<I{len(token_ids)}q", len(token_ids), *token_ids))
    extra = repr(tuple(extra_keys)).encode() if extra_keys else b""
    digest.update(struct.pack("<I", len(extra)) + extra)
    return digest.digest()


def content_hash(token_ids: Sequence[int]) -> bytes:
    """Position-independent hash of a block's tokens alone (no parent).

    Two blocks with equal content hashes hold the same tokens but possibly
    after different prefixes; a "cache-miss explainer" can use this to tell a
    miss caused by a different prefix from a miss on new content.
    """
    return hash_block_tokens(None, token_ids)


def hash_request_blocks(token_ids: Sequence[int], block_size: int,
                        parent_hash: bytes | None = None, start_block: int = 0,
                        extra_keys: tuple = ()) -> list[bytes]:
    """Hashes of the full blocks of ``token_ids`` from block ``start_block`` on.

    ``parent_hash`` must be the hash of block ``start_block - 1`` (None when
    starting at 0). A trailing partial block is not hashed. ``extra_keys`` are
    mixed into the first block only (they then flow down the chain).
    """
    hashes: list[bytes] = []
    num_full = len(token_ids) // block_size
    for index in range(start_block, num_full):
        block = token_ids[index * block_size:(index + 1) * block_size]
        keys = extra_keys if index == 0 else ()
        parent_hash = hash_block_tokens(parent_hash, block, keys)
        hashes.append(parent_hash)
    return hashes
