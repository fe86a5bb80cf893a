"""A GGUF's tensors served as shipped: mapped, blocks to the kernels, no float32 copy.

:func:`read_gguf_weights` maps the file (``gguf.GGUFReader`` reads it
through ``numpy.memmap``) and returns every tensor under its Hugging Face
name (``gguf_convert.hf_tensor_name``), in the form the model's products
take, by GGUF type:

=================  ==========================================================
F32, F16, BF16     float32 arrays (norms, biases: small); Gemma's norms un-shifted
Q4_0, Q4_1, Q8_0   ``BlockQuantizedWeight`` (``ggml_blocks``): the file's codes
Q5_0               ``BlockQuantizedWeight`` Q8_0 with codes ``q - 16``: exact
Q4_K, Q5_K, Q6_K   ``KQuantWeight``: panels of 16 channels (``cpu.kquant_kernels``)
others             float32, dequantized by the ``gguf`` package (logged)
=================  ==========================================================

Llama's ``attn_q`` / ``attn_k`` rows are un-permuted as whole rows (the bytes of
each block stay), as ``gguf_convert`` does for float tensors; Phi-3's fused
``attn_qkv`` and ``ffn_up`` (gate and up) are served as their parts, whole
rows each; RoPE factor tensors (``rope_freqs``, ``rope_factors_*``) are no
weights (``gguf_convert`` puts them in the config). The K-quant
panels are packed once and written to ``kquant-panels-v2.bin`` in the
checkpoint's cache folder (an index beside it names each array's offset and
the GGUF's size and modification time); later starts map that file and
pack nothing. A weight is held once: the panels are the only copy of a
K-quant tensor's codes, and the embedding reads its rows from the GGUF's own
mapped super-blocks (``KQuantWeight.raw``). With a scheme that does not
serve blocks (``none``, ``int8``, ``w8a8``) every tensor is dequantized to
float32 instead, in memory (no checkpoint is written).
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import structlog

from kvserve.model.ggml_blocks import BLOCK_KINDS, BlockQuantizedWeight, KQuantWeight, \
    from_gguf_bytes
from kvserve.model.rope import row_order_of
from kvserve.model.gguf_convert import (FUSED_PARTS, NORM_SHIFT, ROPE_TENSORS, ConversionError,
                                        architecture, dequantize, hf_tensor_name, open_gguf,
                                        unpermute_qk)

_log = structlog.get_logger()

#: Tensor types read as float32 arrays.
FLOAT_KINDS = ("F32", "F16", "BF16")
#: K-quant types served by ``kvserve.cpu.kquant_kernels``.
KQUANT_KINDS = ("Q4_K", "Q5_K", "Q6_K")
#: The packed panels' file and its index, in the checkpoint folder.
PANEL_FILE, PANEL_INDEX = "kquant-panels-v2.bin", "kquant-panels-v2.json"
#: Byte alignment of each array in the panel file.
_ALIGN = 64
#: What each served form is called in the start-up line.
PATHS = {"float": "float32", "blocks": "ggml blocks (Q8 activations with w4a8)",
         "q5_0": "exact Q8_0 blocks", "kquant": "K-quant panels, Q8_K activations",
         "dequantized": "dequantized to float32 (no kernel for this type)"}


def read_gguf_weights(gguf_path: Path, shapes: dict[str, tuple[int, ...]],
                      n_head: int, n_head_kv: int, blocks: bool,
                      cache_folder: Path | None,
                      row_orders: dict[str, np.ndarray] | None = None,
                      ) -> tuple[dict[str, Any], dict[str, str]]:
    """Every tensor of a GGUF (``gguf_convert.SUPPORTED_ARCHITECTURES``), by HF
    name, served in place.

    Args:
        gguf_path: the ``.gguf`` file.
        shapes: HF name -> shape the model expects (required and optional
            tensors); a tensor of another name is dropped with a warning, one
            of another shape refused.
        n_head, n_head_kv: head counts of Q and K (llama's un-permutation).
        blocks: serve quantized tensors as blocks (``q4``, ``w4a8``); False
            dequantizes everything to float32.
        cache_folder: where the K-quant panels are kept (None: packed in
            memory, not kept).
        row_orders: a partial rotary's q/k row orders (``rope.qk_row_orders``),
            applied as the rows are served (K-quant panels packed in that order).

    Returns:
        ``(weights, paths)``: the weights (table above) and ``{GGUF type:
        how it is served}`` for the start-up line.

    Raises:
        ConversionError: an unreadable file, an unsupported architecture or
            a mis-shaped tensor (one line naming the file and the tensor).
    """
    gguf_path = Path(gguf_path)
    reader = open_gguf(gguf_path)
    arch = architecture(reader, gguf_path)
    shift = np.float32(NORM_SHIFT[arch])
    heads = {"attn_q.weight": n_head, "attn_k.weight": n_head_kv} if arch == "llama" else {}
    tied = not any(t.name == "output.weight" for t in reader.tensors)
    out: dict[str, Any] = {}
    paths: dict[str, str] = {}
    pending: list[tuple[str, Any, np.ndarray | None, bool]] = []

    def serve(t: Any, name: str, shape: tuple[int, ...], rows: np.ndarray | None) -> None:
        """Serve rows ``rows`` of tensor ``t`` (None: all) under ``name``, of ``shape``."""
        kind = t.tensor_type.name
        full = tuple(int(s) for s in reversed(t.shape))
        head_count = next((h for suffix, h in heads.items() if t.name.endswith(suffix)), None)
        perm = None if head_count is None else unpermute_qk(np.arange(shape[0]), head_count)
        if rows is not None:
            perm = rows if perm is None else rows[perm]
        extra = row_order_of(name, row_orders)
        if extra is not None:
            perm = extra if perm is None else perm[extra]
        if blocks and kind in KQUANT_KINDS:
            is_table = t.name == "token_embd.weight"
            pending.append((name, t, perm, is_table and not tied))
            paths[kind] = PATHS["kquant"]
        elif blocks and (kind in BLOCK_KINDS or kind == "Q5_0"):
            raw = np.asarray(t.data)
            weight = (q5_0_as_q8_0(raw, full) if kind == "Q5_0"
                      else from_gguf_bytes(raw, kind, full))
            if perm is not None:
                weight = weight.map(lambda a: a[perm])
            out[name] = weight.map(np.ascontiguousarray)
            paths[kind] = PATHS["q5_0" if kind == "Q5_0" else "blocks"]
        else:
            arr = dequantize(t, gguf_path)
            if perm is not None:
                arr = arr[perm]
            if shift and t.name.endswith("norm.weight"):
                arr = arr - shift
            out[name] = np.ascontiguousarray(arr, dtype=np.float32)
            served = "float" if kind in FLOAT_KINDS or not blocks else "dequantized"
            paths[kind] = PATHS[served]
            if served == "dequantized":
                _log.warning("gguf_tensor_dequantized", tensor=t.name, ggml_type=kind,
                             message=f"{t.name} ({kind}): no kernel for this type, "
                                     "dequantized to float32")

    for t in reader.tensors:
        if t.name in ROPE_TENSORS:
            continue  # RoPE factors: in the config (gguf_convert.read_metadata)
        name = hf_tensor_name(t.name, arch)
        shape = tuple(int(s) for s in reversed(t.shape))
        if name is not None and name not in shapes and _fused_module(name) in FUSED_PARTS:
            for part, part_shape, rows in _split(name, shape, shapes, gguf_path, t.name):
                serve(t, part, part_shape, rows)
            continue
        if name is None or name not in shapes:
            _log.warning("unexpected_tensor_dropped", file=str(gguf_path), tensor=t.name)
            continue
        if shapes[name] != shape:
            raise ConversionError(f"{gguf_path}: tensor {t.name!r} has shape {shape}, "
                                  f"expected {shapes[name]} for {name}")
        serve(t, name, shape, None)
    if pending:
        out.update(_kquant_weights(pending, gguf_path, cache_folder))
    return out, paths


def _fused_module(name: str) -> str:
    """``self_attn.qkv_proj`` of ``model.layers.3.self_attn.qkv_proj.weight``."""
    return name.rsplit(".", 1)[0].split(".", 3)[-1]


def _split(name: str, shape: tuple[int, ...], shapes: dict[str, tuple[int, ...]],
           gguf_path: Path, gguf_name: str) -> list[tuple[str, tuple[int, ...], np.ndarray]]:
    """The parts of a fused tensor (Phi-3's ``qkv_proj``, ``gate_up_proj``:
    ``gguf_convert.FUSED_PARTS``) as ``(part name, part shape, its rows)``,
    the parts' shapes those the model expects. Raises ConversionError when
    they do not add up to the tensor's."""
    module = _fused_module(name)
    prefix, suffix = name[:name.index(module)], name.rsplit(".", 1)[1]
    parts = [f"{prefix}{part}.{suffix}" for part in FUSED_PARTS[module]]
    if any(p not in shapes for p in parts) or sum(shapes[p][0] for p in parts) != shape[0] \
            or any(shapes[p][1:] != shape[1:] for p in parts):
        raise ConversionError(f"{gguf_path}: tensor {gguf_name!r} of shape {shape} does not "
                              f"split into {', '.join(parts)}")
    out, start = [], 0
    for part in parts:
        n = shapes[part][0]
        out.append((part, shapes[part], np.arange(start, start + n)))
        start += n
    return out


def q5_0_as_q8_0(raw: np.ndarray, shape: tuple[int, int]) -> BlockQuantizedWeight:
    """A Q5_0 tensor as the Q8_0 weight of the same values: codes ``q - 16``
    (-16..15), the same float16 ``d`` (ggml's ``dequantize_row_q5_0``: byte j
    of the 16 holds codes j (low nibble) and j + 16 (high), bit j of the
    little-endian ``qh`` word the fifth bit of code j). Exact.

    raw: uint8 bytes of N * K / 32 blocks of 22 bytes; shape (N, K).
    Raises ValueError for a byte count that does not fit."""
    n, k = shape
    if k % 32 or raw.size != n * (k // 32) * 22:
        raise ValueError(f"Q5_0 tensor of shape {shape}: {raw.size} bytes")
    blocks = np.ascontiguousarray(raw, dtype=np.uint8).reshape(n, k // 32, 22)
    d = blocks[:, :, 0:2].copy().view(np.float16)[:, :, 0].astype(np.float32)
    qh = blocks[:, :, 2:6].copy().view("<u4")[:, :, 0:1]
    qs = blocks[:, :, 6:22].astype(np.int16)
    bit = np.arange(16, dtype=np.uint32)
    lo = (qs & 0xF) | (((qh >> bit) & 1).astype(np.int16) << 4)
    hi = (qs >> 4) | (((qh >> (bit + 16)) & 1).astype(np.int16) << 4)
    codes = (np.concatenate([lo, hi], axis=2) - 16).astype(np.int8).reshape(n, k)
    return BlockQuantizedWeight("q8", codes, d, None, "Q5_0")


# --------------------------------------------------------------------------- K-quant panels


def _kquant_weights(pending: list, gguf_path: Path,
                    folder: Path | None) -> dict[str, KQuantWeight]:
    """The ``KQuantWeight`` of each pending ``(name, tensor, row permutation,
    embedding only)``: panels mapped from the folder's panel file (packed and
    written first when it is missing or stale), or packed in memory when
    the folder cannot be written. An embedding-only table gets no panels."""
    from kvserve.cpu import kquant_kernels as kk

    to_pack = [(name, t, perm) for name, t, perm, table_only in pending if not table_only]
    want = {name: [t.tensor_type.name, *(int(s) for s in reversed(t.shape)),
                   *([] if perm is None else [int(perm[0]), len(perm)])]
            for name, t, perm in to_pack}
    stat = gguf_path.stat()
    stamp = [stat.st_size, stat.st_mtime_ns]
    arrays = _map_panels(folder, want, stamp) if folder is not None else None
    if arrays is None:
        arrays = _pack_all(to_pack, gguf_path, folder, want, stamp)
    out = {}
    for name, t, perm, table_only in pending:
        kind = t.tensor_type.name
        n, k = (int(s) for s in reversed(t.shape))
        raw = np.asarray(t.data).reshape(n, k // kk.QK_K, kk.BLOCK_BYTES[kind])
        if perm is not None:
            n = len(perm)  # a part of a fused tensor, or llama's un-permuted q / k
        if table_only:
            out[name] = KQuantWeight(kind, n, k, None, None, None, None, raw)
            continue
        panels = arrays[name]
        out[name] = KQuantWeight(kind, n, k, panels["codes"], panels["scales"], panels["mins"],
                                 panels["dd"], raw if perm is None else None)
    return out


def pack_tensor(raw: np.ndarray, kind: str, perm: np.ndarray | None) -> dict[str, np.ndarray]:
    """The panel arrays (``codes``, ``scales``, ``mins``, ``dd``) of one K-quant
    tensor: ``raw`` uint8[N, K / 256, block bytes] (rows taken in ``perm``'s
    order when given), N padded with zero channels to a multiple of 16."""
    from kvserve.cpu import kquant_kernels as kk
    from kvserve.cpu.kquant_ops import scales_of

    if perm is not None:
        raw = raw[perm]
    n, nsb = raw.shape[0], raw.shape[1]
    pad = -n % kk.KLANES
    if pad:
        raw = np.concatenate([raw, np.zeros((pad, *raw.shape[1:]), np.uint8)])
    kind_id = kk.KIND_OF[kind]
    shapes = kk.packed_shapes(kind_id, n + pad, nsb * kk.QK_K)
    packed = {key: np.zeros(shape, np.uint8) for key, shape in shapes.items() if key != "dd"}
    kk.pack_kquant(np.ascontiguousarray(raw), kind_id, packed["codes"], packed["scales"],
                   packed["mins"])
    d, dmin = scales_of(raw, kind)
    groups = (n + pad) // kk.KLANES
    dd = np.empty((groups, nsb, 2, kk.KLANES), np.float32)
    dd[:, :, 0, :] = d.reshape(groups, kk.KLANES, nsb).transpose(0, 2, 1)
    dd[:, :, 1, :] = -dmin.reshape(groups, kk.KLANES, nsb).transpose(0, 2, 1)
    packed["dd"] = dd.reshape(shapes["dd"])
    return packed


def _pack_all(to_pack: list, gguf_path: Path, folder: Path | None, want: dict,
              stamp: list) -> dict[str, dict[str, np.ndarray]]:
    """Pack every tensor; written to the folder's panel file and mapped back
    when the folder is writable (one tensor's arrays in memory at a time),
    else kept in memory."""
    started = time.perf_counter()
    total = sum(int(np.asarray(t.data).nbytes) for _, t, _ in to_pack)
    _log.info("kquant_packing", tensors=len(to_pack), message=f"Packing {len(to_pack)} K-quant "
              f"tensors ({total / 2**20:,.1f} MiB) into panels (once)...")
    try:
        if folder is None:
            raise OSError("no cache folder")
        handle = tempfile.NamedTemporaryFile(dir=folder, prefix=".panels-", delete=False)
    except OSError:
        return {name: pack_tensor(_blocks_of(t), t.tensor_type.name, perm)
                for name, t, perm in to_pack}
    index: dict[str, Any] = {"gguf": stamp, "tensors": want, "arrays": {}}
    offset = 0
    with handle:
        for group in _fusion_groups(to_pack):
            packed = []
            for name, t, perm in group:
                packed.append((name, pack_tensor(_blocks_of(t), t.tensor_type.name, perm)))
                _drop_pages(t)
            for key in ("codes", "scales", "mins", "dd"):
                pad = -offset % _ALIGN  # a group's arrays of one key end to end
                handle.write(b"\0" * pad)
                offset += pad
                for name, arrays in packed:
                    array = arrays[key]
                    handle.write(array.tobytes())
                    index["arrays"].setdefault(name, {})[key] = [offset, list(array.shape),
                                                                 array.dtype.str]
                    offset += array.nbytes
            del packed
    index["bytes"] = offset
    for stale in folder.glob("kquant-panels-v*"):  # an older layout's
        if stale.name not in (PANEL_FILE, PANEL_INDEX):
            stale.unlink(missing_ok=True)
    os.chmod(handle.name, 0o644)  # a temporary file is owner-only
    os.replace(handle.name, folder / PANEL_FILE)
    _write_json(folder / PANEL_INDEX, index)
    seconds = round(time.perf_counter() - started, 2)
    _log.info("kquant_packed", seconds=seconds, path=str(folder / PANEL_FILE),
              message=f"Packed the K-quant panels in {seconds} s: {offset / 2**20:,.1f} MiB "
                      f"in {folder / PANEL_FILE}")
    arrays = _map_panels(folder, want, stamp)
    if arrays is None:
        raise ConversionError(f"{folder / PANEL_FILE}: written but cannot be mapped back")
    return arrays


#: The parts of each fused projection, in the model's order (``LlamaModel``).
_FUSED = (("qkv", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")),
          ("gate_up", ("mlp.gate_proj", "mlp.up_proj")))


def _fusion_groups(to_pack: list) -> list[list]:
    """``to_pack`` in groups whose panel arrays are written end to end, so that
    the model's fused projections (``q/k/v``, ``gate/up``) can view a run of
    parts of one type as one weight (``ggml_blocks.fuse_adjacent``): per
    layer, its q, k, v projections in that order (a GGUF lists them sorted
    by name), then its gate and up ones; any other tensor alone."""
    groups: dict[str, list] = {}
    rank: dict[str, int] = {}
    for item in to_pack:
        name = item[0]
        key = name
        for group, members in _FUSED:
            for order, part in enumerate(members):
                if f".{part}." in name:
                    key, rank[name] = name.split(f".{part}.")[0] + "." + group, order
        groups.setdefault(key, []).append(item)
    return [sorted(group, key=lambda item: rank.get(item[0], 0)) for group in groups.values()]


def _drop_pages(t: Any) -> None:
    """Tell the kernel this process is done with tensor ``t``'s pages of the
    mapped GGUF (``madvise(MADV_DONTNEED)``: file-backed, so they stay in the
    page cache; only this process's resident set shrinks), so that packing
    a 5 GB file does not hold the whole file resident beside its panels.
    A no-op where the mapping or ``madvise`` is not available."""
    import mmap

    data = np.asarray(t.data)
    base = data
    while getattr(base, "base", None) is not None and not isinstance(base, mmap.mmap):
        base = base.base
    if not isinstance(base, mmap.mmap) or not hasattr(base, "madvise"):
        return
    start = data.ctypes.data - np.frombuffer(base, np.uint8, count=1).ctypes.data
    page = mmap.PAGESIZE
    lo = start // page * page
    try:
        base.madvise(mmap.MADV_DONTNEED, lo, start + data.nbytes - lo)
    except (OSError, ValueError, AttributeError):
        return


def _blocks_of(t: Any) -> np.ndarray:
    from kvserve.cpu.kquant_kernels import BLOCK_BYTES, QK_K

    n, k = (int(s) for s in reversed(t.shape))
    return np.asarray(t.data).reshape(n, k // QK_K, BLOCK_BYTES[t.tensor_type.name])


def _map_panels(folder: Path, want: dict, stamp: list) -> dict[str, dict[str, np.ndarray]] | None:
    """The panel arrays of the folder's panel file, mapped copy-on-write
    (writeable arrays, pages from the file), or None when the file is
    missing or was packed from another file or for other tensors."""
    try:
        index = json.loads((folder / PANEL_INDEX).read_text(encoding="utf-8"))
        data = folder / PANEL_FILE
        if index["gguf"] != stamp or index["tensors"] != want \
                or data.stat().st_size != index["bytes"]:
            return None
        if not index["bytes"]:
            return {}
        mapped = np.memmap(data, dtype=np.uint8, mode="c")
        return {name: {key: np.ndarray(tuple(shape), np.dtype(dtype), buffer=mapped,
                                       offset=offset)
                       for key, (offset, shape, dtype) in entry.items()}
                for name, entry in index["arrays"].items()}
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _write_json(path: Path, obj: Any) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(obj) + "\n", encoding="utf-8")
    os.replace(tmp, path)


__all__ = ["KQUANT_KINDS", "PANEL_FILE", "PANEL_INDEX", "pack_tensor", "q5_0_as_q8_0",
           "read_gguf_weights"]
