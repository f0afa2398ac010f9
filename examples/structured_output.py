"""Structured output: JSON that follows a schema, forked at a decision point.

The schema constrains a branch through llguidance; three forks of it then finish the same
object with different seeds, sharing the prefix in the KV cache. Every result parses and
validates. The default model, no arguments.

usage: python examples/structured_output.py
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import kvfork

SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 16},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "pet": {"enum": ["cat", "dog", "fish", "none"]},
    },
    "required": ["name", "age", "pet"],
    "additionalProperties": False,
}


async def people(n: int = 3) -> list[dict[str, Any]]:
    """n objects that share their first tokens, then part ways."""
    async with kvfork.create_context(kvfork.default_model_path(), n_seq_max=n + 1) as ctx:
        head = kvfork.Branch.create(ctx, 0, {"temperature": 0.9, "seed": 1})
        await head.prefill(ctx.tokenize("A person, as JSON:"))
        head.set_json_schema(SCHEMA)
        shared = "".join([t.text async for t in head.generate(3)])  # '{"name": "' or so
        forks = [await head.fork(seed=s) for s in range(n)]
        texts = await asyncio.gather(*(finish(f) for f in forks))
        return [json.loads(shared + t) for t in texts]


async def finish(branch: kvfork.Branch) -> str:
    return "".join([t.text async for t in branch.generate(64)])


async def main() -> None:
    for person in await people():
        print(json.dumps(person))


if __name__ == "__main__":
    asyncio.run(main())
