"""Many LoRA adapters in one `kvfork serve` (`--lora NAME=PATH[:SCALE]`): each request chooses
its set by name (`lora`, or `model`), its tokens are those of a branch decoding under that set
in the library, requests on different sets share no prefix, and concurrent requests over
several sets each get what they get alone. A real server on loopback, the real `openai`
client, adapters written by the tests."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import kvfork
import openai
import pytest

from .adapter_files import write_lora
from .conftest import FIRST_LOGPROB_NOISE, NEAR_TIE, ON_CPU
from .serving import Server, logprob_margin, servers

PROMPT = "The three most useful things to pack for a long hike are"
TOKENS = 8


@pytest.fixture(scope="module")
def lora_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("serve-lora")
    # The library tests' adapters: they move the logits by 2-3, while decoding a prompt in
    # other batch shapes under them moves them by at most 0.45 (measured), under the margin
    # rule's 1.0. (Random adapters 4x larger drive the model into noise: 1.3 apart.)
    write_lora(d / "a.gguf", seed=1)
    write_lora(d / "b.gguf", seed=2, layers=(3, 4))
    return d


@pytest.fixture(scope="module")
def serve() -> Iterator[Callable[..., Server]]:
    yield from servers()


@pytest.fixture(scope="module")
def lora_server(serve: Any, lora_dir: Path) -> Server:
    server: Server = serve(
        "default",
        "--n-ctx",
        "2048",
        "--n-seq-max",
        "8",
        "--lora",
        f"a={lora_dir / 'a.gguf'}",
        "--lora",
        f"b={lora_dir / 'b.gguf'}:0.5",
        "--chat-template",
        "chatml",  # the default model has none; chat and messages requests need one
    )
    return server


@pytest.fixture(autouse=True)
def _at_rest(request: pytest.FixtureRequest) -> Iterator[None]:
    yield
    if "lora_server" in request.fixturenames:
        request.getfixturevalue("lora_server").assert_at_rest()


def complete(server: Server, prompt: str = PROMPT, **extra: Any) -> Any:
    with server.client() as client:
        return client.completions.create(
            model=extra.pop("model", "default"),
            prompt=prompt,
            max_tokens=TOKENS,
            temperature=0,
            logprobs=2,
            extra_body=extra or None,
        )


def first_logprob(reply: Any) -> float:
    return float(reply.choices[0].logprobs.token_logprobs[0])


def first_shift(x: Any, y: Any) -> float:
    """How far two replies' first rows are apart: the largest difference of the log-probability
    of a token both list among the first position's best two (inf if they list others)."""
    tops_x, tops_y = x.choices[0].logprobs.top_logprobs[0], y.choices[0].logprobs.top_logprobs[0]
    if set(tops_x) != set(tops_y):
        return float("inf")
    return float(max(abs(tops_x[t] - tops_y[t]) for t in tops_x))


def assert_same_greedy_text(got: Any, reference: Any) -> None:
    """The suite's margin rule (`conftest.assert_same_greedy`) on two replies: their tokens
    are equal up to the reference's first near-tie (a prefix shared from the cache, or decoded
    beside other requests, is computed in other batch shapes)."""
    ref, out = reference.choices[0].logprobs, got.choices[0].logprobs
    for i, (g, e) in enumerate(zip(out.tokens, ref.tokens)):
        if logprob_margin(ref.top_logprobs[i].values()) < NEAR_TIE:
            return
        assert g == e, f"token {i} differs ({g!r} != {e!r}) at a clear margin"
    assert len(out.tokens) == len(ref.tokens)


def test_the_adapters_are_listed(lora_server: Server, lora_dir: Path) -> None:
    status, listed = lora_server.get("/lora-adapters")
    assert status == 200
    assert listed == [
        {"id": 0, "name": "a", "path": str(lora_dir / "a.gguf"), "scale": 1.0},
        {"id": 1, "name": "b", "path": str(lora_dir / "b.gguf"), "scale": 0.5},
    ]
    with lora_server.client() as client:
        models = client.models.list().data
    assert [m.id for m in models][1:] == ["a", "b"]
    assert all(getattr(m, "parent", None) == models[0].id for m in models[1:])


def test_a_request_decodes_under_the_set_it_names(lora_server: Server, lora_dir: Path) -> None:
    base = complete(lora_server)
    a = complete(lora_server, lora=[{"name": "a"}])
    # The same adapter chosen by `model`, by id, and at its default scale given explicitly.
    assert_same_greedy_text(complete(lora_server, model="a"), a)
    assert_same_greedy_text(complete(lora_server, lora=[{"id": 0, "scale": 1.0}]), a)
    # Both whole prefills of the same prompt (nothing cached): the adapter moves the first
    # row further than computing it again does (a's prompt found in the cache).
    assert a.usage.prompt_tokens_details.cached_tokens == 0
    a_again = complete(lora_server, model="a")
    assert first_shift(a, base) > first_shift(a, a_again)
    # Scale 0 is the base model; b's default scale is its --lora one, 0.5: its first row is
    # 0.5's up to the cache's noise, further from 1.0's (its first token is a near-tie, so
    # the first position's best two log-probabilities are compared).
    assert_same_greedy_text(complete(lora_server, lora=[{"name": "a", "scale": 0}]), base)
    b_default = complete(lora_server, lora=["b"])
    b_half = complete(lora_server, lora=[{"name": "b", "scale": 0.5}])
    b_full = complete(lora_server, lora=[{"name": "b", "scale": 1.0}])
    assert first_shift(b_default, b_half) <= FIRST_LOGPROB_NOISE
    assert first_shift(b_default, b_full) > first_shift(b_default, b_half)
    # The library's own branch under adapter a gives the server's first token and logprob.
    model = kvfork.Model.load(kvfork.default_model_path())
    with kvfork.create_context_sync(model, n_ctx=512, n_seq_max=1) as ctx:
        branch = kvfork.Branch.create(ctx, 0, {"temperature": 0.0})
        branch.set_adapters({model.load_lora(lora_dir / "a.gguf"): 1.0})
        branch.prefill_sync(ctx.tokenize(PROMPT))
        token = branch.produce_sync()
        if token.text == a.choices[0].logprobs.tokens[0]:
            # The same whole prefill: bit for bit on this CPU; on a GPU in other cells.
            assert branch.logprob(token.token) == pytest.approx(
                first_logprob(a), abs=1e-3 if ON_CPU else FIRST_LOGPROB_NOISE
            )
        else:  # only at a near-tie (the margin rule)
            first_margin = logprob_margin(a.choices[0].logprobs.top_logprobs[0].values())
            assert first_margin < NEAR_TIE, (token.text, a.choices[0].logprobs.tokens[0])
        branch.prune_sync()


def test_requests_on_different_sets_share_no_prefix(lora_server: Server) -> None:
    prompt = "A prompt of its own. " + PROMPT  # no earlier request began so
    complete(lora_server, prompt, lora=["a"])
    again = complete(lora_server, prompt, lora=["a"])
    other = complete(lora_server, prompt, lora=["b"])
    base = complete(lora_server, prompt)
    assert again.usage.prompt_tokens_details.cached_tokens > 0
    assert other.usage.prompt_tokens_details.cached_tokens == 0
    assert base.usage.prompt_tokens_details.cached_tokens == 0


def test_a_prompt_scored_under_a_set_keeps_its_own_scores(lora_server: Server) -> None:
    """A prompt scored without adapters and then under `a`: the second is scored under `a`
    (its scores kept apart, not the first's), and again under `a` it gets its own back."""
    body = {"prompt": PROMPT, "echo": True, "logprobs": 1, "max_tokens": 0}
    scores = []
    for lora in (None, "a", "a"):
        extra = {"lora": [lora]} if lora else {}
        status, reply = lora_server.post(
            "/v1/completions", json.dumps({**body, **extra, "model": "x"}).encode()
        )
        assert status == 200, reply
        scores.append(reply["choices"][0]["logprobs"]["token_logprobs"][1:])
    plain, under_a, again = scores
    assert max(abs(x - y) for x, y in zip(plain, under_a)) > 0.5  # the adapter moves them
    assert again == under_a


def test_every_api_takes_the_set_and_names_the_adapter_that_answered(
    lora_server: Server,
) -> None:
    # Messages read `lora` too (it was dropped: the base model answered, and an unknown name
    # got a 200): a request naming a by `lora` reads the prompt a request under `model: "a"`
    # left in the cache, which no request of another set could.
    question = [{"role": "user", "content": "Name a lighthouse on the coast of Rome."}]

    def message(**fields: Any) -> dict[str, Any]:
        body = {"max_tokens": 4, "temperature": 0, "messages": question, **fields}
        status, reply = lora_server.post("/v1/messages", json.dumps(body).encode())
        assert status == 200, reply
        return reply

    by_model = message(model="a")
    by_lora = message(model="default", lora=["a"])
    assert by_lora["usage"]["cache_read_input_tokens"] > 0
    assert by_model["content"] == by_lora["content"]
    status, refused = lora_server.post(
        "/v1/messages",
        json.dumps({"max_tokens": 4, "messages": question, "lora": ["zzz"]}).encode(),
    )
    assert status == 400 and "lora" in refused["error"]["message"]
    # A reply names the adapter its `model` chose (as /v1/models lists it), else the base.
    with lora_server.client() as client:
        base = client.models.list().data[0].id
        assert by_model["model"] == "a" and by_lora["model"] == base
        assert complete(lora_server, model="a").model == "a"
        assert complete(lora_server, lora=["a"]).model == base
        response = client.responses.create(model="a", input="Hi", max_output_tokens=4)
        assert response.model == "a"


def test_concurrent_requests_over_four_sets_each_get_what_they_get_alone(
    lora_server: Server,
) -> None:
    sets: list[list[Any]] = [[], ["a"], ["b"], ["a", {"name": "b", "scale": 0.5}]]
    prompts = [f"{PROMPT} (trip {i})" for i in range(8)]
    alone = [complete(lora_server, p, lora=sets[i % 4]) for i, p in enumerate(prompts)]

    async def together() -> list[Any]:
        client = lora_server.async_client()
        replies = await asyncio.gather(
            *(
                client.completions.create(
                    model="default",
                    prompt=p,
                    max_tokens=TOKENS,
                    temperature=0,
                    logprobs=2,
                    extra_body={"lora": sets[i % 4]},
                )
                for i, p in enumerate(prompts)
            )
        )
        await client.close()
        return list(replies)

    for got, reference in zip(asyncio.run(together()), alone, strict=True):
        assert_same_greedy_text(got, reference)


@pytest.mark.parametrize(
    ("lora", "words"),
    [
        ([{"name": "nope"}], "no LoRA adapter 'nope'"),
        ([{"id": 7}], "no LoRA adapter 7"),
        ("a", "lora must be a list"),
        ([{"scale": 1}], "a name"),
        ([{"name": "a", "scale": "big"}], "scale"),
        ([{"name": "a", "scale": 1e9}], "scale"),
        ([3.5], "objects"),
        ([{"name": "a"}] * 65, "at most 64 adapters, got 65"),
        ([{"name": "a", "id": 1}], "not both"),
    ],
)
def test_bad_lora_fields_get_a_400_naming_the_field(
    lora_server: Server, lora: Any, words: str
) -> None:
    with lora_server.client() as client, pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(
            model="default", prompt="hi", max_tokens=2, extra_body={"lora": lora}
        )
    error = caught.value.body
    assert isinstance(error, dict)
    assert error["param"] == "lora" and words in error["message"]


@pytest.mark.parametrize(
    ("arg", "words"),
    [
        ("nameonly", "NAME=PATH"),
        ("x=/no/such/file.gguf", "--lora"),
        ("x=f.gguf:inf", "finite"),
    ],
)
def test_bad_lora_arguments_stop_the_start_with_a_message(arg: str, words: str) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "kvfork", "serve", "default", "--port", "1", "--lora", arg],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode != 0
    assert words in done.stderr and "Traceback" not in done.stderr


def test_an_adapter_of_another_model_is_refused(tmp_path: Path) -> None:
    wrong = write_lora(tmp_path / "wrong.gguf", shapes={"attn_q": (64, 64)})
    done = subprocess.run(
        [sys.executable, "-m", "kvfork", "serve", "default", "--lora", f"w={wrong}"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode != 0 and "--lora" in done.stderr
    assert "Traceback" not in done.stderr
