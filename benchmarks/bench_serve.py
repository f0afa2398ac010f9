"""OpenAI-compatible servers under concurrent streamed requests: `kvfork serve` against
llama.cpp's own `llama-server --parallel 16` and llama-cpp-python's example server, in one run.

Workloads (default model, 2 threads for every server, greedy, `/v1/completions`, streamed):
- shared: CLIENTS requests at once, each one ~1,000-token preamble plus its own question;
- disjoint: CLIENTS requests at once, each its own ~250-token prompt.
Each server starts cold for each round; the same requests are then sent again to the warm
server (the "warm" column). Wall time of all requests, median time to first token (TTFT).
Servers are interleaved round by round; medians over ROUNDS. Every server binds 127.0.0.1.

    .venv/bin/python benchmarks/bench_serve.py [--rounds 2] [--clients 16]
        [--llama-server PATH]   # scripts/build_llama_server.sh builds it (default: found there)
        [--peer-python .venv-peer/bin/python]   # `make peer`, plus fastapi, uvicorn, openai
        [--example-server .peer-server/src/examples/server/server.py]  # from the same sdist
        [--adaptive]            # kvfork with its default adaptive thread count, not 2
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable
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


async def burst(url: str, prompts: list[str]) -> tuple[float, float]:
    """All prompts at once: (wall seconds, median TTFT)."""
    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=600)
    t0 = time.perf_counter()
    ttfts = await asyncio.gather(*(one(client, p, t0) for p in prompts))
    wall = time.perf_counter() - t0
    await client.close()
    return wall, statistics.median(ttfts)


def servers(args: argparse.Namespace, model: Path, clients: int) -> list[ServerSpec]:
    n_ctx = clients * 1400
    specs = [
        ServerSpec(
            "kvfork",
            lambda p: [
                sys.executable,
                "-m",
                "kvfork",
                "serve",
                str(model),
                "--port",
                str(p),
                "--n-ctx",
                str(n_ctx),
                "--n-seq-max",
                str(2 * clients),
                # Pinned like the peers' (-t 2 -tb 2, "threads": 2): the adaptive default
                # re-probes one thread now and then (BENCHMARKS §6), which an idle 2-core
                # machine pays for; `--adaptive` measures the default instead.
                *([] if args.adaptive else ["--threads", "2"]),
            ],
        )
    ]
    server = Path(args.llama_server)
    if server.exists():
        specs.append(
            ServerSpec(
                "llama-server",
                lambda p: [
                    str(server),
                    "-m",
                    str(model),
                    "--host",
                    "127.0.0.1",
                    "--port",
                    str(p),
                    "--parallel",
                    str(clients),
                    "-c",
                    str(n_ctx),
                    "-t",
                    "2",
                    "-tb",
                    "2",
                    "--no-webui",
                    "-lv",
                    "0",
                ],
            )
        )
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
    ap.add_argument("--only", choices=["shared", "disjoint"], default=None)
    ap.add_argument("--adaptive", action="store_true", help="kvfork with its adaptive thread count")
    args = ap.parse_args()
    model = kvfork.default_model_path()
    loads = workloads(args.clients)
    if args.only:
        loads = {args.only: loads[args.only]}
    specs = servers(args, model, args.clients)
    results: dict[tuple[str, str], list[tuple[float, float, float]]] = {}
    for _ in range(args.rounds):
        for load, prompts in loads.items():
            for spec in specs:
                proc, url, log = start(spec)
                try:
                    wall, ttft = asyncio.run(burst(url, prompts))
                    warm, _ = asyncio.run(burst(url, prompts))
                finally:
                    proc.terminate()
                    proc.wait(timeout=30)
                    log.close()
                results.setdefault((load, spec.name), []).append((wall, ttft, warm))
                print(
                    f"  {load:8} {spec.name:15} wall {wall:6.2f} s  TTFT {ttft:6.2f} s  "
                    f"warm {warm:6.2f} s",
                    file=sys.stderr,
                    flush=True,
                )
    print(
        f"\n{args.clients} clients, {TOKENS} greedy tokens each, streamed; median of "
        f"{args.rounds} cold starts\n"
    )
    print("| workload | server | wall (s) | median TTFT (s) | same requests again, warm (s) |")
    print("|---|---|---|---|---|")
    for (load, name), rows in results.items():
        med = [statistics.median(r[i] for r in rows) for i in range(3)]
        print(f"| {load} | {name} | {med[0]:.2f} | {med[1]:.2f} | {med[2]:.2f} |")


if __name__ == "__main__":
    main()
