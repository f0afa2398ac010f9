"""Requests into model inputs: a chat's messages through the model's template (tools
included) into tokens and stop strings, a completion's prompt into tokens, embeddings inputs
into vectors; and a finished reply's text back into tool calls. The tokenizer and the template
are the model's, so any context of it will do (`kvfork serve --ray`'s front has a small one
of its own; the actors generate)."""

from __future__ import annotations

import asyncio
import base64
from typing import Any

import numpy as np

from .._native import ChatTemplateError, Context
from .._tools import (
    call_schema,
    calls_as_text,
    parse_tool_calls,
    template_renders_calls,
    template_renders_tools,
    with_tool_prompt,
)
from .errors import APIError, bad_request
from .requests import ChatRequest, CompletionRequest, EmbeddingRequest, TokenizeRequest


class Prompts:
    """The inputs of the requests, built on `ctx` (the model's tokenizer and chat template, or
    `chat_template`), with `embed_ctx` for `/v1/embeddings` (None: no embedding model)."""

    def __init__(
        self,
        ctx: Context,
        *,
        chat_template: str | None = None,
        embed_ctx: Context | None = None,
    ) -> None:
        self.ctx = ctx
        self.chat_template = chat_template
        self.embed_ctx = embed_ctx
        #: Whether the template shows assistant messages' `tool_calls` (None: not probed yet).
        self._calls_shown: bool | None = None

    def chat_prompt(self, req: ChatRequest) -> tuple[list[int], list[str]]:
        """The prompt tokens of a chat request and the template's stop strings."""
        tokens, stop, _ = self.rendered_chat(req)
        return tokens, stop

    def rendered_chat(self, req: ChatRequest) -> tuple[list[int], list[str], str]:
        """`chat_prompt`, and the prompt as text (whose end may open a think block)."""
        text, stop = self.chat_text(req)
        return self.ctx.tokenize(text, add_special=True, parse_special=True), stop, text

    def chat_text(self, req: ChatRequest) -> tuple[str, list[str]]:
        """A chat request's messages (and tools) through the template: the prompt as text, and
        the template's stop strings (`/apply-template` returns the text)."""
        messages, tools = req.messages, req.tools if req.tool_choice != "none" else None
        kwargs: dict[str, Any] = dict(req.template_kwargs)
        if self.chat_template is not None:
            kwargs["template"] = self.chat_template
        try:
            if tools and not template_renders_tools(self.ctx, messages, **kwargs):
                messages, tools = with_tool_prompt(messages, tools), None
            if any(m.get("tool_calls") for m in messages) and not self._renders_calls(kwargs):
                messages = calls_as_text(messages)
            chat = self.ctx.format_chat(messages, tools=tools, **kwargs)
        except ChatTemplateError as exc:
            message = str(exc)
            if self.chat_template is None and self.ctx.model.chat_template is None:
                # The library's advice (`template=`) is not the server user's.
                message = (
                    "the model has no chat template: start the server with --chat-template "
                    "(a llama.cpp built-in name such as chatml or gemma, or a Jinja file), or use "
                    "/v1/completions"
                )
            raise bad_request(message, "messages", "chat_template") from None
        return chat.prompt + req.prefill, list(chat.stop)

    def _renders_calls(self, kwargs: dict[str, Any]) -> bool:
        """Whether the template shows earlier tool calls (`template_renders_calls`), probed once."""
        if self._calls_shown is None:
            self._calls_shown = template_renders_calls(self.ctx, **kwargs)
        return self._calls_shown

    def tokenize(self, req: TokenizeRequest) -> list[Any]:
        """`/tokenize`: token ids, or `{"id", "piece"}` objects (the piece as text, or as a
        list of bytes when it is not whole UTF-8 by itself)."""
        tokens = self.ctx.tokenize(
            req.content, add_special=req.add_special, parse_special=req.parse_special
        )
        if not req.with_pieces:
            return tokens
        out: list[Any] = []
        for t in tokens:
            raw = self.ctx.token_to_bytes(t)
            try:
                piece: Any = raw.decode("utf-8")
            except UnicodeDecodeError:
                piece = list(raw)
            out.append({"id": t, "piece": piece})
        return out

    def detokenize(self, tokens: list[int]) -> str:
        """`/detokenize`: the text of `tokens`, special tokens written out."""
        return self.ctx.detokenize(tokens, unparse_special=True)

    def completion_prompts(self, req: CompletionRequest) -> list[list[int]]:
        """The tokens of each of a `/v1/completions` request's prompts."""
        return [
            list(p)
            if isinstance(p, list)
            else self.ctx.tokenize(p, add_special=True, parse_special=False)
            for p in req.prompts
        ]

    async def embed(self, req: EmbeddingRequest) -> tuple[list[Any], int]:
        """(data items, prompt tokens) of an embeddings request."""
        if self.embed_ctx is None:
            raise APIError(
                404,
                "this server has no embedding model: start it with --embeddings",
                param="input",
                code="embeddings_disabled",
            )
        ctx = self.embed_ctx
        if req.dimensions is not None and req.dimensions != ctx.embedding_dim:
            raise bad_request(
                f"this model's embeddings have {ctx.embedding_dim} dimensions, not "
                f"{req.dimensions} (it was not trained to be cut short)",
                "dimensions",
            )

        def tokenize() -> list[list[int]]:
            return [
                item if isinstance(item, list) else ctx.tokenize(item, add_special=True)
                for item in req.inputs
            ]

        # Off the event loop: a body of many long texts takes seconds to tokenize.
        token_lists = await asyncio.to_thread(tokenize)
        if any(len(t) > ctx.n_batch for t in token_lists):
            raise bad_request(f"an input is longer than {ctx.n_batch} tokens", "input")
        # A slice of n_seq_max inputs at a time: another request's inputs wait for one slice,
        # not for all of a request of thousands (the context runs its calls in order).
        rows: list[Any] = []
        for start in range(0, len(token_lists), ctx.n_seq_max):
            rows.extend(await ctx.embed_batch(token_lists[start : start + ctx.n_seq_max]))
        data = []
        for i, row in enumerate(rows):
            vector = np.asarray(row, dtype=np.float32)
            value: Any = (
                base64.b64encode(vector.tobytes()).decode()
                if req.encoding_format == "base64"
                else vector.tolist()
            )
            data.append({"object": "embedding", "index": i, "embedding": value})
        return data, sum(len(t) for t in token_lists)

    def tool_calls(self, req: ChatRequest, text: str) -> list[dict[str, Any]]:
        if not req.tools or req.tool_choice == "none":
            return []
        return parse_tool_calls(text, req.tools)

    def constrain_tools(self, req: ChatRequest) -> None:
        """A required or named tool call: the output is that call's JSON."""
        if req.tools and req.tool_choice not in ("none", "auto"):
            name = None if req.tool_choice == "required" else req.tool_choice
            req.sampling.json_schema = call_schema(req.tools, name)
            req.sampling.json_schema_param = "tools"
