"""Acceptance (issue 16, disaggregated prefill/decode and the offload tier,
over Ray): ``kvserve serve --prefill-replicas 1 --decode-replicas 1
--kv-offloading-size ...`` serves the golden prompts with the outputs of one
engine, each request prefilled on replica 0 and decoded on replica 1 from
the adopted blocks; both replicas free every block; both attach the tier
the API process created; a prompt the prefill replica refuses gets its 400.
"""

from __future__ import annotations

import time

import httpx
import pytest
from deadlines import HANG_DEADLINE_S, hang_message
from e2e_support import GOLDEN, SERVER_MAX_MODEL_LEN, LiveServer
from test_e2e_data_parallel import assert_golden_as_one_engine

from kvserve.observability.metrics import parse_metrics_text

# slow: the module's shared engine or servers take most of its time (make test-slow).
pytestmark = [pytest.mark.model, pytest.mark.slow]

BLOCK = 16
#: Prompts of at most this many tokens skip the prefill replica (the server's
#: --long-prefill-token-threshold; the default, half the CPU step budget,
#: would send every golden prompt straight to the decode replica).
SHORT_PROMPT_TOKENS = 4


@pytest.fixture(scope="module")
def pd_server(default_model_path, tmp_path_factory):
    server = LiveServer(default_model_path, tmp_path_factory.mktemp("kvserve-pd"),
                        extra_args=["--max-model-len", str(SERVER_MAX_MODEL_LEN),
                                    "--prefill-replicas", "1", "--decode-replicas", "1",
                                    "--long-prefill-token-threshold", str(SHORT_PROMPT_TOKENS),
                                    "--kv-offloading-size", "0.05", "--stats-interval", "0"])
    yield server
    server.stop()


def test_disaggregated_requests_give_one_engines_outputs(pd_server, live_server):
    cases = assert_golden_as_one_engine(pd_server, live_server)
    prefilled = pd_server.log_events("request_prefilled")
    long_prompts = [p for p in GOLDEN if p.values[0] is not None
                    and len(p.values[0]["prompt_token_ids"]) > SHORT_PROMPT_TOKENS]
    assert len(long_prompts) >= len(cases) // 2, "test precondition: most go through prefill"
    assert len(prefilled) >= len(long_prompts) and {e["replica"] for e in prefilled} == {0}
    decoded = [e for e in pd_server.log_events("request_routed") if e.get("role") == "decode"]
    assert {e["replica"] for e in decoded} == {1}


def test_the_decode_replica_reports_the_adopted_blocks_as_cached(pd_server):
    prompt = "Disaggregated serving test. " + "The library opens at nine and closes at six. " * 12
    with httpx.Client(base_url=pd_server.base_url, timeout=300) as client:
        response = client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 4,
                                                         "temperature": 0})
        assert response.status_code == 200, response.text
        usage = response.json()["usage"]
        full_blocks = usage["prompt_tokens"] // BLOCK * BLOCK
        if full_blocks == usage["prompt_tokens"]:
            full_blocks -= BLOCK  # the last prompt token is always computed
        assert usage["prompt_tokens_details"]["cached_tokens"] == full_blocks
        streamed = client.post("/v1/completions", json={
            "prompt": "A streamed disaggregated request: " + prompt, "max_tokens": 4,
            "temperature": 0, "stream": True})
        assert streamed.status_code == 200 and streamed.text.rstrip().endswith("data: [DONE]")


def test_a_short_prompt_skips_the_prefill_replica(pd_server):
    with httpx.Client(base_url=pd_server.base_url, timeout=300) as client:
        response = client.post("/v1/completions", headers={"X-Request-Id": "short-prompt"},
                               json={"prompt": "Hi", "max_tokens": 2, "temperature": 0})
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["prompt_tokens"] <= SHORT_PROMPT_TOKENS
    routed = [e for e in pd_server.log_events("request_routed")
              if e["request_id"] == "short-prompt"]
    assert [(e["role"], e["replica"]) for e in routed] == [("decode", 1)]


def test_both_replicas_free_every_block_and_count_the_transfer(pd_server):
    with httpx.Client(base_url=pd_server.base_url, timeout=300) as client:
        deadline = time.monotonic() + HANG_DEADLINE_S
        while True:
            samples = parse_metrics_text(client.get("/metrics").text)
            usage = {labels["replica"]: value
                     for labels, value in samples["kvserve:kv_cache_usage_perc"]}
            if usage == {"0": 0.0, "1": 0.0}:
                break
            assert time.monotonic() < deadline, hang_message(f"KV blocks still used: {usage}",
                                                             HANG_DEADLINE_S)
            time.sleep(0.1)
    moved = {(labels["replica"], labels["direction"]): value
             for labels, value in samples["kvserve:kv_transfer_bytes_total"]}
    # every exported block was fetched; those the decode cache held already were not loaded
    assert moved[("1", "fetch")] == moved[("0", "export")] > 0
    assert 0 < moved[("1", "import")] <= moved[("0", "export")]


def test_both_replicas_attach_the_tier_the_api_process_made(pd_server):
    tiers = pd_server.log_events("kv_offload_tier")
    assert len(tiers) == 2 and {t["created"] for t in tiers} == {False}
    assert len({t["path"] for t in tiers}) == 1


def test_a_prompt_the_prefill_replica_refuses_gets_a_400(pd_server):
    with httpx.Client(base_url=pd_server.base_url, timeout=300) as client:
        response = client.post("/v1/completions", json={
            "prompt": "word " * (SERVER_MAX_MODEL_LEN + 100), "max_tokens": 4})
    assert response.status_code == 400, response.text
    assert "max_model_len" in response.text or "context" in response.text
