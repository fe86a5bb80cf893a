"""Hypothesis strategies of fuzzed request bodies, shared by ``test_api_fuzz.py``
(fake engine) and ``test_api_fuzz_live.py`` (the real engine behind a live server):
random JSON-ish values for the known fields, unknown fields, wrong containers."""

from __future__ import annotations

from hypothesis import strategies as st

SCALARS = st.one_of(
    st.none(), st.booleans(), st.integers(min_value=-2**80, max_value=2**80),
    st.sampled_from([0, 1, -1, 16, 17, 20, 21, 2**63, -2**63 - 1, 4096, 10**9]),
    st.floats(allow_nan=True, allow_infinity=True), st.sampled_from([0.0, -0.0, 1e-300, 1e308]),
    st.text(max_size=12), st.sampled_from(["", "1", "abc", "\x00", "🎉"]))
JSONISH = st.recursive(SCALARS, lambda inner: st.one_of(
    st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=6), inner, max_size=4)),
    max_leaves=12)
MESSAGE = st.fixed_dictionaries({"role": st.one_of(st.sampled_from(
    ["user", "system", "assistant", "tool", "developer"]), JSONISH)},
    optional={"content": st.one_of(st.text(max_size=20), JSONISH,
                                   st.lists(st.fixed_dictionaries(
                                       {"type": st.just("text"), "text": JSONISH})))})
COMMON = ["model", "max_tokens", "temperature", "top_p", "top_k", "min_p", "n", "seed", "stop",
          "stop_token_ids", "ignore_eos", "min_tokens", "presence_penalty", "frequency_penalty",
          "repetition_penalty", "logit_bias", "skip_special_tokens",
          "include_stop_str_in_output", "stream", "stream_options", "priority", "user",
          "logprobs", "echo", "top_logprobs", "max_completion_tokens", "unknown_field"]
ODD_FIELD = {
    "logit_bias": st.dictionaries(st.one_of(st.text(max_size=6),
                                            st.integers(-5, 10**7).map(str)), JSONISH,
                                  max_size=3),
    "stream_options": st.one_of(JSONISH, st.fixed_dictionaries({"include_usage": JSONISH})),
    "stop": st.one_of(JSONISH, st.lists(st.text(max_size=5), max_size=3)),
    "prompt": st.one_of(st.text(max_size=20), JSONISH,
                        st.lists(st.integers(-10, 10**7), max_size=4),
                        st.lists(st.lists(st.integers(-10, 10**7), max_size=3), max_size=3)),
    "messages": st.one_of(JSONISH, st.lists(MESSAGE, max_size=3)),
    "tokens": st.one_of(JSONISH, st.lists(st.integers(-10, 2**70), max_size=4)),
}


@st.composite
def bodies(draw):
    """(path, body): a route and a dict over its fields with odd values."""
    path = draw(st.sampled_from(["/v1/chat/completions", "/v1/completions", "/tokenize",
                                 "/detokenize"]))
    own = {"/v1/chat/completions": ["messages"], "/v1/completions": ["prompt"],
           "/tokenize": ["prompt", "messages", "add_special_tokens"],
           "/detokenize": ["tokens"]}[path]
    body = {}
    for name in own:
        if draw(st.integers(0, 9)) > 0:
            body[name] = draw(ODD_FIELD.get(name, JSONISH))
    for name in draw(st.lists(st.sampled_from(COMMON), max_size=6, unique=True)):
        body[name] = draw(ODD_FIELD.get(name, JSONISH))
    return path, body


def _nums(low: float, high: float, *edges: float) -> st.SearchStrategy:
    return st.one_of(st.floats(low, high), st.integers(int(low), int(high)), st.sampled_from(edges))


#: Values near the valid range of each field (edges included), so that a good
#: share of ``plausible_bodies`` pass validation and reach the engine.
PLAUSIBLE = {
    "max_tokens": st.one_of(st.integers(1, 6), st.sampled_from([0, -1, 100000])),
    "temperature": _nums(0, 2, -0.5, 2.5, 1e-9),
    "top_p": _nums(0, 1, 0.0, 1e-9, 1.5),
    "top_k": st.sampled_from([-1, 0, 1, 2, 50, 10**6]),
    "min_p": _nums(0, 1, -0.1, 1.5),
    "n": st.one_of(st.integers(1, 4), st.sampled_from([0, 17])),
    "seed": st.one_of(st.integers(0, 2**32), st.sampled_from([-1, 2**64])),
    "stop": st.one_of(st.text(max_size=4), st.lists(st.text(max_size=4), max_size=5)),
    "stop_token_ids": st.lists(st.integers(-1, 49160), max_size=3),
    "ignore_eos": st.booleans(),
    "min_tokens": st.integers(0, 8),
    "presence_penalty": _nums(-2, 2, -2.5, 2.5),
    "frequency_penalty": _nums(-2, 2, -2.5, 2.5),
    "repetition_penalty": _nums(0, 2, 0.0, 1e-9),
    "logit_bias": st.dictionaries(st.integers(-1, 49160).map(str),
                                  _nums(-100, 100, -101, 1e9), max_size=3),
    "skip_special_tokens": st.booleans(),
    "include_stop_str_in_output": st.booleans(),
    "stream": st.booleans(),
    "stream_options": st.fixed_dictionaries({}, optional={"include_usage": st.booleans()}),
    "priority": st.integers(-5, 5),
    "user": st.text(max_size=8),
    "logprobs": st.one_of(st.booleans(), st.integers(-1, 21)),
    "echo": st.booleans(),
    "top_logprobs": st.integers(-1, 21),
    "max_completion_tokens": st.one_of(st.none(), st.integers(1, 6)),
}
_TEXT = st.text(min_size=1, max_size=20)
_PROMPT = st.one_of(_TEXT, st.lists(st.integers(0, 49151), min_size=1, max_size=6),
                    st.lists(_TEXT, min_size=1, max_size=2))
_MESSAGES = st.lists(st.fixed_dictionaries(
    {"role": st.sampled_from(["user", "system", "assistant"]), "content": _TEXT}),
    min_size=1, max_size=3)


@st.composite
def plausible_bodies(draw):
    """(path, body): a well-formed /v1 request with a few fields set to values
    near (or just past) their valid range."""
    path = draw(st.sampled_from(["/v1/chat/completions", "/v1/completions"]))
    body = {"messages": draw(_MESSAGES)} if path == "/v1/chat/completions" \
        else {"prompt": draw(_PROMPT)}
    for name in draw(st.lists(st.sampled_from(sorted(PLAUSIBLE)), max_size=5, unique=True)):
        body[name] = draw(PLAUSIBLE[name])
    return path, body
