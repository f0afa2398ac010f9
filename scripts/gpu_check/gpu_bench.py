"""kvfork on the GPU, one model: checks, then `store.step` throughput in the loop of
benchmarks/bare_bench.cpp (llama.cpp driven by hand, the anchor); and the bench stage's report.

Checks (a line `CHECK name OK|DIFFERS|FAIL detail` each; only `backend` stops the stage):
1. backend: `system_info()` names cuda;
2. gpu_equals_cpu: greedy tokens with every layer on the GPU against none; a small model has
   near-ties, so the first parting is reported with its position rather than failed;
3. forks_equal_root: 8 forks of a greedy branch stepped together against the root's own
   greedy continuation (cell placement changes the attention's summation order: they may
   part late, which is recorded, not failed).
PERF: `store.step` greedy tokens/s for each N (a prompt, N - 1 forks, STEPS steps, best of
3), with host rows and with `device_sampling=True`, `Branch.generate` at N = 1.

usage (PYTHONPATH=site:scripts):
  python -m gpu_check.gpu_bench run --model PATH --label NAME --json OUT [--ns 1,8,64,128]
  python -m gpu_check.gpu_bench report --dir DIR    (the stage's tables, from its outputs)
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import re
import sys
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

PROMPT = "The history of the printing press begins with"
ALL_LAYERS = 99


def _checks(model_path: str, result: dict[str, Any]) -> None:
    import kvfork

    greedy = kvfork.SamplingParams(temperature=0.0)
    checks: dict[str, str] = result["checks"]

    def check(name: str, fn: Callable[[], str]) -> None:
        try:
            checks[name] = fn()
        except Exception:  # noqa: BLE001 - a check reports its error and the next one runs
            checks[name] = "FAIL " + traceback.format_exc()[-1200:]
        print(f"CHECK {name} {checks[name]}", flush=True)

    def backend() -> str:
        info = kvfork.system_info()
        result["info"] = {
            k: info.get(k) for k in ("backend", "backends", "cpu_variant", "llama_cpp")
        }
        return ("OK " if info.get("backend") == "cuda" else "FAIL ") + str(info.get("backend"))

    def gpu_equals_cpu() -> str:
        texts = []
        for layers in (ALL_LAYERS, 0):
            model = kvfork.Model.load(model_path, n_gpu_layers=layers)
            with kvfork.create_context_sync(model, n_ctx=2048, n_seq_max=2) as ctx:
                b = kvfork.Branch.create(ctx, 0, greedy)
                b.prefill_sync(ctx.tokenize(PROMPT))
                texts.append([t.token for t in b.generate_sync(48)])
        gpu, cpu = texts
        same = next((i for i, (a, c) in enumerate(zip(gpu, cpu)) if a != c), len(gpu))
        verdict = "OK" if same == len(gpu) else "DIFFERS"
        return f"{verdict} {same}/{len(gpu)} leading greedy tokens equal"

    def forks_equal_root() -> str:
        model = kvfork.Model.load(model_path, n_gpu_layers=ALL_LAYERS)
        with kvfork.create_context_sync(model, n_ctx=4096, n_seq_max=9) as ctx:
            root = kvfork.Branch.create(ctx, 0, greedy)
            root.prefill_sync(ctx.tokenize(PROMPT))
            kids = [root.fork_sync() for _ in range(8)]
            store = kvfork.BranchStore(ctx)
            texts: list[list[int]] = [[] for _ in kids]
            for _ in range(24):
                for i, t in enumerate(store.step_sync(kids)):
                    texts[i].append(t.token)
            alone = [t.token for t in root.generate_sync(24)]
        equal = sum(t == alone for t in texts)
        parts = [next((i for i, (a, b) in enumerate(zip(t, alone)) if a != b), 24) for t in texts]
        verdict = "OK" if equal == len(kids) else "DIFFERS"
        return (
            f"{verdict} {equal}/8 forks equal the root over 24 steps (first parting: {min(parts)})"
        )

    check("backend", backend)
    check("gpu_equals_cpu", gpu_equals_cpu)
    check("forks_equal_root", forks_equal_root)


def _throughput(model_path: str, ns: Sequence[int], steps: int, result: dict[str, Any]) -> None:
    import kvfork

    greedy = kvfork.SamplingParams(temperature=0.0)
    model = kvfork.Model.load(model_path, n_gpu_layers=ALL_LAYERS)
    for n in ns:
        # Host rows (the default), then `device_sampling=True` (issue 42's item 3: against
        # the bare loop's backend sampling, the same greedy tokens copied back as ids), with
        # the 64 candidates, then with one (an argmax on the device: KVFORK_DEVICE_CANDIDATES);
        # host rows and K=1 again with each step's rows read before it replies
        # (KVFORK_LAND_BEFORE_REPLY, as before engine/landing.rs).
        for key, on_device, env in _RUNS:
            with _env(env):
                got = _step_rate(model, n, steps, greedy, on_device)
            result.setdefault(key, {})[str(n)] = got.rate
            # Where a step's time goes (issue 42's item 3 gap at small N): the decode, the
            # engine's own, the hand-over and Python.
            split = [got.decode_ms, got.engine_ms, got.caller_ms]
            result.setdefault("split_ms", {}).setdefault(key, {})[str(n)] = split
            if not on_device:
                # The team that summarizes the rows between decodes (engine/summaries.rs).
                outside = got.step_ms - got.decode_ms
                result.setdefault("outside_ms", {})[str(n)] = outside
                result.setdefault("team_threads", {})[str(n)] = got.team
            kept = env.get("KVFORK_DEVICE_CANDIDATES")
            mode = f" device_sampling{f' K={kept}' if kept else ''}" if on_device else ""
            mode += " land-first" if "KVFORK_LAND_BEFORE_REPLY" in env else ""
            print(
                f"PERF kvfork store.step{mode} N={n} tok/s={got.rate:.1f} "
                f"step_ms={got.step_ms:.3f} decode_ms={got.decode_ms:.3f} "
                f"engine_ms={got.engine_ms:.3f} caller_ms={got.caller_ms:.3f} "
                f"threads={got.team}",
                flush=True,
            )
    with kvfork.create_context_sync(model, n_ctx=4096, n_seq_max=2) as ctx:
        b = kvfork.Branch.create(ctx, 0, greedy)
        b.prefill_sync(ctx.tokenize(PROMPT))
        list(b.generate_sync(8))
        t0 = time.perf_counter()
        count = len(list(b.generate_sync(steps * 2)))
        result["generate"] = count / (time.perf_counter() - t0)
    print(f"PERF kvfork generate N=1 tok/s={result['generate']:.1f}", flush=True)


#: The throughput's runs: (result key, device_sampling, the environment its context is made in).
_RUNS: tuple[tuple[str, bool, dict[str, str]], ...] = (
    ("store_step", False, {}),
    ("store_step_device", True, {}),
    ("store_step_device_k1", True, {"KVFORK_DEVICE_CANDIDATES": "1"}),
    ("store_step_land_first", False, {"KVFORK_LAND_BEFORE_REPLY": "1"}),
    (
        "store_step_device_k1_land_first",
        True,
        {"KVFORK_DEVICE_CANDIDATES": "1", "KVFORK_LAND_BEFORE_REPLY": "1"},
    ),
)

#: The variables `_env` sets (read when a context is created).
_KNOBS = ("KVFORK_DEVICE_CANDIDATES", "KVFORK_LAND_BEFORE_REPLY")


@contextlib.contextmanager
def _env(values: dict[str, str]) -> Iterator[None]:
    """The knobs `_KNOBS` set to `values` (the others unset) for the block."""
    before = {k: os.environ.pop(k) for k in _KNOBS if k in os.environ}
    os.environ.update(values)
    try:
        yield
    finally:
        for k in _KNOBS:
            os.environ.pop(k, None)
        os.environ.update(before)


@dataclasses.dataclass
class StepRate:
    """`store.step`'s best run: tokens/s, and where a step's milliseconds went."""

    rate: float
    step_ms: float
    #: In `llama_decode` and the wait for its outputs.
    decode_ms: float
    #: The engine's own, around the decode (sampling, accepting, bookkeeping).
    engine_ms: float
    #: The batch thread count the context settled on.
    team: int

    @property
    def caller_ms(self) -> float:
        """The rest: the hand-over to the engine thread and back, and Python."""
        return self.step_ms - self.decode_ms - self.engine_ms


def _step_rate(model: Any, n: int, steps: int, params: Any, device_sampling: bool) -> StepRate:
    """`store.step` of a prompt and N - 1 forks, best of 3 after 2 warm-up steps."""
    import kvfork

    # Each branch takes a cell a step (2 warm-up steps, then 3 runs of `steps`), the prompt
    # shared: at N = 128 and 64 steps, about 25,000 cells.
    n_ctx = max(8192, n * (2 + 3 * steps) + 1024)
    with kvfork.create_context_sync(
        model, n_ctx=n_ctx, n_batch=512, n_seq_max=n, device_sampling=device_sampling
    ) as ctx:
        root = kvfork.Branch.create(ctx, 0, params)
        root.prefill_sync(ctx.tokenize(PROMPT))
        branches = [root] + [root.fork_sync() for _ in range(n - 1)]
        store = kvfork.BranchStore(ctx)
        for _ in range(2):
            store.step_sync(branches)
        best, decode, engine = float("inf"), 0.0, 0.0
        for _ in range(3):
            s0 = ctx.stats()
            t0 = time.perf_counter()
            for _ in range(steps):
                store.step_sync(branches)
            dt = time.perf_counter() - t0
            if dt < best:
                s1 = ctx.stats()
                best = dt
                decode = float(s1["decode_seconds"]) - float(s0["decode_seconds"])
                engine = float(s1["commit_seconds"]) - float(s0["commit_seconds"]) - decode
        ms = 1000 / steps
        return StepRate(n * steps / best, best * ms, decode * ms, engine * ms, ctx.n_threads_batch)


def run(model: str, label: str, ns: Sequence[int], steps: int, out: Path) -> int:
    """Checks and throughput for one model into `out` (JSON); 1 when the backend is not CUDA."""
    result: dict[str, Any] = {
        "label": label,
        "model": Path(model).name,
        "steps": steps,
        "checks": {},
        "store_step": {},
        "store_step_device": {},
    }
    _checks(model, result)
    if result["checks"].get("backend", "").startswith("OK"):
        _throughput(model, ns, steps, result)
    out.write_text(json.dumps(result, indent=1))
    return 0 if result["checks"].get("backend", "").startswith("OK") else 1


_BARE = re.compile(r"^bare(-gpusample)? N=(\d+) tok/s=([\d.]+)", re.MULTILINE)


def parse_bare(text: str) -> dict[tuple[str, int], float]:
    """bare_bench's lines -> {("host" | "gpu", N): tok/s}."""
    return {
        ("gpu" if m.group(1) else "host", int(m.group(2))): float(m.group(3))
        for m in _BARE.finditer(text)
    }


def _num(rate: float | None) -> str:
    return f"{rate:,.0f}" if rate else "-"


def _ratio(rate: float | None, anchor: float | None) -> str:
    return f"{rate / anchor:.2f}" if rate and anchor else "-"


_MODES = (
    ("store_step", "host rows"),
    ("store_step_device", "device_sampling"),
    ("store_step_device_k1", "device_sampling, K=1"),
    ("store_step_land_first", "host rows, landing first"),
    ("store_step_device_k1_land_first", "K=1, landing first"),
)


def _landing_table(result: dict[str, Any]) -> list[str]:
    """tok/s with each step's reply before its rows are read (the default) and after
    (`KVFORK_LAND_BEFORE_REPLY`), host rows and K=1. Nothing when the run predates it."""
    first = result.get("store_step_land_first")
    if not first:
        return []
    k1, k1_first = (result.get(k, {}) for k in _MODES_K1)
    lines = [
        "Replies before the rows land (the default) against after, tok/s",
        "",
        "| N | host rows | landing first | ratio | K=1 | K=1, landing first | ratio |",
        "|---|---|---|---|---|---|---|",
    ]
    for n_text, rate in result["store_step"].items():
        before = first.get(n_text)
        cells = [_num(rate), _num(before), _ratio(rate, before)]
        cells += [_num(k1.get(n_text)), _num(k1_first.get(n_text))]
        cells.append(_ratio(k1.get(n_text), k1_first.get(n_text)))
        lines.append(f"| {n_text} | {' | '.join(cells)} |")
    return [*lines, ""]


_MODES_K1 = ("store_step_device_k1", "store_step_device_k1_land_first")


def _split_table(split: dict[str, dict[str, list[float]]]) -> list[str]:
    """Where a step's time went, N by N and mode by mode: in the decode (and the wait for
    its outputs), the engine's own around it, and the rest (the hand-over to the engine
    thread and back, Python). Nothing when the run predates the split."""
    modes = [(key, name) for key, name in _MODES if key in split]
    if not modes:
        return []
    lines = [
        "Where a step's time goes, ms: decode + the engine's own + hand-over and Python",
        "",
        "| N | " + " | ".join(name for _, name in modes) + " |",
        "|---|" + "---|" * len(modes),
    ]
    for n_text in sorted({n for key, _ in modes for n in split[key]}, key=int):
        cells = []
        for key, _ in modes:
            parts = split[key].get(n_text)
            cells.append(" + ".join(f"{p:.3f}" for p in parts) if parts else "-")
        lines.append(f"| {n_text} | {' | '.join(cells)} |")
    return [*lines, ""]


def report(folder: Path) -> str:
    """Markdown: per model, the checks and one table of kvfork against bare llama.cpp, then
    bench_store.py's throughput and device-sampling tables as it printed them."""
    lines: list[str] = []
    for path in sorted(folder.glob("kvfork-*.json")):
        result = json.loads(path.read_text())
        label = result["label"]
        bare: dict[tuple[str, int], float] = {}
        for mode in ("host", "gpu"):
            txt = folder / f"bare-{label}-{mode}.txt"
            if txt.is_file():
                bare.update(parse_bare(txt.read_text()))
        lines.append(f"### {result['model']} ({label}), greedy, {result['steps']} steps, tok/s")
        for name, verdict in result["checks"].items():
            lines.append(f"- CHECK {name}: {verdict.splitlines()[0] if verdict else ''}")
        if "generate" in result:
            lines.append(f"- Branch.generate N=1: {result['generate']:.0f} tok/s")
        lines += [
            "",
            (
                "| N | kvfork store.step | kvfork, device_sampling | device_sampling, K=1 "
                "| bare, host argmax | bare, backend sampling "
                "| kvfork / bare backend (target >= 1.0) | kvfork / bare host "
                "| device_sampling / bare backend | K=1 / bare backend "
                "| kvfork ms a step of its own (outside llama_decode and the wait for its outputs) |"
            ),
            "|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        on_device = result.get("store_step_device", {})
        argmax = result.get("store_step_device_k1", {})
        outside = result.get("outside_ms", {})
        for n_text, rate in result["store_step"].items():
            n = int(n_text)
            host, gpu, dev = bare.get(("host", n)), bare.get(("gpu", n)), on_device.get(n_text)
            k1 = argmax.get(n_text)
            cells = [_num(rate), _num(dev), _num(k1), _num(host), _num(gpu)]
            cells += [_ratio(rate, gpu), _ratio(rate, host), _ratio(dev, gpu), _ratio(k1, gpu)]
            team = result.get("team_threads", {}).get(n_text)
            spent = f"{outside[n_text]:.3f}" if n_text in outside else "-"
            cells.append(f"{spent} ({team} threads)" if team else spent)
            lines.append(f"| {n} | {' | '.join(cells)} |")
        lines.append("")
        lines += _landing_table(result)
        lines += _split_table(result.get("split_ms", {}))
    for path in sorted(folder.glob("noise-*.txt")):
        lines.append("### gpu_check.noise: the suite's tolerances, measured (tests/conftest.py)")
        lines.append(path.read_text().strip())
        lines.append("")
    for pattern, title in (
        ("bench_store-*.txt", "--only throughput"),
        ("device-*.txt", "--only device (device_sampling=True against host rows)"),
    ):
        for path in sorted(folder.glob(pattern)):
            label = path.stem.split("-", 1)[1]
            lines.append(f"### benchmarks/bench_store.py {title} ({label})")
            lines.append(path.read_text().strip())
            lines.append("")
    return "\n".join(lines) + "\n" if lines else "no benchmark output yet\n"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("run")
    p.add_argument("--model", required=True)
    p.add_argument("--label", required=True)
    p.add_argument("--json", type=Path, required=True)
    p.add_argument("--ns", default="1,8,64,128")
    p.add_argument("--steps", type=int, default=64)
    p = sub.add_parser("report")
    p.add_argument("--dir", type=Path, required=True)
    args = parser.parse_args(argv)
    if args.cmd == "report":
        print(report(args.dir), end="")
        return 0
    ns = [int(x) for x in args.ns.split(",")]
    return run(args.model, args.label, ns, args.steps, args.json)


if __name__ == "__main__":
    sys.exit(main())
