"""`create_context` and `Context`: options validated, thread counts fixed or adapting, `async
with` (with or without `await`), an event loop that runs on while the engine decodes, and
the end of a context (use after close, dropped without close, dropped while it decodes, the
interpreter's exit while a thread decodes)."""

from __future__ import annotations

import asyncio
import gc
import os
import re
import subprocess
import sys

import kvfork
import pytest

from .conftest import GREEDY, PROMPT, root


def test_async_with_create_context_needs_no_await(model: kvfork.Model) -> None:
    async def main() -> tuple[int, bool]:
        async with kvfork.create_context(model, n_ctx=256, n_seq_max=1) as ctx:
            n = ctx.n_ctx
        return n, ctx.closed

    assert asyncio.run(main()) == (256, True)


async def test_async_context(model: kvfork.Model) -> None:
    async with await kvfork.create_context(model, n_ctx=256, n_seq_max=1) as c:
        b = kvfork.Branch.create(c, 0, GREEDY)
        await b.prefill(c.tokenize("Hi"))
        assert b.position == 2
    assert c.closed


@pytest.mark.parametrize("n_seq_max", [0, 257, 100000, 2**33])
def test_n_seq_max_out_of_range(model: kvfork.Model, n_seq_max: int) -> None:
    with pytest.raises(ValueError, match=r"n_seq_max.*\[1, 256\]"):
        kvfork.create_context_sync(model, n_seq_max=n_seq_max)


@pytest.mark.parametrize(
    ("option", "value", "documented"),
    [
        ("n_ctx", -5, "[16, 16777216]"),
        ("n_ctx", 8, "[16, 16777216]"),
        ("n_ctx", 2**40, "[16, 16777216]"),
        ("n_batch", 0, "[1, 65536]"),
        ("n_threads", 0, "[1, 512]"),
        ("n_threads_batch", 2**31, "[1, 512]"),
    ],
)
def test_an_option_out_of_range_names_its_documented_range(
    model: kvfork.Model, option: str, value: int, documented: str
) -> None:
    """Below 1 or past the C type as just past the limit: the range `create_context`
    documents, not the C type's."""
    with pytest.raises(ValueError, match=f"{option}.*{re.escape(documented)}"):
        kvfork.create_context_sync(model, **{option: value})  # type: ignore[arg-type]


def test_context_reports_its_threads(model: kvfork.Model) -> None:
    with kvfork.create_context_sync(model, n_ctx=256, n_seq_max=1, n_threads=1) as c:
        assert c.n_threads == 1
    with kvfork.create_context_sync(model, n_ctx=256, n_seq_max=1) as c:
        assert c.n_threads >= 1


def test_thread_counts_adapt_unless_fixed(model: kvfork.Model) -> None:
    with kvfork.create_context_sync(model, n_ctx=256, n_threads=1, n_threads_batch=2) as c:
        assert (c.n_threads, c.n_threads_batch) == (1, 2)
        assert len(list(root(c).generate_sync(40))) == 40  # fixed: no probe changes them
        assert (c.n_threads, c.n_threads_batch) == (1, 2)
    with kvfork.create_context_sync(model, n_ctx=256) as c:
        b = root(c)
        for _ in b.generate_sync(64):  # probes run; the settled counts stay in range
            assert 1 <= c.n_threads <= 8 and 1 <= c.n_threads_batch <= 8
    with pytest.raises(ValueError, match="n_threads_batch"):
        kvfork.create_context_sync(model, n_threads_batch=0)


async def test_event_loop_not_blocked(ctx: kvfork.Context) -> None:
    ticks = 0

    async def ticker() -> None:
        nonlocal ticks
        while True:
            ticks += 1
            await asyncio.sleep(0)

    task = asyncio.create_task(ticker())
    b = kvfork.Branch.create(ctx, 0, GREEDY)
    await b.prefill(ctx.tokenize(PROMPT * 20))
    task.cancel()
    assert ticks > 1  # the loop kept running while llama.cpp decoded


def test_use_after_close(model: kvfork.Model) -> None:
    c = kvfork.create_context_sync(model, n_ctx=256, n_seq_max=2)
    b = root(c, "Hello")
    c.close()
    c.close()  # idempotent
    with pytest.raises(kvfork.KvforkError):
        c.tokenize("x")
    with pytest.raises(kvfork.KvforkError):
        b.commit_sync(1)
    with pytest.raises(kvfork.KvforkError):
        kvfork.Branch.create(c, 0)


def test_context_dropped_without_close(model: kvfork.Model) -> None:
    c = kvfork.create_context_sync(model, n_ctx=256, n_seq_max=1)
    root(c, "Hi")
    del c
    gc.collect()


def in_child(code: str, *args: str) -> subprocess.CompletedProcess[str]:
    """`code` in a fresh interpreter on the default model (bounded: a hang fails)."""
    return subprocess.run(
        [sys.executable, "-c", code, *args],
        env={**os.environ, "PYTHONFAULTHANDLER": "1"},
        capture_output=True,
        text=True,
        timeout=120,
    )


DROP_BUSY = """
import logging, sys, time, warnings, kvfork
warnings.simplefilter("ignore")  # the prefill's operation is never awaited
if sys.argv[1] == "debug":
    kvfork.set_log_level(logging.DEBUG)  # llama.cpp logs as the engine closes
c = kvfork.create_context_sync(kvfork.default_model_path(), n_ctx=2048, n_seq_max=1)
b = kvfork.Branch.create(c, 0, {})
op = b.prefill(c.tokenize("hello world " * 1000)[:1800])
time.sleep(0.3)  # decoding now
del op, b, c  # the last references: the engine's thread is joined here
print("dropped")
"""


@pytest.mark.parametrize("logging_level", ["default", "debug"])
def test_dropping_a_busy_context_returns(logging_level: str) -> None:
    """The join of the engine's thread lets the GIL go: the aborted decode's log lines reach
    Python (it hung: the engine thread waited for the GIL the joining thread held)."""
    out = in_child(DROP_BUSY, logging_level)
    assert out.returncode == 0 and out.stdout.strip() == "dropped", out.stderr[-2000:]


EXIT_WHILE_DECODING = """
import ctypes, sys, threading, time
# Registered before kvfork loads, so it runs after the library's static destructors (exit
# handlers run last-registered first): 0.5 s in which an engine still decoding would use
# torn-down state.
libc = ctypes.CDLL(None)
libc.__cxa_atexit(ctypes.cast(libc.usleep, ctypes.c_void_p), ctypes.c_void_p(500_000), None)
import kvfork
c = kvfork.create_context_sync(kvfork.default_model_path(), n_ctx=2048, n_seq_max=1)
prompt = c.tokenize("The quick brown fox jumps over the lazy dog. " * 200)[:1800]
def decode_forever():
    while True:
        b = kvfork.Branch.create(c, 0, {})
        b.prefill_sync(prompt)
        b.prune_sync()
threading.Thread(target=decode_forever, daemon=True).start()
time.sleep(float(sys.argv[1]))
"""


def test_the_interpreter_exits_cleanly_while_a_daemon_thread_decodes() -> None:
    """A daemon thread is frozen at exit, still holding its context: kvfork closes every
    context at exit, so no engine decodes while the process tears down (a SIGSEGV in ggml)."""
    for delay in ("0.3", "0.7", "1.1"):
        out = in_child(EXIT_WHILE_DECODING, delay)
        assert out.returncode == 0, (delay, out.returncode, out.stderr[-2000:])


FORK = """
import os, kvfork
m = kvfork.Model.load(kvfork.default_model_path())
c = kvfork.create_context_sync(m, n_ctx=512, n_seq_max=2)
b = kvfork.Branch.create(c, 0, {"temperature": 0})
b.prefill_sync(c.tokenize("Once upon a time"))
pid = os.fork()
if pid == 0:
    try:
        b.fork_sync()
    except kvfork.KvforkError as e:
        print("child:", e)
    c.close()
    with kvfork.create_context_sync(m, n_ctx=512, n_seq_max=1) as mine:
        x = kvfork.Branch.create(mine, 0, {"temperature": 0})
        x.prefill_sync(mine.tokenize("Once upon a time"))
        print("child's own context:", len(list(x.generate_sync(3))))
else:  # the child ends as any script does: its exit closes what it inherited
    _, status = os.waitpid(pid, 0)
    print("parent:", status, len(list(b.generate_sync(2))))
"""


def test_a_forked_child_is_told_its_inherited_context_is_the_parent_s() -> None:
    """The child of os.fork() has none of the engines' threads: a call on an inherited
    context raises KvforkError saying so (it waited forever), closing it returns, the child
    exits cleanly (a Rust panic at exit) and can make contexts of its own; the parent's go on."""
    out = in_child(FORK)
    assert out.returncode == 0, out.stderr[-2000:]
    lines = out.stdout.splitlines()
    assert any("before this process forked" in line for line in lines), lines
    assert "child's own context: 3" in lines and "parent: 0 2" in lines, lines
    assert "panicked" not in out.stderr, out.stderr[-2000:]


CTRL_C_WHILE_LOADING = """
import os, signal, time, kvfork
signal.signal(signal.SIGALRM, lambda *_: os.kill(os.getpid(), signal.SIGINT))
signal.setitimer(signal.ITIMER_REAL, 0.05)  # Ctrl-C 50 ms into the load
try:
    kvfork.Model.load(kvfork.default_model_path())
    time.sleep(2)
    print("not interrupted")
except KeyboardInterrupt:
    print("interrupted")
"""


def test_ctrl_c_while_a_model_loads_is_not_lost() -> None:
    """The load logs (llama.cpp's warnings go to Python's logging): Ctrl-C's handler ran in
    that Python code and its KeyboardInterrupt was dropped with the log line."""
    out = in_child(CTRL_C_WHILE_LOADING)
    assert out.stdout.strip() == "interrupted", (out.stdout, out.stderr[-2000:])


SUBINTERPRETER = """
try:
    import _interpreters as interpreters  # 3.13+
except ImportError:
    import _xxsubinterpreters as interpreters
import sys, kvfork
sub = interpreters.create()
try:
    failed = interpreters.run_string(sub, f"import sys; sys.path[:0] = {sys.path!r}; import kvfork")
except Exception as e:  # 3.11, 3.12 raise
    failed = e
print("refused:", failed)
interpreters.destroy(sub)
"""


def test_a_subinterpreter_is_refused_at_import() -> None:
    """CPython gives a subinterpreter a copy of the extension's module without running its
    init, and the extension keeps Python objects process-wide: once such a subinterpreter was
    gone, every await in the main interpreter failed. The import is refused there."""
    out = in_child(SUBINTERPRETER)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "main interpreter only" in out.stdout, out.stdout


def test_the_handles_take_weak_references(model: kvfork.Model) -> None:
    """A cache of branches (or contexts) by weak reference, as `weakref.WeakValueDictionary`
    keeps them, does not keep them alive."""
    import weakref

    with kvfork.create_context_sync(model, n_ctx=256, n_seq_max=2) as c:
        b = root(c, "Hello")
        store, cache = kvfork.BranchStore(c), kvfork.PrefixCache(c)
        refs = [weakref.ref(x) for x in (model, c, b, store, cache)]
        assert all(r() is not None for r in refs)
        by_handle: weakref.WeakValueDictionary[int, kvfork.Branch] = weakref.WeakValueDictionary()
        by_handle[b.handle] = b
        b.prune_sync()
        del b, store, cache
        gc.collect()
        assert not by_handle and refs[2]() is None
