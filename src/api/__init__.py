"""OpenAI-compatible HTTP API (Starlette): routes, SSE streaming, errors, auth.

``build_app(engine, server_config)`` returns the ASGI app; see ``app.py``.
"""

from kvserve.api.app import build_app

__all__ = ["build_app"]
