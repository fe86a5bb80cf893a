"""Load Hugging Face checkpoints: ``config.json`` -> :class:`ModelConfig`, safetensors -> numpy.

Supported families: ``llama``, ``mistral`` and ``qwen2`` (all share the Llama tensor
layout; qwen2 adds q/k/v biases), and Gemma 3's text model (``gemma3_text``, or
``gemma3`` with a nested ``text_config``: q/k norms and four norms per layer).
Weights keep their Hugging Face names and shapes, ``[out_features, in_features]``
for linear layers; Gemma's norm weights keep their ``w`` (the model multiplies by
``1 + w``).
"""

from __future__ import annotations

import json
import mmap
import struct
from pathlib import Path
from typing import Any

import numpy as np
import structlog

from kvserve.config import ModelConfig
from kvserve.model.rope import qk_row_orders, read_rope, row_order_of

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "phi3", "gemma3_text", "gemma3")
#: The Gemma 3 ``model_type`` s (``gemma3``: the multimodal wrapper, whose
#: ``text_config`` is read; its vision tower is not served).
GEMMA3_MODEL_TYPES = ("gemma3_text", "gemma3")
#: Hugging Face ``Gemma3TextConfig`` defaults of the keys a config may omit.
_GEMMA3_DEFAULTS = {"rope_theta": 1_000_000.0, "rope_local_base_freq": 10_000.0,
                    "query_pre_attn_scalar": 256, "sliding_window": 4096,
                    "sliding_window_pattern": 6, "hidden_activation": "gelu_pytorch_tanh",
                    "tie_word_embeddings": True, "max_position_embeddings": 131072}

#: ``config.json`` keys that change no number kvserve computes: bookkeeping,
#: training-only settings (dropout, initialisation), generation defaults
#: (read from ``generation_config.json``), token ids read elsewhere.
HARMLESS_CONFIG_KEYS = frozenset({
    "architectures", "model_type", "torch_dtype", "dtype", "transformers_version",
    "use_cache", "initializer_range", "attention_dropout", "pretraining_tp", "pad_token_id",
    "bos_token_id", "eos_token_id", "_name_or_path", "resid_pdrop", "embd_pdrop",
    "auto_map", "tokenizer_class", "_attn_implementation_autoset", "output_attentions",
    "output_hidden_states", "return_dict", "use_return_dict", "tie_encoder_decoder",
    "is_decoder", "is_encoder_decoder", "chunk_size_feed_forward", "id2label", "label2id",
    "problem_type", "task_specific_params", "finetuning_task", "tf_legacy_loss",
    "pruned_heads", "torchscript", "add_cross_attention", "cross_attention_hidden_size",
    "decoder_start_token_id", "sep_token_id", "prefix", "max_length", "min_length",
    "do_sample", "early_stopping", "num_beams", "temperature", "top_k", "top_p",
    "repetition_penalty", "length_penalty", "no_repeat_ngram_size", "bad_words_ids",
    "num_return_sequences", "output_scores", "return_dict_in_generate", "forced_bos_token_id",
    "forced_eos_token_id", "remove_invalid_values", "exponential_decay_length_penalty",
    "suppress_tokens", "begin_suppress_tokens", "typical_p", "encoder_no_repeat_ngram_size",
    "diversity_penalty", "num_beam_groups", "use_bfloat16", "unsloth_fixed",
})
#: The keys each Llama-family ``model_type`` reads (:func:`_llama_fields`);
#: with :data:`HARMLESS_CONFIG_KEYS`, every key its transformers config class
#: writes (``tests/model/test_families.py`` checks this against the
#: reference checkpoints' configs).
_COMMON_KEYS = {"vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                "num_attention_heads", "num_key_value_heads", "head_dim", "rms_norm_eps",
                "rope_theta", "rope_scaling", "rope_parameters", "max_position_embeddings",
                "tie_word_embeddings", "hidden_act", "attention_bias", "mlp_bias",
                "partial_rotary_factor", "quantization_config", "layer_types",
                "rope_freq_factors"}
CONFIG_KEYS_READ = {
    "llama": _COMMON_KEYS,
    "mistral": _COMMON_KEYS | {"sliding_window"},
    "qwen2": _COMMON_KEYS | {"sliding_window", "use_sliding_window", "max_window_layers"},
    "qwen3": _COMMON_KEYS | {"sliding_window", "use_sliding_window", "max_window_layers"},
    "phi3": _COMMON_KEYS | {"sliding_window", "original_max_position_embeddings"},
}
_log = structlog.get_logger()

# Tensors some checkpoints carry that inference does not need.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def load_model_config(path: Path) -> ModelConfig:
    """Read ``path/config.json`` into a :class:`ModelConfig`.

    Defaults follow Hugging Face: ``num_key_value_heads`` = ``num_attention_heads``,
    ``head_dim`` = hidden / heads, ``tie_word_embeddings`` False, ``rope_theta`` 10000,
    ``rms_norm_eps`` 1e-6, ``attention_bias`` True for qwen2 (q/k/v biases).
    ``eos_token_id`` may be an int or a list; ids from ``generation_config.json``,
    if present, are added. :func:`_llama_fields` reads the Llama family's RoPE,
    sliding windows and q/k norms, :func:`_gemma3_fields` Gemma 3's keys; each
    refuses, naming the key, what would change the math and is not computed.

    Args:
        path: checkpoint folder.

    Raises:
        FileNotFoundError: no ``config.json``.
        ValueError: unsupported ``model_type`` (named in the message), a missing key,
            or a Gemma 3 feature the model code does not compute (soft-capping,
            RoPE scaling, another activation; :func:`_gemma3_fields`).
    """
    path = Path(path)
    cfg = json.loads((path / "config.json").read_text(encoding="utf-8"))
    model_type = cfg.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(f"{path / 'config.json'}: unsupported model_type {model_type!r} "
                         f"(supported: {', '.join(SUPPORTED_MODEL_TYPES)})")
    extra: dict[str, Any] = {}
    if model_type in GEMMA3_MODEL_TYPES:
        if model_type == "gemma3":
            if not isinstance(cfg.get("text_config"), dict):
                raise ValueError(f"{path / 'config.json'}: model_type 'gemma3' without a "
                                 "'text_config' object")
            outer = {k: cfg[k] for k in ("bos_token_id", "eos_token_id") if k in cfg}
            cfg = {**outer, **cfg["text_config"]}
        cfg = {**_GEMMA3_DEFAULTS, **{k: v for k, v in cfg.items() if v is not None}}
    try:
        extra = (_gemma3_fields(path, cfg) if model_type in GEMMA3_MODEL_TYPES
                 else _llama_fields(path, cfg, model_type))
        heads = int(cfg["num_attention_heads"])
        hidden = int(cfg["hidden_size"])
        fields = dict(
            name=path.name,
            model_type=model_type,
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(cfg["intermediate_size"]),
            num_hidden_layers=int(cfg["num_hidden_layers"]),
            num_attention_heads=heads,
            num_key_value_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=int(cfg.get("head_dim") or hidden // heads),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=float(cfg.get("rope_theta", 10000.0)),
            max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=model_type == "qwen2",
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=_eos_ids(path, cfg),
        )
    except KeyError as exc:
        raise ValueError(f"{path / 'config.json'}: missing key {exc.args[0]!r}") from None
    try:
        return ModelConfig(**{**fields, **extra})
    except ValueError as exc:
        raise ValueError(f"{path / 'config.json'}: {exc}") from None


def unread_config_keys(cfg: dict[str, Any], model_type: str) -> list[str]:
    """Keys of a Llama-family ``config.json`` dict that kvserve neither reads
    nor knows to be harmless (:data:`CONFIG_KEYS_READ`), sorted."""
    read = CONFIG_KEYS_READ.get(model_type, set())
    return sorted(k for k in cfg if k not in read and k not in HARMLESS_CONFIG_KEYS)


def _llama_fields(path: Path, cfg: dict[str, Any], model_type: str) -> dict[str, Any]:
    """The :class:`ModelConfig` fields of a Llama-family config (``llama``,
    ``mistral``, ``qwen2``, ``qwen3``, ``phi3``) beyond the common ones:
    RoPE (``kvserve.model.rope.read_rope``: ``rope_theta`` wherever it is,
    scaled types), sliding windows (Mistral and Phi-3: every layer when
    ``sliding_window`` is set; Qwen: layers from ``max_window_layers`` when
    ``use_sliding_window``; or ``layer_types`` as given), Qwen3's q/k norms.

    Raises ValueError naming the key for what would change the math and is
    not computed: another activation, MLP biases, attention biases beyond
    Qwen2's q/k/v, a RoPE type or key :func:`read_rope` refuses, a
    ``quantization_config`` (pre-quantized GPTQ / AWQ / FP8 weights).
    Keys it does not know are logged (``config_keys_not_read``), not refused.
    """
    where = f"{path / 'config.json'}"
    act = cfg.get("hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"{where}: hidden_act = {act!r} is not supported (silu)")
    if cfg.get("mlp_bias"):
        raise ValueError(f"{where}: mlp_bias = true is not supported (MLP without biases)")
    if cfg.get("attention_bias") and model_type != "qwen2":
        raise ValueError(f"{where}: attention_bias = true is not supported for {model_type} "
                         "(its q/k/v/o biases; Qwen2's q/k/v biases are)")
    if cfg.get("quantization_config"):
        method = cfg["quantization_config"].get("quant_method", "?") \
            if isinstance(cfg["quantization_config"], dict) else "?"
        raise ValueError(f"{where}: quantization_config ({method}) is not supported: serve "
                         "the float checkpoint or a GGUF")
    spec = read_rope(cfg, where)
    layers = int(cfg["num_hidden_layers"])
    window = cfg.get("sliding_window")
    types = cfg.get("layer_types")
    if model_type in ("qwen2", "qwen3"):
        if not cfg.get("use_sliding_window"):
            window = None
        if types is None:
            first = int(cfg.get("max_window_layers", layers))
            types = ["sliding_attention" if window is not None and i >= first
                     else "full_attention" for i in range(layers)]
    elif model_type == "llama":
        window = None
    if types is None:
        types = ["sliding_attention" if window else "full_attention"] * layers
    if "sliding_attention" not in types:
        window = None
    unread = unread_config_keys(cfg, model_type)
    if unread:
        _log.warning("config_keys_not_read", file=where, keys=unread)
    return {
        "rope_theta": spec.theta,
        "rope_scaling": None if spec.is_default else spec,
        "layer_types": tuple(types),
        "sliding_window": int(window) if window else None,
        "qk_norm": model_type == "qwen3",
    }


def _gemma3_fields(path: Path, cfg: dict[str, Any]) -> dict[str, Any]:
    """The Gemma 3 fields of :class:`ModelConfig` from a ``Gemma3TextConfig``
    dict (defaults already merged in).

    ``layer_types`` comes from the list when present, else from
    ``sliding_window_pattern`` as Hugging Face derives it (layer i is full
    iff ``(i + 1) % pattern == 0``: 6 gives layers 5, 11, 17, ... full).
    RoPE: :func:`kvserve.model.rope.read_rope` for the full layers (Gemma 3
    1B and larger scale them linearly), plain RoPE of
    ``rope_local_base_freq`` for the sliding ones.
    Raises ValueError (naming the file) for what this model code does not
    compute: logit soft-capping, a scaled RoPE on sliding layers, another
    activation, or a RoPE :func:`read_rope` refuses.
    """
    where = path / "config.json"
    for key in ("final_logit_softcapping", "attn_logit_softcapping"):
        if cfg.get(key) is not None:
            raise ValueError(f"{where}: {key} = {cfg[key]!r} is not supported (Gemma 3 "
                             "without soft-capping only, as the 270M and 1B)")
    # full layers: rope_theta and any rope_scaling (transformers 4), or
    # rope_parameters["full_attention"] (5); sliding layers: plain RoPE of
    # rope_local_base_freq, or rope_parameters["sliding_attention"]
    full = read_rope(cfg, str(where), "full_attention", default_theta=cfg["rope_theta"])
    local_theta = cfg["rope_local_base_freq"]
    params = cfg.get("rope_parameters")
    if isinstance(params, dict) and isinstance(params.get("sliding_attention"), dict):
        local = read_rope(cfg, str(where), "sliding_attention", default_theta=local_theta)
        if not local.is_default:
            raise ValueError(f"{where}: rope_parameters['sliding_attention'] has rope_type "
                             f"{local.rope_type!r}; only 'default' is supported there")
        local_theta = local.theta
    if cfg["hidden_activation"] not in ("gelu_pytorch_tanh", "gelu_tanh"):
        raise ValueError(f"{where}: hidden_activation {cfg['hidden_activation']!r} is not "
                         "supported (gelu_pytorch_tanh)")
    layers = int(cfg["num_hidden_layers"])
    types = cfg.get("layer_types")
    if types is None:
        pattern = int(cfg["sliding_window_pattern"])
        types = ["full_attention" if (i + 1) % pattern == 0 else "sliding_attention"
                 for i in range(layers)]
    return {
        "layer_types": tuple(types),
        "sliding_window": int(cfg["sliding_window"]),
        "rope_theta": full.theta,
        "rope_scaling": None if full.is_default else full,
        "rope_local_base_freq": float(local_theta),
        "query_pre_attn_scalar": float(cfg["query_pre_attn_scalar"]),
        "hidden_activation": "gelu_pytorch_tanh",
        "norm_offset": 1.0,
        "embedding_multiplier": float(int(cfg["hidden_size"]) ** 0.5),
        "qk_norm": True,
        "sandwich_norms": True,
    }


def _as_id_list(value: Any) -> list[int]:
    """An ``eos_token_id`` value (None, int or list of ints) as a list."""
    if value is None:
        return []
    return [int(v) for v in value] if isinstance(value, list) else [int(value)]


def _eos_ids(path: Path, cfg: dict[str, Any]) -> tuple[int, ...]:
    """EOS ids from config.json, then generation_config.json, without duplicates."""
    ids = _as_id_list(cfg.get("eos_token_id"))
    gen = path / "generation_config.json"
    if gen.is_file():
        ids += _as_id_list(json.loads(gen.read_text(encoding="utf-8")).get("eos_token_id"))
    return tuple(dict.fromkeys(ids))


def expected_tensor_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Required tensor names and their HF shapes for ``config``.

    ``lm_head.weight`` is included only when the embeddings are not tied; q/k/v
    biases only when ``config.attention_bias``; ``self_attn.{q,k}_norm.weight``
    ([head_dim]) when ``config.qk_norm``; ``{pre,post}_feedforward_layernorm.weight``
    when ``config.sandwich_norms``.
    """
    h, hd, ffn = config.hidden_size, config.head_dim, config.intermediate_size
    q, kv = config.num_attention_heads * hd, config.num_key_value_heads * hd
    shapes: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (config.vocab_size, h),
        "model.norm.weight": (h,),
    }
    if not config.tie_word_embeddings:
        shapes["lm_head.weight"] = (config.vocab_size, h)
    layer = {
        "self_attn.q_proj.weight": (q, h), "self_attn.k_proj.weight": (kv, h),
        "self_attn.v_proj.weight": (kv, h), "self_attn.o_proj.weight": (h, q),
        "mlp.gate_proj.weight": (ffn, h), "mlp.up_proj.weight": (ffn, h),
        "mlp.down_proj.weight": (h, ffn),
        "input_layernorm.weight": (h,), "post_attention_layernorm.weight": (h,),
    }
    if config.qk_norm:
        layer.update({"self_attn.q_norm.weight": (hd,), "self_attn.k_norm.weight": (hd,)})
    if config.sandwich_norms:
        layer.update({"pre_feedforward_layernorm.weight": (h,),
                      "post_feedforward_layernorm.weight": (h,)})
    if config.attention_bias:
        layer.update({"self_attn.q_proj.bias": (q,), "self_attn.k_proj.bias": (kv,),
                      "self_attn.v_proj.bias": (kv,)})
    for i in range(config.num_hidden_layers):
        shapes.update({f"model.layers.{i}.{k}": v for k, v in layer.items()})
    return shapes


def _optional_tensor_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Tensors that may be present but are not required (tied lm_head, llama o_proj bias)."""
    opt: dict[str, tuple[int, ...]] = {}
    if config.tie_word_embeddings:
        opt["lm_head.weight"] = (config.vocab_size, config.hidden_size)
    if config.attention_bias:
        for i in range(config.num_hidden_layers):
            opt[f"model.layers.{i}.self_attn.o_proj.bias"] = (config.hidden_size,)
    return opt


def load_weights(path: Path, config: ModelConfig, dtype: Any = np.float32) -> dict[str, np.ndarray]:
    """Load every ``*.safetensors`` file in ``path`` as numpy arrays of ``dtype``.

    BF16, F16, F32 and F64 tensors are accepted (BF16 is widened to float32 before
    the cast). Unneeded tensors (``rotary_emb.inv_freq``) are dropped; other unknown
    names are dropped with a warning event.

    Args:
        path: checkpoint folder.
        config: the model's config, to check names and shapes.
        dtype: numpy dtype of the returned arrays (default float32).

    Returns:
        ``{hf_name: array}``, C-contiguous, HF shapes (``[out, in]`` for linear layers).
        With tied embeddings ``lm_head.weight`` is usually absent.

    Raises:
        FileNotFoundError: no ``*.safetensors`` file in ``path``.
        ValueError: a required tensor is missing, a shape is wrong, a name appears in
            two files, or a dtype is unsupported; the message names file and tensor.
    """
    path = Path(path)
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors file in {path}")
    shapes = expected_tensor_shapes(config)
    shapes.update(_optional_tensor_shapes(config))
    weights: dict[str, np.ndarray] = {}
    origin: dict[str, Path] = {}
    for file in files:
        for name, arr in _split_fused(_read_safetensors(file), config).items():
            if name.endswith(_IGNORED_SUFFIXES):
                continue
            if name not in shapes:
                _log.warning("unexpected_tensor_dropped", file=str(file), tensor=name)
                continue
            if name in weights:
                raise ValueError(f"tensor {name!r} appears in both {origin[name]} and {file}")
            if tuple(arr.shape) != shapes[name]:
                raise ValueError(f"{file}: tensor {name!r} has shape {tuple(arr.shape)}, "
                                 f"expected {shapes[name]}")
            weights[name] = np.ascontiguousarray(arr, dtype=dtype)
            origin[name] = file
    missing = [n for n in expected_tensor_shapes(config) if n not in weights]
    if missing:
        raise ValueError(f"{path}: missing tensor {missing[0]!r}"
                         + (f" and {len(missing) - 1} more" if len(missing) > 1 else ""))
    orders = qk_row_orders(config)
    for name in list(weights) if orders is not None else ():
        order = row_order_of(name, orders)
        if order is not None:  # a partial rotary: q/k rows as the kernels rotate them
            weights[name] = np.ascontiguousarray(weights[name][order])
    return weights


def _split_fused(tensors: dict[str, np.ndarray], config: ModelConfig) -> dict[str, np.ndarray]:
    """Phi-3's fused projections under Llama's names: ``self_attn.qkv_proj``
    [(nh + 2 nkv) hd, H] as ``q_proj`` / ``k_proj`` / ``v_proj`` (rows in that
    order) and ``mlp.gate_up_proj`` [2 I, H] as ``gate_proj`` / ``up_proj``
    (gate first, as ``Phi3MLP`` chunks it); views, no copy. Other names pass."""
    out: dict[str, np.ndarray] = {}
    q = config.num_attention_heads * config.head_dim
    kv = config.num_key_value_heads * config.head_dim
    inter = config.intermediate_size
    for name, arr in tensors.items():
        if name.endswith("self_attn.qkv_proj.weight") and arr.shape[0] == q + 2 * kv:
            stem = name.removesuffix("qkv_proj.weight")
            out.update({f"{stem}q_proj.weight": arr[:q], f"{stem}k_proj.weight": arr[q:q + kv],
                        f"{stem}v_proj.weight": arr[q + kv:]})
        elif name.endswith("mlp.gate_up_proj.weight") and arr.shape[0] == 2 * inter:
            stem = name.removesuffix("gate_up_proj.weight")
            out.update({f"{stem}gate_proj.weight": arr[:inter],
                        f"{stem}up_proj.weight": arr[inter:]})
        else:
            out[name] = arr
    return out


_DTYPES = {"F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": np.uint16}


def _read_safetensors(file: Path) -> dict[str, np.ndarray]:
    """Read one safetensors file into numpy (float32 for BF16, native dtype otherwise).

    Parses the header directly so that BF16 works (``safetensors.numpy`` cannot
    represent it): BF16 bits are the high half of a float32, so ``u16 << 16`` is exact.
    """
    with open(file, "rb") as handle:
        (header_len,) = struct.unpack("<Q", handle.read(8))
        header = json.loads(handle.read(header_len))
        with mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ) as buf:
            base = 8 + header_len
            out = {}
            for name, info in header.items():
                if name == "__metadata__":
                    continue
                np_dtype = _DTYPES.get(info["dtype"])
                if np_dtype is None:
                    raise ValueError(f"{file}: tensor {name!r} has unsupported dtype {info['dtype']}")
                start, end = info["data_offsets"]
                arr = np.frombuffer(buf, dtype=np_dtype, count=(end - start) // np.dtype(np_dtype).itemsize,
                                    offset=base + start).reshape(info["shape"])
                if info["dtype"] == "BF16":
                    arr = (arr.astype(np.uint32) << 16).view(np.float32)
                else:
                    arr = arr.copy()  # detach from the mmap before it closes
                out[name] = arr
    return out


def find_gguf(path: Path) -> Path:
    """The ``.gguf`` file in checkpoint folder ``path`` (``--quantization q4``,
    or a folder served from its GGUF).

    The default model's folder gets the GGUF it is converted from (fetched
    now if an older cache lacks it). Raises FileNotFoundError when ``path``
    holds none, ValueError when it holds several.
    """
    from kvserve.model import default_model

    path = Path(path)
    found = sorted(path.glob("*.gguf"))
    if not found and default_model.is_default_model_folder(path):
        found = [default_model.ensure_default_gguf(path)]
    if not found:
        raise FileNotFoundError(f"--quantization q4 serves the blocks of a GGUF file, and {path} "
                                "holds none: put the .gguf this checkpoint was converted from "
                                "into the folder")
    if len(found) > 1:
        raise ValueError(f"{path} holds several .gguf files ({', '.join(p.name for p in found)}); "
                         "keep the one this checkpoint was converted from")
    return found[0]


def load_checkpoint_weights(path: Path, config: ModelConfig, quantization: str,
                            dtype: Any = None) -> dict[str, Any]:
    """The weights of checkpoint folder ``path`` for ``--quantization quantization``.

    A folder of ``*.safetensors`` with a float scheme (``none``, ``int8``,
    ``w8a8``): :func:`load_weights`. A scheme that serves GGUF blocks
    (``q4``, ``w4a8``), or a folder holding a GGUF and no safetensors (a
    ``--model file.gguf``): the GGUF's tensors in place
    (``kvserve.model.gguf_weights.read_gguf_weights``; blocks only for the
    block schemes, else dequantized to float32 in memory), its K-quant
    panels kept in ``path``. Logs ``gguf_weights`` with how each tensor type
    is served.

    Raises what :func:`load_weights`, :func:`find_gguf` and
    ``read_gguf_weights`` raise (``ConversionError`` is a ValueError).
    """
    from kvserve.model.gguf_weights import read_gguf_weights
    from kvserve.model.quantization import BLOCK_SCHEMES

    path = Path(path)
    blocks = quantization in BLOCK_SCHEMES
    if not blocks and any(path.glob("*.safetensors")):
        return load_weights(path, config, dtype=dtype)
    gguf = find_gguf(path)
    shapes = expected_tensor_shapes(config)
    shapes.update(_optional_tensor_shapes(config))
    weights, paths = read_gguf_weights(gguf, shapes, config.num_attention_heads,
                                       config.num_key_value_heads, blocks, path,
                                       qk_row_orders(config))
    missing = [n for n in expected_tensor_shapes(config) if n not in weights]
    if missing:
        raise ValueError(f"{gguf}: missing tensor {missing[0]!r}"
                         + (f" and {len(missing) - 1} more" if len(missing) > 1 else ""))
    _log.info("gguf_weights", gguf=str(gguf), paths=paths,
              message="GGUF tensors served as " + "; ".join(
                  f"{kind}: {how}" for kind, how in sorted(paths.items())))
    return weights
