"""RoPE settings (``kvserve.model.rope``) against transformers' own frequencies.

``data/rope_reference.json`` was written by ``tools/make_family_references.py
rope`` with transformers 5.25 (``ROPE_INIT_FUNCTIONS`` on a ``LlamaConfig`` /
``Phi3Config``): per scaled type (``llama3``, ``linear``, ``yarn``,
``longrope``) the config as given (transformers 4's ``rope_theta`` +
``rope_scaling``), the config as transformers 5 saves it (``rope_parameters``),
the inverse frequencies (float32) and the attention factor. Both config forms
must give transformers' frequencies; unknown types and keys are refused.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from kvserve.model.ops import build_rope_cache
from kvserve.model.rope import RopeSpec, inverse_frequencies, read_rope, rope_table

REFERENCE = json.loads((Path(__file__).parent / "data" / "rope_reference.json").read_text())


def _head_dim(cfg: dict) -> int:
    return cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]


@pytest.mark.parametrize("name", sorted(REFERENCE))
@pytest.mark.parametrize("form", ["given", "saved"])
def test_frequencies_match_transformers(name, form):
    ref = REFERENCE[name]
    given = ref["config"]
    cfg = given if form == "given" else {**ref["saved_config"],
                                         "hidden_size": given["hidden_size"],
                                         "num_attention_heads": given["num_attention_heads"]}
    spec = read_rope(cfg, "config.json")
    assert spec.rope_type == name
    hd = _head_dim(given)
    # transformers computes in float32: a few ulps
    np.testing.assert_allclose(inverse_frequencies(spec, hd), ref["inv_freq"], rtol=2e-6)
    assert spec.attention_factor == pytest.approx(ref["attention_factor"], rel=1e-12)
    if "inv_freq_long" in ref:
        np.testing.assert_allclose(inverse_frequencies(spec, hd, long=True),
                                   ref["inv_freq_long"], rtol=2e-6)


def test_table_rows_are_scaled_cos_sin():
    ref = REFERENCE["yarn"]
    spec = read_rope(ref["config"], "config.json")
    table = rope_table(spec, 64, 40)
    p = 37
    angles = p * np.asarray(ref["inv_freq"], np.float64)
    expect = ref["attention_factor"] * np.concatenate([np.cos(angles), np.sin(angles)])
    np.testing.assert_allclose(table[p], expect, rtol=1e-5, atol=1e-6)


def test_longrope_table_switches_to_long_factors_at_the_original_context():
    ref = REFERENCE["longrope"]
    spec = read_rope(ref["config"], "config.json")
    cut = spec.original_max_position
    table = rope_table(spec, 64, cut + 2)
    for p, key in ((cut - 1, "inv_freq"), (cut + 1, "inv_freq_long")):
        angles = p * np.asarray(ref[key], np.float64)
        expect = ref["attention_factor"] * np.concatenate([np.cos(angles), np.sin(angles)])
        # the reference's float32 frequencies (rel. 6e-8) times p ~ 4,096: 1e-3
        np.testing.assert_allclose(table[p], expect, atol=1e-3)


def test_default_equals_the_plain_table():
    spec = read_rope({"rope_parameters": {"rope_type": "default", "rope_theta": 1e6}}, "c")
    assert spec == RopeSpec(1e6) and spec.is_default
    np.testing.assert_array_equal(rope_table(spec, 32, 50), build_rope_cache(32, 50, 1e6))


def test_theta_from_each_place():
    assert read_rope({"rope_theta": 5e5}, "c").theta == 5e5  # transformers 4
    assert read_rope({"rope_parameters": {"rope_theta": 1e6, "rope_type": "default"}},
                     "c").theta == 1e6  # transformers 5
    nested = {"rope_parameters": {"full_attention": {"rope_theta": 1e6, "rope_type": "default"},
                                  "sliding_attention": {"rope_theta": 1e4,
                                                        "rope_type": "default"}}}
    assert read_rope(nested, "c").theta == 1e6
    assert read_rope(nested, "c", "sliding_attention").theta == 1e4
    assert read_rope({}, "c").theta == 10000.0


@pytest.mark.parametrize("params, key", [
    ({"rope_type": "dynamic", "factor": 2.0}, "'dynamic'"),
    ({"rope_type": "su", "factor": 2.0}, "'su'"),
    ({"rope_type": "linear", "factor": 2.0, "low_freq_factor": 1.0}, "'low_freq_factor'"),
    ({"rope_type": "default", "partial_rotary_factor": 1.5}, "partial_rotary_factor"),
    ({"rope_type": "llama3", "factor": 8.0}, "low_freq_factor"),
    ({"rope_type": "linear"}, "factor"),
])
def test_refused_in_one_line_naming_the_key(params, key):
    for cfg in ({"rope_scaling": params, "max_position_embeddings": 4096},
                {"rope_parameters": params, "max_position_embeddings": 4096}):
        with pytest.raises(ValueError, match=key) as err:
            read_rope(cfg, "x/config.json")
        assert "\n" not in str(err.value) and str(err.value).startswith("x/config.json: ")
