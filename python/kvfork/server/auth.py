"""`--api-key`: the key a request carries, compared in constant time."""

from __future__ import annotations

import hmac
from collections.abc import Mapping


def bearer_token(headers: Mapping[str, str]) -> str | None:
    """The token of `Authorization: Bearer TOKEN` (the scheme in any case, as RFC 7235 has
    it; spaces around the token ignored), or None."""
    scheme, _, token = headers.get("authorization", "").strip().partition(" ")
    return token.strip() if scheme.lower() == "bearer" else None


def matches(given: str | None, key: str) -> bool:
    """Whether `given` is `key` (a comparison whose time does not tell how much matched)."""
    return given is not None and hmac.compare_digest(given.encode(), key.encode())
