"""`kvfork serve` on a hybrid model (the tiny LFM2 of `family_models`: convolution layers
beside attention): requests sharing a system prompt share it exactly, through the recurrent
state's checkpoints, with the real `openai` client on 127.0.0.1."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import kvfork
import pytest

from .family_models import model_path
from .serving import Server, servers

# Long enough for the prefix cache to share it (16+ tokens), the same in every request.
SYSTEM = (
    "You are a careful assistant. Answer in one short sentence, name your sources, and never "
    "guess a date you do not know."
)
QUESTIONS = [
    "Who built the first printing press?",
    "Where is Mainz?",
    "What is movable type?",
    "Why did paper matter?",
]
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def hybrid_path(family_model_dir: Path) -> Path:
    return model_path("lfm2", family_model_dir)


@pytest.fixture(scope="module")
def hybrid_server(hybrid_path: Path) -> Iterator[Server]:
    for start in servers():
        server: Server = start(str(hybrid_path), "--n-ctx", "2048", "--n-seq-max", "6")
        yield server
        server.assert_at_rest()


def _alone(path: Path, question: str) -> str:
    """The greedy reply of a fresh context, nothing shared."""
    with kvfork.create_context_sync(path, n_ctx=1024) as ctx:
        chat = kvfork.Chat(ctx, params={"temperature": 0.0}, system=SYSTEM)
        return chat.send_sync(question, max_tokens=MAX_TOKENS)


def test_a_hybrid_model_shares_the_system_prompt_exactly(
    hybrid_server: Server, hybrid_path: Path
) -> None:
    """Each reply equals the same request alone. From the third request on, the system
    prompt comes from the cache (the second marked where the prompts part), not re-prefilled;
    the first two share nothing, as the first had no checkpoint where they part."""
    client = hybrid_server.client()
    cached: list[int] = []
    for i, question in enumerate(QUESTIONS):
        messages: list[Any] = [
            {"role": "system", "content": SYSTEM},
            {"role": "user", "content": question},
        ]
        if i % 2:
            pieces, usage = [], None
            for chunk in client.chat.completions.create(
                model="x",
                messages=messages,
                temperature=0,
                max_tokens=MAX_TOKENS,
                stream=True,
                stream_options={"include_usage": True},
            ):
                if chunk.choices and chunk.choices[0].delta.content:
                    pieces.append(chunk.choices[0].delta.content)
                usage = chunk.usage or usage
            text = "".join(pieces)
        else:
            reply = client.chat.completions.create(
                model="x", messages=messages, temperature=0, max_tokens=MAX_TOKENS
            )
            text, usage = reply.choices[0].message.content or "", reply.usage
        assert text == _alone(hybrid_path, question), question
        assert usage is not None and usage.prompt_tokens_details is not None
        cached.append(usage.prompt_tokens_details.cached_tokens or 0)
    assert cached[0] == 0
    assert all(c > 16 for c in cached[2:]), cached
    assert hybrid_server.metric("kvfork_checkpoint_restores_total") >= 2


def test_a_device_sampling_hybrid_server_sets_a_bias_before_the_last_token(
    hybrid_path: Path,
) -> None:
    """`--device-sampling` on the hybrid model: a request's logit bias is set before its
    prompt's last token is decoded (a recurrent state cannot decode that token again for the
    row), so a greedy request forced onto one token starts with it, cold and from the cache."""
    for start in servers():
        server: Server = start(
            str(hybrid_path), "--n-ctx", "2048", "--n-seq-max", "4", "--device-sampling"
        )
        status, body = server.post("/tokenize", b'{"content": " Mainz"}')
        assert status == 200
        forced = body["tokens"][-1]
        status, body = server.post("/detokenize", json.dumps({"tokens": [forced]}).encode())
        assert status == 200
        messages: Any = [
            {"role": "system", "content": SYSTEM},
            {"role": "user", "content": QUESTIONS[0]},
        ]
        for _ in range(2):
            reply = server.client().chat.completions.create(
                model="x",
                messages=messages,
                temperature=0,
                max_tokens=2,
                logit_bias={str(forced): 100},
            )
            assert (reply.choices[0].message.content or "").startswith(body["content"])
        server.assert_at_rest()
