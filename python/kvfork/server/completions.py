"""`/v1/completions` with several prompts (`prompt` a list of strings or of token-id lists, as
evaluation harnesses batch their requests): one generation per prompt, its choices numbered
`prompt * n + choice` as OpenAI numbers them.

The prompts of one request share the server as separate requests would, but at most as many
run at once as there are sequences for their choices: a long list waits for its own earlier
prompts, not in the admission queue, which it would otherwise fill (503s for everyone)."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator
from typing import Any

from .backend import Events
from .generation import Event, Outcome


class Several:
    """The generations of one request's prompts as one `Events`: `async for` gives every
    prompt's events as they come (their choices renumbered), each prompt's `Outcome` (choices
    renumbered too) at its end; `close()` closes them all and never suspends."""

    def __init__(self, generations: list[Events], n: int, at_once: int) -> None:
        self.generations = generations
        self.n = n
        self.at_once = max(1, at_once)
        self._tasks: list[asyncio.Task[None]] = []

    def __aiter__(self) -> AsyncIterator[Event | Outcome]:
        return self._events()

    def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        for generation in self.generations:
            generation.close()

    async def _events(self) -> AsyncIterator[Event | Outcome]:
        out: asyncio.Queue[Event | Outcome | BaseException] = asyncio.Queue()
        turns = asyncio.Semaphore(self.at_once)
        self._tasks = [
            asyncio.create_task(self._run(i, g, turns, out)) for i, g in enumerate(self.generations)
        ]
        try:
            ended = 0
            while ended < len(self.generations):  # each ends with its Outcome
                item = await out.get()
                if isinstance(item, BaseException):
                    raise item
                yield item
                ended += isinstance(item, Outcome)
        finally:
            self.close()

    async def _run(
        self,
        prompt: int,
        generation: Events,
        turns: asyncio.Semaphore,
        out: asyncio.Queue[Event | Outcome | BaseException],
    ) -> None:
        """Prompt `prompt`'s generation, when its turn comes, onto `out`."""
        first = prompt * self.n
        try:
            async with turns:
                async for item in generation:
                    if isinstance(item, Event):
                        out.put_nowait(dataclasses.replace(item, index=first + item.index))
                    else:
                        for choice in item.choices:
                            choice.index += first
                        out.put_nowait(item)
        except Exception as exc:  # noqa: BLE001 - the request's task raises it
            out.put_nowait(exc)
        finally:
            generation.close()


def usage(outcomes: list[Outcome]) -> dict[str, Any]:
    """The usage of a request's prompts together."""
    together = Outcome(
        [c for o in outcomes for c in o.choices],
        sum(o.prompt_tokens for o in outcomes),
        sum(o.cached_tokens for o in outcomes),
    )
    return together.usage()
