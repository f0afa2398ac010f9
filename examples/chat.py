"""A warm multi-turn chat on the small instruct model, then a fork of the conversation.

Each turn prefills only what it adds (the new user turn and the template's markup): the
history already sits in the branch's KV cache. At the end the conversation is forked and
two different follow-ups are answered from the same shared history.

usage: python examples/chat.py
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import kvfork

# The 135M model answers in English only when told who it is (`kvfork chat`'s default too).
SYSTEM = "You are a helpful assistant."
TURNS = [
    "What is the capital of France?",
    "What is a famous tower there?",
    "How tall is it, roughly?",
]


@dataclass
class Turn:
    """One exchange: the reply, the tokens this turn prefilled, the whole prompt's tokens."""

    user: str
    reply: str
    prefilled: int
    prompt_tokens: int


async def converse(turns: list[str] = TURNS, max_tokens: int = 48) -> list[Turn]:
    """Run ``turns`` as one conversation (greedy) and return what each turn cost."""
    path = kvfork.default_chat_model_path()
    async with kvfork.create_context(path, n_ctx=2048, n_seq_max=3) as ctx:
        params = kvfork.SamplingParams(temperature=0.0)
        chat = kvfork.Chat(ctx, params=params, system=SYSTEM)
        done: list[Turn] = []
        for user in turns:
            before = chat.prefilled_tokens
            reply = await chat.send(user, max_tokens=max_tokens)
            full = ctx.format_chat(chat.messages).prompt  # what a stateless call re-reads
            done.append(Turn(user, reply, chat.prefilled_tokens - before, len(ctx.tokenize(full))))
        return done


async def fork_the_conversation(max_tokens: int = 32) -> tuple[str, str]:
    """One shared history, two follow-ups answered on forks of its branch."""
    path = kvfork.default_chat_model_path()
    async with kvfork.create_context(path, n_ctx=2048, n_seq_max=3) as ctx:
        chat = kvfork.Chat(ctx, params=kvfork.SamplingParams(temperature=0.0), system=SYSTEM)
        await chat.send(TURNS[0], max_tokens=max_tokens)
        assert chat.branch is not None
        answers = []
        for question in ("What is the capital of Italy?", "What is the capital of Spain?"):
            side = await chat.fork()  # the whole history on a fork of its branch, no copy
            answers.append(await side.send(question, max_tokens=max_tokens))
            assert side.branch is not None
            await side.branch.prune()
        return answers[0], answers[1]


async def main() -> None:
    for turn in await converse():
        print(f"user: {turn.user}\nassistant: {turn.reply}")
        print(f"  [prefilled {turn.prefilled} tokens; the whole prompt is {turn.prompt_tokens}]\n")
    italy, spain = await fork_the_conversation()
    print(f"forked follow-ups from one history:\n  Italy: {italy}\n  Spain: {spain}")


if __name__ == "__main__":
    asyncio.run(main())
