"""The bodies of OpenAI requests, read and checked: each field has its type and range checked
and a bad one is a 400 naming it (never the framework's 422 shape)."""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field, replace
from typing import Any

from .adapters import Choice, parse_lora
from .errors import bad_request, is_finite_number
from .reasoning import EFFORTS, FORMATS, Asked, Plan

#: Default completion length when a request names none (llama.cpp's server uses the context).
DEFAULT_MAX_TOKENS = 256


@dataclass
class Sampling:
    """What every generation request shares."""

    max_tokens: int = DEFAULT_MAX_TOKENS
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[int, float] = field(default_factory=dict)
    stop: list[str] = field(default_factory=list)
    n: int = 1
    logprobs: bool = False
    top_logprobs: int = 0
    stream: bool = False
    include_usage: bool = False
    #: A JSON schema the output follows (response_format or a required tool call).
    json_schema: dict[str, Any] | None = None
    #: The field that schema came from, which an error in it names.
    json_schema_param: str = "response_format"
    #: The LoRA adapters asked for by name or index (`adapters.parse_lora`).
    lora: Choice = field(default_factory=list)
    #: The request's `model`: an adapter's name selects it (`Adapters.resolve`).
    model: str | None = None
    #: How its choices reason (chat requests: `reasoning.plan`); None: no reasoning followed.
    reasoning: Plan | None = None
    #: The prompt's tokens get logprobs too (`/v1/completions` with `echo` and `logprobs`).
    score_prompt: bool = False

    def params(self, choice: int = 0) -> dict[str, Any]:
        """kvfork SamplingParams fields for choice `choice` (seeded choices differ)."""
        p: dict[str, Any] = {
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "min_p": self.min_p,
            "presence_penalty": self.presence_penalty,
            "frequency_penalty": self.frequency_penalty,
        }
        if self.presence_penalty or self.frequency_penalty:
            p["penalty_last_n"] = 64
        if self.seed is not None:
            p["seed"] = (self.seed + choice) % 2**32
        return p


@dataclass
class CompletionRequest:
    """`/v1/completions`."""

    #: One or more prompts: each a string or a list of token ids.
    prompts: list[str | list[int]]
    sampling: Sampling
    echo: bool = False


@dataclass
class ChatRequest:
    """`/v1/chat/completions`."""

    messages: list[dict[str, Any]]
    sampling: Sampling
    tools: list[dict[str, Any]] | None = None
    #: "none", "auto", "required", or the name of the function that must be called.
    tool_choice: str = "auto"
    #: What the request asked of its reasoning (`reasoning_*` fields).
    reasoning: Asked = field(default_factory=Asked)
    #: Variables for the chat template (`chat_template_kwargs`, `reasoning_effort`).
    template_kwargs: dict[str, Any] = field(default_factory=dict)
    #: The start of the reply, which it continues (a Messages request's final assistant
    #: turn): after the prompt the template opens the reply with.
    prefill: str = ""


@dataclass
class EmbeddingRequest:
    """`/v1/embeddings`."""

    inputs: list[str | list[int]]
    encoding_format: str = "float"
    #: OpenAI's `dimensions`: only the model's own is given (a vector cut short is not an
    #: embedding of a model that was not trained for it).
    dimensions: int | None = None


#: The deepest nesting of arrays and objects a body may have (a real request needs a
#: handful; deeper ones only stress the parser and whatever walks the result).
MAX_NESTING = 64


class _NotAJsonNumber(ValueError):
    pass


def _no_constant(name: str) -> float:
    """Python's parser takes `NaN` and `Infinity`; JSON has no such numbers, and a reply
    that echoed one back (a tool's schema) could not be written as JSON."""
    raise _NotAJsonNumber(f"{name} is not a JSON number")


def _finite(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):  # 1e999: a number JSON can write, but not as a float
        raise _NotAJsonNumber(f"{text} is too large for a float")
    return value


def parse_json(raw: bytes) -> dict[str, Any]:
    """The request body as a JSON object, nested at most `MAX_NESTING` deep, its numbers
    finite."""
    try:
        body = json.loads(raw, parse_constant=_no_constant, parse_float=_finite)
    except RecursionError:
        raise bad_request(f"the body is nested deeper than {MAX_NESTING} levels") from None
    except (ValueError, UnicodeDecodeError) as exc:
        raise bad_request(f"the body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise bad_request("the body must be a JSON object")
    if _nesting(body) > MAX_NESTING:
        raise bad_request(f"the body is nested deeper than {MAX_NESTING} levels")
    if SURROGATE_ESCAPE.search(raw):  # rare: only then are the strings looked at
        _refuse_lone_surrogates(body)
    return body


#: A `\uD800`-`\uDFFF` escape: half of a pair (one character once parsed), or alone.
SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F][0-9a-fA-F]{2}")
_SURROGATE = re.compile("[\ud800-\udfff]")


def _refuse_lone_surrogates(body: dict[str, Any]) -> None:
    """A 400 naming the first string (key or value) holding an unpaired UTF-16 surrogate:
    valid JSON, but not text (it cannot be encoded as UTF-8, tokenized, or sent back)."""

    def refuse(where: str, path: str, text: str) -> None:
        found = _SURROGATE.search(text)
        if found is not None:
            raise bad_request(
                f"{where} holds an unpaired UTF-16 surrogate (\\u{ord(found.group()):04x}): "
                "not text",
                re.split(r"[.\[]", path, maxsplit=1)[0] or None,
            )

    stack: list[tuple[Any, str]] = [(body, "")]
    while stack:
        item, path = stack.pop()
        if isinstance(item, str):
            refuse(path, path, item)
        elif isinstance(item, dict):
            for key, value in item.items():
                refuse(f"a key of {path or 'the body'}", path, key)
                stack.append((value, f"{path}.{key}" if path else key))
        elif isinstance(item, list):
            stack.extend((value, f"{path}[{i}]") for i, value in enumerate(item))


def _nesting(value: Any) -> int:
    """How deep arrays and objects nest in `value` (without recursion)."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict):
            children: Any = item.values()
        elif isinstance(item, list):
            children = item
        else:
            continue
        deepest = max(deepest, depth)
        if deepest > MAX_NESTING:
            return deepest
        stack.extend((child, depth + 1) for child in children)
    return deepest


def number_field(body: dict[str, Any], name: str, default: float, lo: float, hi: float) -> float:
    """`body[name]`, a number in [lo, hi] (`default` when absent); else a 400 naming it."""
    value = body.get(name)
    if value is None:
        return default
    if not is_finite_number(value):
        raise bad_request(f"{name} must be a number", name)
    if not lo <= value <= hi:
        raise bad_request(f"{name} must be in [{lo}, {hi}], got {value}", name)
    return float(value)


def int_field(body: dict[str, Any], name: str, default: int | None, lo: int, hi: int) -> int | None:
    """`body[name]`, an integer in [lo, hi] (`default` when absent); else a 400 naming it."""
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int):
        raise bad_request(f"{name} must be an integer", name)
    if not lo <= value <= hi:
        raise bad_request(f"{name} must be in [{lo}, {hi}], got {value}", name)
    return value


def bool_field(body: dict[str, Any], name: str, default: bool = False) -> bool:
    """`body[name]`, a boolean (`default` when absent); else a 400 naming it."""
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise bad_request(f"{name} must be a boolean", name)
    return value


def model_field(body: dict[str, Any]) -> str | None:
    """`body["model"]`: a string (an adapter's name selects it), absent, or a 400."""
    value = body.get("model")
    if value is not None and not isinstance(value, str):
        raise bad_request("model must be a string", "model")
    return value


def _stop(body: dict[str, Any]) -> list[str]:
    value = body.get("stop")
    if value is None:
        return []
    if isinstance(value, str):
        return [value]
    if isinstance(value, list) and all(isinstance(s, str) for s in value) and len(value) <= 4:
        return [s for s in value if s]
    raise bad_request("stop must be a string or a list of at most 4 strings", "stop")


def _logit_bias(body: dict[str, Any], vocab_size: int) -> dict[int, float]:
    value = body.get("logit_bias")
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise bad_request("logit_bias must be an object {token id: bias}", "logit_bias")
    out: dict[int, float] = {}
    for key, bias in value.items():
        try:
            token = int(key)
        except (TypeError, ValueError):
            raise bad_request(f"logit_bias key {key!r} is not a token id", "logit_bias") from None
        if not 0 <= token < vocab_size:
            raise bad_request(f"logit_bias token {token} is outside the vocabulary", "logit_bias")
        if isinstance(bias, bool) or not isinstance(bias, int | float) or not -100 <= bias <= 100:
            raise bad_request("logit_bias values must be numbers in [-100, 100]", "logit_bias")
        out[token] = float(bias)
    return out


def _response_format(body: dict[str, Any]) -> dict[str, Any] | None:
    value = body.get("response_format")
    if value is None:
        return None
    if not isinstance(value, dict) or not isinstance(value.get("type"), str):
        raise bad_request("response_format must be an object with a type", "response_format")
    kind = value["type"]
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "object"}
    if kind == "json_schema":
        spec = value.get("json_schema")
        schema = spec.get("schema") if isinstance(spec, dict) else None
        if not isinstance(schema, dict):
            raise bad_request(
                "response_format.json_schema.schema must be a JSON schema object",
                "response_format",
            )
        return schema
    raise bad_request(f"response_format type {kind!r} is not supported", "response_format")


def parse_sampling(
    body: dict[str, Any], vocab_size: int, max_n: int, min_tokens: int = 1
) -> Sampling:
    """The sampling fields every generation endpoint shares (`min_tokens`: the least
    `max_tokens` may be)."""
    max_tokens = int_field(body, "max_completion_tokens", None, min_tokens, 1 << 20)
    if max_tokens is None:
        max_tokens = int_field(body, "max_tokens", DEFAULT_MAX_TOKENS, min_tokens, 1 << 20)
    n = int_field(body, "n", 1, 1, 1 << 20)
    assert n is not None and max_tokens is not None
    if n > max_n:
        raise bad_request(f"n = {n} is more than this server's {max_n} sequences", "n")
    logprobs = body.get("logprobs")
    top = 0
    if isinstance(logprobs, int) and not isinstance(logprobs, bool):
        # /v1/completions: logprobs is the number of alternatives.
        if not 0 <= logprobs <= 20:
            raise bad_request("logprobs must be in [0, 20]", "logprobs")
        top, logprobs = logprobs, True
    elif logprobs is not None and not isinstance(logprobs, bool):
        raise bad_request("logprobs must be a boolean", "logprobs")
    asked = int_field(body, "top_logprobs", None, 0, 20)
    if asked and logprobs is not True:  # as OpenAI: silently ignored otherwise
        raise bad_request("top_logprobs needs logprobs: true", "top_logprobs")
    top = asked if asked is not None else top
    options = body.get("stream_options")
    if options is not None and not isinstance(options, dict):
        raise bad_request("stream_options must be an object", "stream_options")
    stream = bool_field(body, "stream")
    if options is not None and not stream:  # as OpenAI: it would be silently ignored
        raise bad_request("stream_options needs stream: true", "stream_options")
    include_usage = (options or {}).get("include_usage")
    if include_usage is not None and not isinstance(include_usage, bool):
        raise bad_request(
            "stream_options.include_usage must be a boolean", "stream_options.include_usage"
        )
    seed = int_field(body, "seed", None, -(2**63), 2**63 - 1)
    return Sampling(
        max_tokens=max_tokens,
        temperature=number_field(body, "temperature", 1.0, 0.0, 2.0),
        top_p=number_field(body, "top_p", 1.0, 0.0, 1.0),
        top_k=int_field(body, "top_k", 0, 0, 1 << 20) or 0,
        min_p=number_field(body, "min_p", 0.0, 0.0, 1.0),
        seed=seed,
        presence_penalty=number_field(body, "presence_penalty", 0.0, -2.0, 2.0),
        frequency_penalty=number_field(body, "frequency_penalty", 0.0, -2.0, 2.0),
        logit_bias=_logit_bias(body, vocab_size),
        stop=_stop(body),
        n=n,
        logprobs=bool(logprobs),
        top_logprobs=top,
        stream=stream,
        include_usage=include_usage is True,
        json_schema=_response_format(body),
        lora=parse_lora(body),
        model=model_field(body),
    )


def parse_completion(body: dict[str, Any], vocab_size: int, max_n: int) -> CompletionRequest:
    """`/v1/completions`: a prompt (a string or a list of token ids), or a list of them."""
    prompts = _completion_prompts(body.get("prompt"), vocab_size)
    # Refused rather than ignored: a reply that silently left them out would look like theirs.
    if body.get("suffix") not in (None, ""):
        raise bad_request("suffix (text to insert before) is not supported", "suffix")
    echo = bool_field(body, "echo")
    # `max_tokens: 0` with echo scores the prompt alone (evaluation harnesses ask so).
    for name in ("max_tokens", "max_completion_tokens"):
        if type(body.get(name)) is int and body[name] == 0 and not echo:
            raise bad_request(
                f"{name} 0 generates nothing: it is for scoring the prompt, with echo: true "
                "and logprobs",
                name,
            )
    sampling = parse_sampling(body, vocab_size, max_n, min_tokens=0 if echo else 1)
    if body.get("best_of") not in (None, sampling.n):
        raise bad_request(
            "best_of is not supported: ask for n choices (with logprobs to rank them)", "best_of"
        )
    if echo and sampling.logprobs:
        sampling = replace(sampling, score_prompt=True)
    return CompletionRequest(prompts=prompts, sampling=sampling, echo=echo)


#: Most prompts one `/v1/completions` request may hold.
MAX_PROMPTS = 1024


def _completion_prompts(prompt: Any, vocab_size: int) -> list[str | list[int]]:
    """`prompt` as a list of prompts: a string, a list of token ids, or a list of either."""

    def token_ids(item: Any) -> bool:
        return (
            isinstance(item, list)
            and bool(item)
            and all(isinstance(t, int) and not isinstance(t, bool) for t in item)
        )

    if isinstance(prompt, str) or token_ids(prompt):
        prompts = [prompt]
    elif isinstance(prompt, list) and prompt:
        prompts = prompt
    else:
        raise bad_request(
            "prompt must be a non-empty string, a list of token ids, or a list of either",
            "prompt",
        )
    if len(prompts) > MAX_PROMPTS:
        raise bad_request(f"a request holds at most {MAX_PROMPTS} prompts", "prompt")
    for i, item in enumerate(prompts):
        which = f"prompt {i}" if len(prompts) > 1 else "prompt"
        if isinstance(item, str):
            if not item:
                raise bad_request(f"{which} is empty", "prompt")
        elif not token_ids(item):
            raise bad_request(
                f"{which} is neither a non-empty string nor a list of token ids", "prompt"
            )
        elif not all(0 <= t < vocab_size for t in item):
            raise bad_request(f"{which} holds a token id outside the vocabulary", "prompt")
    return prompts


_ROLES = {"system", "developer", "user", "assistant", "tool"}


def _messages(body: dict[str, Any]) -> list[dict[str, Any]]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad_request("messages must be a non-empty list", "messages")
    out = []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict) or m.get("role") not in _ROLES:
            raise bad_request(f"{where} must be an object with a role in {sorted(_ROLES)}", where)
        content = m.get("content")
        if isinstance(content, list):  # content parts: keep the text ones
            texts = [p.get("text") for p in content if isinstance(p, dict)]
            if not all(isinstance(t, str) for t in texts):
                raise bad_request(f"{where}.content parts must be text parts", where)
            content = "".join(t for t in texts if isinstance(t, str))
        if content is None:
            # As OpenAI's API: only an assistant turn may leave its content out (one that
            # made tool calls, or said nothing); any other turn without text is a mistake.
            if m["role"] != "assistant":
                raise bad_request(f"{where}.content is required for a {m['role']} message", where)
            content = ""
        if content is not None and not isinstance(content, str):
            raise bad_request(f"{where}.content must be a string", where)
        message: dict[str, Any] = {"role": "system" if m["role"] == "developer" else m["role"]}
        message["content"] = content or ""
        if m.get("tool_calls") is not None:
            _check_tool_calls(m["tool_calls"], where)
        for key in ("name", "tool_call_id", "tool_calls"):
            if key in m and m[key] is not None:
                message[key] = m[key]
        out.append(message)
    return out


def _check_tool_calls(calls: Any, where: str) -> None:
    """An assistant message's `tool_calls` as OpenAI's own: a list of
    `{"id", "type": "function", "function": {"name", "arguments"}}` (arguments a JSON string,
    or the object itself); else a 400 naming the message."""
    if not isinstance(calls, list):
        raise bad_request(f"{where}.tool_calls must be a list", where)
    for j, call in enumerate(calls):
        fn = call.get("function") if isinstance(call, dict) else None
        args = fn.get("arguments", "{}") if isinstance(fn, dict) else None
        if not (
            isinstance(fn, dict)
            and isinstance(fn.get("name"), str)
            and isinstance(args, str | dict)
            and isinstance(call.get("id", ""), str)
        ):
            raise bad_request(
                f"{where}.tool_calls[{j}] must be {{'id': str, 'type': 'function', "
                "'function': {'name': str, 'arguments': str}}",
                where,
            )


def _tools(body: dict[str, Any]) -> tuple[list[dict[str, Any]] | None, str]:
    tools = body.get("tools")
    choice = body.get("tool_choice")
    if tools is None:
        if choice not in (None, "none", "auto"):
            raise bad_request("tool_choice needs tools", "tool_choice")
        return None, "none"
    if not isinstance(tools, list) or not tools:
        raise bad_request("tools must be a non-empty list", "tools")
    names = []
    for i, t in enumerate(tools):
        fn = t.get("function") if isinstance(t, dict) else None
        if not (isinstance(t, dict) and t.get("type") == "function" and isinstance(fn, dict)):
            raise bad_request(
                f"tools[{i}] must be {{'type': 'function', 'function': {{...}}}}", "tools"
            )
        if not isinstance(fn.get("name"), str) or not fn["name"]:
            raise bad_request(f"tools[{i}].function.name must be a non-empty string", "tools")
        params = fn.get("parameters", {"type": "object"})
        if not isinstance(params, dict):
            raise bad_request(f"tools[{i}].function.parameters must be a JSON schema", "tools")
        if fn["name"] in names:
            raise bad_request(f"tools[{i}]: a second function named {fn['name']!r}", "tools")
        names.append(fn["name"])
    if choice is None:
        choice = "auto"
    if isinstance(choice, dict):
        fn = choice.get("function")
        name = fn.get("name") if isinstance(fn, dict) else None
        if choice.get("type") != "function" or not isinstance(name, str) or name not in names:
            raise bad_request("tool_choice must name one of the tools' functions", "tool_choice")
        return tools, name
    if choice not in ("none", "auto", "required"):
        raise bad_request(
            "tool_choice must be 'none', 'auto', 'required' or a function", "tool_choice"
        )
    return tools, choice


def _choice_of(body: dict[str, Any], name: str, options: tuple[str, ...]) -> str | None:
    value = body.get(name)
    if value is not None and value not in options:
        raise bad_request(f"{name} must be one of {', '.join(options)}", name)
    return value


#: The longest budget message: it is tokenized on the event loop when a budget is spent.
MAX_MESSAGE = 4096


def parse_reasoning(body: dict[str, Any]) -> Asked:
    """The `reasoning_*` fields of a chat request: `reasoning_format`, `reasoning_budget`
    (tokens; -1 unlimited, 0 ends the block at once), `reasoning_budget_message`,
    `reasoning_effort`, `reasoning_control` and `reasoning_shared`."""
    message = body.get("reasoning_budget_message")
    if message is not None and (not isinstance(message, str) or len(message) > MAX_MESSAGE):
        raise bad_request(
            f"reasoning_budget_message must be a string of at most {MAX_MESSAGE} characters",
            "reasoning_budget_message",
        )
    return Asked(
        format=_choice_of(body, "reasoning_format", FORMATS),
        budget=int_field(body, "reasoning_budget", None, -1, 1 << 20),
        message=message,
        effort=_choice_of(body, "reasoning_effort", EFFORTS),
        control=bool_field(body, "reasoning_control"),
        shared=bool_field(body, "reasoning_shared"),
    )


#: Template variables a request may not set: the renderer's own arguments.
_RESERVED_KWARGS = {"messages", "tools", "template", "add_generation_prompt"}


def parse_template_kwargs(body: dict[str, Any], effort: str | None) -> dict[str, Any]:
    """`chat_template_kwargs` (llama-server's: variables for the chat template), with
    `reasoning_effort`: a level is the template's `reasoning_effort`, "none" its
    `enable_thinking: false` (unless the kwargs set either)."""
    value = body.get("chat_template_kwargs")
    if value is None:
        value = {}
    if not isinstance(value, dict):
        raise bad_request("chat_template_kwargs must be an object", "chat_template_kwargs")
    reserved = sorted(_RESERVED_KWARGS.intersection(value))
    if reserved:
        raise bad_request(
            f"chat_template_kwargs may not set {', '.join(reserved)}", "chat_template_kwargs"
        )
    kwargs = dict(value)
    if effort == "none":
        kwargs.setdefault("enable_thinking", False)
    elif effort not in (None, "default"):
        kwargs.setdefault("reasoning_effort", effort)
    return kwargs


def parse_chat(body: dict[str, Any], vocab_size: int, max_n: int) -> ChatRequest:
    """`/v1/chat/completions`."""
    messages = _messages(body)
    tools, choice = _tools(body)
    reasoning = parse_reasoning(body)
    return ChatRequest(
        messages=messages,
        sampling=parse_sampling(body, vocab_size, max_n),
        tools=tools,
        tool_choice=choice,
        reasoning=reasoning,
        template_kwargs=parse_template_kwargs(body, reasoning.effort),
    )


def parse_control(body: dict[str, Any]) -> str:
    """`POST /v1/chat/completions/control` (llama-server's): the running request's `id`; its
    `action` must be the one there is, `reasoning_end`. `model` is accepted (a router's)."""
    request_id = body.get("id")
    if not isinstance(request_id, str) or not request_id:
        raise bad_request("id must be the id of a running chat completion", "id")
    action = body.get("action")
    if action != "reasoning_end":
        raise bad_request("action must be 'reasoning_end'", "action")
    return request_id


#: The most texts one `/v1/embeddings` request may embed (OpenAI's own bound): more is hours
#: of work on a CPU from one body under the size limit.
MAX_EMBEDDING_INPUTS = 2048


def parse_embeddings(body: dict[str, Any], vocab_size: int) -> EmbeddingRequest:
    """`/v1/embeddings`: a string, a list of strings, a token list or a list of token lists."""
    value = body.get("input")
    items: list[Any]
    if isinstance(value, str) or (
        isinstance(value, list) and value and all(isinstance(t, int) for t in value)
    ):
        items = [value]
    elif isinstance(value, list) and value:
        items = value
    else:
        raise bad_request("input must be a string, a list of strings or of token lists", "input")
    if len(items) > MAX_EMBEDDING_INPUTS:
        raise bad_request(
            f"input holds {len(items)} items: at most {MAX_EMBEDDING_INPUTS} a request", "input"
        )
    for item in items:
        if isinstance(item, str) and item:
            continue
        if (
            isinstance(item, list)
            and item
            and all(
                isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab_size for t in item
            )
        ):
            continue
        raise bad_request("input items must be non-empty strings or token id lists", "input")
    model_field(body)  # checked as elsewhere; one model embeds whatever it names
    fmt = body.get("encoding_format", "float")
    if fmt not in ("float", "base64"):
        raise bad_request("encoding_format must be 'float' or 'base64'", "encoding_format")
    dimensions = int_field(body, "dimensions", None, 1, 1 << 20)
    return EmbeddingRequest(inputs=items, encoding_format=fmt, dimensions=dimensions)


@dataclass
class TokenizeRequest:
    """`/tokenize` (llama-server's shape)."""

    content: str
    add_special: bool = False
    parse_special: bool = True
    with_pieces: bool = False


def parse_tokenize(body: dict[str, Any]) -> TokenizeRequest:
    """`/tokenize`: `content`, with `add_special` (BOS; default false), `parse_special`
    (special tokens written as text are recognised; default true) and `with_pieces`."""
    content = body.get("content")
    if not isinstance(content, str):
        raise bad_request("content must be a string", "content")
    return TokenizeRequest(
        content=content,
        add_special=bool_field(body, "add_special"),
        parse_special=bool_field(body, "parse_special", default=True),
        with_pieces=bool_field(body, "with_pieces"),
    )


def parse_detokenize(body: dict[str, Any], vocab_size: int) -> list[int]:
    """`/detokenize`: `tokens`, ids of the vocabulary."""
    tokens = body.get("tokens")
    if not isinstance(tokens, list) or not all(
        isinstance(t, int) and not isinstance(t, bool) for t in tokens
    ):
        raise bad_request("tokens must be a list of token ids", "tokens")
    if not all(0 <= t < vocab_size for t in tokens):
        raise bad_request("tokens holds an id outside the vocabulary", "tokens")
    return list(tokens)


def parse_apply_template(body: dict[str, Any]) -> ChatRequest:
    """`/apply-template`: `messages` (and `tools`, `tool_choice`, `chat_template_kwargs`,
    `reasoning_effort`) as `/v1/chat/completions` takes them; nothing is generated."""
    tools, choice = _tools(body)
    effort = _choice_of(body, "reasoning_effort", EFFORTS)
    return ChatRequest(
        messages=_messages(body),
        sampling=Sampling(),
        tools=tools,
        tool_choice=choice,
        template_kwargs=parse_template_kwargs(body, effort),
    )
