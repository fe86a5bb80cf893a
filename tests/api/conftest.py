"""Fixtures for the API tests: a fake engine and an httpx client on the app."""

from __future__ import annotations

import httpx
import pytest

from kvserve.api import build_app
from kvserve.config import ServerConfig
from fake_engine import FakeEngine


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture
def engine() -> FakeEngine:
    return FakeEngine()


@pytest.fixture
def server_config() -> ServerConfig:
    return ServerConfig(max_request_bytes=4096)


@pytest.fixture
async def client(engine: FakeEngine, server_config: ServerConfig):
    app = build_app(engine, server_config)
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as c:
        yield c
