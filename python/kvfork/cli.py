"""The `kvfork` command (also `python -m kvfork`).

    kvfork demo                         forks of one prompt, one decode per step, live
    kvfork generate MODEL PROMPT        generate (best-of-N with --n, constrained, speculative)
    kvfork chat [MODEL]                 interactive multi-turn chat (or one turn per stdin line)
    kvfork embed MODEL [TEXT ...]       embeddings as JSON lines, or --rank QUERY
    kvfork bench [MODEL]                a quick throughput check: one sequence against N forks
    kvfork serve MODEL                  an OpenAI-compatible server (kvfork[server]); with
                                        --ray, over Ray actors routed by prefix
    kvfork info [MODEL]                 metadata, chat template, system info (no MODEL: where
                                        the embedded models are)

MODEL is a GGUF file, or `default` (Gemma 3 270M, base) or `chat` (SmolLM2-135M-Instruct).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import io
import json
import logging
import math
import os
import socket
import sys
import threading
import time
from collections.abc import AsyncIterator, Callable, Coroutine, Sequence
from pathlib import Path
from typing import Any

from . import _demo
from ._chat import HELPFUL_ASSISTANT, Chat
from ._models import cache_dir, default_chat_model_path, default_model_path, model_locations
from ._native import (
    Branch,
    BranchStore,
    ChatTemplateError,
    Context,
    KvCacheFullError,
    KvforkError,
    Model,
    SamplingParams,
    Token,
    __version__,
    system_info,
)
from ._open import create_context
from ._progress import Progress
from ._speculative import PromptLookup

MODEL_ALIASES = {"default": default_model_path, "chat": default_chat_model_path}

log = logging.getLogger("kvfork.server")


class CliError(Exception):
    """A usage problem reported as ``kvfork: error: ...`` with exit status 2."""


#: The most MiB `--cache-ram` or `--cache-disk` takes: 2**63 bytes.
MAX_CACHE_MIB = 1 << 43
#: Cells of `kvfork serve --embeddings`' own context (more when --n-batch asks for more).
EMBED_N_CTX = 4096


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line ``argv`` (default ``sys.argv[1:]``); returns the exit status."""
    parser = _parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    try:
        run = _runner(getattr(args, "loop", "asyncio"))
        result: int = run(args.run(args))
        return result
    except CliError as exc:
        parser.exit(2, f"kvfork: error: {exc}\n")
    except BrokenPipeError:
        # The reader went away (`| head`): no message; stdout is pointed at /dev/null so the
        # interpreter's own flush at exit does not complain again. 141: as SIGPIPE ends tools.
        with contextlib.suppress(OSError):
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141
    except (KvforkError, ValueError, OSError) as exc:
        parser.exit(1, f"kvfork: {type(exc).__name__}: {exc}\n")
    except KeyboardInterrupt:
        return 130


def _runner(loop: str) -> Callable[[Coroutine[Any, Any, int]], int]:
    """`asyncio.run`, or uvloop's (`--loop`; `auto`: uvloop where it is installed, as the
    `server` extra does): its C event loop spends less time on each streamed token."""
    if loop == "asyncio":
        return asyncio.run
    try:
        import uvloop
    except ImportError:
        if loop == "uvloop":
            raise CliError("--loop uvloop: uvloop is not installed (pip install uvloop)") from None
        return asyncio.run
    return uvloop.run


def resolve_model(name: str | None, fallback: str = "default") -> Path:
    """A GGUF path for a MODEL argument: a file, or the alias ``default`` / ``chat``."""
    name = name or fallback
    if name in MODEL_ALIASES:
        target = cache_dir()
        fresh = not any(target.glob("*.gguf"))  # the first use assembles it (seconds)
        with Progress(f"preparing the {name} model", enabled=None if fresh else False):
            return MODEL_ALIASES[name]()
    path = Path(name)
    if not path.is_file():
        raise CliError(f"no such model file: {name} (a GGUF path, or 'default' or 'chat')")
    return path


def sampling_params(args: argparse.Namespace) -> SamplingParams:
    """SamplingParams from the shared sampling options."""
    return SamplingParams(
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        min_p=args.min_p,
        repeat_penalty=args.repeat_penalty,
        seed=args.seed,
    )


async def prefill(branch: Branch, tokens: list[int], n_batch: int) -> None:
    """Prefill ``tokens``, n_batch at a time, with a progress line when it is long."""
    with Progress("prefill", total=len(tokens)) as progress:
        for start in range(0, len(tokens), n_batch):
            await branch.prefill(tokens[start : start + n_batch])
            progress.update(min(start + n_batch, len(tokens)))


async def open_context(path: Path, **options: Any) -> Context:
    """A context on ``path``, with a progress line while the model loads."""
    with Progress(f"loading {path.name}"):
        return await create_context(path, **options)


# --- commands -------------------------------------------------------------------------------


async def cmd_demo(args: argparse.Namespace) -> int:
    """Forks of one prompt advanced in one decode per step, against sequential generation."""
    model = resolve_model(args.model)
    await _demo.run(model, n=args.n, max_tokens=args.max_tokens, prompt=args.prompt)
    return 0


async def cmd_generate(args: argparse.Namespace) -> int:
    """Generate from PROMPT: streamed with --n 1, best-of-N by perplexity otherwise."""
    if args.draft and args.n > 1:
        raise CliError("--draft works with --n 1 (speculation follows one sequence)")
    model = resolve_model(args.model)
    ctx = await open_context(model, n_ctx=args.n_ctx, n_seq_max=args.n + 1)
    with ctx:
        tokens = ctx.tokenize(args.prompt)
        if not tokens:  # a model that adds no BOS, and an empty prompt: nothing to go on
            raise CliError("the prompt is empty: give PROMPT some text")
        root = Branch.create(ctx, 0, sampling_params(args))
        _constrain(root, args)
        await prefill(root, tokens, ctx.n_batch)
        if args.n == 1:
            await _stream(root, args)
        else:
            await _best_of_n(ctx, root, args)
    return 0


def _constrain(branch: Branch, args: argparse.Namespace) -> None:
    if args.json_schema is not None:
        branch.set_json_schema(_read(args.json_schema))
    elif args.grammar is not None:
        branch.set_grammar(_read(args.grammar))


def _read(path: str, lenient: bool = False) -> str:
    """The text of `path` (`lenient`: bytes that are not UTF-8 read as U+FFFD)."""
    try:
        data = Path(path).read_bytes()
    except OSError as exc:
        raise CliError(f"cannot read {path}: {exc.strerror}") from exc
    try:
        return data.decode("utf-8", "replace" if lenient else "strict")
    except UnicodeDecodeError as exc:
        raise CliError(f"{path} is not UTF-8 text: {exc.reason} at byte {exc.start}") from exc


async def _stream(branch: Branch, args: argparse.Namespace) -> None:
    out = sys.stdout
    out.write(args.prompt)
    out.flush()
    start, count = time.perf_counter(), 0
    if args.draft == "prompt-lookup":
        stream: AsyncIterator[Token] = branch.generate(args.max_tokens, draft=PromptLookup())
    else:
        stream = branch.generate(args.max_tokens)
    async for token in stream:
        out.write(token.text)
        out.flush()
        count += 1
    elapsed = time.perf_counter() - start
    sys.stderr.write(
        f"\n[{count} tokens in {elapsed:.2f}s, {count / max(elapsed, 1e-9):.1f} tok/s, "
        f"perplexity {branch.perplexity:.2f}]\n"
    )


async def _best_of_n(ctx: Context, root: Branch, args: argparse.Namespace) -> None:
    # Each candidate its own stream, from the one --seed (any seed --n 1 takes).
    forks = [await root.fork(seed=(args.seed * 1000 + i) % 2**32) for i in range(args.n)]
    store = BranchStore(ctx)
    texts = [""] * len(forks)
    running = list(range(len(forks)))
    with Progress(f"generating {args.n} candidates", total=args.max_tokens) as progress:
        for step in range(args.max_tokens):
            if not running:
                break
            try:
                drawn = await store.step([forks[i] for i in running])
            except KvCacheFullError:  # the candidates as they stand (a step is all or nothing)
                sys.stderr.write(f"\n[stopped at the context's end: --n-ctx {ctx.n_ctx}]\n")
                break
            for i, token in zip(list(running), drawn):
                if token.is_stop:
                    running.remove(i)
                else:
                    texts[i] += token.text
            progress.update(step + 1)
    order = sorted(range(len(forks)), key=lambda i: forks[i].perplexity)
    for rank, i in enumerate(order):
        mark = "best" if rank == 0 else f"#{rank + 1}"
        print(f"--- candidate {i} ({mark}, perplexity {forks[i].perplexity:.2f})")
        print(args.prompt + texts[i])


def _lenient_stdin() -> None:
    """Bytes on stdin that are not UTF-8 become U+FFFD (they ended the command with a codec
    error, the lines after them unread)."""
    if isinstance(sys.stdin, io.TextIOWrapper):
        sys.stdin.reconfigure(errors="replace")


async def _read_line() -> str:
    """A line of stdin without holding up the event loop, read by a daemon thread: Ctrl-C at
    the prompt ends the command at once (the default executor's thread would be waited for
    at exit, until the next Enter)."""
    loop = asyncio.get_running_loop()
    line: asyncio.Future[str] = loop.create_future()

    def deliver(text: str, error: Exception | None) -> None:
        if line.done():
            return
        if error is not None:
            line.set_exception(error)
        else:
            line.set_result(text)

    def read() -> None:
        text, error = "", None
        try:
            text = sys.stdin.readline()
        except Exception as exc:  # noqa: BLE001 (any: the awaiting task raises it)
            error = exc
        with contextlib.suppress(RuntimeError):  # the loop closed: nobody waits
            loop.call_soon_threadsafe(deliver, text, error)

    threading.Thread(target=read, daemon=True).start()
    return await line


async def cmd_chat(args: argparse.Namespace) -> int:
    """A warm multi-turn conversation: each turn prefills only what it adds."""
    model = resolve_model(args.model, fallback="chat")
    ctx = await open_context(model, n_ctx=args.n_ctx, n_seq_max=1)
    _lenient_stdin()
    interactive = sys.stdin.isatty()
    with ctx:
        # A long session shifts the context (keeping the system message), as llama.cpp's
        # own chat does, rather than end when it fills --n-ctx.
        chat = Chat(
            ctx,
            params=sampling_params(args),
            system=args.system or None,
            on_context_full="shift",
        )
        if interactive:
            print(f"chatting with {model.name}; /exit or Ctrl-D ends.", file=sys.stderr)
        while True:
            if interactive:
                sys.stdout.write("you> ")
                sys.stdout.flush()
            line = await _read_line()
            if not line:
                break
            content = line.strip()
            if content in ("/exit", "/quit"):
                break
            if not content:
                continue
            if interactive:
                sys.stdout.write("assistant> ")
            before = chat.prefilled_tokens
            # Closed here whatever happens (a reader gone: the context closes after it).
            stream = chat.stream(content, max_tokens=args.max_tokens)
            try:
                async with contextlib.aclosing(stream):
                    async for piece in stream:
                        sys.stdout.write(piece)
                        sys.stdout.flush()
            except KvCacheFullError as exc:  # this turn alone: the conversation goes on
                print(
                    f"\nkvfork: the turn does not fit (--n-ctx {ctx.n_ctx}): {exc}", file=sys.stderr
                )
                continue
            sys.stdout.write("\n")
            if args.verbose:
                added = chat.prefilled_tokens - before
                print(f"[prefilled {added} new tokens this turn]", file=sys.stderr)
    return 0


async def cmd_embed(args: argparse.Namespace) -> int:
    """Embeddings of TEXT arguments (or stdin lines) as JSON lines, or ranked by --rank."""
    _lenient_stdin()
    texts = list(args.text) or [line.rstrip("\n") for line in sys.stdin if line.strip()]
    if not texts:
        raise CliError("nothing to embed: give TEXT arguments or lines on stdin")
    model = resolve_model(args.model)
    queries = [args.rank] if args.rank is not None else []
    options = {"embeddings": True, "pooling": args.pooling, "n_seq_max": min(len(texts) + 1, 64)}
    ctx = await open_context(model, **options)
    with ctx:
        longest = max(len(ctx.tokenize(text)) for text in queries + texts)
        if longest > ctx.n_batch:  # one text is one batch: a context sized for the longest
            if longest > ctx.model.n_ctx_train:
                raise CliError(
                    f"a text has {longest} tokens; this model embeds at most "
                    f"{ctx.model.n_ctx_train} (split the text)"
                )
            ctx.close()
            ctx = await create_context(ctx.model, n_ctx=longest, n_batch=longest, **options)
        with ctx:
            vectors = await ctx.embed_batch(queries + texts, normalize=True)
    if args.rank is not None:
        scores = vectors[1:] @ vectors[0]
        for i in sorted(range(len(texts)), key=lambda i: -scores[i]):
            print(f"{scores[i]:+.4f}  {texts[i]}")
    else:
        for text, vector in zip(texts, vectors):
            print(json.dumps({"text": text, "embedding": [round(float(x), 6) for x in vector]}))
    return 0


async def cmd_perplexity(args: argparse.Namespace) -> int:
    """Perplexity of a text file (or stdin) as llama.cpp's `llama-perplexity` measures it:
    the text's tokens cut into chunks of --n-ctx, each decoded from the start of a context
    with its first token made BOS (where the model has one), the tokens of its second half
    after the first scored given everything before them."""
    _lenient_stdin()
    text = _read(args.file, lenient=True) if args.file else sys.stdin.read()
    n_ctx = args.n_ctx
    # The text and the limits first, on a small context: the chunks' is made for them.
    with await open_context(resolve_model(args.model), n_ctx=64) as small:
        model = small.model
        if n_ctx > model.n_ctx_train:
            raise CliError(
                f"--n-ctx {n_ctx} is more than this model was trained on ({model.n_ctx_train})"
            )
        bos = small.bos_token if small.tokenize("") else None  # a model that adds one
        tokens = small.tokenize(text)
    count = len(tokens) // n_ctx
    if args.max_chunks:
        count = min(count, args.max_chunks)
    if count == 0:
        raise CliError(
            f"the text has {len(tokens)} tokens: give at least --n-ctx ({n_ctx}), "
            "or a smaller --n-ctx"
        )
    with await create_context(model, n_ctx=n_ctx, n_batch=n_ctx) as ctx:
        first = n_ctx // 2
        logprobs: list[float] = []
        with Progress("scoring", total=count) as progress:
            for i in range(count):
                chunk = tokens[i * n_ctx : (i + 1) * n_ctx]
                if bos is not None:
                    chunk[0] = bos
                branch = Branch.create(ctx)
                await branch.prefill(chunk[: first + 1])
                logprobs += await branch.score(chunk[first + 1 :])
                await branch.prune()
                progress.update(i + 1)
    nll = -math.fsum(logprobs) / len(logprobs)
    # The standard error of the mean negative log-likelihood, carried to the perplexity.
    spread = math.sqrt(math.fsum((-lp - nll) ** 2 for lp in logprobs) / max(len(logprobs) - 1, 1))
    error = math.exp(nll) * spread / math.sqrt(len(logprobs))
    print(f"perplexity: {math.exp(nll):.4f} +/- {error:.4f}")
    print(f"{count} chunks of {n_ctx} tokens, {len(logprobs)} tokens scored")
    return 0


async def cmd_bench(args: argparse.Namespace) -> int:
    """Tokens per second for one sequence and for N forks in one decode per step, and how
    close the stepping loop runs to the bare `llama_decode` time."""
    model = resolve_model(args.model)
    widths = [1, *args.n] if 1 not in args.n else list(args.n)
    # Room for the widest step's forks beside the prompt (~170 tokens), as asked.
    n_ctx = max(2048, 512 + max(widths) * (args.steps + 2))
    ctx = await open_context(model, n_ctx=n_ctx, n_seq_max=max(widths) + 1)
    with ctx:
        root = Branch.create(ctx, 0, SamplingParams(temperature=0.0))
        prompt = ctx.tokenize("The history of the printing press begins with " * 16)
        start = time.perf_counter()
        await prefill(root, prompt, ctx.n_batch)
        print(
            f"prefill: {len(prompt)} tokens, {len(prompt) / (time.perf_counter() - start):.0f} tok/s"
        )
        print(f"{'forks':>6} {'tok/s':>8} {'ms/step':>8} {'decode share':>13}")
        store = BranchStore(ctx)
        for n in widths:
            forks = [await root.fork() for _ in range(n)]
            await store.step(forks)  # warm-up
            stats = ctx.stats()
            start = time.perf_counter()
            for _ in range(args.steps):
                await store.step(forks)
            elapsed = time.perf_counter() - start
            decode = ctx.stats()["decode_seconds"] - stats["decode_seconds"]
            rate = n * args.steps / elapsed
            print(f"{n:6d} {rate:8.0f} {1000 * elapsed / args.steps:8.1f} {decode / elapsed:12.1%}")
            for fork in forks:
                await fork.prune()
    return 0


async def cmd_info(args: argparse.Namespace) -> int:
    """The model's metadata and chat template, and what this build of llama.cpp runs on; with
    no model, the system and where the embedded models are."""
    if args.model is None:
        return _info_without_model(args)
    path = resolve_model(args.model)
    with Progress(f"loading {path.name}"):
        model = await asyncio.to_thread(Model.load, path)
    info: dict[str, Any] = {
        "name": model.name,
        "path": str(path),
        "size_bytes": path.stat().st_size,
        "vocab_size": model.vocab_size,
        "n_ctx_train": model.n_ctx_train,
        "n_embd": model.n_embd,
        "chat_template": model.chat_template,
        "metadata": model.metadata,
        "system": system_info(),
    }
    if args.json:
        print(json.dumps(info, indent=2))
        return 0
    for key in ("name", "path", "size_bytes", "vocab_size", "n_ctx_train", "n_embd"):
        print(f"{key:12} {info[key]}")
    print("\nmetadata:")
    for key, value in sorted(model.metadata.items()):
        shown = value if len(value) <= 80 else value[:77] + "..."
        print(f"  {key}: {shown}")
    template = model.chat_template
    print("\nchat template:", "none" if template is None else f"{len(template)} characters")
    if template is not None:
        print("  " + template.replace("\n", "\n  "))
    _print_system()
    return 0


def _chat_template(arg: str | None) -> str | None:
    """`--chat-template`: a file's text, or the argument itself (Jinja or a built-in name)."""
    if arg is None:
        return None
    file = Path(arg)
    return file.read_text() if file.is_file() else arg


def _check_address(host: str, port: int) -> None:
    """The address the server is to listen on can be bound, checked before the model loads
    (taken, it failed after the start-up line had announced it, exit status 3). The
    server binds it again itself, as uvicorn does (SO_REUSEADDR)."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except OSError as exc:
        raise CliError(f"--host {host!r}: {exc}") from None
    family, kind, proto, _, address = infos[0]
    with socket.socket(family, kind, proto) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(address)
        except OSError as exc:
            raise CliError(f"cannot listen on {host}:{port}: {exc.strerror}") from None


def _check_chat_template(ctx: Context, template: str | None) -> None:
    """A `--chat-template` must render a conversation: a misspelt built-in name or file path
    is read as a template's text, which would drop every message (a CliError instead)."""
    if template is None:
        return
    probe = "kvfork-probe-7f3a"
    try:
        chat = ctx.format_chat(
            [{"role": "user", "content": probe}], add_generation_prompt=True, template=template
        )
    except ChatTemplateError as exc:
        raise CliError(f"--chat-template: {exc}") from None
    if probe not in chat.prompt:
        raise CliError(
            f"--chat-template {template[:60]!r} does not render the messages: not a "
            "llama.cpp built-in name (chatml, gemma, llama3, ...), a file, or a Jinja "
            "template that shows them"
        )


async def cmd_serve(args: argparse.Namespace) -> int:
    """An OpenAI-compatible server; concurrent requests share prefixes and decodes. With
    ``--ray``, each request runs on one of ``--actors`` Ray actors, routed by prefix."""
    try:
        from .server import Generator, Prompts, Service, create_app
        from .server.adapters import Adapters, AdapterSpec
        from .server.backend import Backend
        from .server.generation import Spill
        from .server.metrics import Metrics
        from .server.process import run
        from .server.reasoning import Defaults
        from .server.warmup import wanted, warm_up
    except ImportError as exc:
        raise CliError(
            f"kvfork serve needs the server extra: pip install 'kvfork[server]' ({exc})"
        ) from exc
    if args.ray is None and (args.actors is not None or args.route is not None):
        raise CliError("--actors and --route apply to --ray")
    args.actors = args.actors or 2
    args.route = args.route or "affinity"
    _check_address(args.host, args.port)
    if args.ray is not None and args.n_batch is not None:
        raise CliError("--n-batch applies to a local server; the Ray actors use the default")
    for flag, size in (("--cache-ram", args.cache_ram), ("--cache-disk", args.cache_disk)):
        if not 0 <= size < MAX_CACHE_MIB:  # in bytes, below 2**63
            raise CliError(f"{flag} must be in [0, {MAX_CACHE_MIB}) MiB, got {size}")
    key = args.api_key
    if key is not None and not (key and key.isascii() and key.isprintable() and " " not in key):
        # Empty, or with a space or a letter a header cannot carry, no client could match it.
        raise CliError("--api-key must be a printable ASCII token without spaces")
    if args.ray is not None and (args.cache_ram or args.cache_dir is not None):
        raise CliError("--cache-ram and --cache-dir apply to a local server, not --ray")
    if args.ray is not None and args.lora:
        raise CliError("--lora applies to a local server, not --ray")
    if args.ray is not None and args.warmup == "on":
        raise CliError("--warmup on applies to a local server, not --ray")
    if args.ray is not None and args.device_sampling:
        raise CliError("--device-sampling applies to a local server, not --ray")
    try:
        lora_specs = [AdapterSpec.parse(text) for text in args.lora]
    except ValueError as exc:
        raise CliError(str(exc)) from None
    mib = 1 << 20
    spill = Spill(
        host_bytes=args.cache_ram * mib,
        disk_dir=args.cache_dir,
        disk_bytes=args.cache_disk * mib if args.cache_dir is not None else 0,
    )
    path = resolve_model(args.model)
    # Both counts pinned: an adaptive batch count would take every core (BENCHMARKS §10).
    options: dict[str, int | bool] = (
        {}
        if args.threads is None
        else dict.fromkeys(("n_threads", "n_threads_batch"), args.threads)
    )
    if args.n_batch is not None:
        options["n_batch"] = args.n_batch
    if args.device_sampling:
        options["device_sampling"] = True
    cluster = None
    adapters = None
    warmed: float | None = None
    if args.ray is None:
        ctx = await open_context(path, n_ctx=args.n_ctx, n_seq_max=args.n_seq_max, **options)
        try:
            adapters = await asyncio.to_thread(Adapters.load, ctx.model, lora_specs)
        except (ValueError, KvforkError) as exc:
            ctx.close()
            raise CliError(f"--lora: {exc}") from None
        if wanted(args.warmup):
            try:
                warmed = await warm_up(ctx)
            except KvforkError as exc:
                ctx.close()
                raise CliError(f"the warm-up failed (--warmup off skips it): {exc}") from None
    else:
        ctx = await open_context(path, n_ctx=512, n_seq_max=1)  # the front's tokenizer
    embed_ctx = None
    if args.embeddings:
        # --threads and --n-batch as for generation (an input may hold n_batch tokens).
        embed_options = {k: v for k, v in options.items() if k != "device_sampling"}
        n_ctx = max(EMBED_N_CTX, args.n_batch or 0)
        embed_ctx = await open_context(
            path, n_ctx=n_ctx, n_seq_max=8, embeddings=True, pooling="mean", **embed_options
        )
    template = _chat_template(args.chat_template)
    try:
        _check_chat_template(ctx, template)
    except CliError:
        ctx.close()
        if embed_ctx is not None:
            embed_ctx.close()
        raise
    prompts = Prompts(ctx, chat_template=template, embed_ctx=embed_ctx)
    metrics = Metrics()
    backend: Backend
    if args.ray is None:
        generator = Generator(ctx, max_queue=args.max_queue, spill=spill, adapters=adapters)
        backend = Service(prompts, generator, model_id=path.stem, metrics=metrics)
        where = f"n_ctx {ctx.n_ctx}, {ctx.n_seq_max} sequences"
        if adapters:
            where += ", LoRA " + ", ".join(spec.name for spec in adapters)
        if warmed is not None:
            where += f", warm-up {warmed:.2f} s"
    else:
        generator = None
        cluster = await _open_cluster(args, path, prompts, metrics)
        backend = cluster
        where = (
            f"{args.actors} Ray actors routed by {args.route}, each n_ctx {args.n_ctx}, "
            f"{args.n_seq_max} sequences"
        )
    app = create_app(
        backend,
        api_key=args.api_key,
        max_body_mb=args.max_body_mb,
        stall_seconds=args.stall_seconds,
        max_stored_responses=args.max_stored_responses,
        stored_responses_mb=args.stored_responses_mb,
        reasoning=Defaults(
            args.reasoning_format, args.reasoning_budget, args.reasoning_budget_message
        ),
    )
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("kvfork serve: %(levelname)s %(message)s"))
    logging.getLogger("kvfork.server").addHandler(handler)
    loop = type(asyncio.get_running_loop()).__module__.split(".")[0]
    print(
        f"kvfork serve: {path.name} on http://{args.host}:{args.port}/v1 ({where}; loop {loop})",
        file=sys.stderr,
        flush=True,
    )
    try:
        await run(
            app,
            host=args.host,
            port=args.port,
            log_level=args.log_level,
            graceful_seconds=args.shutdown_seconds,
            stop_admitting=backend.stop_admitting,
            end_all=backend.end_all,
        )
        if generator is not None and (held := generator.live_stats()["sequences_requests"]):
            log.warning("%d sequences still held by requests at shutdown", held)
        if generator is not None and spill.disk_dir is not None:
            kept = await asyncio.to_thread(generator.persist)
            print(f"kvfork serve: {kept} cache entries in {spill.disk_dir}", file=sys.stderr)
    finally:
        if cluster is not None:
            cluster.shutdown()
        ctx.close()
        if embed_ctx is not None:
            embed_ctx.close()
    return 0


async def _open_cluster(args: argparse.Namespace, path: Path, prompts: Any, metrics: Any) -> Any:
    """`kvfork serve --ray`: join (or start) the cluster, load the actors; requests' inputs
    from `prompts` (on this process's own small context)."""
    try:
        from .server.cluster import connect, open_cluster
    except ImportError as exc:
        raise CliError(f"kvfork serve --ray needs Ray: pip install 'kvfork[ray]' ({exc})") from exc
    try:
        connect(args.ray, args.actors * (args.threads or 1))
    except (ConnectionError, RuntimeError) as exc:
        raise CliError(f"cannot reach the Ray cluster at {args.ray!r}: {exc}") from exc
    with Progress(f"starting {args.actors} actors on {path.name}"):
        return await open_cluster(
            str(path),
            prompts,
            actors=args.actors,
            threads=args.threads,
            route=args.route,
            n_ctx=args.n_ctx,
            n_seq_max=args.n_seq_max,
            max_queue=args.max_queue,
            model_id=path.stem,
            metrics=metrics,
        )


def _info_without_model(args: argparse.Namespace) -> int:
    models = {
        alias: {"path": str(path), "present": path.is_file()}
        for alias, path in model_locations().items()
    }
    if args.json:
        info = {"version": __version__, "models": models, "system": system_info()}
        print(json.dumps(info, indent=2))
        return 0
    print(f"kvfork {__version__}\n\nmodels (MODEL may be a GGUF path or one of these):")
    for alias, where in models.items():
        state = "present" if where["present"] else "prepared on first use"
        print(f"  {alias:8} {where['path']} ({state})")
    _print_system()
    print("\n`kvfork info MODEL` shows a model's metadata and chat template.")
    return 0


def _print_system() -> None:
    print("\nsystem:")
    for key, value in system_info().items():
        print(f"  {key}: {value}")


# --- the parser -----------------------------------------------------------------------------


def _int_in(low: int, high: int | None = None) -> Callable[[str], int]:
    """An argparse type: an int in [low, high], else a usage error naming the range (a port
    past 65535 was wrapped around by the event loop, a negative count ran a broken loop)."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not an int: {text!r}") from None
        if value < low or (high is not None and value > high):
            bound = f"in [{low}, {high}]" if high is not None else f"at least {low}"
            raise argparse.ArgumentTypeError(f"must be {bound}, got {value}")
        return value

    parse.__name__ = "int"  # argparse names the type in its messages
    return parse


def _float_from(
    low: float, *, above: bool = False, high: float = math.inf
) -> Callable[[str], float]:
    """An argparse type: a finite float at least `low` (above it with `above`) and at most
    `high`, else a usage error (an infinite grace period overflowed uvicorn's deadline: a
    traceback)."""
    if high < math.inf:
        wanted = f"must be in [{low:g}, {high:g}]"
    elif low > -math.inf:
        wanted = f"must be a finite number {'above' if above else 'at least'} {low:g}"
    else:
        wanted = "must be a finite number"

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
        if not math.isfinite(value) or not low <= value <= high or (above and value == low):
            raise argparse.ArgumentTypeError(f"{wanted}, got {text}")
        return value

    parse.__name__ = "float"
    return parse


def _directory(text: str) -> Path:
    """An argparse type: a directory's path, made if missing (empty, it was the current
    directory; a file's path failed later with "File exists")."""
    if not text:
        raise argparse.ArgumentTypeError("empty: give a directory")
    path = Path(text)
    if path.exists() and not path.is_dir():
        raise argparse.ArgumentTypeError(f"{text!r} is not a directory")
    return path


_directory.__name__ = "directory"


def _widths(text: str) -> list[int]:
    """`bench --n`: comma-separated fork counts, each in [1, 255] (a sequence each, and one more)."""
    return [_int_in(1, 255)(part) for part in text.split(",")]


def _sampling_options(parser: argparse.ArgumentParser, temperature: float) -> None:
    group = parser.add_argument_group("sampling")
    group.add_argument("--temperature", type=_float_from(-math.inf), default=temperature)
    group.add_argument("--top-k", type=_int_in(0), default=40)
    group.add_argument("--top-p", type=_float_from(0, high=1), default=0.95)
    group.add_argument("--min-p", type=_float_from(0, high=1), default=0.05)
    group.add_argument("--repeat-penalty", type=_float_from(0, above=True), default=1.0)
    group.add_argument("--seed", type=_int_in(0, 2**32 - 1), default=1)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvfork",
        description="Forkable, batched llama.cpp inference. MODEL: a GGUF file, "
        "or 'default' (Gemma 3 270M) or 'chat' (SmolLM2-135M-Instruct).",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    demo = sub.add_parser("demo", help="N forks of one prompt, one decode per step, live")
    demo.add_argument("--model", default=None, help="GGUF file or alias (default: default)")
    demo.add_argument("--n", type=_int_in(1), default=8, help="number of forks (default 8)")
    demo.add_argument("--max-tokens", type=_int_in(1), default=32)
    demo.add_argument("--prompt", default=_demo.DEFAULT_PROMPT)
    demo.set_defaults(run=cmd_demo)

    gen = sub.add_parser("generate", help="generate a continuation of PROMPT")
    gen.add_argument("model", help="GGUF file, 'default' or 'chat'")
    gen.add_argument("prompt")
    gen.add_argument(
        "--n", type=_int_in(1, 255), default=1, help="candidates; >1 ranks them by perplexity"
    )
    gen.add_argument("--max-tokens", type=_int_in(0), default=128)
    gen.add_argument("--n-ctx", type=_int_in(1), default=4096)
    constraint = gen.add_mutually_exclusive_group()
    constraint.add_argument("--json-schema", metavar="FILE", help="output follows this schema")
    constraint.add_argument("--grammar", metavar="FILE", help="output follows this GBNF grammar")
    gen.add_argument(
        "--draft", choices=["prompt-lookup"], help="exact speculative decoding from this source"
    )
    _sampling_options(gen, temperature=0.8)
    gen.set_defaults(run=cmd_generate)

    chat = sub.add_parser("chat", help="multi-turn chat (stdin lines are turns when piped)")
    chat.add_argument("model", nargs="?", default=None, help="GGUF file (default: chat)")
    chat.add_argument(
        "--system",
        default=HELPFUL_ASSISTANT,
        help=f"the system message (default: {HELPFUL_ASSISTANT!r}, which the small chat model "
        "follows; '' for none, i.e. the template's own)",
    )
    chat.add_argument("--max-tokens", type=_int_in(0), default=256)
    chat.add_argument("--n-ctx", type=_int_in(1), default=4096)
    chat.add_argument("--verbose", action="store_true", help="tokens prefilled per turn")
    _sampling_options(chat, temperature=0.0)
    chat.set_defaults(run=cmd_chat)

    embed = sub.add_parser("embed", help="embeddings of TEXT arguments or stdin lines")
    embed.add_argument("model", help="GGUF file, 'default' or 'chat'")
    embed.add_argument("text", nargs="*")
    embed.add_argument("--rank", metavar="QUERY", help="print the texts ranked by similarity")
    embed.add_argument("--pooling", default="mean", choices=["mean", "cls", "last"])
    embed.set_defaults(run=cmd_embed)

    ppl = sub.add_parser(
        "perplexity", help="perplexity of a text file, as llama-perplexity measures it"
    )
    ppl.add_argument("model", help="GGUF file, 'default' or 'chat'")
    ppl.add_argument("file", nargs="?", help="a text file (default: stdin)")
    ppl.add_argument(
        "--n-ctx", type=_int_in(16, 65536), default=512, help="chunk size in tokens (512)"
    )
    ppl.add_argument("--max-chunks", type=_int_in(0), default=0, help="at most this many (0: all)")
    ppl.set_defaults(run=cmd_perplexity)

    bench = sub.add_parser("bench", help="tokens/s: one sequence against N forks")
    bench.add_argument("model", nargs="?", default=None, help="GGUF file (default: default)")
    bench.add_argument(
        "--n", type=_widths, default=[4, 8], help="fork counts, e.g. 4,8,16 (default 4,8)"
    )
    bench.add_argument("--steps", type=_int_in(1), default=16)
    bench.set_defaults(run=cmd_bench)

    serve = sub.add_parser("serve", help="an OpenAI-compatible server (needs kvfork[server])")
    serve.add_argument("model", help="GGUF file, 'default' or 'chat'")
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=_int_in(1, 65535), default=8000)
    serve.add_argument(
        "--n-ctx",
        type=_int_in(1),
        default=20480,
        help="KV cells shared by every request (default: 16 x ~1,250 tokens)",
    )
    serve.add_argument(
        "--n-seq-max",
        type=_int_in(1),
        default=32,
        help="sequences: requests' choices plus prefix-cache entries",
    )
    serve.add_argument(
        "--n-batch",
        type=_int_in(1),
        default=None,
        help="tokens one decode holds (default 512): prompt chunks and the running streams' "
        "steps share it, so a stream waits at most one such decode while prompts arrive",
    )
    serve.add_argument(
        "--cache-ram",
        type=int,
        default=0,
        metavar="MIB",
        help="host memory for prefix-cache entries evicted from the KV (default 0: dropped); "
        "a prompt matching one is copied back instead of prefilled",
    )
    serve.add_argument(
        "--cache-dir",
        type=_directory,
        default=None,
        help="a directory for entries host memory cannot hold, written there at shutdown too: "
        "a restarted server finds them",
    )
    serve.add_argument(
        "--cache-disk",
        type=int,
        default=4096,
        metavar="MIB",
        help="disk the --cache-dir entries may take (default 4096)",
    )
    serve.add_argument(
        "--max-queue",
        type=_int_in(0),
        default=64,
        help="requests that may wait for a sequence before 503",
    )
    serve.add_argument(
        "--device-sampling",
        action="store_true",
        help="find each output's best 64 logits on the device (a GPU) and copy back only "
        "those, for requests that draw from them (temperature 0, or top_k 1 to 64); the "
        "others (the default top_k 0: the whole vocabulary; penalties, logit_bias, "
        "response_format) get whole rows as without it (create_context(device_sampling=))",
    )
    serve.add_argument(
        "--api-key",
        default=None,
        help="require 'Authorization: Bearer KEY' (all but /health and /metrics)",
    )
    serve.add_argument(
        "--loop",
        choices=["auto", "uvloop", "asyncio"],
        default="auto",
        help="the event loop: uvloop where installed (auto; kvfork[server] installs it), "
        "else asyncio's",
    )
    serve.add_argument(
        "--warmup",
        choices=["auto", "on", "off"],
        default="auto",
        help="run each decode shape once before serving, so the first requests do not load "
        "the device's kernels (auto: only when layers are on a GPU)",
    )
    serve.add_argument(
        "--chat-template",
        default=None,
        help="a Jinja template (text or file) or a llama.cpp built-in name",
    )
    serve.add_argument(
        "--embeddings",
        action="store_true",
        help="also serve /v1/embeddings (a second, embedding context)",
    )
    serve.add_argument(
        "--threads",
        type=_int_in(1),
        default=None,
        help="threads of each context, batches included (default: adaptive)",
    )
    serve.add_argument(
        "--ray",
        metavar="ADDRESS",
        default=None,
        help="run requests on Ray actors: a cluster address, 'auto' (the cluster on this "
        "machine) or 'local' (start one here); needs kvfork[ray]",
    )
    serve.add_argument(
        "--actors",
        type=_int_in(1),
        default=None,
        help="with --ray: actors, each its own context (default 2)",
    )
    serve.add_argument(
        "--route",
        choices=["affinity", "hash", "random"],
        default=None,
        help="with --ray: by the longest prefix an actor holds (default), a consistent hash "
        "of the prompt's leading block, or at random",
    )
    serve.add_argument(
        "--max-body-mb",
        type=_float_from(0, above=True),
        default=16,
        help="largest request body in MiB; larger ones get 413 before they are read (default 16)",
    )
    serve.add_argument(
        "--stall-seconds",
        type=_float_from(0, above=True),
        default=30,
        help="/health reports 'degraded' (503) once requests have waited this long with none "
        "admitted (default 30)",
    )
    serve.add_argument(
        "--shutdown-seconds",
        type=_float_from(0),
        default=10,
        help="on SIGTERM or Ctrl-C, how long requests in flight may run before they are "
        "cancelled (default 10)",
    )
    serve.add_argument(
        "--lora",
        metavar="NAME=PATH[:SCALE]",
        action="append",
        default=[],
        help="a LoRA adapter requests may choose by name (their `lora` field, or `model`: "
        "NAME); repeatable; SCALE defaults to 1",
    )
    serve.add_argument(
        "--max-stored-responses",
        type=_int_in(0),
        default=1000,
        metavar="N",
        help="/v1/responses kept for GET and previous_response_id, least recently used "
        "dropped first (default 1000; 0 keeps none)",
    )
    serve.add_argument(
        "--stored-responses-mb",
        type=_float_from(0),
        default=64,
        metavar="MIB",
        help="memory those stored responses and their conversations may take (default 64)",
    )
    serve.add_argument(
        "--reasoning-format",
        choices=["auto", "deepseek", "deepseek-legacy", "none"],
        default="auto",
        help="chat replies: a think block's text in message.reasoning_content (auto, deepseek), "
        "there and in content with its markup (deepseek-legacy), or left in content (none)",
    )
    serve.add_argument(
        "--reasoning-budget",
        type=_int_in(-1, 1 << 20),  # as a request's own
        default=-1,
        metavar="N",
        help="tokens a chat reply may think before the end of its think block is forced and "
        "it answers: -1 unlimited (default), 0 at once; a request's reasoning_budget overrides",
    )
    serve.add_argument(
        "--reasoning-budget-message",
        default="",
        metavar="TEXT",
        help="text forced before the end marker when the reasoning budget is spent",
    )
    serve.add_argument(
        "--log-level",
        default="warning",
        type=str.lower,
        choices=["critical", "error", "warning", "info", "debug", "trace"],
        help="the server's and uvicorn's log level",
    )
    serve.set_defaults(run=cmd_serve)

    info = sub.add_parser("info", help="model metadata, chat template, system info")
    info.add_argument(
        "model", nargs="?", default=None, help="GGUF file, 'default' or 'chat' (none: the system)"
    )
    info.add_argument("--json", action="store_true", help="one JSON object")
    info.set_defaults(run=cmd_info)
    return parser


if __name__ == "__main__":
    sys.exit(main())
