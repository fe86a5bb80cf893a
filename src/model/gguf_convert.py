"""Convert a llama.cpp GGUF file into a Hugging Face-layout checkpoint folder.

Supported ``general.architecture`` values: ``llama`` (Llama 2/3.x, Mistral,
SmolLM2: the default model), ``qwen2`` (Qwen 2/2.5), ``qwen3`` (Qwen3 dense),
``phi3`` (Phi-3/3.5, Phi-4-mini without partial rotary) and ``gemma3`` (Gemma
3 text models). The result is::

    model.safetensors       float32 tensors with Hugging Face names and shapes
    config.json             the family's config (model_type llama, qwen2, qwen3,
                            phi3 or gemma3_text), RoPE scaling included
    tokenizer.json          HF ``tokenizers`` format (``kvserve.model.gguf_tokenizer``)
    tokenizer_config.json   special tokens, add_bos_token and the chat template (if any)

Every tensor is dequantized to float32 with ``gguf.quants.dequantize`` (all
GGML types the ``gguf`` package reads: F16, BF16, Q4_0 ... Q8_0, the K-quants,
the IQ types). Two conventions of llama.cpp's converter
(``convert_hf_to_gguf.py``) are undone:

- ``LlamaModel.modify_tensors`` permutes the rows of ``attn_q`` / ``attn_k``
  into interleaved RoPE pairs (:func:`unpermute_qk` inverts it);
  ``Gemma3Model`` does not permute (its ``modify_tensors`` is ``TextModel``'s).
- ``Gemma3Model.norm_shift`` stores every ``*norm.weight`` as ``1 + w``
  (``Gemma3RMSNorm`` computes ``x * (1 + w)``); the checkpoint keeps
  Hugging Face's ``w``, so 1 is subtracted here.

The ``gguf`` package is imported only inside the functions that read files.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np

from kvserve.model.gguf_tokenizer import build_bpe_tokenizer, build_spm_tokenizer

SUPPORTED_ARCHITECTURES = ("llama", "gemma3", "qwen2", "qwen3", "phi3")
#: The HF ``model_type`` each architecture's config is written as.
MODEL_TYPES = {"llama": "llama", "gemma3": "gemma3_text", "qwen2": "qwen2", "qwen3": "qwen3",
               "phi3": "phi3"}
#: Tensors that hold RoPE frequency factors, not weights: read into the
#: config (``rope_freqs``: llama.cpp's ``freq_factors`` of a Llama 3.x;
#: ``rope_factors_*``: Phi-3's LongRoPE factors).
ROPE_TENSORS = ("rope_freqs.weight", "rope_factors_long.weight", "rope_factors_short.weight")
#: ``{arch}.rope.scaling.type`` values a GGUF may carry, and what they become.
_GGUF_ROPE_SCALING = ("none", "linear", "yarn")


class ConversionError(ValueError):
    """A GGUF file cannot be converted; the message names the file and, if any, the tensor."""


# --------------------------------------------------------------------------- the file


#: Byte size of each GGUF metadata value type that has one (``gguf``'s
#: ``GGUFValueType``: 8 is a string, 9 an array).
_SCALAR_BYTES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
_STRING, _ARRAY = 8, 9
#: GGML's most dimensions of a tensor (``GGML_MAX_DIMS``).
_MAX_DIMS = 4


def check_gguf_header(gguf_path: Path) -> None:
    """Walk a GGUF's header (metadata and tensor index) with every count and
    length checked against the bytes left in the file, before ``gguf``'s
    reader trusts them: a header that claims 2^62 entries, or a string longer
    than the file, made that reader loop for many seconds or end in an
    ``IndexError``. Layout: GGUF v2/v3 (``docs/gguf.md`` of ggml): magic,
    version u32, tensor count u64, metadata count u64, then ``key, type,
    value`` entries (a string is a u64 length and its bytes; an array an item
    type, a u64 count and its items), then per tensor its name, u32 dims,
    u64 sizes, u32 type and u64 offset.

    Raises:
        ConversionError: one line naming the file and what does not fit.
    """
    import mmap
    import struct

    gguf_path = Path(gguf_path)

    def fail(what: str) -> ConversionError:
        return ConversionError(f"{gguf_path}: not a readable GGUF file ({what})")

    try:
        with open(gguf_path, "rb") as handle:
            size = os.fstat(handle.fileno()).st_size
            if size < 24:
                raise fail(f"{size} bytes, shorter than a GGUF header")
            with mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ) as buf:
                _walk_header(buf, size, fail, struct)
    except OSError as exc:
        raise ConversionError(f"{gguf_path}: cannot read ({exc.strerror or exc})") from None


def _walk_header(buf: Any, size: int, fail: Callable[[str], Exception], struct: Any) -> None:
    """:func:`check_gguf_header`'s walk over the mapped file ``buf``."""
    if bytes(buf[:4]) != b"GGUF":
        raise fail("no GGUF magic")
    version, n_tensors, n_kv = struct.unpack_from("<IQQ", buf, 4)
    if version not in (2, 3):
        raise fail(f"version {version}, not 2 or 3")
    pos = 24

    def take(n: int, what: str) -> int:
        nonlocal pos
        if n < 0 or n > size - pos:
            raise fail(f"{what} of {n:,} bytes at byte {pos:,} runs past the end "
                       f"({size:,} bytes)")
        start, pos = pos, pos + n
        return start

    def u32(what: str) -> int:
        return struct.unpack_from("<I", buf, take(4, what))[0]

    def u64(what: str) -> int:
        return struct.unpack_from("<Q", buf, take(8, what))[0]

    def string(what: str) -> bytes:
        length = u64(f"{what}'s length")
        start = take(length, what)
        return bytes(buf[start:start + length]) if length <= 256 else b""

    def value(kind: int, what: str) -> None:
        if kind in _SCALAR_BYTES:
            take(_SCALAR_BYTES[kind], what)
        elif kind == _STRING:
            string(what)
        elif kind == _ARRAY:
            item, count = u32(f"{what}'s item type"), u64(f"{what}'s count")
            if item in _SCALAR_BYTES:
                take(count * _SCALAR_BYTES[item], f"{what} ({count:,} items)")
            elif item == _STRING:
                if count * 8 > size - pos:
                    raise fail(f"{what}: {count:,} strings cannot fit in the file")
                for _ in range(count):
                    string(f"{what}'s item")
            else:
                raise fail(f"{what}: arrays of type {item} are not GGUF")
        else:
            raise fail(f"{what}: unknown value type {kind}")

    if n_kv * 13 > size - pos:  # a key's length, one byte of name, type, one byte
        raise fail(f"{n_kv:,} metadata entries cannot fit in the file")
    alignment = 32  # GGUF's default (``general.alignment``)
    for i in range(n_kv):
        key = string(f"metadata key {i}")
        kind = u32(f"metadata value {i}'s type")
        at = pos
        value(kind, f"metadata value {i}")
        if key == b"general.alignment" and kind == 4:
            alignment = struct.unpack_from("<I", buf, at)[0] or 32
    if n_tensors * 24 > size - pos:
        raise fail(f"{n_tensors:,} tensors cannot fit in the file")
    tensors = []
    for i in range(n_tensors):
        name = string(f"tensor {i}'s name").decode("utf-8", "replace")
        dims = u32(f"tensor {i}'s dimension count")
        if not 1 <= dims <= _MAX_DIMS:
            raise fail(f"tensor {i} has {dims} dimensions")
        at = take(8 * dims + 4 + 8, f"tensor {i}'s sizes, type and offset")
        shape = struct.unpack_from(f"<{dims}Q", buf, at)
        kind, offset = struct.unpack_from("<IQ", buf, at + 8 * dims)
        tensors.append((name or f"tensor {i}", shape, kind, offset))
    _check_tensor_data(tensors, -(-pos // alignment) * alignment, size, fail)


def _check_tensor_data(tensors: list, data_start: int, size: int,
                       fail: Callable[[str], Exception]) -> None:
    """Each tensor's bytes (``gguf``'s ``GGML_QUANT_SIZES``: elements per block
    and bytes per block of its type) lie inside the file: a file cut short
    is named as such, not as numpy's reshape error."""
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    for name, shape, kind, offset in tensors:
        try:
            block, block_bytes = GGML_QUANT_SIZES[GGMLQuantizationType(kind)]
        except (ValueError, KeyError):
            raise fail(f"tensor {name!r} has unknown type {kind}") from None
        elements = 1
        for dim in shape:
            elements *= dim
        nbytes = elements // block * block_bytes
        if data_start + offset + nbytes > size:
            raise fail(f"tensor {name!r} needs {nbytes:,} bytes at byte "
                       f"{data_start + offset:,}, past the end of the file ({size:,} bytes): "
                       "truncated?")


def open_gguf(gguf_path: Path) -> Any:
    """``gguf.GGUFReader`` over the file (mapped, nothing read but the
    header, metadata and tensor index), each tensor's bytes checked to lie
    inside the file.

    Raises:
        ConversionError: one line naming the file, for a file the reader
            cannot parse (a truncated or lying header: counts or lengths past
            the end, an unknown type: :func:`check_gguf_header` first) or a
            tensor whose data runs past the end.
    """
    import gguf

    gguf_path = Path(gguf_path)
    check_gguf_header(gguf_path)
    try:
        reader = gguf.GGUFReader(gguf_path)
    except (ValueError, OSError, IndexError, KeyError, OverflowError, MemoryError,
            UnicodeDecodeError) as exc:
        raise ConversionError(f"{gguf_path}: not a readable GGUF file "
                              f"({type(exc).__name__}: {str(exc)[:200]})") from None
    for t in reader.tensors:
        if int(np.asarray(t.data).nbytes) != int(t.n_bytes):
            raise ConversionError(f"{gguf_path}: tensor {t.name!r} needs {int(t.n_bytes):,} "
                                  "bytes past its offset, but the file ends first "
                                  "(truncated?)")
    return reader


# --------------------------------------------------------------------------- metadata


def _field(reader: Any, key: str, gguf_path: Path, default: Any = ...) -> Any:
    """The decoded value of metadata ``key``; ConversionError if absent and no default.

    Arrays of strings and numbers are read straight from the reader's parts
    (``contents()`` is slow on a 262,144-entry vocabulary)."""
    field = reader.fields.get(key)
    if field is None:
        if default is ...:
            raise ConversionError(f"{gguf_path}: missing GGUF metadata key {key!r}")
        return default
    try:
        return field.contents()
    except UnicodeDecodeError as exc:
        raise ConversionError(f"{gguf_path}: metadata {key!r} holds a string that is not "
                              f"UTF-8 ({exc.reason} at byte {exc.start})") from None


def _array(reader: Any, key: str, kind: Callable[[Any], Any], gguf_path: Path) -> list | None:
    """Metadata array ``key`` as a list (``kind``: ``str``, ``float`` or ``int``), or None."""
    field = reader.fields.get(key)
    if field is None:
        return None
    parts = [field.parts[i] for i in field.data]
    if kind is str:
        try:
            return [bytes(p).decode("utf-8") for p in parts]
        except UnicodeDecodeError as exc:
            raise ConversionError(f"{gguf_path}: metadata {key!r} holds a string that is not "
                                  f"UTF-8 ({exc.reason} at byte {exc.start})") from None
    return [kind(p[0]) for p in parts]


def architecture(reader: Any, gguf_path: Path) -> str:
    """``general.architecture``; ConversionError when kvserve cannot convert it."""
    arch = _field(reader, "general.architecture", gguf_path)
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ConversionError(f"{gguf_path}: unsupported architecture {arch!r} "
                              f"(supported: {', '.join(SUPPORTED_ARCHITECTURES)})")
    return arch


def read_metadata(reader: Any, gguf_path: Path) -> dict[str, Any]:
    """The model and tokenizer metadata the conversion needs, under arch-neutral keys.

    Keys: ``arch``, ``n_layer``, ``hidden``, ``ffn``, ``n_head``, ``n_head_kv``,
    ``head_dim``, ``eps``, ``theta``, ``ctx``, ``vocab``, ``sliding_window``
    (gemma3, phi3), ``rope_dims`` (the rotary dimensions of a head), RoPE
    scaling (``rope_scaling``: ``none`` | ``linear`` |
    ``yarn``, ``rope_factor``, ``rope_orig_ctx``, ``rope_attn_factor``; the
    factor tensors ``rope_freqs``, ``rope_factors_long`` / ``_short`` as float
    lists or None), ``tokenizer`` (``gpt2`` | ``llama``), ``tokens``, ``scores``,
    ``merges``, ``token_types``, ``pre``, ``bos``, ``eos``, ``unk``, ``pad``,
    ``add_bos``, ``add_space_prefix``, ``chat_template``.

    Raises:
        ConversionError: an unsupported architecture, tokenizer model or RoPE
            scaling type, rotary dimensions beyond the head, or a missing key
            (named).
    """
    arch = architecture(reader, gguf_path)

    def f(key: str, default: Any = ...) -> Any:
        return _field(reader, key, gguf_path, default)

    n_head = int(f(f"{arch}.attention.head_count"))
    hidden = int(f(f"{arch}.embedding_length"))
    tokens = _array(reader, "tokenizer.ggml.tokens", str, gguf_path)
    if tokens is None:
        raise ConversionError(f"{gguf_path}: missing GGUF metadata key 'tokenizer.ggml.tokens'")
    model = f("tokenizer.ggml.model")
    if model not in ("gpt2", "llama"):
        raise ConversionError(f"{gguf_path}: unsupported tokenizer model {model!r} "
                              "(supported: 'gpt2' BPE, 'llama' SentencePiece)")
    scaling = f(f"{arch}.rope.scaling.type", "none")
    if scaling not in _GGUF_ROPE_SCALING:
        raise ConversionError(f"{gguf_path}: {arch}.rope.scaling.type = {scaling!r} is not "
                              f"supported ({', '.join(_GGUF_ROPE_SCALING)})")
    rope_dims = f(f"{arch}.rope.dimension_count", None)
    key_length = f(f"{arch}.attention.key_length", hidden // n_head)
    if rope_dims is not None and not 0 < int(rope_dims) <= int(key_length):
        raise ConversionError(f"{gguf_path}: {arch}.rope.dimension_count = {rope_dims} for a "
                              f"head of {key_length}")
    factors = {t.name: [float(v) for v in np.asarray(t.data, np.float32).reshape(-1)]
               for t in reader.tensors if t.name in ROPE_TENSORS}
    return {
        "arch": arch,
        "n_layer": int(f(f"{arch}.block_count")),
        "hidden": hidden,
        "ffn": int(f(f"{arch}.feed_forward_length")),
        "n_head": n_head,
        "n_head_kv": int(f(f"{arch}.attention.head_count_kv", n_head)),
        "head_dim": int(key_length),
        "eps": float(f(f"{arch}.attention.layer_norm_rms_epsilon")),
        "theta": float(f(f"{arch}.rope.freq_base", 10000.0)),
        "ctx": int(f(f"{arch}.context_length")),
        "vocab": int(f(f"{arch}.vocab_size", len(tokens))),
        "sliding_window": f(f"{arch}.attention.sliding_window", None),
        "rope_scaling": scaling,
        "rope_dims": int(rope_dims) if rope_dims is not None else int(key_length),
        "rope_factor": float(f(f"{arch}.rope.scaling.factor", 1.0)),
        "rope_orig_ctx": f(f"{arch}.rope.scaling.original_context_length", None),
        "rope_attn_factor": f(f"{arch}.rope.scaling.attn_factor", None),
        "rope_freqs": factors.get("rope_freqs.weight"),
        "rope_factors_long": factors.get("rope_factors_long.weight"),
        "rope_factors_short": factors.get("rope_factors_short.weight"),
        "tokenizer": model,
        "tokens": tokens,
        "scores": _array(reader, "tokenizer.ggml.scores", float, gguf_path),
        "merges": _array(reader, "tokenizer.ggml.merges", str, gguf_path) or [],
        "token_types": _array(reader, "tokenizer.ggml.token_type", int, gguf_path) or [1] * len(tokens),
        "pre": f("tokenizer.ggml.pre", "default"),
        "bos": f("tokenizer.ggml.bos_token_id", None),
        "eos": f("tokenizer.ggml.eos_token_id", None),
        "unk": f("tokenizer.ggml.unknown_token_id", None),
        "pad": f("tokenizer.ggml.padding_token_id", None),
        "add_bos": bool(f("tokenizer.ggml.add_bos_token", False)),
        "add_space_prefix": bool(f("tokenizer.ggml.add_space_prefix", model == "llama")),
        "chat_template": f("tokenizer.chat_template", None),
    }


# --------------------------------------------------------------------------- tensor names


_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
#: GGUF block tensor -> HF Llama module (llama.cpp ``gguf/tensor_mapping.py``).
_BLOCK_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
#: Gemma 3 differs in its norms: four per layer and Q/K norms
#: (``MODEL_TENSORS[MODEL_ARCH.GEMMA3]`` in gguf-py's ``constants.py``).
_GEMMA3_BLOCK_NAMES = {
    **_BLOCK_NAMES,
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
_QK_NORM_NAMES = {"attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm"}
#: Phi-3 keeps HF's fused projections: ``attn_qkv`` (q, k, v rows) and
#: ``ffn_up`` holding gate then up (``Phi3MiniModel`` writes ``gate_up_proj``
#: unsplit); the loaders split them (:data:`FUSED_PARTS`).
_PHI3_BLOCK_NAMES = {**{k: v for k, v in _BLOCK_NAMES.items()
                        if k not in ("attn_q", "attn_k", "attn_v", "ffn_gate", "ffn_up")},
                     "attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"}
_BLOCK_NAMES_BY_ARCH = {"llama": _BLOCK_NAMES, "gemma3": _GEMMA3_BLOCK_NAMES,
                        "qwen2": _BLOCK_NAMES, "qwen3": {**_BLOCK_NAMES, **_QK_NORM_NAMES},
                        "phi3": _PHI3_BLOCK_NAMES}
#: A fused HF module and its parts, rows in this order.
FUSED_PARTS = {"self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
               "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj")}
_BLOCK_RE = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")


def hf_tensor_name(gguf_name: str, arch: str = "llama") -> str | None:
    """Map a GGUF tensor name to its HF name for ``arch``, or None when it has no mapping.

    Example: ``blk.3.attn_q.weight`` -> ``model.layers.3.self_attn.q_proj.weight``;
    ``blk.0.ffn_norm.weight`` is ``post_attention_layernorm`` for llama and
    ``pre_feedforward_layernorm`` for gemma3.
    """
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    names = _BLOCK_NAMES_BY_ARCH.get(arch, _BLOCK_NAMES)
    m = _BLOCK_RE.fullmatch(gguf_name)
    if m is None or m.group(2) not in names:
        return None
    return f"model.layers.{m.group(1)}.{names[m.group(2)]}.{m.group(3)}"


def expected_shapes(meta: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """HF shape of every tensor a checkpoint of ``meta``'s architecture may hold
    (``lm_head.weight`` is optional: tied embeddings)."""
    h, hd, v, ffn = meta["hidden"], meta["head_dim"], meta["vocab"], meta["ffn"]
    q, kv = meta["n_head"] * hd, meta["n_head_kv"] * hd
    shapes = {"model.embed_tokens.weight": (v, h), "model.norm.weight": (h,), "lm_head.weight": (v, h)}
    per_layer = {
        "self_attn.q_proj.weight": (q, h), "self_attn.k_proj.weight": (kv, h),
        "self_attn.v_proj.weight": (kv, h), "self_attn.o_proj.weight": (h, q),
        "mlp.gate_proj.weight": (ffn, h), "mlp.up_proj.weight": (ffn, h),
        "mlp.down_proj.weight": (h, ffn),
        "input_layernorm.weight": (h,), "post_attention_layernorm.weight": (h,),
    }
    arch = meta.get("arch")
    if arch == "gemma3":
        per_layer.update({
            "self_attn.q_norm.weight": (hd,), "self_attn.k_norm.weight": (hd,),
            "pre_feedforward_layernorm.weight": (h,), "post_feedforward_layernorm.weight": (h,)})
    if arch == "qwen3":
        per_layer.update({"self_attn.q_norm.weight": (hd,), "self_attn.k_norm.weight": (hd,)})
    if arch == "qwen2":
        per_layer.update({"self_attn.q_proj.bias": (q,), "self_attn.k_proj.bias": (kv,),
                          "self_attn.v_proj.bias": (kv,)})
    if arch == "phi3":
        for part in ("q", "k", "v"):
            del per_layer[f"self_attn.{part}_proj.weight"]
        del per_layer["mlp.gate_proj.weight"], per_layer["mlp.up_proj.weight"]
        per_layer.update({"self_attn.qkv_proj.weight": (q + 2 * kv, h),
                          "mlp.gate_up_proj.weight": (2 * ffn, h)})
    for i in range(meta["n_layer"]):
        for suffix, shape in per_layer.items():
            shapes[f"model.layers.{i}.{suffix}"] = shape
    return shapes


# --------------------------------------------------------------------------- tensors


def permute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """Apply llama.cpp's HF->GGUF row permutation to a Q or K projection.

    Within each head, rows ``[x0..x(d/2-1), y0..y(d/2-1)]`` (HF's rotate-half RoPE
    layout) become ``[x0, y0, x1, y1, ...]`` (GGUF's interleaved-pair layout).

    Args:
        w: ``[n_head * head_dim, in_features]`` weight (or a bias of shape ``[n_head * head_dim]``).
        n_head: number of heads of this projection (the KV head count for K).
    """
    rows = w.shape[0]
    return w.reshape(n_head, 2, rows // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def unpermute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """Exact inverse of :func:`permute_qk`: GGUF interleaved rows back to HF's layout.

    Args:
        w: ``[n_head * head_dim, in_features]`` weight (or bias) as stored in the GGUF.
        n_head: number of heads of this projection (the KV head count for K).

    Returns:
        A new array of the same shape and dtype.
    """
    rows = w.shape[0]
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def qk_heads(gguf_name: str, meta: dict[str, Any]) -> int | None:
    """Head count to un-permute GGUF tensor ``gguf_name`` with, or None when
    its rows are stored as in HF (every tensor but llama's ``attn_q`` / ``attn_k``)."""
    if meta["arch"] != "llama":
        return None
    if gguf_name.endswith("attn_q.weight"):
        return meta["n_head"]
    if gguf_name.endswith("attn_k.weight"):
        return meta["n_head_kv"]
    return None


#: Added to every ``*norm.weight`` by llama.cpp's converter, per architecture
#: (``Gemma3Model.norm_shift``); subtracted here.
NORM_SHIFT = {"llama": 0.0, "gemma3": 1.0, "qwen2": 0.0, "qwen3": 0.0, "phi3": 0.0}


def dequantize(tensor: Any, gguf_path: Path) -> np.ndarray:
    """Dequantize one GGUF tensor to float32 in numpy (row-major, HF) order.

    Raises:
        ConversionError: a type the ``gguf`` package cannot dequantize (named).
    """
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize as gguf_dequantize

    try:
        arr = gguf_dequantize(tensor.data, GGMLQuantizationType(tensor.tensor_type))
    except (NotImplementedError, ValueError, KeyError) as exc:
        raise ConversionError(f"{gguf_path}: tensor {tensor.name!r} has unsupported quantization "
                              f"type {tensor.tensor_type.name}") from exc
    # GGUF lists dimensions innermost first; numpy wants them outermost first.
    shape = tuple(int(d) for d in reversed(tensor.shape))
    return arr.astype(np.float32, copy=False).reshape(shape)


def convert_tensors(reader: Any, meta: dict[str, Any], gguf_path: Path) -> dict[str, np.ndarray]:
    """Dequantize, rename, check, un-permute and un-shift every tensor of the GGUF.

    Returns ``{hf_name: float32 array}``, C-contiguous, HF shapes.

    Raises:
        ConversionError: an unknown, mis-shaped, missing or undequantizable tensor.
    """
    shapes = expected_shapes(meta)
    shift = np.float32(NORM_SHIFT[meta["arch"]])
    out: dict[str, np.ndarray] = {}
    for t in reader.tensors:
        if t.name in ROPE_TENSORS:
            continue  # in the config (read_metadata)
        name = hf_tensor_name(t.name, meta["arch"])
        if name is None or name not in shapes:
            raise ConversionError(f"{gguf_path}: unknown tensor {t.name!r}")
        arr = dequantize(t, gguf_path)
        if arr.shape != shapes[name]:
            raise ConversionError(f"{gguf_path}: tensor {t.name!r} has shape {arr.shape}, "
                                  f"expected {shapes[name]} for {name}")
        heads = qk_heads(t.name, meta)
        if heads is not None:
            arr = unpermute_qk(arr, heads)
        if shift and t.name.endswith("norm.weight"):
            arr = arr - shift
        out[name] = np.ascontiguousarray(arr, dtype=np.float32)
    missing = sorted(set(shapes) - set(out) - {"lm_head.weight"})
    if missing:
        raise ConversionError(f"{gguf_path}: missing tensor(s) {missing[:5]} ({len(missing)} in all)")
    return out


# --------------------------------------------------------------------------- config files


def _rope_config(meta: dict[str, Any], where: str) -> dict[str, Any]:
    """The config keys of the GGUF's RoPE scaling (``kvserve.model.rope`` reads them).

    ``rope_freqs`` (Llama 3.x: llama.cpp's converter writes the ``llama3``
    factors as a tensor and no scaling keys) becomes kvserve's
    ``rope_freq_factors``; Phi-3's two factor tensors a ``longrope``
    ``rope_scaling`` with the file's attention factor; ``linear`` and
    ``yarn`` their ``rope_scaling``."""
    out: dict[str, Any] = {}
    if meta["rope_freqs"] is not None:
        out["rope_freq_factors"] = meta["rope_freqs"]
    long, short = meta["rope_factors_long"], meta["rope_factors_short"]
    if (long is None) != (short is None):
        raise ConversionError(f"{where}: one of rope_factors_long / rope_factors_short only")
    if long is not None:
        if meta["rope_orig_ctx"] is None:
            raise ConversionError(f"{where}: LongRoPE factors without "
                                  f"{meta['arch']}.rope.scaling.original_context_length")
        out["original_max_position_embeddings"] = int(meta["rope_orig_ctx"])
        out["rope_scaling"] = {"rope_type": "longrope", "long_factor": long,
                               "short_factor": short}
        if meta["rope_attn_factor"] is not None:
            out["rope_scaling"]["attention_factor"] = float(meta["rope_attn_factor"])
    elif meta["rope_scaling"] == "linear":
        out["rope_scaling"] = {"rope_type": "linear", "factor": meta["rope_factor"]}
    elif meta["rope_scaling"] == "yarn":
        out["rope_scaling"] = {"rope_type": "yarn", "factor": meta["rope_factor"],
                               "original_max_position_embeddings": int(
                                   meta["rope_orig_ctx"] or meta["ctx"])}
    return out


def _llama_config(meta: dict[str, Any], tied: bool) -> dict[str, Any]:
    """The HF ``config.json`` contents for a converted llama, qwen2, qwen3 or
    phi3 GGUF (each a Llama-family ``model_type``; Phi-3's sliding window
    when the file gives one, 0 meaning none)."""
    window = meta["sliding_window"] if meta["arch"] == "phi3" else None
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": MODEL_TYPES[meta["arch"]],
        **({"sliding_window": int(window)} if window else {}),
        # a partial rotary (Phi-4-mini: rope.dimension_count 96 of 128)
        **({"partial_rotary_factor": meta["rope_dims"] / meta["head_dim"]}
           if meta["rope_dims"] != meta["head_dim"] else {}),
        **_rope_config(meta, f"GGUF {meta['arch']}"),
        "vocab_size": meta["vocab"],
        "hidden_size": meta["hidden"],
        "intermediate_size": meta["ffn"],
        "num_hidden_layers": meta["n_layer"],
        "num_attention_heads": meta["n_head"],
        "num_key_value_heads": meta["n_head_kv"],
        "head_dim": meta["head_dim"],
        "rms_norm_eps": meta["eps"],
        "rope_theta": meta["theta"],
        "max_position_embeddings": meta["ctx"],
        "tie_word_embeddings": tied,
        "bos_token_id": meta["bos"],
        "eos_token_id": meta["eos"],
        "torch_dtype": "float32",
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
    }


#: Gemma 3 settings the GGUF does not carry, as llama.cpp hard-codes them
#: (``llama-model.cpp``, ``LLM_ARCH_GEMMA3``: ``set_swa_pattern(6)``,
#: ``rope_freq_base_train_swa = 10000``) and Hugging Face's published
#: Gemma3TextConfig has them (google/gemma-3-270m: ``rope_local_base_freq``
#: 10000, ``sliding_window_pattern`` 6, ``hidden_activation`` gelu_pytorch_tanh).
GEMMA3_SLIDING_PATTERN = 6
GEMMA3_ROPE_LOCAL_BASE_FREQ = 10000.0


def gemma3_layer_types(n_layer: int, pattern: int = GEMMA3_SLIDING_PATTERN) -> list[str]:
    """``layer_types`` of Gemma 3: every ``pattern``-th layer (5, 11, 17, ...) is
    ``full_attention``, the others ``sliding_attention``."""
    return ["full_attention" if (i + 1) % pattern == 0 else "sliding_attention"
            for i in range(n_layer)]


def _gemma3_config(meta: dict[str, Any], tied: bool) -> dict[str, Any]:
    """The HF ``config.json`` contents (Gemma3TextConfig keys) for a converted gemma3 GGUF.

    ``query_pre_attn_scalar``: ``head_dim``, except for the 62-layer 27B model,
    whose attention scale is ``(hidden / heads) ** -0.5`` (llama.cpp:
    ``f_attention_scale`` for ``LLM_TYPE_27B``; HF: 168)."""
    n_layer, hd = meta["n_layer"], meta["head_dim"]
    scalar = meta["hidden"] // meta["n_head"] if n_layer == 62 else hd
    window = meta["sliding_window"]
    return {
        "architectures": ["Gemma3ForCausalLM"],
        "model_type": "gemma3_text",
        "vocab_size": meta["vocab"],
        "hidden_size": meta["hidden"],
        "intermediate_size": meta["ffn"],
        "num_hidden_layers": n_layer,
        "num_attention_heads": meta["n_head"],
        "num_key_value_heads": meta["n_head_kv"],
        "head_dim": hd,
        "rms_norm_eps": float(f"{meta['eps']:.7g}"),  # the file's float32 of 1e-6
        "rope_theta": meta["theta"],
        "rope_local_base_freq": GEMMA3_ROPE_LOCAL_BASE_FREQ,
        "sliding_window": None if window is None else int(window),
        "layer_types": gemma3_layer_types(n_layer),
        "query_pre_attn_scalar": scalar,
        "hidden_activation": "gelu_pytorch_tanh",
        "max_position_embeddings": meta["ctx"],
        "tie_word_embeddings": tied,
        "bos_token_id": meta["bos"],
        "eos_token_id": _gemma3_eos_ids(meta),
        "pad_token_id": meta["pad"],
        "final_logit_softcapping": None,
        "attn_logit_softcapping": None,
        "attention_bias": False,
        "torch_dtype": "float32",
    }


def _gemma3_eos_ids(meta: dict[str, Any]) -> int | list[int]:
    """The GGUF's EOS, and ``<end_of_turn>`` (which ends a chat turn) when the
    vocabulary has it: Hugging Face's ``generation_config.json`` of Gemma 3
    lists both (``[1, 106]``), and llama.cpp stops at both (an end-of-generation
    token)."""
    tokens = meta["tokens"]
    try:
        end_of_turn = tokens.index("<end_of_turn>")
    except ValueError:
        return meta["eos"]
    return [meta["eos"], end_of_turn] if end_of_turn != meta["eos"] else meta["eos"]


def hf_config(meta: dict[str, Any], tied: bool) -> dict[str, Any]:
    """The HF ``config.json`` contents for ``meta``'s architecture."""
    return (_gemma3_config if meta["arch"] == "gemma3" else _llama_config)(meta, tied)


def tokenizer_config(meta: dict[str, Any]) -> dict[str, Any]:
    """The HF ``tokenizer_config.json`` contents (special tokens, add_bos_token, chat template)."""
    tokens = meta["tokens"]

    def tok(idx: int | None) -> str | None:
        return tokens[idx] if idx is not None and 0 <= idx < len(tokens) else None

    spm = meta["tokenizer"] == "llama"
    return {
        "tokenizer_class": "GemmaTokenizer" if spm else "GPT2Tokenizer",
        "add_bos_token": meta["add_bos"] if spm else False,
        "add_eos_token": False,
        "add_prefix_space": meta["add_space_prefix"] if spm else False,
        "bos_token": tok(meta["bos"]),
        "eos_token": tok(meta["eos"]),
        "pad_token": tok(meta["pad"]),
        "unk_token": tok(meta["unk"]),
        "clean_up_tokenization_spaces": False,
        "model_max_length": meta["ctx"],
        "additional_special_tokens": [t for t, ty in zip(tokens, meta["token_types"]) if ty == 3],
        "chat_template": meta["chat_template"],
    }


def build_tokenizer_from_meta(meta: dict[str, Any], gguf_path: Path) -> Any:
    """The ``tokenizers.Tokenizer`` of ``meta`` (``gpt2`` BPE or ``llama`` SentencePiece)."""
    if meta["tokenizer"] == "gpt2":
        return build_bpe_tokenizer(meta["tokens"], meta["merges"], meta["token_types"], meta["pre"])
    if meta["scores"] is None:
        raise ConversionError(f"{gguf_path}: missing GGUF metadata key 'tokenizer.ggml.scores'")
    return build_spm_tokenizer(meta["tokens"], meta["scores"], meta["token_types"], meta["unk"],
                               meta["add_space_prefix"])


# --------------------------------------------------------------------------- entry point


@dataclass(frozen=True)
class ConvertedCheckpoint:
    """What :func:`convert_gguf` wrote: the folder, the architecture and the
    tensor count (for the caller's log line)."""

    folder: Path
    arch: str
    num_tensors: int


def convert_gguf(gguf_path: Path, out_dir: Path, weights: bool = True) -> ConvertedCheckpoint:
    """Convert a ``llama``, ``gemma3``, ``qwen2``, ``qwen3`` or ``phi3`` GGUF file
    into a Hugging Face checkpoint folder.

    Every tensor is dequantized to float32, renamed to its HF name, reshaped to
    the HF ``[out_features, in_features]`` layout; llama's ``attn_q``/``attn_k``
    rows are un-permuted (:func:`unpermute_qk`) and gemma3's norms un-shifted
    (``NORM_SHIFT``). With ``weights=False`` only the config and tokenizer
    files are written (a folder served from the GGUF itself,
    ``kvserve.model.gguf_weights``; the tensors are checked when loaded).

    Args:
        gguf_path: the ``.gguf`` file.
        out_dir: folder to create (parents too); existing files are overwritten.
        weights: write ``model.safetensors`` (float32) too.

    Raises:
        ConversionError: unsupported architecture, tokenizer model or tensor
            type, missing metadata, an unknown tensor name or a shape
            mismatch. The message names the file and the tensor.
    """
    from safetensors.numpy import save_file

    gguf_path = Path(gguf_path)
    reader = open_gguf(gguf_path)
    meta = read_metadata(reader, gguf_path)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    if weights:
        tensors = convert_tensors(reader, meta, gguf_path)
        tied = "lm_head.weight" not in tensors
        save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
        os.chmod(out_dir / "model.safetensors", 0o644)  # safetensors writes it owner-only
        count = len(tensors)
        del tensors
    else:
        tied = not any(t.name == "output.weight" for t in reader.tensors)
        count = sum(t.name not in ROPE_TENSORS for t in reader.tensors)
    _write_json(out_dir / "config.json", hf_config(meta, tied))
    try:
        tokenizer = build_tokenizer_from_meta(meta, gguf_path)
    except ValueError as exc:
        raise ConversionError(f"{gguf_path}: {exc}") from None
    tokenizer.save(str(out_dir / "tokenizer.json"))
    _write_json(out_dir / "tokenizer_config.json", tokenizer_config(meta))
    return ConvertedCheckpoint(out_dir, meta["arch"], count)


def _write_json(path: Path, obj: Any) -> None:
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


__all__ = ["ConversionError", "ConvertedCheckpoint", "SUPPORTED_ARCHITECTURES", "convert_gguf",
           "open_gguf",
           "expected_shapes", "gemma3_layer_types", "hf_tensor_name", "permute_qk",
           "read_metadata", "unpermute_qk"]
