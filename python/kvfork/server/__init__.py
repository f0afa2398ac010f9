"""`kvfork serve`: an OpenAI-compatible server whose concurrent requests share prefixes.

Every request is an asyncio task on one context; its branch comes from a `kvfork.PrefixCache`,
so requests that share a system prompt or a document fork it instead of prefilling it again,
and their generation steps share decodes. Needs the `server` extra
(`pip install 'kvfork[server]'`: Starlette, uvicorn, prometheus_client).
"""

from __future__ import annotations

from .app import create_app
from .errors import APIError
from .generation import Generator
from .prompts import Prompts
from .service import Service

__all__ = ["APIError", "Generator", "Prompts", "Service", "create_app"]
