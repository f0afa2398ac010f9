"""Stage serve's report: benchmarks/bench_serve.py's shared and disjoint workloads, `kvfork
serve` against the CUDA `llama-server`, every layer offloaded in both, and kvfork's throughput
as a multiple of llama-server's next to the targets the CPU run has (BENCHMARKS.md §11:
shared >= 4x, disjoint >= 1.0x). A burst sends the same requests for the same tokens to each
server, so kvfork's multiple of llama-server's throughput is llama-server's wall time over
kvfork's; each round's is given too (servers interleaved round by round).

The stage's folder holds, for each workload W: W.txt (bench_serve.py's table, its stdout),
W.log (its stderr: a line per server and round) and W.done (its exit status).

usage (PYTHONPATH=scripts):  python -m gpu_check.serve report --dir DIR
"""

from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Sequence
from pathlib import Path

WORKLOADS = ("shared", "disjoint")
#: kvfork's throughput as a multiple of llama-server's, at least (cold bursts, median).
TARGETS = {"shared": 4.0, "disjoint": 1.0}
KVFORK, PEER = "kvfork", "llama-server"
#: bench_serve.py's line per server and round (stderr) and its table's rows (stdout).
_ROUND = re.compile(
    r"^\s*(\w+)\s+(\S+)\s+wall\s+(\S+) s\s+TTFT\s+(\S+) s\s+warm\s+(\S+) s\b.*$", re.MULTILINE
)
_ROW = re.compile(r"^\| (\w+) \| (\S+) \| (\S+) \| (\S+) \| (\S+) \|$", re.MULTILINE)

Timing = tuple[float, float, float]  # wall, median TTFT, warm wall (seconds)


def parse_rounds(text: str) -> dict[tuple[str, str], list[Timing]]:
    """(workload, server) -> each round's (wall, TTFT, warm), in order."""
    out: dict[tuple[str, str], list[Timing]] = {}
    for load, server, *values in _ROUND.findall(text):
        wall, ttft, warm = (float(v) for v in values)
        out.setdefault((load, server), []).append((wall, ttft, warm))
    return out


def parse_table(text: str) -> dict[tuple[str, str], Timing]:
    """(workload, server) -> the medians bench_serve.py's table gives."""
    out: dict[tuple[str, str], Timing] = {}
    for load, server, *values in _ROW.findall(text):
        try:
            wall, ttft, warm = (float(v) for v in values)
        except ValueError:  # the header
            continue
        out[(load, server)] = (wall, ttft, warm)
    return out


def verdict(load: str, table: dict[tuple[str, str], Timing], rounds: list[float]) -> str:
    """One line: kvfork's throughput as a multiple of llama-server's, against the target."""
    ours, peer = table.get((load, KVFORK)), table.get((load, PEER))
    if ours is None or peer is None:
        missing = " and ".join(n for n, t in ((KVFORK, ours), (PEER, peer)) if t is None)
        return f"- {load}: no result for {missing}"
    ratio = peer[0] / ours[0]
    target = TARGETS[load]
    each = f"; rounds {', '.join(f'{r:.2f}' for r in rounds)}" if rounds else ""
    return (
        f"- {load}: kvfork {ratio:.2f}x llama-server's throughput (cold, {ours[0]:.2f} s "
        f"against {peer[0]:.2f} s{each}), target >= {target:g}x: "
        f"{'met' if ratio >= target else 'NOT met'}; median TTFT {ours[1] / peer[1]:.3f}x "
        f"llama-server's; warm {peer[2] / ours[2]:.2f}x"
    )


HEADER = [
    "| workload | server | wall (s) | median TTFT (s) | same requests again, warm (s) |",
    "|---|---|---|---|---|",
]


def report(folder: Path) -> str:
    """Markdown: a verdict line per workload (or its failure), then one table of
    bench_serve.py's rows for both workloads under its caption."""
    lines: list[str] = []
    caption = ""
    rows: list[str] = []
    for load in WORKLOADS:
        txt, log, done = (folder / f"{load}.{ext}" for ext in ("txt", "log", "done"))
        if not done.is_file():
            lines.append(f"- {load}: not run yet")
            continue
        status = done.read_text().strip()
        out = txt.read_text() if txt.is_file() else ""
        err = log.read_text(errors="replace") if log.is_file() else ""
        if status != "0":
            tail = "\n".join(err.strip().splitlines()[-15:])
            lines.append(f"- {load}: FAILED (bench_serve.py exit {status}):\n```\n{tail}\n```")
            continue
        runs = parse_rounds(err)
        mine, theirs = runs.get((load, KVFORK), []), runs.get((load, PEER), [])
        per_round = [p[0] / k[0] for k, p in zip(mine, theirs, strict=False) if k[0] > 0]
        lines.append(verdict(load, parse_table(out), per_round))
        rows += [r for r in out.splitlines() if _ROW.match(r) and not r.startswith(HEADER[0][:12])]
        caption = caption or next((t for t in out.splitlines() if t and t[0] != "|"), "")
    if rows:
        lines += ["", *([caption, ""] if caption else []), *HEADER, *rows]
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    sub.add_parser("report").add_argument("--dir", type=Path, required=True)
    args = parser.parse_args(argv)
    print(report(args.dir), end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
