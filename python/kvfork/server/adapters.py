"""The server's LoRA adapters (`kvfork serve --lora NAME=PATH[:SCALE]`, repeatable): loaded once
on the model, chosen per request by name.

A request picks adapters with `"lora": [{"name": NAME, "scale": S}, ...]` (llama-server's
`{"id": N, "scale": S}` works too), or by naming one as its `model` (as vLLM serves LoRA
modules: `GET /v1/models` lists them beside the base model). Its branch decodes under that set
(`PrefixCache.branch(adapters=)`): requests on different sets share no prefix (their KV
differs) and a step decodes one group per set, while requests on the same set share both.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .._native import LoraAdapter, Model
from .errors import bad_request, is_finite_number

#: The largest |scale| a request or `--lora` may give (llama.cpp takes any float; past this it
#: is a typo, and the logits would be noise).
MAX_SCALE = 100.0

#: The most adapters a request's `lora` list may name (a bound on the work a request asks for).
MAX_ITEMS = 64

#: What a request asks for: each adapter by name or index, with its scale (None: the default
#: one `--lora` gave).
Choice = list[tuple[str | int, float | None]]


@dataclass(frozen=True)
class AdapterSpec:
    """One `--lora NAME=PATH[:SCALE]` argument."""

    name: str
    path: Path
    scale: float = 1.0

    @classmethod
    def parse(cls, text: str) -> AdapterSpec:
        """`NAME=PATH[:SCALE]`; ValueError naming what is wrong. A path that itself holds a
        colon keeps it unless what follows the last one is a number."""
        name, eq, rest = text.partition("=")
        if not eq or not name or not rest:
            raise ValueError(f"--lora {text!r}: expected NAME=PATH[:SCALE]")
        path, scale = rest, 1.0
        head, colon, tail = rest.rpartition(":")
        if colon and head:
            try:
                scale = float(tail)
            except ValueError:
                pass  # part of the path
            else:
                path = head
        if not math.isfinite(scale) or abs(scale) > MAX_SCALE:
            raise ValueError(f"--lora {text!r}: the scale must be finite, at most {MAX_SCALE}")
        return cls(name, Path(path), scale)


class Adapters:
    """The adapters of a server by name, in `--lora` order (their index is llama-server's
    `id`)."""

    def __init__(self, loaded: list[tuple[AdapterSpec, LoraAdapter]]) -> None:
        self._loaded = loaded
        self._by_name = {spec.name: i for i, (spec, _) in enumerate(loaded)}

    @classmethod
    def load(cls, model: Model, specs: list[AdapterSpec]) -> Adapters:
        """Load each spec's file for `model` (blocking). ValueError for a name given twice;
        the model's ModelLoadError for a file that is not a LoRA of this model."""
        names = [s.name for s in specs]
        if len(set(names)) != len(names):
            raise ValueError(f"--lora names must differ: {names}")
        return cls([(spec, model.load_lora(spec.path)) for spec in specs])

    def __len__(self) -> int:
        return len(self._loaded)

    def __iter__(self) -> Iterator[AdapterSpec]:
        return (spec for spec, _ in self._loaded)

    def listing(self) -> list[dict[str, Any]]:
        """`GET /lora-adapters`: llama-server's `[{"id", "path", "scale"}]`, with the name."""
        return [
            {"id": i, "name": spec.name, "path": str(spec.path), "scale": spec.scale}
            for i, (spec, _) in enumerate(self._loaded)
        ]

    def resolve(self, choice: Choice, model: str | None) -> dict[LoraAdapter, float]:
        """The set a request decodes under: its `lora` list, else the adapter its `model`
        names (any other model name means the base model, as before). A 400 naming `lora`
        for an adapter this server does not have; a scale of 0 leaves that adapter out."""
        if not choice and model in self._by_name:
            choice = [(model, None)]
        chosen: dict[LoraAdapter, float] = {}
        for key, scale in choice:
            i = self._by_name.get(key) if isinstance(key, str) else key
            if i is None or not 0 <= i < len(self._loaded):
                have = ", ".join(self._by_name) or "none (start it with --lora NAME=PATH)"
                raise bad_request(f"no LoRA adapter {key!r} on this server; it has {have}", "lora")
            spec, adapter = self._loaded[i]
            value = spec.scale if scale is None else scale
            if value:
                chosen[adapter] = value
        return chosen


def parse_lora(body: dict[str, Any]) -> Choice:
    """A request's `lora` field: a list of `{"name" | "id", "scale"?}` objects (or of names)."""
    value = body.get("lora")
    if value is None:
        return []
    if not isinstance(value, list):
        raise bad_request("lora must be a list of {name, scale} objects", "lora")
    if len(value) > MAX_ITEMS:
        raise bad_request(f"lora lists at most {MAX_ITEMS} adapters, got {len(value)}", "lora")
    choice: Choice = []
    for item in value:
        if isinstance(item, str):
            item = {"name": item}
        if not isinstance(item, dict):
            raise bad_request("lora items must be objects with a name or an id", "lora")
        if "name" in item and "id" in item:
            raise bad_request("a lora item names its adapter by name or by id, not both", "lora")
        key = item.get("name", item.get("id"))
        if not isinstance(key, str | int) or isinstance(key, bool):
            raise bad_request("lora items need a name (a string) or an id (an integer)", "lora")
        scale = item.get("scale")
        if scale is not None and (not is_finite_number(scale) or abs(scale) > MAX_SCALE):
            raise bad_request(f"lora scale must be a number of at most {MAX_SCALE}", "lora")
        choice.append((key, None if scale is None else float(scale)))
    return choice
