"""A conversation kept warm on one branch (multi-turn chat without re-prefilling history)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from typing import Any

from ._native import Branch, Context, SamplingParams
from ._stops import StopStrings

#: A system message the small chat model (SmolLM2-135M-Instruct) follows: without one, or with
#: "Answer briefly.", it answers "What is the capital of France?" with French nonsense.
HELPFUL_ASSISTANT = "You are a helpful assistant."


class Chat:
    """A conversation on one live branch.

    Each turn renders the whole conversation with the model's chat template (or ``template``)
    and prefills only what the rendering adds to the text already in the branch's KV cache:
    the new user turn and the template's markup. The reply is generated on the same branch
    and ends at an end-of-generation token or at one of the template's stop strings.

    If the template renders earlier turns differently once a new one is added (the new
    prompt no longer extends the old one), the turn starts over on a fresh branch:
    ``cold_restarts`` counts those.
    """

    def __init__(
        self,
        ctx: Context,
        *,
        params: SamplingParams | dict[str, Any] | None = None,
        system: str | None = None,
        template: str | None = None,
        **template_kwargs: Any,
    ) -> None:
        """Start a conversation on ``ctx`` (no branch is taken until the first turn).

        ``params``: the reply's SamplingParams (or a dict; None for the defaults); ``system``:
        an optional system message; ``template`` and ``template_kwargs``: as in
        ``Context.format_chat``. From its first turn it holds one lease of ``ctx`` (``branch``).
        """
        self.ctx = ctx
        self.params = params
        self.template = template
        self.template_kwargs = template_kwargs
        self.messages: list[dict[str, Any]] = []
        if system is not None:
            self.messages.append({"role": "system", "content": system})
        self.branch: Branch | None = None
        self.prefilled_tokens = 0  # tokens prefilled over all turns
        self.cold_restarts = 0
        self._text = ""  # the rendered text whose tokens are in the branch's KV cache

    def _begin(self, content: str) -> tuple[StopStrings, list[int]]:
        """Add the user turn; the tokens to prefill so the branch holds the new prompt (on a
        fresh branch when the prompt no longer extends what it holds)."""
        self.messages.append({"role": "user", "content": content})
        chat = self.ctx.format_chat(
            self.messages,
            add_generation_prompt=True,
            template=self.template,
            **self.template_kwargs,
        )
        if self.branch is None or not chat.prompt.startswith(self._text):
            if self.branch is not None:
                self.branch.prune_sync()
                self.cold_restarts += 1
            self.branch = Branch.create(self.ctx, 0, self.params)
            self._text = ""
        delta = chat.prompt[len(self._text) :]
        tokens = self.ctx.tokenize(delta, add_special=not self._text, parse_special=True)
        self._text = chat.prompt
        self.prefilled_tokens += len(tokens)
        return StopStrings(chat.stop), tokens

    def _end(self, reply: StopStrings) -> str:
        self._text += reply.text  # every generated token was committed (a stop string too)
        self.messages.append({"role": "assistant", "content": reply.content})
        return reply.content

    async def send(self, content: str, *, max_tokens: int = 256) -> str:
        """Add a user turn, generate the assistant's reply (also appended to ``messages``)."""
        reply, tokens = self._begin(content)
        assert self.branch is not None
        await self.branch.prefill(tokens)
        async for tok in self.branch.generate(max_tokens=max_tokens):
            if reply.add(tok.text):
                break
        return self._end(reply)

    async def stream(self, content: str, *, max_tokens: int = 256) -> AsyncIterator[str]:
        """Like ``send``, yielding the reply's text as it is generated. Text that could be
        the start of a stop string is held back until it is not; the whole reply is
        appended to ``messages`` when the stream ends (also when it is closed early)."""
        reply, tokens = self._begin(content)
        assert self.branch is not None
        try:
            await self.branch.prefill(tokens)
            async for tok in self.branch.generate(max_tokens=max_tokens):
                stopped = reply.add(tok.text)
                if piece := reply.take():
                    yield piece
                if stopped:
                    break
            if piece := reply.take(final=True):
                yield piece
        finally:
            self._end(reply)

    def stream_sync(self, content: str, *, max_tokens: int = 256) -> Iterator[str]:
        """Blocking twin of ``stream``."""
        reply, tokens = self._begin(content)
        assert self.branch is not None
        try:
            self.branch.prefill_sync(tokens)
            for tok in self.branch.generate_sync(max_tokens=max_tokens):
                stopped = reply.add(tok.text)
                if piece := reply.take():
                    yield piece
                if stopped:
                    break
            if piece := reply.take(final=True):
                yield piece
        finally:
            self._end(reply)

    def send_sync(self, content: str, *, max_tokens: int = 256) -> str:
        """Blocking twin of ``send``."""
        reply, tokens = self._begin(content)
        assert self.branch is not None
        self.branch.prefill_sync(tokens)
        for tok in self.branch.generate_sync(max_tokens=max_tokens):
            if reply.add(tok.text):
                break
        return self._end(reply)

    async def fork(self) -> Chat:
        """A second conversation that shares this one's history, on a fork of its branch (no
        KV is copied): ask different follow-ups on each. Prune ``branch`` of the fork when
        done with it (``await side.branch.prune()``)."""
        return self._forked(None if self.branch is None else await self.branch.fork())

    def fork_sync(self) -> Chat:
        """Blocking twin of ``fork``."""
        return self._forked(None if self.branch is None else self.branch.fork_sync())

    def _forked(self, branch: Branch | None) -> Chat:
        other = Chat(self.ctx, params=self.params, template=self.template, **self.template_kwargs)
        other.messages = [dict(m) for m in self.messages]
        other.branch = branch
        other._text = self._text  # "" until the first turn takes a branch
        return other
