"""The SentencePiece (GGUF ``llama`` tokenizer model) tokenizer built with ``tokenizers``.

Unit tests on a tiny vocabulary check the rules (score-ranked merges, byte
fallback, user-defined and control tokens, the decoder); the ``gemma``
tests check the real Gemma 3 vocabulary against two references the code did
not produce: the golden file's ``prompt_token_ids`` (Hugging Face
transformers) and ``tests/data/gemma_tokenizer_llamacpp.json``, the ids
llama.cpp's own tokenizer gave for 317 varied texts (``llama-server``
``/tokenize`` with ``add_special: false`` on ``gemma-3-270m-q4_k_m.gguf``,
llama.cpp 0.25.3 ggml, generated once).
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
from gemma_fixture import gemma_model_path  # noqa: F401 - the fixture

from kvserve.model.gguf_tokenizer import build_spm_tokenizer, spm_merges
from kvserve.model.tokenizer import Tokenizer

DATA = Path(__file__).resolve().parents[1] / "data" / "gemma_tokenizer_llamacpp.json"
GOLDEN = Path(__file__).resolve().parents[2].parent / "shared" / "golden" / "gemma3_270m_greedy.json"

# ---------------------------------------------------------------- tiny vocabulary

BYTES = [f"<0x{b:02X}>" for b in range(256)]
#      id: 0       1        2        3       4             5     6-261  262  263  264  265   266   267    268    269
TOKENS = ["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "  ", *BYTES, "a", "b", "▁", "ab", "▁a", "▁ab", "ba", "aba"]
TYPES = [3, 3, 3, 2, 3, 4, *[6] * 256, 1, 1, 1, 1, 1, 1, 1, 1]
SCORES = [0.0] * 6 + [0.0] * 256 + [-100.0, -101.0, -102.0, -3.0, -1.0, -2.0, -50.0, -60.0]
ID = {t: i for i, t in enumerate(TOKENS)}


@pytest.fixture(scope="module")
def tiny() -> object:
    return build_spm_tokenizer(TOKENS, SCORES, TYPES, unk_id=3, add_space_prefix=False)


def test_merges_ranked_by_merged_piece_score() -> None:
    # Scores: ▁a -1, ▁ab -2, ab -3, ba -50, aba -60: every split of a normal piece
    # into two vocabulary pieces, best-scored piece first; single characters none.
    assert spm_merges(TOKENS, SCORES, TYPES) == [
        ("▁", "a"), ("▁", "ab"), ("▁a", "b"), ("a", "b"), ("b", "a"), ("a", "ba"), ("ab", "a")]


def test_bigram_merging_follows_scores(tiny) -> None:
    # "▁ab": ▁+a (score -1) merges before a+b (-3), then ▁a+b (-2) gives ▁ab.
    assert tiny.encode(" ab", add_special_tokens=False).ids == [ID["▁ab"]]
    # "aba": a+b (-3) before b+a (-50); then ab+a is "aba" (-60).
    assert tiny.encode("aba", add_special_tokens=False).ids == [ID["aba"]]
    # "bab": a+b (-3) beats b+a (-50), and b + ab has no piece.
    assert tiny.encode("bab", add_special_tokens=False).ids == [ID["b"], ID["ab"]]


def test_byte_fallback_and_no_prefix_space(tiny) -> None:
    # "é" is not in the vocabulary: its UTF-8 bytes C3 A9 as byte pieces.
    assert tiny.encode("aé", add_special_tokens=False).ids == [ID["a"], ID["<0xC3>"], ID["<0xA9>"]]
    # add_space_prefix false: "a" at the start gets no "▁".
    assert tiny.encode("a", add_special_tokens=False).ids == [ID["a"]]


def test_added_tokens_match_raw_text(tiny) -> None:
    # The user-defined "  " (two raw spaces) wins over "▁▁"; control tokens are special.
    assert tiny.encode("a  b", add_special_tokens=False).ids == [ID["a"], ID["  "], ID["b"]]
    enc = tiny.encode("<start_of_turn>ab", add_special_tokens=False)
    assert enc.ids == [ID["<start_of_turn>"], ID["ab"]]
    assert tiny.decode(enc.ids, skip_special_tokens=True) == "ab"


def test_decoder_restores_spaces_and_bytes(tiny) -> None:
    text = "ab ab  é a"
    ids = tiny.encode(text, add_special_tokens=False).ids
    assert tiny.decode(ids, skip_special_tokens=False) == text


def test_kvserve_tokenizer_bytes_and_bos(tmp_path: Path, tiny) -> None:
    tiny.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<bos>", "eos_token": "<eos>", "add_bos_token": True}))
    tok = Tokenizer(tmp_path)
    ids = tok.encode(" aé  b", add_special_tokens=True)
    assert ids[0] == ID["<bos>"]
    assert [tok.id_to_bytes(i) for i in ids[1:]] == [b" a", b"\xc3", b"\xa9", b"  ", b"b"]
    assert tok.id_to_bytes(ID["<start_of_turn>"]) == b"<start_of_turn>"


def test_duplicate_pieces_refused() -> None:
    with pytest.raises(ValueError, match="duplicate"):
        build_spm_tokenizer(["a", "a"], [0.0, 0.0], [1, 1])


# ---------------------------------------------------------------- the real vocabulary


@pytest.fixture(scope="module")
def gemma_tok(gemma_model_path: Path) -> Tokenizer:  # noqa: F811 - the fixture
    return Tokenizer(gemma_model_path)


@pytest.mark.gemma
def test_golden_prompt_ids(gemma_tok: Tokenizer) -> None:
    if not GOLDEN.is_file():
        pytest.skip(f"no {GOLDEN}")
    cases = json.loads(GOLDEN.read_text(encoding="utf-8"))
    assert len(cases) == 6
    for case in cases:
        prompt = case["case"]["prompt"]
        assert gemma_tok.encode(prompt, add_special_tokens=True) == case["prompt_token_ids"], prompt
        assert gemma_tok.decode(case["output_token_ids"]) == case["output_text"]


@pytest.mark.gemma
def test_ids_equal_llama_cpp(gemma_tok: Tokenizer) -> None:
    expected = json.loads(DATA.read_text(encoding="utf-8"))
    assert len(expected) >= 300
    wrong = {text: (gemma_tok.encode(text), ids) for text, ids in expected.items()
             if gemma_tok.encode(text) != ids}
    assert not wrong, list(wrong.items())[:3]


def _varied_texts(n: int) -> list[str]:
    rng = random.Random(30)
    pieces = ["the", " ", "  ", "   ", "\n", "\n\n", "\t", "\r\n", "é", "ß", "日本語", "한국어", "🙂",
              "👨‍👩‍👧", "def f(x):", "    return x", "{", "}", "<", ">", "<b>", "0", "42", "3.14",
              "\u200b", "ﬁ", "—", "…", "\\n", '"', "'"]
    texts = ["", " ", "a", "  leading", "trailing  ", "\t\tindent\n", "x" * 300]
    while len(texts) < n:
        if rng.random() < 0.7:
            texts.append("".join(rng.choice(pieces) for _ in range(rng.randint(1, 25))))
        else:
            texts.append("".join(chr(rng.choice([rng.randint(32, 126), rng.randint(160, 0xD7FF),
                                                 rng.randint(0x1F300, 0x1FAFF)]))
                                 for _ in range(rng.randint(1, 30))))
    return texts


@pytest.mark.gemma
def test_decode_encode_round_trip(gemma_tok: Tokenizer) -> None:
    # "▁" (U+2581) in a text decodes as a space in SentencePiece itself; left out.
    texts = [t for t in [*_varied_texts(300), *json.loads(DATA.read_text(encoding="utf-8"))]
             if "\u2581" not in t]
    assert len(texts) >= 500
    for text in texts:
        ids = gemma_tok.encode(text)
        assert gemma_tok.decode(ids, skip_special_tokens=False) == text, text
        assert b"".join(gemma_tok.id_to_bytes(i) for i in ids).decode("utf-8") == text, text


@pytest.mark.gemma
def test_special_tokens_and_bos(gemma_tok: Tokenizer) -> None:
    assert (gemma_tok.bos_token_id, gemma_tok.eos_token_id) == (2, 1)
    assert gemma_tok.add_bos_token is True
    assert gemma_tok.chat_template is None  # this GGUF has none
    assert gemma_tok.vocab_size == 262144
    assert gemma_tok.encode("<start_of_turn>user") == [105, 2364]
    assert gemma_tok.encode_text("<start_of_turn>") != [105]  # as text, not the control token
