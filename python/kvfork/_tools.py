"""Tool calls for chat: rendering the tools into the prompt and reading calls back out.

A chat template that takes `tools` (Qwen, Llama 3.1, Hermes …) renders them itself; for one
that ignores them (SmolLM2's ChatML does) a built-in tool prompt is added to the system
message, in the Hermes style many small models were tuned on: the model answers with
`<tool_call>{"name": ..., "arguments": {...}}</tool_call>`. With a required or named tool the
call is constrained to the functions' JSON schema (llguidance), so it always parses.
"""

from __future__ import annotations

import contextlib
import json
import re
import uuid
from typing import Any

from ._native import Context

_CALL = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)


def _functions(tools: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [t["function"] for t in tools]


def template_renders_tools(ctx: Context, messages: list[dict[str, Any]], **kw: Any) -> bool:
    """Whether the context's chat template shows `tools` (rendering changes with them)."""
    probe = [{"type": "function", "function": {"name": "kvfork_probe_fn", "parameters": {}}}]
    with_tools = ctx.format_chat(messages, tools=probe, **kw).prompt
    return "kvfork_probe_fn" in with_tools


def tool_prompt(tools: list[dict[str, Any]]) -> str:
    """The built-in tool prompt: the functions' signatures and how to call one."""
    lines = [
        "You can call functions. Their JSON signatures are inside <tools></tools>:",
        "<tools>",
        *(json.dumps(fn, ensure_ascii=False) for fn in _functions(tools)),
        "</tools>",
        "To call a function, reply with only a JSON object inside <tool_call></tool_call>:",
        '<tool_call>{"name": <function name>, "arguments": <arguments object>}</tool_call>',
    ]
    return "\n".join(lines)


def with_tool_prompt(
    messages: list[dict[str, Any]], tools: list[dict[str, Any]]
) -> list[dict[str, Any]]:
    """`messages` with the tool prompt added to the system message (or as one)."""
    prompt = tool_prompt(tools)
    out = [dict(m) for m in messages]
    if out and out[0].get("role") == "system":
        out[0]["content"] = f"{out[0].get('content') or ''}\n\n{prompt}".strip()
    else:
        out.insert(0, {"role": "system", "content": prompt})
    return out


def template_renders_calls(ctx: Context, **kw: Any) -> bool:
    """Whether the context's chat template shows an assistant message's `tool_calls`."""
    call = {"type": "function", "function": {"name": "kvfork_probe_fn", "arguments": {}}}
    probe: list[dict[str, Any]] = [
        {"role": "user", "content": "x"},
        {"role": "assistant", "content": "", "tool_calls": [{"id": "c", **call}]},
    ]
    return "kvfork_probe_fn" in ctx.format_chat(probe, add_generation_prompt=False, **kw).prompt


def calls_as_text(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """`messages` for a template that does not show tool calls: each assistant message's
    `tool_calls` written into its content as the `<tool_call>` blocks the tool prompt asks for,
    and each tool result as a `<tool_response>` block, so that the model sees its own calls
    and their results in the next turns (Hermes' convention)."""
    out = []
    for m in messages:
        m = dict(m)
        if m.get("role") == "assistant" and m.get("tool_calls"):
            blocks = [_call_text(c) for c in m.pop("tool_calls")]
            m["content"] = "\n".join([*filter(None, [m.get("content")]), *blocks])
        elif m.get("role") == "tool":
            m["content"] = f"<tool_response>\n{m.get('content') or ''}\n</tool_response>"
        out.append(m)
    return out


def _call_text(call: dict[str, Any]) -> str:
    fn = call.get("function") or {}
    args = fn.get("arguments", {})
    if isinstance(args, str):
        with contextlib.suppress(ValueError):  # else kept as the text it was
            args = json.loads(args)
    body = json.dumps({"name": fn.get("name"), "arguments": args}, ensure_ascii=False)
    return f"<tool_call>{body}</tool_call>"


def call_schema(tools: list[dict[str, Any]], name: str | None = None) -> dict[str, Any]:
    """JSON schema of one call `{"name", "arguments"}`: of the function `name`, or of any."""
    options = [
        {
            "type": "object",
            "properties": {
                "name": {"const": fn["name"]},
                "arguments": fn.get("parameters") or {"type": "object"},
            },
            "required": ["name", "arguments"],
            "additionalProperties": False,
        }
        for fn in _functions(tools)
        if name is None or fn["name"] == name
    ]
    return options[0] if len(options) == 1 else {"anyOf": options}


def _call(obj: Any, names: set[str]) -> dict[str, Any] | None:
    if not isinstance(obj, dict) or obj.get("name") not in names:
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    return {
        "id": f"call_{uuid.uuid4().hex[:24]}",
        "type": "function",
        "function": {"name": obj["name"], "arguments": json.dumps(args, ensure_ascii=False)},
    }


def text_before_calls(text: str) -> str:
    """What a reply says before its first `<tool_call>` block, trailing whitespace left out
    ("" without such a block): kept beside the calls, as OpenAI's and Anthropic's replies
    keep it."""
    found = _CALL.search(text)
    return text[: found.start()].rstrip() if found else ""


def parse_tool_calls(text: str, tools: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The calls of known functions in a reply: `<tool_call>` blocks, or a reply that is one
    JSON call object. Empty when the reply is plain text."""
    names = {fn["name"] for fn in _functions(tools)}
    blocks = _CALL.findall(text) or [text.strip()]
    calls = []
    for block in blocks:
        try:
            obj = json.loads(block)
        except ValueError:
            continue
        for item in obj if isinstance(obj, list) else [obj]:
            call = _call(item, names)
            if call is not None:
                calls.append(call)
    return calls
