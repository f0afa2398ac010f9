"""OpenAI-compatible servers under concurrent streamed requests: `kvfork serve` against
llama.cpp's own `llama-server --parallel 16` and llama-cpp-python's example server, in one run.

Workloads (default model, 2 threads for every server, greedy, `/v1/completions`, streamed):
- shared: CLIENTS requests at once, each one ~1,000-token preamble plus its own question;
- disjoint: CLIENTS requests at once, each its own ~250-token prompt;
- steady: requests arriving one by one as a Poisson stream (`--rate` per second, `--requests`
  of them, prompts of 50–1,000 tokens and 64 output tokens, all drawn from a fixed seed),
  as a real server sees them: p50/p95 time to first token, p50/p95 time between tokens,
  throughput (generated tokens per second of wall time).
For the bursts each server starts cold for each round; the same requests are then sent again
to the warm server (the "warm" column). Wall time of all requests, median time to first token
(TTFT). Servers are interleaved round by round; medians over ROUNDS. Every server binds
127.0.0.1.

    .venv/bin/python benchmarks/bench_serve.py [--rounds 2] [--clients 16]
        [--llama-server PATH]   # scripts/build_llama_server.sh builds it (default: found there)
        [--peer-python .venv-peer/bin/python]   # `make peer`, plus fastapi, uvicorn, openai
        [--example-server .peer-server/src/examples/server/server.py]  # same sdist; '': none
        [--adaptive]            # kvfork with its default adaptive thread count, not 2
        [--gpu-layers N]        # llama-server -ngl N; kvfork serve offloads every layer on a GPU
        [--kvfork-variant NAME=ARGS ...]  # also kvfork serve with these options, as NAME
        [--client openai|raw]   # bursts: the openai client, or bare connections reading SSE
        [--only shared|disjoint|steady] [--rate 2] [--requests 64]
        [--only conversations] [--conversations 32] [--turns 2]
        [--only beside]         # short requests arriving while a long prompt is prefilled
- beside (`--only beside`): one ~1,300-token prompt, then 4 short questions arriving 0.5–2 s
  later, while it is prefilled: the long one's TTFT, the short ones' median and worst TTFT
  (a short job behind a long one shows there), the wall time.
- conversations (`--only conversations`): many ~1,500-token conversations taking turns in a
  random order against 8 sequences and a KV for ~12 of them: kvfork with `--cache-ram` (its
  evicted prefix-cache entries kept in host memory), kvfork without, llama-server with its
  own `--cache-ram`; wall time, median TTFT, prompt tokens prefilled.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import os
import random
import shlex
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import kvfork
import openai

ROOT = Path(__file__).resolve().parent.parent
TOKENS = 32


def preamble(words: int, seed: int) -> str:
    topics = ["rivers", "printing", "bridges", "weather", "markets", "music", "trains", "salt"]
    out = []
    for i in range(words // 12):
        t = topics[(i * 7 + seed) % len(topics)]
        out.append(f"Note {seed}.{i}: the history of {t} shows how people shared what they knew.")
    return " ".join(out)


def workloads(clients: int) -> dict[str, list[str]]:
    shared = preamble(700, 0)  # ~1,000 tokens on Gemma 3
    return {
        "shared": [
            f"{shared}\nQuestion {i}: what is item {i} about? Answer:" for i in range(clients)
        ],
        "disjoint": [preamble(170, i + 1) + " Summary:" for i in range(clients)],
    }


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class ServerSpec:
    name: str
    command: Callable[[int], list[str]]
    env: dict[str, str] | None = None


def start(
    spec: ServerSpec,
) -> tuple[subprocess.Popen[bytes], str, tempfile._TemporaryFileWrapper[bytes]]:
    port = free_port()
    log = tempfile.NamedTemporaryFile(prefix=f"bench-{spec.name}-", suffix=".log")  # noqa: SIM115
    env = {**os.environ, **(spec.env or {})}
    proc = subprocess.Popen(spec.command(port), stdout=log, stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{spec.name} exited: {Path(log.name).read_text()[-2000:]}")
        try:
            with urllib.request.urlopen(url + "/v1/models", timeout=2):
                return proc, url, log
        except OSError:
            time.sleep(0.3)
    proc.kill()
    raise RuntimeError(f"{spec.name} did not start")


@contextlib.contextmanager
def running(spec: ServerSpec) -> Iterator[str]:
    """`spec`'s server, started (its URL) and stopped however the block ends."""
    proc, url, log = start(spec)
    try:
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        log.close()


async def one(client: openai.AsyncOpenAI, prompt: str, t0: float) -> float:
    """Stream one completion; the time to its first token."""
    ttft = float("nan")
    stream = await client.completions.create(
        model="m", prompt=prompt, max_tokens=TOKENS, temperature=0, stream=True
    )
    async for chunk in stream:
        if chunk.choices and chunk.choices[0].text and ttft != ttft:
            ttft = time.perf_counter() - t0
    return ttft


STEADY_TOKENS = 64
STEADY_SEED = 2026


def steady_requests(n: int, rate: float) -> list[tuple[float, str]]:
    """`n` (arrival time, prompt) pairs: exponential gaps at `rate` per second, prompts of
    50–1,000 tokens (a note of `preamble` is 13 words, ~22 Gemma 3 tokens), from a fixed
    seed."""
    rng = random.Random(STEADY_SEED)
    at, out = 0.0, []
    for i in range(n):
        at += rng.expovariate(rate)
        notes = max(2, round(rng.uniform(50, 1000) / 22))
        out.append((at, preamble(12 * notes, 100 + i) + f" Request {i}:"))
    return out


def medians(runs: list[dict[str, float]]) -> dict[str, float]:
    """Each measure's median over the rounds' rows."""
    return {k: statistics.median(r[k] for r in runs) for k in runs[0]}


def quantile(xs: list[float], q: float) -> float:
    xs = sorted(x for x in xs if x == x)
    if not xs:
        return float("nan")
    return xs[min(len(xs) - 1, int(q * len(xs)))]


async def timed_stream(
    client: openai.AsyncOpenAI, prompt: str, start: float
) -> tuple[float, list[float], int]:
    """Stream one completion sent at `start`: its TTFT, the gaps between its tokens, and
    how many chunks of text it got."""
    stream = await client.completions.create(
        model="m", prompt=prompt, max_tokens=STEADY_TOKENS, temperature=0, stream=True
    )
    times = []
    async for chunk in stream:
        if chunk.choices and chunk.choices[0].text:
            times.append(time.perf_counter())
    if not times:
        return float("nan"), [], 0
    return times[0] - start, [b - a for a, b in itertools.pairwise(times)], len(times)


async def sent_at(
    url: str, plan: list[tuple[float, str]]
) -> tuple[list[tuple[float, list[float], int]], float]:
    """Each of `plan`'s prompts streamed from its time on (`timed_stream`), and the wall time."""
    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=900)
    t0 = time.perf_counter()

    async def at(when: float, prompt: str) -> tuple[float, list[float], int]:
        await asyncio.sleep(max(0.0, t0 + when - time.perf_counter()))
        return await timed_stream(client, prompt, time.perf_counter())

    results = await asyncio.gather(*(at(w, p) for w, p in plan))
    wall = time.perf_counter() - t0
    await client.close()
    return list(results), wall


async def steady(url: str, plan: list[tuple[float, str]]) -> dict[str, float]:
    """Requests sent at their arrival times; TTFT and between-token quantiles, throughput."""
    results, wall = await sent_at(url, plan)
    ttfts = [r[0] for r in results]
    gaps = [g for r in results for g in r[1]]
    return {
        "ttft_p50": quantile(ttfts, 0.5),
        "ttft_p95": quantile(ttfts, 0.95),
        "tbt_p50": quantile(gaps, 0.5),
        "tbt_p95": quantile(gaps, 0.95),
        "tokens_per_s": sum(r[2] for r in results) / wall,
        "wall": wall,
    }


#: `--only beside`: when the short requests arrive, seconds after the long one.
BESIDE_AT = (0.5, 1.0, 1.5, 2.0)


def beside_requests() -> list[tuple[float, str]]:
    """One ~1,300-token prompt at 0 s, then short questions arriving while it is prefilled."""
    long = preamble(820, 9) + " Summary:"  # within llama-server's 1,400 cells a slot
    shorts = [f"Question {i}: what is {i} plus {i}? Answer:" for i in range(len(BESIDE_AT))]
    return [(0.0, long), *zip(BESIDE_AT, shorts, strict=True)]


async def beside(url: str, plan: list[tuple[float, str]]) -> dict[str, float]:
    """`plan`'s requests sent at their times: the long one's TTFT, the short ones' median and
    worst TTFT (a short job behind a long one shows there), the wall time."""
    results, wall = await sent_at(url, plan)
    shorts = [r[0] for r in results[1:]]
    return {
        "long_ttft": results[0][0],
        "short_ttft_p50": statistics.median(shorts),
        "short_ttft_max": max(shorts),
        "wall": wall,
    }


async def one_raw(url: str, prompt: str, t0: float) -> float:
    """`one` over a bare HTTP/1.1 connection (asyncio streams, chunked transfer decoded here),
    parsing only the chunks up to the first text: a client that keeps up with a GPU server."""
    host, _, port = url.removeprefix("http://").partition(":")
    body = json.dumps(
        {"model": "m", "prompt": prompt, "max_tokens": TOKENS, "temperature": 0, "stream": True}
    ).encode()
    reader, writer = await asyncio.open_connection(host, int(port))
    writer.write(
        f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n".encode()
        + body
    )
    ttft, done, pending = float("nan"), False, b""
    try:
        status = await reader.readline()
        if b" 200 " not in status:
            raise RuntimeError(f"{url}: {status.decode(errors='replace').strip()}")
        while (await reader.readline()).strip():  # the headers (chunked, as both servers send)
            pass
        while size := int((await reader.readline()).split(b";")[0], 16):
            pending += await reader.readexactly(size + 2)  # the chunk and its CRLF
            pending = pending[:-2]
            *lines, pending = pending.split(b"\n")
            for line in lines:
                if line.startswith(b"data: [DONE]"):
                    done = True
                elif ttft != ttft and line.startswith(b"data: {"):
                    choices = json.loads(line[6:]).get("choices") or [{}]
                    if choices[0].get("text"):
                        ttft = time.perf_counter() - t0
    finally:
        writer.close()
    if not done:
        raise RuntimeError(f"{url}: a stream ended without data: [DONE]")
    return ttft


async def burst(url: str, prompts: list[str], raw: bool = False) -> tuple[float, float, float]:
    """All prompts at once: (wall seconds, median TTFT, this client's CPU seconds). With
    `raw`, on bare connections without the openai package, whose parsing of each chunk costs this
    process ~0.6 ms on a 2-core EPYC: 16 streams' chunks take longer than a GPU server's step
    (BENCHMARKS §26), so its bursts measured the client."""
    c0, t0 = time.process_time(), time.perf_counter()
    if raw:
        ttfts = await asyncio.gather(*(one_raw(url, p, t0) for p in prompts))
    else:
        client = openai.AsyncOpenAI(
            base_url=url + "/v1", api_key="none", max_retries=0, timeout=600
        )
        ttfts = await asyncio.gather(*(one(client, p, t0) for p in prompts))
        await client.close()
    wall = time.perf_counter() - t0
    return wall, statistics.median(ttfts), time.process_time() - c0


CONVERSATION_TOKENS = 24


@dataclass
class TurnResult:
    ttft: float
    prompt_tokens: int
    cached_tokens: int
    text: str


async def conversation_turn(client: openai.AsyncOpenAI, prompt: str) -> TurnResult:
    """One turn: a streamed greedy completion of CONVERSATION_TOKENS, its time to first token,
    prompt tokens and those the server had cached (as it reports them), and its text."""
    t0 = time.perf_counter()
    ttft, text, usage = float("nan"), [], None
    stream = await client.completions.create(
        model="m",
        prompt=prompt,
        max_tokens=CONVERSATION_TOKENS,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    async for chunk in stream:
        if chunk.choices and chunk.choices[0].text:
            if ttft != ttft:
                ttft = time.perf_counter() - t0
            text.append(chunk.choices[0].text)
        usage = chunk.usage or usage
    details = usage.prompt_tokens_details if usage else None
    cached = (details.cached_tokens or 0) if details else 0
    return TurnResult(ttft, usage.prompt_tokens if usage else 0, cached, "".join(text))


async def conversations(
    url: str, n: int, turns: int, workers: int, seed: int = 7
) -> dict[str, float]:
    """`n` conversations, each over its own ~1,500-token document, taking `turns` turns in a
    random order (a conversation's next turn once its last is answered), `workers` at a time.
    Each turn's prompt is the last one, its answer and a new question: a server that kept the
    conversation prefills only the new part. Wall time, median TTFT, prompt tokens
    prefilled (prompt minus cached, as the servers report them)."""
    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=900)
    rng = random.Random(seed)
    history = [preamble(1050, 100 + c) for c in range(n)]
    done_turns = [0] * n
    order = [c for c in range(n) for _ in range(turns)]
    rng.shuffle(order)
    pending: list[int] = order
    results: list[TurnResult] = []
    busy: set[int] = set()
    lock = asyncio.Lock()

    async def take() -> int | None:
        async with lock:
            for i, c in enumerate(pending):
                if c not in busy:
                    busy.add(c)
                    return pending.pop(i)
            return None

    async def worker() -> None:
        while True:
            c = await take()
            if c is None:
                if not pending:
                    return
                await asyncio.sleep(0.05)
                continue
            k = done_turns[c]
            prompt = f"{history[c]}\nQuestion {k}: what does note {c}.{k} say? Answer:"
            result = await conversation_turn(client, prompt)
            results.append(result)
            history[c] = prompt + result.text
            done_turns[c] += 1
            async with lock:
                busy.discard(c)

    t0 = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(workers)))
    wall = time.perf_counter() - t0
    await client.close()
    return {
        "wall": wall,
        "ttft": statistics.median(r.ttft for r in results),
        "prefilled": sum(r.prompt_tokens - r.cached_tokens for r in results),
        "prompt": sum(r.prompt_tokens for r in results),
    }


def kvfork_serve(
    model: Path, n_ctx: int, seqs: int, adaptive: bool, extra: list[str]
) -> Callable[[int], list[str]]:
    """`kvfork serve` on a port, pinned to 2 threads like the peers (-t 2 -tb 2, "threads":
    2) unless `adaptive`: the adaptive default re-probes one thread now and then
    (BENCHMARKS §6), which an idle 2-core machine pays for."""
    threads = [] if adaptive else ["--threads", "2"]
    return lambda p: [
        sys.executable, "-m", "kvfork", "serve", str(model), "--port", str(p),
        "--n-ctx", str(n_ctx), "--n-seq-max", str(seqs), *threads, *extra,
    ]  # fmt: skip


def llama_server(
    server: Path, model: Path, n_ctx: int, parallel: int, extra: list[str]
) -> Callable[[int], list[str]]:
    """llama.cpp's `llama-server` on a port of loopback, 2 threads."""
    return lambda p: [
        str(server), "-m", str(model), "--host", "127.0.0.1", "--port", str(p),
        "--parallel", str(parallel), "-c", str(n_ctx), "-t", "2", "-tb", "2",
        "--no-webui", "-lv", "0", *extra,
    ]  # fmt: skip


def gpu_layers(args: argparse.Namespace) -> list[str]:
    """llama-server's `-ngl` for `--gpu-layers` (nothing when not given: its default).
    `kvfork serve` has no such option: it offloads every layer whenever its backend is a GPU
    (`Model.load`'s default), so a run asking for layers on the GPU must have kvfork's GPU
    backend, and one asking for none must not."""
    if args.gpu_layers is None:
        return []
    backend = kvfork.system_info()["backend"]
    if (args.gpu_layers != 0) != (backend != "cpu"):
        raise SystemExit(
            f"--gpu-layers {args.gpu_layers}: kvfork's backend is {backend}, so kvfork serve "
            f"offloads {'no' if backend == 'cpu' else 'every'} layer; llama-server would not match"
        )
    return ["-ngl", str(args.gpu_layers)]


def conversation_servers(args: argparse.Namespace, model: Path) -> list[ServerSpec]:
    """8 sequences and a KV for about 12 of the ~1,600-token conversations: kvfork with
    `--cache-ram` (every conversation fits in host memory), kvfork without, and llama-server
    with its own `--cache-ram`."""
    n_ctx, seqs, ram = 12 * 1600, 8, "4096"
    specs = [
        ServerSpec(
            "kvfork+ram", kvfork_serve(model, n_ctx, seqs, args.adaptive, ["--cache-ram", ram])
        ),
        ServerSpec("kvfork", kvfork_serve(model, n_ctx, seqs, args.adaptive, [])),
    ]
    server = Path(args.llama_server)
    if server.exists():
        specs.append(
            ServerSpec(
                "llama-server",
                llama_server(server, model, n_ctx, seqs, ["--cache-ram", ram, *gpu_layers(args)]),
            )
        )
    return specs


def servers(args: argparse.Namespace, model: Path, clients: int) -> list[ServerSpec]:
    n_ctx = clients * 1400
    specs = [ServerSpec("kvfork", kvfork_serve(model, n_ctx, 2 * clients, args.adaptive, []))]
    for variant in args.kvfork_variant:
        name, _, options = variant.partition("=")
        serve = kvfork_serve(model, n_ctx, 2 * clients, args.adaptive, shlex.split(options))
        specs.append(ServerSpec(name, serve))
    server = Path(args.llama_server)
    if server.exists():
        ngl = gpu_layers(args)
        specs.append(ServerSpec("llama-server", llama_server(server, model, n_ctx, clients, ngl)))
    example = Path(args.example_server) if args.example_server else None
    if example and example.exists() and Path(args.peer_python).exists():
        config = Path(tempfile.mkdtemp()) / "config.json"

        def example_cmd(p: int) -> list[str]:
            # Its shipped configs bind 0.0.0.0: this one binds loopback.
            config.write_text(
                json.dumps(
                    {
                        "server": {"host": "127.0.0.1", "port": p},
                        "model": {
                            "alias": "m",
                            "path": str(model),
                            "n_ctx": n_ctx,
                            "n_seq_max": clients,
                            "threads": 2,
                            "threads_batch": 2,
                            "kv_unified": True,
                        },
                    }
                )
            )
            return [args.peer_python, str(example), "-C", str(config)]

        specs.append(ServerSpec("example-server", example_cmd))
    return specs


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--clients", type=int, default=16)
    ap.add_argument("--llama-server", default=str(ROOT / ".peer-server/build/bin/llama-server"))
    ap.add_argument("--peer-python", default=str(ROOT / ".venv-peer/bin/python"))
    ap.add_argument(
        "--example-server", default=str(ROOT / ".peer-server/src/examples/server/server.py")
    )
    ap.add_argument(
        "--only",
        choices=["shared", "disjoint", "steady", "conversations", "beside"],
        default=None,
    )
    ap.add_argument("--conversations", type=int, default=32, help="conversations: how many")
    ap.add_argument("--turns", type=int, default=2, help="conversations: turns of each")
    ap.add_argument("--rate", type=float, default=2.0, help="steady: arrivals per second")
    ap.add_argument("--requests", type=int, default=64, help="steady: how many")
    ap.add_argument("--adaptive", action="store_true", help="kvfork with its adaptive thread count")
    ap.add_argument(
        "--gpu-layers",
        type=int,
        default=None,
        metavar="N",
        help="llama-server's -ngl N (default: its own); kvfork serve offloads every layer when "
        "its backend is a GPU, and N must agree (0 on the CPU, else every layer)",
    )
    ap.add_argument(
        "--client",
        choices=["openai", "raw"],
        default="openai",
        help="bursts: the openai package's client (default), or bare connections reading the "
        "SSE lines (raw: a client that keeps up with a server on a GPU)",
    )
    ap.add_argument(
        "--kvfork-variant",
        action="append",
        default=[],
        metavar="NAME=ARGS",
        help="also run kvfork serve with these options, named NAME (e.g. "
        "'no-warmup=--warmup off'), interleaved with the others",
    )
    args = ap.parse_args()
    if any("=" not in v or not v.partition("=")[0] for v in args.kvfork_variant):
        ap.error("--kvfork-variant takes NAME=ARGS")
    model = kvfork.default_model_path()
    if args.only == "conversations":
        run_conversations(args, model)
        return
    if args.only == "beside":
        run_beside(args, model)
        return
    loads = workloads(args.clients)
    if args.only in ("shared", "disjoint"):
        loads = {args.only: loads[args.only]}
    elif args.only == "steady":
        loads = {}
    specs = servers(args, model, args.clients)
    results: dict[tuple[str, str], list[tuple[float, float, float]]] = {}
    steady_rows: dict[str, list[dict[str, float]]] = {}
    plan = steady_requests(args.requests, args.rate)
    for _ in range(args.rounds):
        if args.only in (None, "steady"):
            for spec in specs:
                with running(spec) as url:
                    row = asyncio.run(steady(url, plan))
                steady_rows.setdefault(spec.name, []).append(row)
                print(
                    f"  steady   {spec.name:15} TTFT p50 {row['ttft_p50']:5.2f} p95 "
                    f"{row['ttft_p95']:5.2f} s  between tokens p50 {row['tbt_p50'] * 1e3:5.0f} "
                    f"p95 {row['tbt_p95'] * 1e3:5.0f} ms  {row['tokens_per_s']:6.1f} tok/s",
                    file=sys.stderr,
                    flush=True,
                )
        for load, prompts in loads.items():
            for spec in specs:
                with running(spec) as url:
                    wall, ttft, cpu = asyncio.run(burst(url, prompts, args.client == "raw"))
                    warm, _, _ = asyncio.run(burst(url, prompts, args.client == "raw"))
                results.setdefault((load, spec.name), []).append((wall, ttft, warm))
                print(
                    f"  {load:8} {spec.name:15} wall {wall:6.2f} s  TTFT {ttft:6.2f} s  "
                    f"warm {warm:6.2f} s  (client CPU {cpu:4.2f} s)",
                    file=sys.stderr,
                    flush=True,
                )
    if results:
        print(
            f"\n{args.clients} clients ({args.client} client), {TOKENS} greedy tokens each, "
            f"streamed; median of {args.rounds} cold starts\n"
        )
        print("| workload | server | wall (s) | median TTFT (s) | same requests again, warm (s) |")
        print("|---|---|---|---|---|")
    for (load, name), rows in results.items():
        med = [statistics.median(r[i] for r in rows) for i in range(3)]
        print(f"| {load} | {name} | {med[0]:.2f} | {med[1]:.2f} | {med[2]:.2f} |")
    if steady_rows:
        print(
            f"\nsteady: {args.requests} requests, Poisson arrivals at {args.rate}/s, prompts of "
            f"50–1,000 tokens, {STEADY_TOKENS} tokens each; median of {args.rounds} runs\n"
        )
        print(
            "| server | TTFT p50 (s) | TTFT p95 (s) | between tokens p50 (ms) | p95 (ms) | tok/s |"
        )
        print("|---|---|---|---|---|---|")
        for name, runs in steady_rows.items():
            m = medians(runs)
            print(
                f"| {name} | {m['ttft_p50']:.2f} | {m['ttft_p95']:.2f} | {m['tbt_p50'] * 1e3:.0f} "
                f"| {m['tbt_p95'] * 1e3:.0f} | {m['tokens_per_s']:.1f} |"
            )


def run_beside(args: argparse.Namespace, model: Path) -> None:
    """`--only beside`: short requests arriving while a long prompt is prefilled, each
    server cold each round, interleaved; medians over the rounds."""
    plan = beside_requests()
    rows: dict[str, list[dict[str, float]]] = {}
    for _ in range(args.rounds):
        for spec in servers(args, model, args.clients):
            with running(spec) as url:
                row = asyncio.run(beside(url, plan))
            rows.setdefault(spec.name, []).append(row)
            print(
                f"  beside   {spec.name:15} long TTFT {row['long_ttft']:6.2f} s  short TTFT "
                f"p50 {row['short_ttft_p50']:6.2f} max {row['short_ttft_max']:6.2f} s  "
                f"wall {row['wall']:6.2f} s",
                file=sys.stderr,
                flush=True,
            )
    print(
        f"\nbeside: one ~1,300-token prompt, then {len(BESIDE_AT)} short ones arriving "
        f"{BESIDE_AT[0]:g}–{BESIDE_AT[-1]:g} s later, {STEADY_TOKENS} tokens each; median of "
        f"{args.rounds} cold starts\n"
    )
    print("| server | long TTFT (s) | short TTFT p50 (s) | short TTFT max (s) | wall (s) |")
    print("|---|---|---|---|---|")
    for name, runs in rows.items():
        m = medians(runs)
        print(
            f"| {name} | {m['long_ttft']:.2f} | {m['short_ttft_p50']:.2f} "
            f"| {m['short_ttft_max']:.2f} | {m['wall']:.2f} |"
        )


def run_conversations(args: argparse.Namespace, model: Path) -> None:
    """The conversations workload alone, servers interleaved round by round."""
    rows: dict[str, list[dict[str, float]]] = {}
    for _ in range(args.rounds):
        for spec in conversation_servers(args, model):
            proc, url, log = start(spec)
            try:
                row = asyncio.run(conversations(url, args.conversations, args.turns, 8))
            except openai.APIError as exc:
                tail = Path(log.name).read_text(errors="replace")[-3000:]
                print(f"  conversations {spec.name}: failed ({exc})\n{tail}", file=sys.stderr)
                continue
            finally:
                proc.terminate()
                proc.wait(timeout=60)
                log.close()
            rows.setdefault(spec.name, []).append(row)
            print(
                f"  conversations {spec.name:13} wall {row['wall']:7.1f} s  TTFT "
                f"{row['ttft']:6.2f} s  prefilled {row['prefilled']:7.0f} of "
                f"{row['prompt']:7.0f} prompt tokens",
                file=sys.stderr,
                flush=True,
            )
    print(
        f"\nconversations: {args.conversations} of ~1,500 tokens, {args.turns} turns each in "
        f"random order, 8 at a time, {CONVERSATION_TOKENS} tokens a turn; 8 sequences, a KV "
        f"for ~12; median of {args.rounds} runs\n"
    )
    print("| server | wall (s) | median TTFT (s) | prompt tokens prefilled |")
    print("|---|---|---|---|")
    for name, runs in rows.items():
        m = medians(runs)
        print(
            f"| {name} | {m['wall']:.1f} | {m['ttft']:.2f} | {m['prefilled']:.0f} of {m['prompt']:.0f} |"
        )


if __name__ == "__main__":
    main()
