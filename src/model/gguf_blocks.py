"""``--quantization q4`` for any converted GGUF: the tensors our block kernels run, as blocks.

The default model's GGUF stores every quantized tensor as Q4_1; a
llama.cpp "K-quant mix" such as Gemma 3 270M's Q4_K_M holds other types too
(Q5_0, Q4_K, Q6_K here): :func:`read_model_blocks` keeps the tensors of the
types our kernels run (``ggml_blocks.BLOCK_KINDS``) as blocks and leaves the
others to the float32 checkpoint converted from the same file (the caller
loads both and lets the blocks replace their float twins).

Tensors of the types our kernels do not run (Gemma 3 270M's Q5_0, Q4_K and
Q6_K) are requantized to Q8_0 (``requantize_q8``): dequantized by the
``gguf`` package, then quantized per 32 values with ggml's Q8_0 rule
(``d = max|w| / 127``, ``q = round(w / d)``). Eight bits hold a 4- to
6-bit source almost exactly (the error is at most ``d / 2`` per value, plus
``127 |d - fp16(d)|`` from the float16 scale), and
every product then reads a quarter of float32's bytes: for Gemma 3 270M the
whole model is Q8_0 blocks (the tied embedding and LM head over 262,144
tokens as shipped, 168 M of its 268 M weights), 285 MiB where float32 is
1,023 MiB. ``requantize_q8=False`` keeps those tensors float32 instead.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np

from kvserve.model.ggml_blocks import BLOCK_KINDS, BlockQuantizedWeight, from_gguf_bytes
from kvserve.model.gguf_convert import architecture, hf_tensor_name, unpermute_qk

#: Tensor types that stay float (norms; never blocks).
FLOAT_KINDS = ("F32", "F16", "BF16")


def read_model_blocks(gguf_path: Path, hf_shapes: dict[str, tuple[int, ...]],
                      n_head: int, n_head_kv: int,
                      requantize_q8: bool = True) -> dict[str, BlockQuantizedWeight]:
    """The block tensors of a ``llama`` or ``gemma3`` GGUF, by HF name.

    Q4_0 / Q4_1 / Q8_0 tensors as stored; other quantized types requantized
    to Q8_0 (the module docstring; ``ggml_type`` then reads e.g.
    ``Q8_0<Q4_K``), or skipped with ``requantize_q8=False``. Llama's
    ``attn_q`` / ``attn_k`` rows are un-permuted (whole rows move; the bytes
    of each block stay); gemma3's are stored as in HF. Norms are never
    blocks (F32, F16 and BF16 tensors are left to the float checkpoint).

    Args:
        gguf_path: the ``.gguf`` file.
        hf_shapes: HF name -> expected shape (``loader.expected_tensor_shapes``
            plus the optional ones).
        n_head, n_head_kv: head counts of Q and K (llama's un-permutation).

    Returns:
        ``{hf_name: BlockQuantizedWeight}`` (C-contiguous host arrays).

    Raises:
        ValueError: an unsupported architecture (``ConversionError``), or a
            block tensor whose name or shape does not fit ``hf_shapes`` (named).
    """
    import gguf

    reader = gguf.GGUFReader(str(gguf_path))
    arch = architecture(reader, Path(gguf_path))
    out: dict[str, BlockQuantizedWeight] = {}
    for t in reader.tensors:
        kind = t.tensor_type.name
        if kind in FLOAT_KINDS or (kind not in BLOCK_KINDS and not requantize_q8):
            continue
        name = hf_tensor_name(t.name, arch)
        shape = tuple(int(s) for s in reversed(t.shape))
        if name is None or hf_shapes.get(name) != shape:
            raise ValueError(f"{gguf_path}: tensor {t.name!r} {shape} does not fit the "
                             f"checkpoint ({name}: {hf_shapes.get(name)})")
        if kind in BLOCK_KINDS:
            weight = from_gguf_bytes(np.asarray(t.data), kind, shape)
        else:
            weight = replace(from_gguf_bytes(_q8_0_bytes(t), "Q8_0", shape),
                             ggml_type=f"Q8_0<{kind}")
        if arch == "llama" and t.name.endswith("attn_q.weight"):
            weight = weight.map(lambda a: unpermute_qk(a, n_head))
        elif arch == "llama" and t.name.endswith("attn_k.weight"):
            weight = weight.map(lambda a: unpermute_qk(a, n_head_kv))
        out[name] = weight.map(np.ascontiguousarray)
    return out


def load_block_cache(cache_file: Path) -> dict[str, BlockQuantizedWeight] | None:
    """The blocks ``save_block_cache`` wrote, by HF name; None when there is
    no such file or it cannot be read (then the caller reads the GGUF)."""
    import json

    try:
        with np.load(cache_file) as stored:
            arrays = {key: stored[key] for key in stored.files}
        meta = json.loads(str(arrays.pop("__meta__")))
    except (OSError, ValueError, KeyError):
        return None
    return {name: BlockQuantizedWeight(kind, arrays[f"{name}.qs"], arrays[f"{name}.d"],
                                       arrays.get(f"{name}.m"), ggml_type)
            for name, (kind, ggml_type) in meta.items()}


def save_block_cache(cache_file: Path, blocks: dict[str, BlockQuantizedWeight]) -> None:
    """Keep ``blocks`` (a :func:`read_model_blocks` result) in ``cache_file``,
    an uncompressed ``.npz`` (``{name}.qs``, ``.d``, ``.m`` and a JSON
    ``__meta__`` of kinds and types; not ``*.safetensors``, which the float
    loader reads), written to a temporary file and renamed into place. An
    OSError (a read-only cache) only costs the next start the GGUF pass."""
    import json
    import os
    import tempfile

    arrays: dict[str, np.ndarray] = {}
    meta = {}
    for name, weight in blocks.items():
        arrays[f"{name}.qs"], arrays[f"{name}.d"] = weight.qs, weight.d
        if weight.m is not None:
            arrays[f"{name}.m"] = weight.m
        meta[name] = (weight.kind, weight.ggml_type)
    arrays["__meta__"] = np.array(json.dumps(meta))
    try:
        with tempfile.NamedTemporaryFile(dir=Path(cache_file).parent, suffix=".tmp",
                                         delete=False) as handle:
            np.savez(handle, **arrays)
            tmp = handle.name
        os.replace(tmp, cache_file)
    except OSError:
        return


def _q8_0_bytes(tensor: Any) -> np.ndarray:
    """A GGUF tensor of another quantized type as Q8_0 bytes: dequantized
    and quantized again by the ``gguf`` package (ggml's ``quantize_row_q8_0``
    rule). Raises ``NotImplementedError`` (the package's) for a type it
    cannot dequantize."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize, quantize

    values = dequantize(np.asarray(tensor.data), tensor.tensor_type)
    return quantize(values.astype(np.float32, copy=False), GGMLQuantizationType.Q8_0)


def block_summary(blocks: dict[str, Any]) -> dict[str, int]:
    """``{ggml_type: count}`` of a :func:`read_model_blocks` result, for a log line."""
    counts: dict[str, int] = {}
    for weight in blocks.values():
        counts[weight.ggml_type] = counts.get(weight.ggml_type, 0) + 1
    return counts
