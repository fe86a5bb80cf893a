"""Hostile GGUF headers are one line each, before ``gguf``'s reader trusts
them (issue 47, item 3): counts of 2^62, strings and arrays longer than the
file, a non-UTF-8 token, too many dimensions, an unknown value type, a
wrong magic; and a bounded mutation loop over a real file (llama.cpp's
converter wrote it) finds nothing but ``ConversionError``.

Cases are patched into ``data/families/llama3/model.gguf`` at offsets found
by searching its bytes (the GGUF layout: magic, version u32, tensor count
u64, metadata count u64, then entries).
"""

from __future__ import annotations

import random
import struct
from pathlib import Path

import pytest

from kvserve.model.gguf_convert import ConversionError, check_gguf_header, open_gguf, \
    read_metadata

BASE = (Path(__file__).parent / "data" / "families" / "llama3" / "model.gguf").read_bytes()


def _patch(data: bytes, at: int, fmt: str, value: int) -> bytes:
    out = bytearray(data)
    struct.pack_into(fmt, out, at, value)
    return bytes(out)


def _after(key: bytes) -> int:
    """Offset just past the metadata key ``key`` (its value's type comes next)."""
    return BASE.index(key) + len(key)


def _cases() -> dict[str, tuple[bytes, str]]:
    tokens = _after(b"tokenizer.ggml.tokens")  # type u32 (9), item type u32 (8), count u64
    first_token = tokens + 4 + 4 + 8 + 8  # past the count, the first string's length
    tensor = BASE.rindex(b"token_embd.weight") + len(b"token_embd.weight")  # n_dims u32 next
    non_utf8 = bytearray(BASE)
    non_utf8[first_token] = 0x80
    arch_value = _after(b"general.architecture") + 4 + 8  # past its type and length
    bad_arch = bytearray(BASE)
    bad_arch[arch_value] = 0xE5
    return {
        "tensor count 2^62": (_patch(BASE, 8, "<Q", 2**62), "tensors cannot fit"),
        "metadata count 2^62": (_patch(BASE, 16, "<Q", 2**62), "metadata entries cannot fit"),
        "key length 2^62": (_patch(BASE, 24, "<Q", 2**62), "metadata key 0"),
        "token count 2^62": (_patch(BASE, tokens + 8, "<Q", 2**62), "strings cannot fit"),
        "token count 10^6": (_patch(BASE, tokens + 8, "<Q", 10**6), "strings cannot fit"),
        "token length 2^40": (_patch(BASE, tokens + 16, "<Q", 2**40), "runs past the end"),
        "array of unknown items": (_patch(BASE, tokens + 4, "<I", 77), "arrays of type 77"),
        "unknown value type": (_patch(BASE, tokens, "<I", 99), "unknown value type 99"),
        "seven dimensions": (_patch(BASE, tensor, "<I", 7), "7 dimensions"),
        "no magic": (b"GGUX" + BASE[4:], "no GGUF magic"),
        "version 9": (_patch(BASE, 4, "<I", 9), "version 9"),
        "cut in the header": (BASE[:3000], "cannot fit"),
        # found by a new user: numpy's reshape message before
        "cut in the tensor data": (BASE[:len(BASE) // 2], "truncated?"),
        "non-UTF-8 token": (bytes(non_utf8), "not UTF-8"),
        "non-UTF-8 architecture": (bytes(bad_arch), "not UTF-8"),
    }


CASES = _cases()


@pytest.mark.parametrize("name", sorted(CASES))
def test_hostile_header_is_one_line(name, tmp_path):
    data, words = CASES[name]
    path = tmp_path / "hostile.gguf"
    path.write_bytes(data)
    with pytest.raises(ConversionError) as err:
        read_metadata(open_gguf(path), path)
    message = str(err.value)
    assert words in message and message.startswith(str(path)) and "\n" not in message


def test_the_real_file_passes():
    check_gguf_header(Path(__file__).parent / "data" / "families" / "llama3" / "model.gguf")


def test_mutated_headers_raise_only_conversion_errors(tmp_path):
    """Bytes overwritten, u64 counts planted and runs deleted in the header,
    400 files (a fixed seed): each read ends in ``ConversionError`` or a
    metadata dict, nothing else (a found ``UnicodeDecodeError`` and a
    10^9-item array that kept the reader busy for 44 s are cases above)."""
    rng = random.Random(47)
    path = tmp_path / "mutated.gguf"
    for _ in range(400):
        data = bytearray(BASE[:rng.choice([64, 512, 4096, 20000, len(BASE)])])
        for _ in range(rng.randint(1, 4)):
            if not data:
                break
            pos = rng.randrange(0, min(len(data), 12000))
            kind = rng.random()
            if kind < 0.4:
                data[pos] = rng.randrange(256)
            elif kind < 0.7 and pos + 8 <= len(data):
                data[pos:pos + 8] = struct.pack("<Q", rng.choice([2**62, 2**32, 10**9, 0, 255]))
            else:
                del data[pos:pos + rng.randint(1, 64)]
        path.write_bytes(bytes(data))
        try:
            read_metadata(open_gguf(path), path)
        except ConversionError as exc:
            assert "\n" not in str(exc)


@pytest.mark.parametrize("name", ["token count 2^62", "non-UTF-8 token"])
def test_a_refused_file_leaves_no_folder_in_the_cache(name, tmp_path):
    from kvserve.model.gguf_model import resolve_model

    path = tmp_path / "hostile.gguf"
    path.write_bytes(CASES[name][0])
    cache = tmp_path / "cache"
    with pytest.raises(ConversionError):
        resolve_model(str(path), cache=cache)
    # no folder, partial or whole (the conversion's lock file may stay, empty)
    left = [p for p in cache.rglob("*") if not p.name.endswith(".lock")]
    assert left in ([], [cache / "gguf"])
