"""Hugging Face ``tokenizers`` tokenizers built from a GGUF file's tokenizer metadata.

Two llama.cpp tokenizer models (``tokenizer.ggml.model``) are built, with the
``tokenizers`` library only (no sentencepiece or transformers at run time):

- ``gpt2``: byte-level BPE from ``tokenizer.ggml.tokens`` / ``merges``
  (:func:`build_bpe_tokenizer`; SmolLM2, the default model);
- ``llama``: SentencePiece (:func:`build_spm_tokenizer`; Gemma 3): a BPE model
  with byte fallback whose merges come from the pieces' scores, as
  transformers' ``SentencePieceExtractor`` makes them and as llama.cpp's SPM
  tokenizer (``llm_tokenizer_spm``) applies them: the adjacent pair whose
  concatenation is the best-scored vocabulary piece merges first.

Token types (``tokenizer.ggml.token_type``, llama.cpp's ``llama_token_type``):
1 normal, 2 unknown, 3 control (special added tokens), 4 user-defined (plain
added tokens, matched in the raw text before the model, as llama.cpp's
``tokenizer_st_partition`` does), 5 unused, 6 byte (``<0xAB>``).

Neither tokenizer has a post-processor: BOS is added by
``kvserve.model.tokenizer.Tokenizer.encode`` when ``tokenizer_config.json``
says ``add_bos_token``.
"""

from __future__ import annotations

from typing import Any, Sequence

CONTROL = 3
"""llama.cpp token type of control (special) tokens."""
USER_DEFINED = 4
"""llama.cpp token type of user-defined tokens (plain added tokens)."""
BYTE = 6
"""llama.cpp token type of byte-fallback tokens ``<0x00>`` .. ``<0xFF>``."""

SPIECE_UNDERLINE = "▁"
"""SentencePiece's stand-in for a space (U+2581)."""


class TokenizerBuildError(ValueError):
    """The GGUF tokenizer metadata cannot make a tokenizer (duplicate pieces, bad lengths)."""


def _added_tokens(tokens: Sequence[str], token_types: Sequence[int]) -> tuple[list, list]:
    """``(special, plain)`` ``AddedToken`` lists: control tokens special, user-defined plain;
    neither normalized (they match the raw text)."""
    from tokenizers import AddedToken

    special = [AddedToken(t, special=True, normalized=False)
               for t, ty in zip(tokens, token_types) if ty == CONTROL]
    plain = [AddedToken(t, special=False, normalized=False)
             for t, ty in zip(tokens, token_types) if ty == USER_DEFINED]
    return special, plain


def build_bpe_tokenizer(tokens: list[str], merges: list[str], token_types: list[int],
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

    Raises:
        TokenizerBuildError: two tokens have the same string.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {tok: i for i, tok in enumerate(tokens)}
    if len(vocab) != len(tokens):
        raise TokenizerBuildError("tokenizer.ggml.tokens holds duplicate token strings")
    pairs = [tuple(m.split(" ", 1)) for m in merges]
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=pairs, fuse_unk=False, byte_fallback=False))
    steps = [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)]
    if pre in ("smollm", "starcoder", "refact"):
        steps.insert(0, pre_tokenizers.Digits(individual_digits=True))
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(steps)
    tokenizer.decoder = decoders.ByteLevel()
    special, plain = _added_tokens(tokens, token_types)
    tokenizer.add_special_tokens(special)
    tokenizer.add_tokens(plain)
    return tokenizer


def spm_merges(tokens: Sequence[str], scores: Sequence[float],
               token_types: Sequence[int]) -> list[tuple[str, str]]:
    """BPE merges equivalent to SentencePiece's score-ranked bigram merging.

    Every split of a normal piece (type 1) into two vocabulary pieces is a
    merge, ranked by the merged piece's score, highest first; ties keep
    vocabulary order (the piece's id, then the left part's and the right
    part's ids), as transformers' ``SentencePieceExtractor.extract`` does.

    Args:
        tokens: piece strings, index = id.
        scores: float score of each piece (``tokenizer.ggml.scores``).
        token_types: type of each piece; only normal pieces (1) are merge results.

    Returns:
        ``[(left, right), ...]`` in rank order.
    """
    vocab = {t: i for i, t in enumerate(tokens)}
    ranked = []
    for idx, (piece, score, kind) in enumerate(zip(tokens, scores, token_types)):
        if kind != 1 or len(piece) < 2:
            continue
        local = []
        for cut in range(1, len(piece)):
            left, right = piece[:cut], piece[cut:]
            li, ri = vocab.get(left), vocab.get(right)
            if li is not None and ri is not None:
                local.append((li, ri, left, right))
        local.sort()
        ranked.extend((-float(score), idx, left, right) for _, _, left, right in local)
    ranked.sort(key=lambda m: (m[0], m[1]))
    return [(left, right) for _, _, left, right in ranked]


def build_spm_tokenizer(tokens: list[str], scores: list[float], token_types: list[int],
                        unk_id: int | None = None, add_space_prefix: bool = False) -> Any:
    """Build an HF ``tokenizers.Tokenizer`` equivalent to a GGUF SentencePiece (``llama``) tokenizer.

    The model is BPE with ``byte_fallback=True`` (a character outside the
    vocabulary becomes its UTF-8 bytes' ``<0xAB>`` tokens) and the merges of
    :func:`spm_merges`; the normalizer replaces ``" "`` with ``"▁"`` (after
    prepending ``"▁"`` when ``add_space_prefix``); no pre-tokenizer (SentencePiece
    merges across the whole text); the decoder is ``Replace("▁", " ")``,
    ``ByteFallback``, ``Fuse`` (plus ``Strip`` of the one leading space with
    ``add_space_prefix``), transformers' ``LlamaConverter`` decoder. Control
    tokens (type 3) are special added tokens; user-defined tokens (type 4) are
    plain added tokens matched in the raw text before normalization, as
    llama.cpp matches them (Gemma's runs of spaces, tabs and newlines are such
    tokens).

    Args:
        tokens: ``tokenizer.ggml.tokens`` (SentencePiece pieces, index = id).
        scores: ``tokenizer.ggml.scores``, one float per piece.
        token_types: ``tokenizer.ggml.token_type``, one int per piece.
        unk_id: ``tokenizer.ggml.unknown_token_id`` (None: no unknown token).
        add_space_prefix: ``tokenizer.ggml.add_space_prefix`` (Gemma: False).

    Returns:
        A ``tokenizers.Tokenizer`` with no post-processor (no BOS is added).

    Raises:
        TokenizerBuildError: lengths differ, or two pieces have the same string.
    """
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers

    if not len(tokens) == len(scores) == len(token_types):
        raise TokenizerBuildError(f"tokenizer metadata lengths differ: {len(tokens)} tokens, "
                                  f"{len(scores)} scores, {len(token_types)} types")
    vocab = {tok: i for i, tok in enumerate(tokens)}
    if len(vocab) != len(tokens):
        raise TokenizerBuildError("tokenizer.ggml.tokens holds duplicate token strings")
    unk = tokens[unk_id] if unk_id is not None and 0 <= unk_id < len(tokens) else None
    model = models.BPE(vocab=vocab, merges=spm_merges(tokens, scores, token_types),
                       unk_token=unk, fuse_unk=True, byte_fallback=True)
    tokenizer = Tokenizer(model)
    steps = [normalizers.Replace(Regex(" "), SPIECE_UNDERLINE)]
    if add_space_prefix:
        steps.insert(0, normalizers.Prepend(SPIECE_UNDERLINE))
    tokenizer.normalizer = normalizers.Sequence(steps)
    dec = [decoders.Replace(SPIECE_UNDERLINE, " "), decoders.ByteFallback(), decoders.Fuse()]
    if add_space_prefix:
        dec.append(decoders.Strip(" ", 1, 0))
    tokenizer.decoder = decoders.Sequence(dec)
    special, plain = _added_tokens(tokens, token_types)
    tokenizer.add_special_tokens(special)
    tokenizer.add_tokens(plain)
    return tokenizer
