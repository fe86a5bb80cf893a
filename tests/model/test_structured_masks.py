"""``StructuredOutputs``: masks touch only the constrained rows, allow exactly
what the grammar allows (checked by decoding the allowed tokens, not with
llguidance), follow the sampled tokens, and replay a preempted request."""

from __future__ import annotations

import numpy as np
import pytest
from tiny_llama import write_byte_tokenizer

from kvserve.constraints.masks import StructuredOutputs
from kvserve.core.structured_outputs import StructuredOutputsParams
from kvserve.model.tokenizer import Tokenizer

#: The logits' width: the tiny byte tokenizer's 258 ids, padded as an LM head may be.
VOCAB = 300


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    folder = write_byte_tokenizer(tmp_path_factory.mktemp("byte-tokenizer"))
    tokenizer = Tokenizer(folder)
    structured = StructuredOutputs(folder / "tokenizer.json", VOCAB, (tokenizer.eos_token_id,))
    yield structured, tokenizer
    structured.close()


def masked(structured: StructuredOutputs, sample_ids: list[str], logits: np.ndarray):
    rows = structured.rows(sample_ids)
    structured.apply(logits, rows, structured.fill(rows).result())
    return logits


def test_only_constrained_rows_are_masked_and_they_allow_the_grammar(setup) -> None:
    structured, tokenizer = setup
    structured.add("c", StructuredOutputsParams(choice=("yes", "no")))
    rng = np.random.default_rng(0)
    logits = rng.standard_normal((3, VOCAB)).astype(np.float32)
    original = logits.copy()
    masked(structured, ["u0", "c", "u1"], logits)
    np.testing.assert_array_equal(logits[[0, 2]], original[[0, 2]])
    allowed = np.flatnonzero(np.isfinite(logits[1]))
    texts = {tokenizer.decode([int(t)]) for t in allowed}
    assert texts == {"y", "n"}, texts
    np.testing.assert_array_equal(logits[1, allowed], original[1, allowed])
    structured.remove("c")


def test_masks_follow_the_sampled_tokens_to_eos(setup) -> None:
    structured, tokenizer = setup
    structured.add("r", StructuredOutputsParams(regex="[0-9]{2}"))
    text = ""
    for _ in range(4):
        logits = masked(structured, ["r"], np.zeros((1, VOCAB), dtype=np.float32))
        token = int(np.flatnonzero(np.isfinite(logits[0]))[0])  # the lowest allowed id
        if token == tokenizer.eos_token_id:
            break
        text += tokenizer.decode([token])
        structured.accept("r", token)
    assert len(text) == 2 and text.isdigit(), text
    structured.remove("r")


def test_a_preempted_request_resumes_where_it_was(setup) -> None:
    structured, tokenizer = setup
    params = StructuredOutputsParams(choice=("alpha beta",))
    structured.add("p", params, output_token_ids=tokenizer.encode("alpha"))
    logits = masked(structured, ["p"], np.zeros((1, VOCAB), dtype=np.float32))
    nxt = {tokenizer.decode([int(t)]) for t in np.flatnonzero(np.isfinite(logits[0]))}
    assert nxt == {" "}, nxt
    structured.remove("p")
