"""`/v1/completions` with several prompts (`prompt` a list of strings or of token-id lists, as
evaluation harnesses batch their requests): one generation per prompt, its choices numbered
`prompt * n + choice` as OpenAI numbers them.

The prompts of one request share the server as separate requests would, but they take one
place in the admission queue, as one request does: a prompt starts once the one before it
has started (been admitted), at most as many running as there are sequences for their
choices, so a long list waits for its own earlier prompts rather than filling the queue
(503s for everyone). Scored prompts (`echo` + `logprobs`) run one at a time: each holds the
cells of its whole prompt, which the prefix cache cannot share, so two long ones at once
could need more cells than there are."""

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
        started = [asyncio.Event() for _ in self.generations]
        self._tasks = [
            asyncio.create_task(self._run(i, g, turns, started, out))
            for i, g in enumerate(self.generations)
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
        started: list[asyncio.Event],
        out: asyncio.Queue[Event | Outcome | BaseException],
    ) -> None:
        """Prompt `prompt`'s generation, when its turn comes (a free turn, and the prompt
        before it started: its first item came), onto `out`."""
        first = prompt * self.n
        try:
            if prompt > 0:
                await started[prompt - 1].wait()
            async with turns:
                async for item in generation:
                    started[prompt].set()
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
