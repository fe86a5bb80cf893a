"""Helpers of the tools tests: a stub OpenAI-style server that is not kvserve.

Imported by ``conftest.py`` and the test modules (pytest puts this folder on
``sys.path``); a unique module name, unlike ``conftest``.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from pathlib import Path

from deadlines import HANG_DEADLINE_S, hang_message

#: The repository's tools/ folder.
TOOLS = Path(__file__).resolve().parents[2] / "tools"


def load_tool(name: str):
    """``tools/<name>.py`` as a module, registered in ``sys.modules`` (as
    ``<name>_under_test``: its dataclasses need their module there)."""
    import importlib.util
    import sys

    spec = importlib.util.spec_from_file_location(f"{name}_under_test", TOOLS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module

#: The stub's delays: first content chunk after STUB_TTFT s, then one every STUB_ITL s.
STUB_TTFT = 0.3
STUB_ITL = 0.1
STUB_CHUNKS = 6
#: What the stub saw, in order: ``(event, prompt text, time.perf_counter())``
#: with event ``received`` (a request's body read) or ``done`` (its last
#: content chunk written), for tests that check an order of events rather
#: than a duration.
STUB_EVENTS: list[tuple[str, str, float]] = []


def _stub_app():
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import JSONResponse, StreamingResponse
    from starlette.routing import Route

    async def chat(request: Request):
        body = await request.json()
        text = json.dumps(body.get("messages", ""))
        STUB_EVENTS.append(("received", text, time.perf_counter()))
        if "FAIL" in text:
            return JSONResponse({"error": {"message": "stub overload", "type": "overloaded",
                                           "param": None, "code": 429}}, status_code=429)
        n = min(int(body.get("max_tokens", STUB_CHUNKS)), STUB_CHUNKS)
        created = int(time.time())

        def chunk(delta: dict, finish=None, usage=None, choices=True) -> str:
            obj = {"id": "stub-1", "object": "chat.completion.chunk", "created": created,
                   "model": "stub", "choices": [{"index": 0, "delta": delta,
                                                 "finish_reason": finish}] if choices else []}
            if usage is not None:
                obj["usage"] = usage
            return f"data: {json.dumps(obj)}\n\n"

        async def events():
            yield chunk({"role": "assistant", "content": ""})  # no content: not a token
            await asyncio.sleep(STUB_TTFT)
            for i in range(n):
                if i:
                    await asyncio.sleep(STUB_ITL)
                yield chunk({"content": f"w{i} "}, finish="length" if i == n - 1 else None)
            STUB_EVENTS.append(("done", text, time.perf_counter()))
            if (body.get("stream_options") or {}).get("include_usage"):
                yield chunk({}, usage={"prompt_tokens": 7, "completion_tokens": n,
                                       "total_tokens": 7 + n}, choices=False)
            yield "data: [DONE]\n\n"

        if not body.get("stream"):
            await asyncio.sleep(STUB_TTFT)
            return JSONResponse({"id": "stub-1", "object": "chat.completion", "choices": [
                {"index": 0, "message": {"role": "assistant", "content": "hi"},
                 "finish_reason": "stop"}],
                "usage": {"prompt_tokens": 7, "completion_tokens": 1, "total_tokens": 8}})
        return StreamingResponse(events(), media_type="text/event-stream")

    async def models(request: Request):
        return JSONResponse({"object": "list", "data": [{"id": "stub-model", "object": "model"}]})

    return Starlette(routes=[Route("/v1/chat/completions", chat, methods=["POST"]),
                             Route("/v1/models", models, methods=["GET"])])


class StubServer:
    """The stub app under uvicorn in a background thread, on a free port."""

    def __init__(self) -> None:
        import uvicorn
        from e2e_support import free_port

        port = free_port()
        config = uvicorn.Config(_stub_app(), host="127.0.0.1", port=port, log_level="warning",
                                access_log=False, lifespan="off")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        self.base_url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + HANG_DEADLINE_S
        while not self.server.started:
            if not self.thread.is_alive():
                raise RuntimeError("stub server did not start")
            if time.monotonic() > deadline:
                raise RuntimeError(hang_message("stub server did not start", HANG_DEADLINE_S))
            time.sleep(0.02)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)
