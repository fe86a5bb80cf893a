"""The server's generation defaults (``--generation-config``) in requests that
omit a sampling field: both endpoints, explicit fields winning, and the
default model answering the README's first question well without a
temperature."""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx
import pytest
from structlog.testing import capture_logs

from kvserve.api import build_app
from kvserve.config import CacheConfig, EngineConfig, ServerConfig
from kvserve.core.sampling_params import SamplingParams
from kvserve.model.generation_config import (GenerationDefaults, log_generation_defaults,
                                             resolve_generation_defaults)
from fake_engine import FakeEngine

DEFAULTS = GenerationDefaults(temperature=0.2, top_p=0.9, top_k=40, min_p=0.05,
                              repetition_penalty=1.1, max_tokens=50)
CHAT = {"messages": [{"role": "user", "content": "hi"}]}
COMPLETION = {"prompt": "hi"}


@pytest.fixture
def server_config() -> ServerConfig:
    return ServerConfig(generation_defaults=DEFAULTS)


async def sent(client: httpx.AsyncClient, engine: FakeEngine, path: str,
               body: dict) -> SamplingParams:
    """POST ``body`` to ``path`` (200 expected); the params the engine got."""
    response = await client.post(path, json=body)
    assert response.status_code == 200, response.text
    return engine.requests[-1].sampling_params


@pytest.mark.anyio
async def test_chat_without_sampling_fields_gets_every_default(client, engine) -> None:
    params = await sent(client, engine, "/v1/chat/completions", CHAT)
    assert (params.temperature, params.top_p, params.top_k, params.min_p,
            params.repetition_penalty, params.max_tokens) == (0.2, 0.9, 40, 0.05, 1.1, 50)
    # Fields the file does not hold keep SamplingParams' defaults.
    assert (params.presence_penalty, params.frequency_penalty, params.n) == (0.0, 0.0, 1)


@pytest.mark.anyio
async def test_fields_a_request_sends_win_and_temperature_zero_stays_greedy(client, engine) -> None:
    params = await sent(client, engine, "/v1/chat/completions",
                        {**CHAT, "temperature": 0, "top_k": 0, "max_completion_tokens": 7})
    assert (params.temperature, params.top_k, params.max_tokens) == (0.0, 0, 7)
    assert (params.top_p, params.min_p, params.repetition_penalty) == (0.9, 0.05, 1.1)
    params = await sent(client, engine, "/v1/chat/completions",
                        {**CHAT, "top_p": 1.0, "min_p": 0.0, "repetition_penalty": 1.0,
                         "max_tokens": 300})
    assert (params.temperature, params.top_p, params.min_p, params.repetition_penalty,
            params.max_tokens) == (0.2, 1.0, 0.0, 1.0, 300)


@pytest.mark.anyio
async def test_null_is_an_omission(client, engine) -> None:
    params = await sent(client, engine, "/v1/chat/completions",
                        {**CHAT, "temperature": None, "max_tokens": None})
    assert (params.temperature, params.max_tokens) == (0.2, 50)


@pytest.mark.anyio
async def test_completions_get_the_defaults_and_keep_openais_16_tokens(client, engine) -> None:
    params = await sent(client, engine, "/v1/completions", COMPLETION)
    assert (params.temperature, params.top_p, params.top_k, params.max_tokens) == (0.2, 0.9, 40, 16)
    params = await sent(client, engine, "/v1/completions", {**COMPLETION, "max_tokens": None})
    assert params.max_tokens == 50  # null: the default's, as in vLLM
    params = await sent(client, engine, "/v1/completions",
                        {**COMPLETION, "temperature": 0.0, "max_tokens": 3})
    assert (params.temperature, params.max_tokens) == (0.0, 3)


@pytest.mark.anyio
async def test_a_bad_value_sent_is_still_a_400_naming_it(client, engine) -> None:
    response = await client.post("/v1/chat/completions", json={**CHAT, "top_p": 0})
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "top_p"
    assert engine.requests == []


async def _params_with(config: ServerConfig, path: str, body: dict) -> SamplingParams:
    engine = FakeEngine()
    transport = httpx.ASGITransport(app=build_app(engine, config))
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
        return await sent(client, engine, path, body)


@pytest.mark.anyio
async def test_without_defaults_requests_get_the_neutral_ones() -> None:
    params = await _params_with(ServerConfig(), "/v1/chat/completions", CHAT)
    assert (params.temperature, params.top_p, params.top_k,
            params.max_tokens) == (1.0, 1.0, 0, None)


@pytest.mark.anyio
async def test_vllm_setting_ignores_the_models_file(tmp_path: Path) -> None:
    (tmp_path / "generation_config.json").write_text('{"temperature": 0.3}')
    ignored = resolve_generation_defaults(tmp_path, EngineConfig(
        model=str(tmp_path), generation_config="vllm").generation_config)
    params = await _params_with(ServerConfig(generation_defaults=ignored),
                                "/v1/chat/completions", CHAT)
    assert params.temperature == 1.0
    auto = EngineConfig(model=str(tmp_path)).generation_config
    used = resolve_generation_defaults(tmp_path, auto)
    params = await _params_with(ServerConfig(generation_defaults=used),
                                "/v1/chat/completions", CHAT)
    assert params.temperature == 0.3


@pytest.mark.anyio
async def test_a_folders_max_new_tokens_caps_every_request(tmp_path: Path) -> None:
    (tmp_path / "generation_config.json").write_text('{"max_new_tokens": 20}')
    capped = resolve_generation_defaults("unused-model", str(tmp_path))
    config = ServerConfig(generation_defaults=capped)
    for path, body in (("/v1/chat/completions", {**CHAT, "max_tokens": 500}),
                       ("/v1/chat/completions", CHAT),
                       ("/v1/completions", {**COMPLETION, "max_tokens": 500})):
        assert (await _params_with(config, path, body)).max_tokens == 20
    assert (await _params_with(config, "/v1/completions", COMPLETION)).max_tokens == 16


# ---------------------------------------------------------------- the real default model


@pytest.mark.model
def test_the_default_model_answers_the_readme_question_without_a_temperature(
        default_model_path: Path) -> None:
    """The README's first request sends no temperature: with the defaults the
    converted checkpoint now carries, it is answered well (before: sampled at
    temperature 1, "Le Grand Mopérat France...")."""
    from kvserve.engine import AsyncEngine

    defaults = resolve_generation_defaults(default_model_path, "auto")
    assert defaults.source == str(default_model_path / "generation_config.json")
    assert defaults.temperature == 0.0
    with capture_logs() as logs:
        log_generation_defaults(defaults)
    assert logs[0]["values"]["temperature"] == 0.0

    async def ask() -> list[dict]:
        engine = await AsyncEngine.start(
            EngineConfig(model=str(default_model_path),
                         cache=CacheConfig(kv_cache_memory=32 * 2**20)), stats_interval=0)
        try:
            app = build_app(engine, ServerConfig(generation_defaults=defaults))
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://test",
                                         timeout=300) as client:
                bodies = []
                for seed in (2, 3):  # at temperature 0.2 both answered "L'Étoile, la ..."
                    response = await client.post("/v1/chat/completions", json={
                        "model": "SmolLM2-135M-Instruct", "seed": seed, "messages": [
                            {"role": "user", "content": "What is the capital of France?"}]})
                    assert response.status_code == 200, response.text
                    bodies.append(response.json())
                return bodies
        finally:
            await engine.shutdown()

    for body in asyncio.run(ask()):
        choice = body["choices"][0]
        assert choice["message"]["content"] == "The capital of France is Paris."
        assert choice["finish_reason"] == "stop"
