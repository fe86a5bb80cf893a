#!/usr/bin/env python3
"""Write a random-weight Llama GGUF of a real model's shapes, and quantize it with llama.cpp.

Benchmarks at real sizes need real-sized files, and model weights never come
from a hub here: this writes a ``general.architecture = llama`` GGUF whose
shapes are a published model's (``--preset``), whose tokenizer, chat template
and special tokens are copied from an existing GGUF (``--tokenizer-from``,
by default the default model's Q4_1 file, vocabulary 49,152), and whose
weights are random normal (standard deviation ``--std``; norms 1) in F16. It
is streamed tensor by tensor (an 8B file never sits in memory). Then, for
each ``--quantize`` type, llama.cpp's ``llama-quantize`` (from the
benchmark's build, ``tools/bench_vs_llamacpp.py``'s ``--llamacpp-dir``)
writes ``<name>-<TYPE>.gguf`` beside it.

Presets (Hugging Face configs of the public models; the vocabulary is the
tokenizer's):

========  ======  ======  =====  ========  ====  ====================
preset    hidden  layers  heads  KV heads  FFN   embeddings
========  ======  ======  =====  ========  ====  ====================
1b        2048    16      32     8         8192  tied (Llama 3.2 1B)
3b        3072    28      24     8         8192  tied (Llama 3.2 3B)
8b        4096    32      32     8         14336 untied (Llama 3.1 8B)
========  ======  ======  =====  ========  ====  ====================

RoPE base 500,000, RMS-norm epsilon 1e-5, context 131,072 as those configs
say (Llama 3's ``rope_scaling`` is not written: these files are for speed
and memory, and for equal tokens between two engines reading the same file).

Usage::

    .venv/bin/python tools/make_synthetic_gguf.py --preset 1b --out /tmp/models \\
        --quantize Q4_K_M Q4_0
    .venv/bin/python tools/make_synthetic_gguf.py --preset 8b --out /tmp/models --quantize Q4_K_M
"""

from __future__ import annotations

if __name__ == "__main__":  # first: outside the venv, say how to run this script
    import _venv_guard  # noqa: F401

import argparse
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

#: Tokenizer metadata copied from the source GGUF.
_TOKENIZER_PREFIX = "tokenizer."


@dataclass(frozen=True)
class Shapes:
    """A Llama model's shapes."""

    hidden: int
    layers: int
    heads: int
    kv_heads: int
    ffn: int
    tied: bool


PRESETS = {
    "1b": Shapes(2048, 16, 32, 8, 8192, True),
    "3b": Shapes(3072, 28, 24, 8, 8192, True),
    "8b": Shapes(4096, 32, 32, 8, 14336, False),
    "tiny": Shapes(256, 2, 4, 2, 512, True),
}


def tensor_shapes(s: Shapes, vocab: int) -> list[tuple[str, tuple[int, ...]]]:
    """``(GGUF name, numpy shape)`` of every tensor, in llama.cpp's order."""
    hd = s.hidden // s.heads
    out = [("token_embd.weight", (vocab, s.hidden))]
    for i in range(s.layers):
        p = f"blk.{i}."
        out += [(p + "attn_norm.weight", (s.hidden,)),
                (p + "attn_q.weight", (s.heads * hd, s.hidden)),
                (p + "attn_k.weight", (s.kv_heads * hd, s.hidden)),
                (p + "attn_v.weight", (s.kv_heads * hd, s.hidden)),
                (p + "attn_output.weight", (s.hidden, s.heads * hd)),
                (p + "ffn_norm.weight", (s.hidden,)),
                (p + "ffn_gate.weight", (s.ffn, s.hidden)),
                (p + "ffn_up.weight", (s.ffn, s.hidden)),
                (p + "ffn_down.weight", (s.hidden, s.ffn))]
    out.append(("output_norm.weight", (s.hidden,)))
    if not s.tied:
        out.append(("output.weight", (vocab, s.hidden)))
    return out


def _copy_tokenizer(writer, source: Path) -> int:
    """Copy every ``tokenizer.*`` field of ``source`` into ``writer``; the vocabulary size."""
    import gguf

    reader = gguf.GGUFReader(source)
    vocab = 0
    for key, field in reader.fields.items():
        if not key.startswith(_TOKENIZER_PREFIX):
            continue
        kind = field.types[0]
        if kind == gguf.GGUFValueType.ARRAY:
            sub = field.types[-1]
            values = field.contents()
            writer.add_key_value(key, values, kind, sub_type=sub)
            if key == "tokenizer.ggml.tokens":
                vocab = len(values)
        else:
            writer.add_key_value(key, field.contents(), kind)
    return vocab


def write_f16(path: Path, shapes: Shapes, source: Path, std: float, seed: int) -> None:
    """Stream a random-weight F16 Llama GGUF of ``shapes`` to ``path``."""
    import gguf

    writer = gguf.GGUFWriter(path, "llama")
    vocab = _copy_tokenizer(writer, source)
    writer.add_name(f"synthetic-llama-{path.stem}")
    writer.add_block_count(shapes.layers)
    writer.add_context_length(131072)
    writer.add_embedding_length(shapes.hidden)
    writer.add_feed_forward_length(shapes.ffn)
    writer.add_head_count(shapes.heads)
    writer.add_head_count_kv(shapes.kv_heads)
    writer.add_rope_freq_base(500000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_dimension_count(shapes.hidden // shapes.heads)
    writer.add_vocab_size(vocab)
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    tensors = tensor_shapes(shapes, vocab)
    for name, shape in tensors:
        dtype = np.float32 if len(shape) == 1 else np.float16
        writer.add_tensor_info(name, shape, np.dtype(dtype),
                               int(np.prod(shape)) * np.dtype(dtype).itemsize)
    writer.write_header_to_file(path)
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    rng = np.random.default_rng(seed)
    for name, shape in tensors:
        if len(shape) == 1:
            writer.write_tensor_data(np.ones(shape, np.float32))
            continue
        rows = []
        for start in range(0, shape[0], 1024):  # bounded memory for the 8B tables
            n = min(1024, shape[0] - start)
            rows.append((rng.standard_normal((n, shape[1]), dtype=np.float32) * std)
                        .astype(np.float16))
        writer.write_tensor_data(np.concatenate(rows))
    writer.close()


def quantize(llama_quantize: Path, f16: Path, out: Path, kind: str) -> None:
    """``llama-quantize f16 out kind`` (2 threads)."""
    subprocess.run([str(llama_quantize), str(f16), str(out), kind, "2"], check=True,
                   stdout=subprocess.DEVNULL)


def main(argv: list[str] | None = None) -> int:
    from kvserve.model.default_model import cache_dir

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", choices=sorted(PRESETS), required=True)
    parser.add_argument("--out", type=Path, required=True, help="folder for the files")
    parser.add_argument("--tokenizer-from", type=Path, default=None,
                        help="GGUF whose tokenizer to copy (default: the default model's)")
    parser.add_argument("--quantize", nargs="*", default=[],
                        help="llama-quantize types to write (Q4_K_M, Q4_0, Q8_0, ...)")
    parser.add_argument("--llamacpp-dir", type=Path, default=cache_dir() / "llama.cpp",
                        help="llama.cpp build folder root (default %(default)s)")
    parser.add_argument("--std", type=float, default=0.02, help="weights' standard deviation")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    source = args.tokenizer_from
    if source is None:
        from kvserve.model.default_model import ensure_default_model
        source = next(ensure_default_model().glob("*.gguf"))
    args.out.mkdir(parents=True, exist_ok=True)
    f16 = args.out / f"synthetic-{args.preset}-F16.gguf"
    if not f16.is_file():
        started = time.perf_counter()
        tmp = f16.with_suffix(".tmp")
        write_f16(tmp, PRESETS[args.preset], source, args.std, args.seed)
        tmp.rename(f16)
        print(f"wrote {f16} ({f16.stat().st_size / 2**20:,.1f} MiB) in "
              f"{time.perf_counter() - started:.1f} s", file=sys.stderr)
    tool = args.llamacpp_dir / "build" / "bin" / "llama-quantize"
    for kind in args.quantize:
        target = args.out / f"synthetic-{args.preset}-{kind}.gguf"
        if target.is_file():
            continue
        if not tool.is_file():
            print(f"{tool} is missing: build llama.cpp first (tools/bench_vs_llamacpp.py)",
                  file=sys.stderr)
            return 2
        started = time.perf_counter()
        quantize(tool, f16, target, kind)
        print(f"wrote {target} ({target.stat().st_size / 2**20:,.1f} MiB) in "
              f"{time.perf_counter() - started:.1f} s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
