"""Acceptance (issue 25): constraints are bounded, compiled off the hot
threads, and fail alone.

On the live default-model server (default limits: 64 KiB, 5 s), while one
client sends, for each constraint field, the largest constraint the server
accepts (new to its cache; the tools' sized to the context, as their
description is in the prompt) and one just over the size limit, a neighbouring
stream keeps receiving tokens and completes; during the compiles it gets
about as many tokens as at its own pace outside them (counted, not timed);
every oversized one is a 400 naming its field; and the server is healthy
afterwards. Before, a compile ran on the event loop (the API's check) and
then in the worker's step: the neighbour got nothing meanwhile.
"""

from __future__ import annotations

import asyncio
import random
import string

import httpx
import pytest

from e2e_support import SERVER_MAX_MODEL_LEN

from kvserve.testing.hostile import CONSTRAINT_FIELDS, Neighbour, fire_constraints

pytestmark = pytest.mark.model

MAX_BYTES = 64 * 1024
#: As long as the server's context allows (a ~40-token prompt).
NEIGHBOUR_TOKENS = SERVER_MAX_MODEL_LEN - 60


def test_a_neighbour_streams_through_the_largest_and_oversized_constraints(live_server) -> None:
    salt = "".join(random.choices(string.ascii_lowercase, k=6))
    neighbour = Neighbour(max_tokens=NEIGHBOUR_TOKENS)

    async def go():
        async with httpx.AsyncClient(base_url=live_server.base_url,
                                     timeout=httpx.Timeout(300.0, connect=10.0)) as client:
            task = asyncio.create_task(neighbour.run(client))
            while len(neighbour.arrivals) < 10 and not task.done():
                await asyncio.sleep(0.05)
            shots = await fire_constraints(client, MAX_BYTES, salt, SERVER_MAX_MODEL_LEN)
            await task
            return shots, (await client.get("/health")).status_code

    shots, health = asyncio.run(go())
    assert health == 200
    assert neighbour.finish_reason == "length"
    assert neighbour.completion_tokens == NEIGHBOUR_TOKENS
    for shot in shots:
        if shot.over:
            assert (shot.status, shot.param) == (400, shot.field), shot
        else:
            assert shot.status == 200, shot
    assert [s.field for s in shots if not s.over] == list(CONSTRAINT_FIELDS)

    # The compiles that ended while the neighbour streamed (on a loaded
    # machine the compiler, which runs on idle CPU only, may outlast it).
    compiles = [s for s in shots if not s.over and s.accepted < neighbour.arrivals[-1]]
    assert compiles, "no compile ended while the neighbour streamed"
    during = sum(neighbour.tokens_between(s.start, s.accepted) for s in compiles)
    window = sum(s.seconds for s in compiles)
    span = (neighbour.arrivals[0], neighbour.arrivals[-1])
    outside = len(neighbour.arrivals) - 1 - during
    rate = outside / (span[1] - span[0] - window)  # tokens per second outside the compiles
    assert during > 0, (window, rate)
    assert during >= 0.5 * rate * window, (during, rate, window)
