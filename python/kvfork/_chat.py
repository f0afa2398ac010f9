"""A conversation kept warm on one branch (multi-turn chat without re-prefilling history)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from ._native import Branch, Context, FormattedChat, SamplingParams, Token


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

    def _render(self) -> FormattedChat:
        return self.ctx.format_chat(
            self.messages,
            add_generation_prompt=True,
            template=self.template,
            **self.template_kwargs,
        )

    def _new_tokens(self, prompt: str) -> list[int]:
        """Tokens to prefill so the branch holds `prompt` (a fresh branch when it must)."""
        if self.branch is None or not prompt.startswith(self._text):
            if self.branch is not None:
                self.branch.prune_sync()
                self.cold_restarts += 1
            self.branch = Branch.create(self.ctx, 0, self.params)
            self._text = ""
        delta = prompt[len(self._text) :]
        tokens = self.ctx.tokenize(delta, add_special=not self._text, parse_special=True)
        self._text = prompt
        self.prefilled_tokens += len(tokens)
        return tokens

    def _finish(self, pieces: Iterable[Token], stop: list[str]) -> str:
        text = ""
        for tok in pieces:
            text += tok.text
            cut = min((i for s in stop if (i := text.find(s)) >= 0), default=-1)
            if cut >= 0:
                self._text += text  # the stop string's tokens were committed
                reply = text[:cut]
                break
        else:
            self._text += text
            reply = text
        self.messages.append({"role": "assistant", "content": reply})
        return reply

    async def send(self, content: str, *, max_tokens: int = 256) -> str:
        """Add a user turn, generate the assistant's reply (also appended to ``messages``)."""
        self.messages.append({"role": "user", "content": content})
        chat = self._render()
        tokens = self._new_tokens(chat.prompt)
        assert self.branch is not None
        await self.branch.prefill(tokens)
        pieces = []
        text = ""
        async for tok in self.branch.generate(max_tokens=max_tokens):
            pieces.append(tok)
            text += tok.text
            if any(s in text for s in chat.stop):
                break
        return self._finish(pieces, chat.stop)

    def send_sync(self, content: str, *, max_tokens: int = 256) -> str:
        """Blocking twin of ``send``."""
        self.messages.append({"role": "user", "content": content})
        chat = self._render()
        tokens = self._new_tokens(chat.prompt)
        assert self.branch is not None
        self.branch.prefill_sync(tokens)
        pieces = []
        text = ""
        for tok in self.branch.generate_sync(max_tokens=max_tokens):
            pieces.append(tok)
            text += tok.text
            if any(s in text for s in chat.stop):
                break
        return self._finish(pieces, chat.stop)
