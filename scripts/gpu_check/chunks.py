"""The test suite in chunks of test files, each chunk its own pytest run with its own result,
so that a run cut short by a call's time limit goes on where it stopped on the next call.

The chunks are fixed on the first run (plan.json); a chunk's result (chunk-NN.json, with its
JUnit XML and log beside it) marks it done. A chunk the deadline interrupts is run again
from its start on the next call; interrupted twice, it is recorded as timed out and skipped.
pytest runs with plugin autoloading off and the suite's own plugins named (asyncio, timeout,
hypothesis), so that the GPU image's plugins (xdist, cov, benchmark) stay out of it.

usage (PYTHONPATH=scripts):
  python -m gpu_check.chunks run --repo R --work DIR [--deadline EPOCH] [--files-per-chunk 6]
                                   [--jobs 1]
  python -m gpu_check.chunks summary --work DIR
run exits 0 when every chunk is done (failures included), 3 when chunks remain.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import threading
import time
import xml.etree.ElementTree as ET
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

PLUGINS = ["-p", "pytest_asyncio.plugin", "-p", "pytest_timeout", "-p", "_hypothesis_pytestplugin"]
#: A runner's return code for a run stopped at its time limit.
CUT = -1
#: Runs a chunk: (files, junit xml, log, seconds allowed) -> (pytest's exit code or CUT, seconds).
Runner = Callable[[list[str], Path, Path, float], tuple[int, float]]


def test_files(repo: Path, first: Sequence[str] = ()) -> list[str]:
    """The suite's test files, relative to the repository, in a fixed order: those named in
    `first` (a rerun of what failed last time, before a short call's deadline) at the front."""
    files = sorted(str(p.relative_to(repo)) for p in (repo / "tests").rglob("test_*.py"))
    unknown = [f for f in first if f not in files]
    if unknown:
        raise ValueError(f"not test files of the suite: {' '.join(unknown)}")
    return list(dict.fromkeys([*first, *files]))


def plan_chunks(files: Sequence[str], per_chunk: int) -> list[list[str]]:
    if per_chunk < 1:
        raise ValueError("per_chunk must be >= 1")
    return [list(files[i : i + per_chunk]) for i in range(0, len(files), per_chunk)]


def load_plan(work: Path, repo: Path, per_chunk: int, first: Sequence[str] = ()) -> list[list[str]]:
    """The chunks fixed by the first run in `work` (made now if there is none)."""
    path = work / "plan.json"
    if path.is_file():
        plan: list[list[str]] = json.loads(path.read_text())
        return plan
    plan = plan_chunks(test_files(repo, first), per_chunk)
    work.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(plan, indent=1))
    return plan


@dataclass
class Chunk:
    """One chunk's latest result."""

    index: int
    files: list[str]
    status: str = "pending"  # passed, failed, error, no-tests, cut, timeout
    rc: int | None = None
    seconds: float = 0.0
    attempts: int = 0
    tests: int = 0
    failures: int = 0
    errors: int = 0
    skipped: int = 0
    failed_ids: list[str] = field(default_factory=list)

    @property
    def done(self) -> bool:
        return self.status not in ("pending", "cut")


def chunk_path(work: Path, index: int, suffix: str) -> Path:
    return work / f"chunk-{index:02d}.{suffix}"


def load_chunk(work: Path, index: int, files: list[str]) -> Chunk:
    path = chunk_path(work, index, "json")
    if path.is_file():
        return Chunk(**json.loads(path.read_text()))
    return Chunk(index, files)


def read_junit(path: Path, chunk: Chunk) -> None:
    """Fills the chunk's counts and failed test ids from pytest's JUnit XML."""
    if not path.is_file():
        return
    try:
        root = ET.parse(path).getroot()
    except ET.ParseError:
        return
    suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
    chunk.tests = sum(int(s.get("tests", 0)) for s in suites)
    chunk.failures = sum(int(s.get("failures", 0)) for s in suites)
    chunk.errors = sum(int(s.get("errors", 0)) for s in suites)
    chunk.skipped = sum(int(s.get("skipped", 0)) for s in suites)
    chunk.failed_ids = []
    for case in root.iter("testcase"):
        for bad in list(case.findall("failure")) + list(case.findall("error")):
            message = (bad.get("message") or "").strip().splitlines()
            first = message[0][:160] if message else bad.tag
            chunk.failed_ids.append(f"{case.get('classname')}::{case.get('name')}: {first}")


def status_of(rc: int) -> str:
    return {0: "passed", 1: "failed", 5: "no-tests"}.get(rc, "error")


def run(
    work: Path,
    plan: list[list[str]],
    deadline: float,
    runner: Runner,
    *,
    min_left: float = 150.0,
    max_attempts: int = 2,
    jobs: int = 1,
    clock: Callable[[], float] = time.time,
    log: Callable[[str], None] = print,
) -> int:
    """Runs the chunks not done yet, up to `jobs` at a time, starting each while at least
    `min_left` seconds remain before `deadline`; 0 when all are done, 3 when some remain.
    A cut chunk stops new starts (the next call goes on)."""
    if jobs < 1:
        raise ValueError("jobs must be >= 1")
    work.mkdir(parents=True, exist_ok=True)
    if not (work / "plan.json").is_file():
        (work / "plan.json").write_text(json.dumps(plan, indent=1))
    todo = [(i, files) for i, files in enumerate(plan) if not load_chunk(work, i, files).done]
    lock = threading.Lock()
    remains = False

    def take() -> tuple[int, list[str], float] | None:
        nonlocal remains
        with lock:
            if remains or not todo:
                return None
            left = deadline - clock()
            if left < min_left:
                log(f"chunk {todo[0][0]:02d}: {left:.0f} s left, under {min_left:.0f}: next call")
                remains = True
                return None
            index, files = todo.pop(0)
            return index, files, left

    def work_loop() -> None:
        nonlocal remains
        while (job := take()) is not None:
            chunk = run_chunk(work, *job, runner, max_attempts)
            with lock:
                log(
                    f"chunk {chunk.index:02d}: {chunk.status} in {chunk.seconds:.0f} s "
                    f"({' '.join(chunk.files)})"
                )
                if chunk.status == "cut":
                    remains = True

    threads = [threading.Thread(target=work_loop) for _ in range(min(jobs, max(len(todo), 1)))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return 3 if remains or todo else 0


def run_chunk(
    work: Path, index: int, files: list[str], left: float, runner: Runner, max_attempts: int
) -> Chunk:
    """Runs one chunk with `left` seconds allowed and records its result."""
    chunk = load_chunk(work, index, files)
    xml = chunk_path(work, index, "xml")
    xml.unlink(missing_ok=True)
    rc, seconds = runner(files, xml, chunk_path(work, index, "log"), left)
    chunk.attempts += 1
    chunk.seconds = seconds
    chunk.rc = None if rc == CUT else rc
    if rc == CUT:
        chunk.status = "timeout" if chunk.attempts >= max_attempts else "cut"
    else:
        chunk.status = status_of(rc)
        read_junit(xml, chunk)
    chunk_path(work, index, "json").write_text(json.dumps(asdict(chunk), indent=1))
    return chunk


def pytest_runner(repo: Path, extra: Sequence[str] = ()) -> Runner:
    """Runs a chunk with this interpreter's pytest in `repo`, output into the chunk's log."""

    def runner(files: list[str], xml: Path, log: Path, limit: float) -> tuple[int, float]:
        cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *PLUGINS]
        cmd += ["--junitxml", str(xml), *extra, *files]
        env = {**os.environ, "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1", "PYTHONUNBUFFERED": "1"}
        start = time.monotonic()
        with log.open("w") as out:
            proc = subprocess.Popen(
                cmd, cwd=repo, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
            )
            try:
                rc = proc.wait(timeout=limit)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
                rc = CUT
        return rc, time.monotonic() - start

    return runner


def summary(work: Path) -> str:
    """The chunks' results as Markdown: totals, a table, the failed tests."""
    plan_path = work / "plan.json"
    if not plan_path.is_file():
        return "no test run yet\n"
    plan: list[list[str]] = json.loads(plan_path.read_text())
    chunks = [load_chunk(work, i, files) for i, files in enumerate(plan)]
    done = [c for c in chunks if c.done]
    total = {k: sum(getattr(c, k) for c in chunks) for k in ("tests", "failures", "errors")}
    skipped = sum(c.skipped for c in chunks)
    passed = total["tests"] - total["failures"] - total["errors"] - skipped
    seconds = sum(c.seconds for c in chunks)
    lines = [
        f"{len(done)}/{len(chunks)} chunks done ({seconds:.0f} s): {passed} passed, "
        f"{total['failures']} failed, {total['errors']} errors, {skipped} skipped"
        + ("" if len(done) == len(chunks) else "; continue: the rest runs on the next call"),
        "",
        "| chunk | status | tests | failed | errors | skipped | s | files |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for c in chunks:
        names = " ".join(Path(f).name for f in c.files)
        lines.append(
            f"| {c.index:02d} | {c.status} | {c.tests} | {c.failures} | {c.errors} | {c.skipped}"
            f" | {c.seconds:.0f} | {names} |"
        )
    failed = [f for c in chunks for f in c.failed_ids]
    if failed:
        lines += ["", "Failed:"] + [f"- {f}" for f in failed[:80]]
        if len(failed) > 80:
            lines.append(f"- ... and {len(failed) - 80} more (test.log)")
    bad_runs = [c for c in chunks if c.status in ("error", "timeout")]
    for c in bad_runs:
        lines.append(f"- chunk {c.index:02d} {c.status} (rc {c.rc}): see chunk-{c.index:02d}.log")
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("run")
    p.add_argument("--repo", type=Path, required=True)
    p.add_argument("--work", type=Path, required=True)
    p.add_argument("--deadline", type=float, default=time.time() + 540)
    p.add_argument("--files-per-chunk", type=int, default=6)
    p.add_argument("--min-left", type=float, default=150.0)
    p.add_argument("--jobs", type=int, default=1, help="chunks run at the same time")
    p.add_argument("--first", default="", help="test files to run first, space-separated")
    p.add_argument("pytest_args", nargs="*", help="more pytest arguments (after --)")
    p = sub.add_parser("summary")
    p.add_argument("--work", type=Path, required=True)
    args = parser.parse_args(argv)
    if args.cmd == "summary":
        print(summary(args.work), end="")
        return 0
    plan = load_plan(args.work, args.repo, args.files_per_chunk, args.first.split())
    started = time.time()
    rc = run(
        args.work,
        plan,
        args.deadline,
        pytest_runner(args.repo.resolve(), args.pytest_args),
        min_left=args.min_left,
        jobs=args.jobs,
    )
    for index in range(len(plan)):
        chunk = load_chunk(args.work, index, plan[index])
        ran_now = chunk_path(args.work, index, "json").is_file() and (
            chunk_path(args.work, index, "json").stat().st_mtime >= started
        )
        if ran_now and chunk.status in ("failed", "error", "timeout"):
            log = chunk_path(args.work, index, "log")
            if log.is_file():
                print(f"\n===== chunk {index:02d} ({chunk.status}) =====")
                print(log.read_text(errors="replace")[-200_000:])
    return rc


if __name__ == "__main__":
    sys.exit(main())
