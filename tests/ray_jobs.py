"""Branch programs that the Ray tests run both in a pool and in-process (pickled by value)."""

from __future__ import annotations

import asyncio
import os

import kvfork
import kvfork.ray as kray

GREEDY = kvfork.SamplingParams(temperature=0.0)
PROMPT = "The history of the printing press begins with"


async def chat_turn(ctx: kvfork.Context, question: str) -> str:
    """One greedy chat turn (ChatML: the default model carries no template)."""
    chat = kvfork.Chat(ctx, params=GREEDY, template="chatml")
    reply = await chat.send(question, max_tokens=24)
    if chat.branch is not None:
        await chat.branch.prune()
    return reply


async def greedy(ctx: kvfork.Context, prompt: str, steps: int) -> list[int]:
    """Greedy produce/commit for `steps` tokens: each commit is one request to the engine."""
    b = kvfork.Branch.create(ctx, 0, GREEDY)
    await b.prefill(ctx.tokenize(prompt))
    out = []
    for _ in range(steps):
        tok = await b.produce()
        await b.commit(tok)
        out.append(tok.token)
    await b.prune()
    return out


async def fork_from_system(ctx: kvfork.Context, system: str, question: str) -> tuple[int, int]:
    """Fork a reply off a warm branch holding `system` (one per actor and key): the actor's
    pid and the warm branch's handle, which stays the same while jobs meet the same branch."""

    async def warm() -> kvfork.Branch:
        b = kvfork.Branch.create(ctx, 0, GREEDY)
        await b.prefill(ctx.tokenize(system))
        return b

    root = await kray.shared(ctx, ("system", system), warm)
    kid = await root.fork()
    await kid.prefill(ctx.tokenize(question))
    for _ in range(4):
        tok = await kid.produce()
        await kid.commit(tok)
    await kid.prune()
    return os.getpid(), root.handle


async def pid(ctx: kvfork.Context) -> int:
    return os.getpid()


async def sleep_then(ctx: kvfork.Context, seconds: float) -> int:
    await asyncio.sleep(seconds)
    return os.getpid()


async def raise_value_error(ctx: kvfork.Context, message: str) -> None:
    raise ValueError(message)


async def bad_grammar(ctx: kvfork.Context) -> None:
    b = kvfork.Branch.create(ctx, 0, GREEDY)
    try:
        b.set_grammar("root ::= this is not gbnf (")
    finally:
        b.prune_sync()


async def unpicklable(ctx: kvfork.Context) -> object:
    return kvfork.Branch.create(ctx, 0, GREEDY)  # a live branch cannot leave its actor


class NeedsTwoArgs(Exception):
    def __init__(self, a: int, b: int) -> None:
        super().__init__(f"{a}/{b}")


async def raise_unpicklable_error(ctx: kvfork.Context) -> None:
    raise NeedsTwoArgs(1, 2)  # a pickle round trip calls NeedsTwoArgs("1/2") and fails


async def raise_base(ctx: kvfork.Context, kind: str) -> None:
    """Raise a BaseException that is no Exception."""
    raise {"interrupt": KeyboardInterrupt, "exit": SystemExit}[kind]()


async def hold_a_lease(ctx: kvfork.Context, seconds: float) -> None:
    """A branch held for `seconds`, pruned however the job ends (a cancel included)."""
    branch = kvfork.Branch.create(ctx)
    try:
        await branch.prefill(ctx.tokenize("hold"))
        await asyncio.sleep(seconds)
    finally:
        await branch.prune()
