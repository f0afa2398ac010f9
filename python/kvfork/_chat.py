"""A conversation kept warm on one branch (multi-turn chat without re-prefilling history)."""

from __future__ import annotations

from collections.abc import AsyncGenerator, Iterator
from dataclasses import dataclass
from typing import Any, Literal

from ._native import Branch, Context, SamplingParams, TokenStream, TokenStreamSync
from ._stops import StopStrings

#: A system message the small chat model (SmolLM2-135M-Instruct) follows: without one, or with
#: "Answer briefly.", it answers "What is the capital of France?" with French nonsense.
HELPFUL_ASSISTANT = "You are a helpful assistant."

#: Tokens a context shift keeps when there is no system message (attention sinks).
DEFAULT_KEEP = 4


@dataclass(frozen=True)
class _Turn:
    """A user turn about to be prefilled: its message, the rendered prompt ending with it,
    the tokens to prefill, the reply's stop strings, whether it starts a fresh branch."""

    message: dict[str, Any]
    prompt: str
    tokens: list[int]
    reply: StopStrings
    restart: bool


@dataclass(eq=False)
class _Reply:
    """A reply being generated: its text, its stream, the branch's position after the last
    token yielded, and whether a ``stream`` of it waits at a yield (its consumer may have
    left the loop)."""

    text: StopStrings
    stream: TokenStream | TokenStreamSync
    seen: int
    idle: bool = False


class Chat:
    """A conversation on one live branch.

    Each turn renders the whole conversation with the model's chat template (or ``template``)
    and prefills only what the rendering adds to the text already in the branch's KV cache:
    the new user turn and the template's markup. The reply is generated on the same branch
    and ends at an end-of-generation token or at one of the template's stop strings.

    If the template renders earlier turns differently once a new one is added (the new
    prompt no longer extends the old one), the turn starts over on a fresh branch:
    ``cold_restarts`` counts those.

    With ``on_context_full="shift"`` the conversation goes on past the context's end: the
    branch keeps the system message (its first tokens) and the most recent half of the rest
    (``shifts`` counts the shifts), as llama.cpp's ``--context-shift`` does. The context's
    end is the branch's position reaching n_ctx: cells other branches of the context hold
    (``fork``, other chats) fill the same cache, so a turn may raise KvCacheFullError first.
    """

    def __init__(
        self,
        ctx: Context,
        *,
        params: SamplingParams | dict[str, Any] | None = None,
        system: str | None = None,
        template: str | None = None,
        on_context_full: Literal["stop", "shift"] = "stop",
        **template_kwargs: Any,
    ) -> None:
        """Start a conversation on ``ctx`` (no branch is taken until the first turn).

        ``params``: the reply's SamplingParams (or a dict; None for the defaults); ``system``:
        an optional system message; ``template`` and ``template_kwargs``: as in
        ``Context.format_chat``; ``on_context_full``: "stop" (a reply ends at the context's
        end) or "shift" (the context shifts, keeping the system message). From its first turn
        it holds one lease of ``ctx`` (``branch``).
        """
        if on_context_full not in ("stop", "shift"):
            raise ValueError(f'on_context_full must be "stop" or "shift", not {on_context_full!r}')
        self.on_context_full = on_context_full
        self.shifts = 0  # context shifts over all turns
        self._keep = DEFAULT_KEEP  # tokens a shift keeps: the system message's
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
        self._reply: _Reply | None = None  # the reply being generated
        self._opening = False  # a turn is being prefilled (`_open`)

    def _begin(self, content: str, max_tokens: int) -> _Turn:
        """The user turn, rendered: what to prefill so the branch holds the new prompt (all of
        it on a fresh branch when the prompt no longer extends what the branch holds).
        Nothing changes until the prefill succeeds (`_opened`), but a stream left waiting at
        a yield ends first (its reply joins). A bad `max_tokens` is refused before anything."""
        if max_tokens is not None:  # None: as generate's, no limit but the context's
            if isinstance(max_tokens, bool) or not isinstance(max_tokens, int):
                raise TypeError(f"max_tokens must be an int, not {type(max_tokens).__name__}")
            if max_tokens < 0:
                raise ValueError(f"max_tokens must be >= 0, not {max_tokens}")
        self._settle("one turn at a time")
        message = {"role": "user", "content": content}
        chat = self.ctx.format_chat(
            [*self.messages, message],
            add_generation_prompt=True,
            template=self.template,
            **self.template_kwargs,
        )
        restart = self.branch is None or not chat.prompt.startswith(self._text)
        held = "" if restart else self._text
        tokens = self.ctx.tokenize(
            chat.prompt[len(held) :], add_special=not held, parse_special=True
        )
        return _Turn(message, chat.prompt, tokens, StopStrings(chat.stop), restart)

    def _settle(self, rule: str) -> None:
        """No turn in progress: RuntimeError while one is prefilled or generating; a stream
        left waiting at a yield ends (its reply joins, as far as it went)."""
        if self._opening:
            raise RuntimeError(f"the chat is prefilling a turn: {rule}")
        if (left := self._reply) is not None:
            if not left.idle:
                raise RuntimeError(f"the chat is generating a reply: {rule}")
            self._end(left)

    def _branch_for(self, turn: _Turn) -> Branch:
        """The branch the turn is prefilled on: a fresh one when it restarts."""
        if turn.restart:
            if self.branch is not None:  # a fork of it keeps its cells
                self.branch.prune_sync(keep_children=True)
                self.cold_restarts += 1
            self.branch = None
            self._text = ""
            self.branch = Branch.create(self.ctx, 0, self.params)
            self._keep = self._system_tokens(turn.prompt)
        assert self.branch is not None
        return self.branch

    def _opened(self, turn: _Turn) -> None:
        """The turn's tokens are in the branch: it joins the conversation."""
        self.messages.append(turn.message)
        self._text = turn.prompt
        self.prefilled_tokens += len(turn.tokens)

    def _failed(self, turn: _Turn, base: int | None) -> None:
        """The turn's prefill raised (or was cancelled): the conversation stays as it was.
        Unless the prefill completed before a cancel landed (the branch is at ``base`` plus
        the turn's tokens: the turn joins), or the branch is empty (a fresh one, or one a
        failed shift emptied): the next turn then prefills the whole conversation."""
        assert self.branch is not None
        if base is not None and self.branch.position == base + len(turn.tokens):
            self._opened(turn)
        elif self.branch.position == 0:
            self._text = ""

    def _system_tokens(self, prompt: str) -> int:
        """How many tokens a context shift keeps: those of the rendered system message (when
        the prompt begins with its rendering), else a few (attention sinks)."""
        system = [m for m in self.messages[:1] if m["role"] == "system"]
        if not system:
            return DEFAULT_KEEP
        text = self.ctx.format_chat(
            system, add_generation_prompt=False, template=self.template, **self.template_kwargs
        ).prompt
        if not prompt.startswith(text):
            return DEFAULT_KEEP
        n = len(self.ctx.tokenize(text, add_special=True, parse_special=True))
        return max(0, min(n, self.ctx.n_ctx - 2))

    def _room_for(self, tokens: list[int]) -> tuple[list[int], int] | None:
        """With "shift": the sinks and tail of a reseed that leaves room for ``tokens`` and a
        reply token (the system message and the most recent half of the rest, or less), or
        None when they fit already or cannot fit."""
        assert self.branch is not None
        position = self.branch.position
        if self.on_context_full != "shift" or position + len(tokens) < self.ctx.n_ctx:
            return None
        keep = min(self._keep, position)
        rest = position - keep
        tail = min(rest - rest // 2, self.ctx.n_ctx - 1 - keep - len(tokens))
        if tail < 0:
            return None  # the turn alone does not fit: the prefill says so
        return self.branch.history[:keep], tail

    async def _open(self, turn: _Turn) -> Branch:
        """Prefill the turn (after a reseed that makes room, with "shift"): all or nothing.
        Another turn meanwhile is refused (`_begin`)."""
        self._opening = True
        try:
            branch, base = self._branch_for(turn), None
            try:
                if (room := self._room_for(turn.tokens)) is not None:
                    await branch.reseed_context(*room)
                    self.shifts += 1
                base = branch.position
                await branch.prefill(turn.tokens)
            except BaseException:
                self._failed(turn, base)
                raise
        finally:
            self._opening = False
        self._opened(turn)
        return branch

    def _open_sync(self, turn: _Turn) -> Branch:
        """Blocking twin of ``_open``."""
        self._opening = True
        try:
            branch, base = self._branch_for(turn), None
            try:
                if (room := self._room_for(turn.tokens)) is not None:
                    branch.reseed_context_sync(*room)
                    self.shifts += 1
                base = branch.position
                branch.prefill_sync(turn.tokens)
            except BaseException:
                self._failed(turn, base)
                raise
        finally:
            self._opening = False
        self._opened(turn)
        return branch

    def _replying(self, turn: _Turn, stream: TokenStream | TokenStreamSync) -> _Reply:
        """The turn's reply starts: the turn in progress until `_end`."""
        assert self.branch is not None
        self._reply = _Reply(turn.reply, stream, self.branch.position)
        return self._reply

    def _end(self, r: _Reply) -> None:
        """The reply joins the conversation (however its generation ended; once). ``r.seen``:
        the branch's position after the last token the stream yielded; past it, the step in
        flight when the reply was cancelled (or Ctrl-C) committed one more: it joins too, so
        the KV and ``messages`` agree."""
        if r is not self._reply:
            return  # a later turn ended it already
        self._reply = None
        assert self.branch is not None
        reply, stream = r.text, r.stream
        self.shifts += stream.shifts
        position = self.branch.position
        if stream.stop_reason is None and position not in (0, r.seen):
            reply.add(self.ctx.token_to_text(self.branch.history[-1]))
        self.messages.append({"role": "assistant", "content": reply.content})
        if position == 0:  # a failed shift emptied the branch
            self._text = ""
        else:  # every generated token was committed (a stop string too)
            self._text += reply.text

    async def send(self, content: str, *, max_tokens: int = 256) -> str:
        """Add a user turn, generate the assistant's reply (also appended to ``messages``). A
        turn whose prefill fails (or is cancelled) is not added: the conversation is as it
        was. A reply cut short by an error or a cancel is added as far as it went (with the
        token a cancelled step committed: as far as the branch holds it). One turn at a
        time: RuntimeError while another is generating."""
        turn = self._begin(content, max_tokens)
        branch = await self._open(turn)
        stream = self._generate(max_tokens)
        r = self._replying(turn, stream)
        try:
            async for tok in stream:
                r.seen = branch.position
                if r.text.add(tok.text):
                    break
        finally:
            self._end(r)
        return r.text.content

    async def stream(self, content: str, *, max_tokens: int = 256) -> AsyncGenerator[str, None]:
        """Like ``send``, yielding the reply's text as it is generated. Text that could be
        the start of a stop string is held back until it is not; the whole reply is
        appended to ``messages`` when the stream ends (also when it is closed early). A stream
        left unfinished (a ``break`` out of its loop) ends when the next turn starts: its
        reply joins as far as it went, and the stream yields no more."""
        turn = self._begin(content, max_tokens)
        branch = await self._open(turn)
        stream = self._generate(max_tokens)
        r = self._replying(turn, stream)
        reply = r.text
        try:
            async for tok in stream:
                r.seen = branch.position
                stopped = reply.add(tok.text)
                if piece := reply.take():
                    r.idle = True
                    yield piece
                    r.idle = False
                    if r is not self._reply:
                        return  # ended by a later turn
                if stopped:
                    break
            if piece := reply.take(final=True):
                r.idle = True
                yield piece
        finally:
            self._end(r)

    def stream_sync(self, content: str, *, max_tokens: int = 256) -> Iterator[str]:
        """Blocking twin of ``stream``."""
        turn = self._begin(content, max_tokens)
        branch = self._open_sync(turn)
        stream = self._generate_sync(max_tokens)
        r = self._replying(turn, stream)
        reply = r.text
        try:
            for tok in stream:
                r.seen = branch.position
                stopped = reply.add(tok.text)
                if piece := reply.take():
                    r.idle = True
                    yield piece
                    r.idle = False
                    if r is not self._reply:
                        return  # ended by a later turn
                if stopped:
                    break
            if piece := reply.take(final=True):
                r.idle = True
                yield piece
        finally:
            self._end(r)

    def send_sync(self, content: str, *, max_tokens: int = 256) -> str:
        """Blocking twin of ``send``."""
        turn = self._begin(content, max_tokens)
        branch = self._open_sync(turn)
        stream = self._generate_sync(max_tokens)
        r = self._replying(turn, stream)
        try:
            for tok in stream:
                r.seen = branch.position
                if r.text.add(tok.text):
                    break
        finally:
            self._end(r)
        return r.text.content

    def _generate(self, max_tokens: int) -> TokenStream:
        assert self.branch is not None
        return self.branch.generate(
            max_tokens=max_tokens, on_context_full=self.on_context_full, keep=self._keep
        )

    def _generate_sync(self, max_tokens: int) -> TokenStreamSync:
        assert self.branch is not None
        return self.branch.generate_sync(
            max_tokens=max_tokens, on_context_full=self.on_context_full, keep=self._keep
        )

    async def fork(self) -> Chat:
        """A second conversation that shares this one's history, on a fork of its branch (no
        KV is copied): ask different follow-ups on each. Prune ``branch`` of the fork when
        done with it (``await side.branch.prune()``). Either may start over (a cold restart)
        without the other. A stream left unfinished ends first (its reply joins both); while
        a turn is prefilled or generating, RuntimeError."""
        self._settle("fork after it")
        return self._forked(None if self.branch is None else await self.branch.fork())

    def fork_sync(self) -> Chat:
        """Blocking twin of ``fork``."""
        self._settle("fork after it")
        return self._forked(None if self.branch is None else self.branch.fork_sync())

    def _forked(self, branch: Branch | None) -> Chat:
        other = Chat(
            self.ctx,
            params=self.params,
            template=self.template,
            on_context_full=self.on_context_full,
            **self.template_kwargs,
        )
        other.messages = [dict(m) for m in self.messages]
        other._keep = self._keep
        other.branch = branch
        other._text = self._text  # "" until the first turn takes a branch
        return other
