"""A restart with `--cache-dir`: conversations whose first turns a stopped `kvfork serve` left
on disk, continued on a restarted one, against the same second turns on a server that
starts with nothing (kvfork without a cache directory, and llama-server, whose `--cache-ram`
does not outlive it).

    .venv/bin/python benchmarks/bench_cache_restart.py [--conversations 8] [--rounds 2]

Each conversation is over its own ~1,500-token document (bench_serve.py's conversations
workload). Phase 1: a kvfork server with `--cache-dir` answers every first turn, one at a
time, then gets SIGTERM; it writes its prefix-cache entries to the directory as it stops
(timed: "stop"). Phase 2: the second turns (the first turn's prompt, its answer and a new
question), one at a time, on a kvfork server restarted on that directory ("ready": start to
its first answer to /v1/models), on a kvfork server without one, and on llama-server started
afresh. Median time to first token and prompt tokens prefilled of the second turns. Default
model, 2 threads, greedy, streamed `/v1/completions`; every server binds 127.0.0.1.
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import statistics
import tempfile
import time
from pathlib import Path

import kvfork
import openai
from bench_serve import (
    ROOT,
    ServerSpec,
    TurnResult,
    conversation_turn,
    kvfork_serve,
    llama_server,
    preamble,
    start,
)

#: A KV of 12 ~1,600-token conversations, 8 sequences (bench_serve.py's conversations).
N_CTX, SEQS = 12 * 1600, 8


async def turns(url: str, prompts: list[str]) -> list[TurnResult]:
    """`prompts` as conversation turns, one at a time."""
    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=600)
    results = [await conversation_turn(client, p) for p in prompts]
    await client.close()
    return results


def first_prompts(n: int) -> list[str]:
    return [
        f"{preamble(1050, 100 + c)}\nQuestion 0: what does note {c}.0 say? Answer:"
        for c in range(n)
    ]


def run_turns(spec: ServerSpec, prompts: list[str]) -> tuple[dict[str, float], list[str]]:
    """Start `spec`, send `prompts` one at a time, stop it with SIGTERM: the timings, texts."""
    t0 = time.perf_counter()
    proc, url, log = start(spec)
    ready = time.perf_counter() - t0
    try:
        results = asyncio.run(turns(url, prompts))
    finally:
        t1 = time.perf_counter()
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=300)
        except Exception:
            proc.kill()
            raise
        stop = time.perf_counter() - t1
        log.close()
    return {
        "ready": ready,
        "stop": stop,
        "ttft": statistics.median(r.ttft for r in results),
        "prefilled": sum(r.prompt_tokens - r.cached_tokens for r in results),
    }, [r.text for r in results]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--conversations", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--llama-server", default=str(ROOT / ".peer-server/build/bin/llama-server"))
    ap.add_argument("--adaptive", action="store_true", help="kvfork's adaptive thread count")
    args = ap.parse_args()
    model = kvfork.default_model_path()
    firsts = first_prompts(args.conversations)
    rows: dict[str, list[dict[str, float]]] = {}
    for r in range(args.rounds):
        with tempfile.TemporaryDirectory(prefix="kvfork-restart-") as cache_dir:
            spilling = ["--cache-ram", "4096", "--cache-dir", cache_dir]
            serve = kvfork_serve(model, N_CTX, SEQS, args.adaptive, spilling)
            before, answers = run_turns(ServerSpec("kvfork (1st turns)", serve), firsts)
            on_disk = sum(f.stat().st_size for f in Path(cache_dir).glob("*.kvfe"))
            seconds = [
                f"{p}{a}\nQuestion 1: and what does the next note say? Answer:"
                for p, a in zip(firsts, answers, strict=True)
            ]
            specs = [
                ServerSpec("kvfork restarted on --cache-dir", serve),
                ServerSpec(
                    "kvfork, no cache dir",
                    kvfork_serve(model, N_CTX, SEQS, args.adaptive, ["--cache-ram", "4096"]),
                ),
            ]
            server = Path(args.llama_server)
            if server.exists():
                ram = ["--cache-ram", "4096"]
                specs.append(
                    ServerSpec("llama-server", llama_server(server, model, N_CTX, SEQS, ram))
                )
            rows.setdefault("kvfork (1st turns)", []).append({**before, "disk_mb": on_disk / 1e6})
            for spec in specs:
                after, _ = run_turns(spec, seconds)
                rows.setdefault(spec.name, []).append(after)
        print(f"round {r + 1} done", flush=True)
    print(f"\n{args.conversations} conversations, medians of {args.rounds} rounds\n")
    print("| server | ready (s) | median TTFT (s) | prompt tokens prefilled | stop (s) |")
    print("|---|---|---|---|---|")
    for name, runs in rows.items():

        def med(key: str, runs: list[dict[str, float]] = runs) -> float:
            return statistics.median(run[key] for run in runs)

        print(
            f"| {name} | {med('ready'):.2f} | {med('ttft'):.2f} | "
            f"{med('prefilled'):,.0f} | {med('stop'):.2f} |"
        )
    disk = statistics.median(run["disk_mb"] for run in rows["kvfork (1st turns)"])
    print(f"\non disk after the first turns: {disk:.1f} MB")


if __name__ == "__main__":
    main()
