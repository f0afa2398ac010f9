"""Bad-input sweep: every public call with wrong types, out-of-range values, NaN/inf, huge and
empty inputs, malformed grammars and schemas, broken GGUF files. Each raises the documented
exception (a TypeError names the argument) and the process lives on; the dangerous ones run in a subprocess that must exit
normally (an abort inside llama.cpp would kill the test runner otherwise)."""

# This file passes wrong types on purpose: mypy's argument checks are what it tests at run time.
# mypy: disable-error-code="arg-type, list-item, dict-item, call-overload, call-arg"

from __future__ import annotations

import math
import os
import struct
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import kvfork
import numpy as np
import pytest

from ..conftest import GREEDY, root
from ..gguf_patch import read_layout

Case = tuple[str, Callable[[], Any], type[BaseException] | tuple[type[BaseException], ...], str]


def _branch_cases(ctx: kvfork.Context) -> list[Case]:
    b = root(ctx)
    vocab = ctx.vocab_size
    other_ctx = kvfork.create_context_sync(ctx.model, n_ctx=256, n_seq_max=1)
    foreign = kvfork.Branch.create(other_ctx, 0, GREEDY)
    store = kvfork.BranchStore(ctx)
    big = 2**70
    schedule = kvfork._native.SpeculativeSchedule(8)
    pending = b.produce_sync()
    return [
        # construction
        ("Branch()", lambda: kvfork.Branch(), TypeError, "Branch.create"),
        ("Context()", lambda: kvfork.Context(), TypeError, "create_context"),
        ("create position<0", lambda: kvfork.Branch.create(ctx, -1), ValueError, "position"),
        ("create position>=n_ctx", lambda: kvfork.Branch.create(ctx, 10**6), ValueError, ""),
        ("create position huge", lambda: kvfork.Branch.create(ctx, big), ValueError, "position"),
        ("create params int", lambda: kvfork.Branch.create(ctx, 0, 5), TypeError, "params"),
        ("create params key", lambda: kvfork.Branch.create(ctx, 0, {"tmp": 1}), ValueError, ""),
        (
            "create bad grammar",
            lambda: kvfork.Branch.create(ctx, 0, grammar="root ::= foo"),
            kvfork.GrammarError,
            "",
        ),
        ("create ctx=None", lambda: kvfork.Branch.create(None, 0), TypeError, ""),
        # decoding
        ("prefill str", lambda: b.prefill_sync("hello"), TypeError, "tokens"),
        ("prefill floats", lambda: b.prefill_sync([1.5, 2.5]), TypeError, "tokens"),
        ("prefill nested", lambda: b.prefill_sync([[1, 2]]), TypeError, "tokens"),
        ("prefill token<0", lambda: b.prefill_sync([1, -1]), ValueError, "token"),
        ("prefill token>=vocab", lambda: b.prefill_sync([vocab]), ValueError, "token"),
        ("prefill token huge", lambda: b.prefill_sync([big]), ValueError, "token"),
        ("prefill 2-D array", lambda: b.prefill_sync(np.ones((2, 2), np.int64)), ValueError, "1-D"),
        ("prefill float array", lambda: b.prefill_sync(np.ones(3)), TypeError, ""),
        (
            "prefill past n_ctx",
            lambda: b.prefill_sync([1] * (ctx.n_ctx + 1)),
            kvfork.KvCacheFullError,
            "",
        ),
        ("commit token<0", lambda: b.commit_sync(-1), ValueError, "token"),
        ("commit token>=vocab", lambda: b.commit_sync(vocab), ValueError, "token"),
        ("commit str", lambda: b.commit_sync("a"), TypeError, "token"),
        ("commit float", lambda: b.commit_sync(1.0), TypeError, "token"),
        ("commit None", lambda: b.commit_sync(None), TypeError, "token"),
        ("accept token>=vocab", lambda: b.accept(vocab), ValueError, "token"),
        ("generate max<0", lambda: b.generate(max_tokens=-1), ValueError, "max_tokens"),
        ("generate_sync max str", lambda: b.generate_sync(max_tokens="3"), TypeError, ""),
        # sampler control
        ("reseed -1", lambda: b.reseed_sampler(-1), ValueError, "seed"),
        ("reseed 2**32", lambda: b.reseed_sampler(2**32), ValueError, "seed"),
        ("fork seed -1", lambda: b.fork_sync(seed=-1), ValueError, "seed"),
        ("set params bad", lambda: b.set_sampler_params({"top_p": 2.0}), ValueError, "top_p"),
        ("set params type", lambda: b.set_sampler_params(3), TypeError, "params"),
        ("grammar undefined rule", lambda: b.set_grammar("root ::= foo"), kvfork.GrammarError, ""),
        ("grammar syntax", lambda: b.set_grammar("root ::= (("), kvfork.GrammarError, ""),
        ("grammar NUL", lambda: b.set_grammar('root ::= "a\0"'), kvfork.GrammarError, "NUL"),
        (
            "lazy grammar blank",
            lambda: b.set_grammar_lazy("  ", ["x"]),
            kvfork.GrammarError,
            "empty",
        ),
        ("grammar int", lambda: b.set_grammar(5), TypeError, ""),
        (
            "lazy bad regex",
            lambda: b.set_grammar_lazy('root ::= "a"', [], patterns=["("]),
            kvfork.GrammarError,
            "",
        ),
        (
            "lazy bad trigger token",
            lambda: b.set_grammar_lazy('root ::= "a"', [vocab]),
            ValueError,
            "token",
        ),
        (
            "lazy trigger type",
            lambda: b.set_grammar_lazy('root ::= "a"', [1.5]),
            TypeError,
            "triggers",
        ),
        (
            "lazy triggers a str",
            lambda: b.set_grammar_lazy('root ::= "a"', "abc"),
            TypeError,
            "not a str",
        ),
        (
            "lazy trigger bool",
            lambda: b.set_grammar_lazy('root ::= "a"', [True]),
            TypeError,
            "not bool",
        ),
        ("bias not dict", lambda: b.set_logit_bias([(1, 1.0)]), TypeError, "dict"),
        ("bias key str", lambda: b.set_logit_bias({"a": 1.0}), TypeError, "token"),
        ("bias key range", lambda: b.set_logit_bias({vocab: 1.0}), ValueError, "token"),
        ("bias NaN", lambda: b.set_logit_bias({1: math.nan}), ValueError, "bias"),
        ("bias +inf", lambda: b.steer({1: math.inf}), ValueError, "bias"),
        ("steer value str", lambda: b.steer({1: "x"}), TypeError, "float"),
        # metrics and logits
        ("entropy base", lambda: b.entropy("decibans"), ValueError, "base"),
        ("surprisal token", lambda: b.surprisal(-3), ValueError, "token"),
        ("surprisal token huge", lambda: b.surprisal(big), ValueError, "token"),
        ("logprob token huge", lambda: b.logprob(-big), ValueError, "token"),
        ("commit token huge", lambda: b.commit_sync(big), ValueError, "token"),
        ("Token() id huge", lambda: kvfork.Token(big, "x", False), ValueError, "token"),
        (
            "control vector layers huge",
            lambda: b.set_control_vector(None, layers=(0, big)),
            ValueError,
            "layers",
        ),
        ("set_logits length", lambda: b.set_logits(np.zeros(10, np.float32)), ValueError, "logits"),
        (
            "set_logits NaN",
            lambda: b.set_logits(np.full(vocab, np.nan, np.float32)),
            ValueError,
            "NaN",
        ),
        ("set_logits float64", lambda: b.set_logits(np.zeros(vocab)), ValueError, "float32"),
        ("set_logits 2-D", lambda: b.set_logits(np.zeros((2, vocab), np.float32)), ValueError, ""),
        ("set_logits list", lambda: b.set_logits([0.0] * 4), ValueError, "float32"),
        # store
        ("store ctx type", lambda: kvfork.BranchStore(5), TypeError, ""),
        ("store commit non-branch", lambda: store.commit_sync([(5, 1)]), TypeError, "Branch"),
        ("store commit shape", lambda: store.commit_sync([b]), TypeError, "pairs"),
        (
            "store commit duplicate",
            lambda: store.commit_sync([(b, 1), (b, 2)]),
            ValueError,
            "twice",
        ),
        (
            "store commit foreign",
            lambda: store.commit_sync([(foreign, 1)]),
            ValueError,
            "another context",
        ),
        ("store commit token", lambda: store.commit_sync([(b, vocab)]), ValueError, "token"),
        ("store prefill shape", lambda: store.prefill_sync([(b,)]), TypeError, "pairs"),
        ("store step foreign", lambda: store.step_sync([foreign]), ValueError, "another context"),
        ("store step non-iterable", lambda: store.step_sync(5), TypeError, ""),
        (
            "store retain foreign",
            lambda: store.retain_only_sync(foreign),
            ValueError,
            "another context",
        ),
        # context
        ("tokenize int", lambda: ctx.tokenize(5), TypeError, ""),
        ("detokenize range", lambda: ctx.detokenize([vocab]), ValueError, "token"),
        ("detokenize str", lambda: ctx.detokenize("abc"), TypeError, "tokens"),
        ("token_to_text range", lambda: ctx.token_to_text(-1), ValueError, "token"),
        ("is_stop_token huge", lambda: ctx.is_stop_token(big), ValueError, "token"),
        ("token_to_text huge", lambda: ctx.token_to_text(big), ValueError, "token"),
        ("token_to_bytes huge", lambda: ctx.token_to_bytes(-big), ValueError, "token"),
        ("kv copy seq range", lambda: ctx.kv_seq_copy(0, ctx.n_seq_max), ValueError, "seq"),
        ("kv copy seq<0", lambda: ctx.kv_seq_copy(-1, 0), ValueError, "src"),
        ("kv remove p0<-1", lambda: ctx.kv_seq_remove(0, -5), ValueError, "p0"),
        ("kv keep range", lambda: ctx.kv_seq_keep(10**6), ValueError, "seq"),
        ("kv pos_max range", lambda: ctx.kv_seq_pos_max_sync(ctx.n_seq_max), ValueError, "seq"),
        # the raw layer and snapshots
        ("decode str", lambda: ctx.decode_sync("abc", 0, 1), TypeError, "tokens"),
        ("decode seq_id str", lambda: ctx.decode_sync([1], 0, "1"), TypeError, "seq_id"),
        ("decode seq_id range", lambda: ctx.decode_sync([1], 0, 256), ValueError, "seq_id"),
        ("decode seq_id huge", lambda: ctx.decode_sync([1], 0, big), ValueError, "seq_id"),
        ("decode position huge", lambda: ctx.decode_sync([1], big, 1), ValueError, "position"),
        ("decode token<0", lambda: ctx.decode_sync([-1], 0, 1), ValueError, "token"),
        ("decode empty", lambda: ctx.decode_sync([], 0, 1), ValueError, "tokens"),
        ("decode held", lambda: ctx.decode_sync([1], 0, b.seq_id), ValueError, "held"),
        ("create seq_id<0", lambda: kvfork.Branch.create(ctx, 0, seq_id=-1), ValueError, "seq_id"),
        ("create seq_id str", lambda: kvfork.Branch.create(ctx, 0, seq_id="0"), TypeError, ""),
        ("create seq_id range", lambda: kvfork.Branch.create(ctx, 0, seq_id=99), ValueError, ""),
        ("fork seq_id range", lambda: b.fork_sync(seq_id=2**31), ValueError, "seq_id"),
        ("fork seq_id held", lambda: b.fork_sync(seq_id=b.seq_id), kvfork.LeaseExhaustedError, ""),
        (
            "capture none",
            lambda: kvfork.Branch.create(ctx).capture_logits(),
            kvfork.KvforkError,
            "",
        ),
        ("decode one token", lambda: b.decode_and_capture_one_sync(vocab), ValueError, "token"),
        ("model_entropy base", lambda: ctx.model_entropy("dB"), ValueError, "base"),
        ("model_surprisal token", lambda: ctx.model_surprisal(-1), ValueError, "token"),
        ("model_surprisal huge", lambda: ctx.model_surprisal(big), ValueError, "token"),
        ("restore str", lambda: ctx.restore_sync("x"), TypeError, "data"),
        ("restore junk", lambda: ctx.restore_sync(b"\xff" * 99), kvfork.StateFileError, ""),
        ("branch restore None", lambda: kvfork.Branch.restore_sync(ctx, None), TypeError, "data"),
        # module
        ("schema not JSON", lambda: kvfork.json_schema_to_grammar("{"), kvfork.GrammarError, ""),
        ("schema type", lambda: kvfork.json_schema_to_grammar(5), TypeError, "schema"),
        (
            "schema bad type",
            lambda: kvfork.json_schema_to_grammar({"type": "bogus"}),
            kvfork.GrammarError,
            "",
        ),
        ("params seed -1", lambda: kvfork.SamplingParams(seed=-1), ValueError, "seed"),
        ("params seed str", lambda: kvfork.SamplingParams(seed="1"), TypeError, "seed"),
        ("params top_k huge", lambda: kvfork.SamplingParams(top_k=2**40), ValueError, "top_k"),
        (
            "params temp NaN",
            lambda: kvfork.SamplingParams(temperature=math.nan),
            ValueError,
            "temperature",
        ),
        ("params unknown", lambda: kvfork.SamplingParams(temprature=1.0), ValueError, "temprature"),
        # the speculative schedule's counts (low level: `generate(draft=...)` drives it)
        ("schedule took -1", lambda: schedule.took(-1, 0, pending), ValueError, "drafted"),
        ("schedule took huge", lambda: schedule.took(1, big, pending), ValueError, "accepted"),
        ("schedule proposed len<0", lambda: schedule.proposed([1], -1), ValueError, "len"),
        (
            "schedule proposed token",
            lambda: schedule.proposed([big], 1),
            (ValueError, OverflowError),
            "",
        ),
    ]


def test_bad_inputs_raise_the_documented_exception(ctx: kvfork.Context) -> None:
    failures = []
    for name, call, exc, match in _branch_cases(ctx):
        try:
            call()
        except exc as e:
            if match and match.lower() not in str(e).lower():
                failures.append(f"{name}: message {str(e)!r} lacks {match!r}")
        except BaseException as e:  # noqa: BLE001 - reported below
            failures.append(f"{name}: {type(e).__name__}: {e}")
        else:
            failures.append(f"{name}: no exception")
    assert not failures, "\n".join(failures)
    # and the context still works
    assert len(ctx.tokenize("still alive")) > 0
    b = root(ctx)
    b.commit_sync(b.produce_sync().token)


def test_disposed_branch_raises_on_every_use(ctx: kvfork.Context) -> None:
    b = root(ctx)
    b.prune_sync()
    uses: list[Callable[[], Any]] = [
        lambda: b.prefill_sync([1]),
        lambda: b.produce_sync(),
        lambda: b.commit_sync(1),
        lambda: b.sample(),
        lambda: b.accept(1),
        lambda: b.fork_sync(),
        lambda: b.fork_sync(seq_id=5),
        lambda: b.capture_logits(),
        lambda: b.decode_and_capture_one_sync(1),
        lambda: b.snapshot_sync(),
        lambda: b.position,
        lambda: b.perplexity,
        lambda: b.entropy(),
        lambda: b.logits(),
        lambda: b.set_grammar(None),
        lambda: b.steer({1: 1.0}),
        lambda: next(iter(b.generate_sync())),
        lambda: kvfork.BranchStore(ctx).step_sync([b]),
        lambda: kvfork.BranchStore(ctx).retain_only_sync(b),
    ]
    for use in uses:
        with pytest.raises(kvfork.BranchDisposedError):
            use()
    b.prune_sync()  # a second prune is a no-op
    b.destroy()  # and so is a destroy after it


def test_closed_context_raises_on_every_use(model: kvfork.Model) -> None:
    ctx = kvfork.create_context_sync(model, n_ctx=256, n_seq_max=2)
    b = root(ctx)
    ctx.close()
    uses: list[Callable[[], object]] = [
        lambda: kvfork.Branch.create(ctx, 0),
        lambda: b.commit_sync(1),
        lambda: b.prefill_sync([1]),
        lambda: ctx.tokenize("x"),
        lambda: ctx.kv_clear(),
        lambda: ctx.kv_seq_pos_max_sync(0),
        lambda: ctx.decode_sync([1], 0, 1),
        lambda: ctx.model_entropy(),
        lambda: ctx.snapshot_sync(),
        lambda: kvfork.Branch.create(ctx, 3, seq_id=1),
        lambda: kvfork.BranchStore(ctx).step_sync([b]),
        lambda: ctx.__enter__(),  # `with ctx:` refused at once, not at its first call
        lambda: ctx.__aenter__(),
    ]
    for use in uses:
        with pytest.raises(kvfork.KvforkError):
            use()
    ctx.close()  # idempotent


@pytest.mark.parametrize(
    ("name", "value", "exc"),
    [
        ("n_ctx", -1, ValueError),
        ("n_ctx", 0, ValueError),
        ("n_ctx", 2**70, ValueError),
        ("n_ctx", "4096", TypeError),
        ("n_batch", -8, ValueError),
        ("n_batch", 0, ValueError),
        ("n_seq_max", -1, ValueError),
        ("n_seq_max", 0, ValueError),
        ("n_seq_max", 257, ValueError),
        ("n_threads", 0, ValueError),
        ("n_threads", -2, ValueError),
        ("type_k", "q7_z", ValueError),
        ("type_v", 5, TypeError),
        ("pooling", "median", ValueError),
        ("n_gpu_layers", -7, ValueError),
    ],
)
def test_create_context_rejects_bad_options_by_name(
    model: kvfork.Model, name: str, value: object, exc: type[BaseException]
) -> None:
    with pytest.raises(exc, match=name):
        kvfork.create_context_sync(model, **{name: value})


def test_create_context_rejects_non_model(model: kvfork.Model) -> None:
    with pytest.raises(TypeError, match="path_or_model"):
        kvfork.create_context_sync(123)
    with pytest.raises(kvfork.ModelLoadError):
        kvfork.create_context_sync("/nonexistent/model.gguf")


# ---- dangerous inputs: each in a subprocess that must exit normally


def run_isolated(body: str, timeout: float = 300) -> str:
    """Run `body` in a fresh interpreter (kvfork imported, MODEL = the default model's path);
    fail unless it exits 0. Returns its stdout."""
    code = "import kvfork, numpy as np\nMODEL = kvfork.default_model_path()\n" + textwrap.dedent(
        body
    )
    out = subprocess.run(
        [sys.executable, "-c", code], check=False, capture_output=True, text=True, timeout=timeout
    )
    assert out.returncode == 0, f"exit {out.returncode}\n{out.stdout}\n{out.stderr[-3000:]}"
    return out.stdout


def test_broken_gguf_files_raise_model_load_error(tmp_path: Path) -> None:
    real = kvfork.default_model_path().read_bytes()
    rng = np.random.default_rng(0)
    files = {
        "empty.gguf": b"",
        "magic_only.gguf": b"GGUF",
        "random.gguf": rng.bytes(4096),
        "magic_random.gguf": b"GGUF" + rng.bytes(4096),
        "header_only.gguf": real[:64],
        "truncated_meta.gguf": real[:100_000],
        "truncated_tensors.gguf": real[: len(real) // 2],
        "flipped.gguf": real[:24] + bytes(b ^ 0xFF for b in real[24:4096]) + real[4096:1_000_000],
        "huge_counts.gguf": real[:8] + (2**62).to_bytes(8, "little") * 2 + real[24:4096],
    }
    for name, data in files.items():
        (tmp_path / name).write_bytes(data)
    (tmp_path / "a_directory.gguf").mkdir()
    out = run_isolated(
        f"""
        import os
        for name in sorted(os.listdir({str(tmp_path)!r})):
            try:
                kvfork.Model.load(os.path.join({str(tmp_path)!r}, name))
                print(name, "LOADED")
            except kvfork.ModelLoadError:
                print(name, "ModelLoadError")
        """
    )
    lines = dict(line.split() for line in out.splitlines())
    assert set(lines) == {*files, "a_directory.gguf"}
    assert all(v == "ModelLoadError" for v in lines.values()), lines


def _malformed_models(real: bytes) -> dict[str, bytes]:
    """Files that parse as GGUF but hold values llama.cpp aborts on (at load or first decode)."""
    layout = read_layout(real)
    arch = "gemma3"

    def patched(offset: int, value: bytes) -> bytes:
        return real[:offset] + value + real[offset + len(value) :]

    block_count, _ = layout.values[f"{arch}.block_count"]
    eps, _ = layout.values[f"{arch}.attention.layer_norm_rms_epsilon"]
    norm_type = layout.tensor_types["blk.0.attn_norm.weight"]
    tokens = layout.strings["tokenizer.ggml.tokens"]
    # two different tokens of the same byte length: make the second a copy of the first
    by_len: dict[int, tuple[int, int]] = {}
    dup = None
    for off, n in tokens[1000:]:
        if n in by_len and real[by_len[n][0] : by_len[n][0] + n] != real[off : off + n]:
            dup = (by_len[n][0], off, n)
            break
        by_len.setdefault(n, (off, n))
    assert dup is not None
    src, dst, n = dup
    return {
        "zero_layers.gguf": patched(block_count, struct.pack("<I", 0)),
        "too_many_layers.gguf": patched(block_count, struct.pack("<I", 100_000)),
        "nan_eps.gguf": patched(eps, struct.pack("<f", math.nan)),
        "negative_eps.gguf": patched(eps, struct.pack("<f", -1e-6)),
        "i32_norm.gguf": patched(norm_type, struct.pack("<I", 26)),  # same size as f32
        "duplicate_token.gguf": patched(dst, real[src : src + n]),
    }


def test_malformed_but_parseable_gguf_files_are_refused(tmp_path: Path) -> None:
    real = kvfork.default_model_path().read_bytes()
    for name, data in _malformed_models(real).items():
        path = tmp_path / name
        path.write_bytes(data)
        out = run_isolated(
            f"""
            try:
                m = kvfork.Model.load({str(path)!r})
                ctx = kvfork.create_context_sync(m, n_ctx=256, n_seq_max=1)
                kvfork.Branch.create(ctx, 0).prefill_sync([2, 9259])
                print("LOADED AND DECODED")
            except kvfork.ModelLoadError as e:
                print("ModelLoadError", e)
            """
        )
        path.unlink()
        assert out.startswith("ModelLoadError") and "malformed GGUF" in out, (name, out)


def test_context_option_combinations_llama_cpp_would_assert_on() -> None:
    out = run_isolated(
        """
        model = kvfork.Model.load(MODEL)
        combos = [
            dict(n_ctx=1024, n_batch=8, n_seq_max=16),   # used to abort (n_outputs_max)
            dict(n_ctx=16, n_batch=1, n_seq_max=1),
            dict(n_ctx=300, n_batch=7, n_seq_max=3),      # nothing a multiple of anything
            dict(n_ctx=256, n_batch=512, n_seq_max=1),    # n_batch > n_ctx
            dict(n_ctx=512, n_seq_max=256, n_batch=64),
            dict(n_ctx=512, type_k="q8_0", type_v="q8_0"),
            dict(n_ctx=512, type_k="q4_0", type_v="f16"),
            dict(n_ctx=512, type_k="bf16", type_v="f32"),
            dict(n_ctx=512, embeddings=True),
            dict(n_ctx=512, embeddings=True, pooling="mean"),
            dict(n_ctx=512, embeddings=True, pooling="last"),
            dict(n_ctx=512, embeddings=True, pooling="rank"),
            dict(n_ctx=512, n_threads=1),
            dict(n_ctx=512, n_threads=64),
        ]
        for opts in combos:
            try:
                ctx = kvfork.create_context_sync(model, **opts)
            except (ValueError, kvfork.KvforkError) as e:
                print("refused", opts, type(e).__name__)
                continue
            b = kvfork.Branch.create(ctx, 0, kvfork.SamplingParams(temperature=0))
            n = min(ctx.n_seq_max, 24)
            toks = ctx.tokenize("The history of the printing press begins with")
            try:
                b.prefill_sync(toks)
                kids = [b] + [b.fork_sync() for _ in range(n - 1)]
                kvfork.BranchStore(ctx).step_sync(kids)   # n > n_batch: split decodes
                print("ok", opts)
            except kvfork.KvforkError as e:
                print("error", opts, type(e).__name__, e)
            ctx.close()
        print("DONE")
        """
    )
    assert out.strip().endswith("DONE")
    print(out)
    assert "ok {'n_ctx': 1024, 'n_batch': 8, 'n_seq_max': 16}" in out


def test_hostile_grammars_and_schemas_do_not_crash() -> None:
    out = run_isolated(
        r"""
        ctx = kvfork.create_context_sync(MODEL, n_ctx=256, n_seq_max=2)
        b = kvfork.Branch.create(ctx, 0)
        b.prefill_sync(ctx.tokenize("Answer:"))
        grammars = [
            "root ::= root",                      # left recursion
            "root ::= a\na ::= a \"x\"",          # indirect left recursion
            "root ::= [",                          # unterminated class
            'root ::= "unterminated',
            "root ::= " + "(" * 5000 + '"a"' + ")" * 5000,   # deep nesting
            "root ::= " + " | ".join(f'"{i}"' for i in range(20000)),  # huge alternation
            "\xff\xfe garbage \u2603",
            "root ::= [^]",
            'root ::= "a"{1000000}',
        ]
        for g in grammars:
            try:
                b.set_grammar(g)
                try:
                    b.produce_sync()
                except kvfork.KvforkError:
                    pass
                print("accepted")
            except kvfork.GrammarError:
                print("GrammarError")
        b.set_grammar(None)
        schemas = ['{', '[]', '{"type": "object", "properties": 5}',
                   '{"$ref": "#/nowhere"}', '{"type": "string", "pattern": "("}',
                   '{"a":' * 3000 + '1' + '}' * 3000]
        for s in schemas:
            try:
                kvfork.json_schema_to_grammar(s)
                print("converted")
            except kvfork.GrammarError:
                print("GrammarError")
        # end-of-generation into an incomplete grammar (llama.cpp aborts on it)
        b.set_grammar('root ::= "abc"')
        for commit in [lambda: b.commit_sync(ctx.eog_token), lambda: b.accept(ctx.eog_token),
                       lambda: kvfork.BranchStore(ctx).commit_sync([(b, ctx.eog_token)])]:
            try:
                commit(); print("eog accepted")
            except kvfork.GrammarError:
                print("eog GrammarError")
        b.produce_sync()                      # the grammar is intact
        b.set_grammar(None)
        deep = '{"type": "object", "properties": {"a": ' * 2000 + '{"type": "integer"}' + '}}' * 2000
        try:
            kvfork.json_schema_to_grammar(deep)
            print("deep converted")
        except kvfork.GrammarError as e:
            print("deep GrammarError")
        for pattern in ["(", "[z-a]", "a{2,1}", "(?<=x)"]:
            try:
                b.set_grammar_lazy('root ::= "a"', ["go"], patterns=[pattern])
                print("lazy accepted")
            except kvfork.GrammarError:
                print("lazy GrammarError")
        print("DONE")
        """
    )
    assert out.strip().endswith("DONE")
    assert out.count("eog GrammarError") == 3 and "deep GrammarError" in out


def test_long_chains_of_refs_and_rules_compile_and_an_oversized_source_is_refused() -> None:
    """llguidance compiles a chain of `$ref`s or Lark rules recursively: 3,000 links
    overflowed an 8 MiB thread stack (SIGSEGV). They compile on a thread with room for the
    deepest chain a source under the size bound (1 MiB) holds."""
    out = run_isolated(
        r"""
        ctx = kvfork.create_context_sync(MODEL, n_ctx=256, n_seq_max=2)
        links = 20_000
        defs = {f"d{i}": {"$ref": f"#/$defs/d{i + 1}"} for i in range(links)}
        defs[f"d{links}"] = {"type": "integer"}
        b = kvfork.Branch.create(ctx, 0, {"temperature": 0})
        b.prefill_sync(ctx.tokenize("A number:"))
        b.set_json_schema({"$defs": defs, "$ref": "#/$defs/d0"})
        print("schema", "".join(t.text for t in b.generate_sync(6)).strip().lstrip("-").isdigit())
        rules = "\n".join(f"r{i}: r{i + 1}" for i in range(links))
        b.prune_sync()
        b = kvfork.Branch.create(ctx, 0, {"temperature": 0})
        b.prefill_sync(ctx.tokenize("Is the sky blue? Answer:"))
        b.set_lark(f'start: r0\n{rules}\nr{links}: " yes" | " no"')
        print("lark", "".join(t.text for t in b.generate_sync(8)) in (" yes", " no"))
        try:
            b.set_lark('start: " yes"' + " " * (1 << 20))
        except kvfork.GrammarError as e:
            print("oversized:", e)
        print("DONE")
        """
    )
    assert "schema True" in out and "lark True" in out and "at most 1048576" in out, out


def test_a_second_task_awaiting_the_same_operation_is_refused() -> None:
    """It took the first task's wake-up: the first slept forever (`gather(op, op)` hung).
    Refused, as awaiting a coroutine twice is; the first task gets its result."""
    out = run_isolated(
        """
        import asyncio
        ctx = kvfork.create_context_sync(MODEL, n_ctx=256, n_seq_max=2)
        b = kvfork.Branch.create(ctx, 0, {"temperature": 0})

        async def main():
            op = b.prefill(ctx.tokenize("Hello there"))

            async def wait():
                return await op

            got = await asyncio.wait_for(
                asyncio.gather(wait(), wait(), return_exceptions=True), 30
            )
            print([type(g).__name__ for g in got], got[1])  # prefill returns None
        asyncio.run(main())
        print("position", b.position)
        """,
        timeout=60,
    )
    assert "['NoneType', 'RuntimeError']" in out and "already being awaited" in out, out
    assert "position 3" in out  # "Hello there" (BOS and two tokens): prefilled once


def test_lazy_trigger_words_stay_cheap_on_long_outputs(ctx: kvfork.Context) -> None:
    """A lazy grammar waiting for its trigger word scans the whole output after every token:
    it must stay linear (the usual [\\s\\S]*?(word) pattern was quadratic and overflowed the
    regex engine's stack after ~20k characters)."""
    b = root(ctx)
    b.set_grammar_lazy('root ::= "x"', ["NEVER_SAID"])
    words = ctx.tokenize(" the cat sat on the mat" * 500, add_special=False)  # ~15k chars
    t0 = time.perf_counter()
    for t in words[:1500]:
        b.accept(t)
    assert time.perf_counter() - t0 < 5.0


def test_hostile_logits_and_huge_inputs_do_not_crash() -> None:
    out = run_isolated(
        """
        import math
        ctx = kvfork.create_context_sync(MODEL, n_ctx=512, n_seq_max=2)
        b = kvfork.Branch.create(ctx, 0, kvfork.SamplingParams(seed=1))
        b.prefill_sync(ctx.tokenize("Hello"))
        V = ctx.vocab_size
        for fill in [-math.inf, math.inf, 3.4e38, -3.4e38, 0.0]:
            try:
                b.set_logits(np.full(V, fill, np.float32))
                b.produce_sync(); b.entropy(); b.surprisal(1)
                print("ok", fill)
            except (ValueError, kvfork.KvforkError) as e:
                print(type(e).__name__, fill)
        row = np.full(V, -math.inf, np.float32); row[7] = 1.0
        b.set_logits(row)
        assert b.produce_sync().token == 7
        b.set_logit_bias({t: -math.inf for t in range(V)})   # every token banned
        try:
            b.produce_sync()
        except kvfork.KvforkError as e:
            print("all banned:", type(e).__name__)
        b.clear_logit_bias()
        ctx.tokenize("x" * 5_000_000)                        # a huge text
        try:
            b.prefill_sync([1] * 10**6)                       # a huge token list
        except kvfork.KvCacheFullError:
            print("huge prefill refused")
        try:
            kvfork.BranchStore(ctx).prefill_sync([(b, [1] * 400), (b, [1])])
        except ValueError:
            print("duplicate refused")
        print("DONE")
        """
    )
    assert "huge prefill refused" in out and out.strip().endswith("DONE")


def test_an_operation_dropped_while_an_exception_propagates_does_not_crash() -> None:
    """An awaitable never awaited because the expression that made it raised: its warning
    runs with the exception set aside, which then goes on (a segfault before)."""
    out = run_isolated(
        """
        import asyncio, warnings
        ctx = kvfork.create_context_sync(MODEL, n_ctx=256, n_seq_max=2)
        b = kvfork.Branch.create(ctx, 0, kvfork.SamplingParams())
        b.prefill_sync(ctx.tokenize("Hello"))
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            try:
                print(ctx.snapshot(), 1 / 0)
            except ZeroDivisionError:
                print("caught")

            async def main():
                try:
                    await asyncio.gather(b.produce(), asyncio.sleep(-1, 1 / 0))
                except ZeroDivisionError:
                    print("caught in gather")
            asyncio.run(main())
        assert any("never awaited" in str(w.message) for w in seen), seen
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # warnings as errors: unraisable, no crash
            try:
                print(b.produce(), 1 / 0)
            except ZeroDivisionError:
                print("caught with warnings as errors")
        print("DONE")
        """
    )
    assert out.count("caught") == 3 and out.strip().endswith("DONE")


def test_penalty_windows_past_the_training_context_cannot_exhaust_memory() -> None:
    """llama.cpp's penalty and DRY samplers allocate their whole window up front: a window of
    2**31 - 1 is clamped to the model's training context (gigabytes a branch before, and an
    abort when the allocation failed), here under a 3 GiB address-space limit."""
    out = run_isolated(
        """
        import resource
        ctx = kvfork.create_context_sync(MODEL, n_ctx=256, n_seq_max=4, n_threads=1)
        b = kvfork.Branch.create(ctx, 0, kvfork.SamplingParams(seed=1))
        b.prefill_sync(ctx.tokenize("Once upon a time"))
        resource.setrlimit(resource.RLIMIT_AS, (3 << 30, 3 << 30))
        b.set_sampler_params({"dry_multiplier": 1.0, "dry_penalty_last_n": 2**31 - 1,
                              "repeat_penalty": 1.1, "penalty_last_n": 2**31 - 1})
        kids = [b.fork_sync() for _ in range(3)]
        for branch in [b, *kids]:
            branch.produce_sync()
        print("DONE")
        """
    )
    assert out.strip().endswith("DONE")


def test_chat_values_that_nest_too_deep_or_contain_themselves_are_value_errors(
    ctx: kvfork.Context,
) -> None:
    """Values for a chat template are bounded in depth: one that contains itself, or nests
    deeper than JSON parsers go, is a ValueError naming its path (a stack overflow before)."""
    msgs = [{"role": "user", "content": "hi"}]
    loop: dict[str, object] = {}
    loop["d"] = loop
    deep: list[object] = []
    for _ in range(20_000):
        deep = [deep]
    looped_message: dict[str, object] = {"role": "user", "content": "x"}
    looped_message["extra"] = looped_message
    with pytest.raises(ValueError, match=r'kwargs\["d"\]\["d"\].*nested deeper than 128'):
        ctx.format_chat(msgs, template="chatml", d=loop)
    with pytest.raises(ValueError, match=r"contains itself"):
        ctx.format_chat(msgs, template="chatml", d=deep)
    with pytest.raises(ValueError, match=r'messages\[0\]\["extra"\]'):
        ctx.format_chat([looped_message], template="chatml")
    nested: list[object] = ["leaf"]
    for _ in range(100):  # deep, but within the bound: rendered
        nested = [nested]
    assert "hi" in ctx.format_chat(msgs, template="chatml", d=nested).prompt


@pytest.mark.skipif(os.environ.get("CI") == "true" and sys.platform != "linux", reason="linux")
def test_kv_ops_that_bypass_tenancy_cannot_crash() -> None:
    out = run_isolated(
        """
        ctx = kvfork.create_context_sync(MODEL, n_ctx=512, n_seq_max=4)
        b = kvfork.Branch.create(ctx, 0, kvfork.SamplingParams(temperature=0))
        b.prefill_sync(ctx.tokenize("The history of the printing press begins with"))
        ctx.kv_seq_copy(b.seq_id, 3, 2, 5)        # partial copy into a free sequence
        ctx.kv_seq_remove(b.seq_id, 3, 6)         # a hole in the middle of the branch
        for op in [lambda: b.commit_sync(b.produce_sync().token),
                   lambda: b.prefill_sync([1, 2, 3])]:
            try:
                op(); print("ok")
            except kvfork.KvforkError as e:
                print(type(e).__name__)
        ctx.kv_seq_keep(3)                         # every branch's cells gone but seq 3
        ctx.kv_clear()
        for op in [lambda: b.commit_sync(1), lambda: b.fork_sync(),
                   lambda: kvfork.Branch.create(ctx, 5).prefill_sync([1, 2])]:
            try:
                op(); print("ok")
            except kvfork.KvforkError as e:
                print(type(e).__name__)
        print("DONE")
        """
    )
    assert out.strip().endswith("DONE")


def argument_calls(ctx: kvfork.Context, b: kvfork.Branch) -> list[tuple[str, Callable[[], Any]]]:
    """(argument name, a call passing that argument a value of the wrong type)."""
    model = ctx.model
    path = kvfork.default_model_path()
    store = kvfork.BranchStore(ctx)
    return [
        ("n_ctx", lambda: kvfork.create_context_sync(path, n_ctx="big")),
        ("n_batch", lambda: kvfork.create_context_sync(path, n_batch=1.5)),
        ("n_threads", lambda: kvfork.create_context_sync(path, n_threads="2")),
        ("type_k", lambda: kvfork.create_context_sync(path, type_k=16)),
        ("embeddings", lambda: kvfork.create_context_sync(path, embeddings="yes")),
        ("pooling", lambda: kvfork.create_context_sync(path, pooling=1)),
        ("path_or_model", lambda: kvfork.create_context_sync(3)),
        ("path", lambda: kvfork.Model.load(3)),
        ("use_mmap", lambda: kvfork.Model.load(path, use_mmap="no")),
        ("n_gpu_layers", lambda: kvfork.Model.load(path, n_gpu_layers="all")),
        ("text", lambda: ctx.tokenize(5)),
        ("add_special", lambda: ctx.tokenize("a", add_special=1)),
        ("tokens", lambda: ctx.detokenize("abc")),
        ("remove_special", lambda: ctx.detokenize([1], remove_special=None)),
        ("token", lambda: ctx.token_to_text("x")),
        ("token", lambda: ctx.is_stop_token(1.0)),
        ("src", lambda: ctx.kv_seq_copy("0", 1)),
        ("path", lambda: ctx.save_state_sync(None)),
        ("normalize", lambda: ctx.embed_sync("a", normalize="no")),
        ("add_generation_prompt", lambda: ctx.format_chat([], add_generation_prompt=2)),
        ("template", lambda: ctx.format_chat([], template=5)),
        ("position", lambda: kvfork.Branch.create(ctx, "0")),
        ("params", lambda: kvfork.Branch.create(ctx, 0, 5)),
        ("grammar", lambda: kvfork.Branch.create(ctx, 0, grammar=5)),
        ("tokens", lambda: b.prefill_sync("hello")),
        ("token", lambda: b.commit_sync("a")),
        ("max_tokens", lambda: b.generate_sync(max_tokens="3")),
        ("seed", lambda: b.fork_sync(seed="1")),
        ("keep_children", lambda: b.prune_sync(keep_children="yes")),
        ("gbnf", lambda: b.set_grammar(5)),
        ("pattern", lambda: b.set_regex(5)),
        ("grammar", lambda: b.set_lark(5)),
        ("patterns", lambda: b.set_grammar_lazy('root ::= "a"', [], patterns=5)),
        ("base", lambda: b.entropy(2)),
        ("token", lambda: b.surprisal("x")),
        ("token", lambda: b.logprob(None)),
        ("k", lambda: b.top_logprobs("3")),
        ("path", lambda: b.save_sync(1.5)),
        ("path", lambda: kvfork.Branch.load_sync(ctx, 1.5)),
        ("draft", lambda: b.speculate_sync(1, "ab")),
        ("ctx", lambda: kvfork.BranchStore(5)),
        ("text", lambda: kvfork.Token(1, 2, False)),
        ("is_stop", lambda: kvfork.Token(1, "a", "no")),
        ("schema", lambda: kvfork._native.json_schema_to_grammar(5)),
        ("entries", lambda: store.commit_sync(5)),
        ("temperature", lambda: kvfork.SamplingParams(temperature="hot")),
        ("top_k", lambda: kvfork.SamplingParams(top_k=1.5)),
        ("path", lambda: model.load(object())),
    ]


def test_every_badly_typed_argument_is_named_in_the_message(ctx: kvfork.Context) -> None:
    b = root(ctx)
    unnamed = []
    for name, call in argument_calls(ctx, b):
        with pytest.raises(TypeError) as info:
            call()
        if name not in str(info.value):
            unnamed.append(f"{name}: {info.value}")
    assert not unnamed, "\n".join(unnamed)


def test_the_readme_example_names_n_ctx() -> None:
    with pytest.raises(TypeError, match="argument 'n_ctx': expected an int, got str"):
        kvfork.create_context_sync(kvfork.default_model_path(), n_ctx="big")


def test_sampled_tokens_are_taken_as_their_ids_in_token_lists(ctx: kvfork.Context) -> None:
    """`Token`'s docstring: accepted wherever a token id is (a list of them was refused)."""
    b = root(ctx)
    tokens = [b.produce_sync()]
    twin = b.fork_sync()
    b.prefill_sync(tokens)
    twin.prefill_sync([t.token for t in tokens])
    assert b.history == twin.history


def test_numpy_integers_are_taken_wherever_an_int_is(ctx: kvfork.Context) -> None:
    """Anything with `__index__` is an int argument, as `operator.index` takes it (token ids
    read from NumPy arrays); a float still is not."""
    b = root(ctx)
    token = int(np.argmax(b.logits()))
    assert ctx.token_to_text(np.int64(token)) == ctx.token_to_text(token)
    assert ctx.is_stop_token(np.int32(token)) == ctx.is_stop_token(token)
    assert b.surprisal(np.int64(token)) == b.surprisal(token)
    assert kvfork.Token(np.int16(3), "x", False).token == 3
    with kvfork.create_context_sync(ctx.model, n_ctx=np.int64(256), n_seq_max=1) as small:
        assert small.n_ctx == 256
    with pytest.raises(TypeError, match="argument 'token': expected an int, got float"):
        ctx.token_to_text(np.float64(token))


def test_save_writes_through_a_link_and_refuses_what_is_no_file(
    ctx: kvfork.Context, tmp_path: Path
) -> None:
    """`save` replaces a file by rename: through a symbolic link it writes the link's target
    (the link stays), and a path that is no regular file (a directory, a device) is refused,
    not replaced."""
    b = root(ctx)
    target = tmp_path / "target.kvfork"
    target.write_bytes(b"old")
    link = tmp_path / "link.kvfork"
    link.symlink_to(target)
    b.save_sync(link)
    assert link.is_symlink() and target.read_bytes() != b"old"
    assert kvfork.Branch.load_sync(ctx, target).position == b.position
    folder = tmp_path / "folder"
    folder.mkdir()
    with pytest.raises(OSError, match="not a regular file"):
        b.save_sync(folder)
    assert folder.is_dir() and not list(tmp_path.glob("*.kvfork-tmp"))


def test_reprs_read_back_as_python(ctx: kvfork.Context) -> None:
    """Reprs escape text as Python does (not Rust's `\\u{7f}`), so they read back."""
    for text in ["\x7f", "naïve", "tab\there", 'quote"s', "\U0001f600"]:
        token = kvfork.Token(1, text, False)
        assert eval(repr(token), {"Token": kvfork.Token}) == token, repr(token)
    assert "closed=False" in repr(ctx)


def test_draft_tokens_past_64_bits_are_value_errors_naming_the_draft(
    ctx: kvfork.Context,
) -> None:
    b = root(ctx)
    pending = b.produce_sync()
    for draft in ([2**64], [-(2**70)], [2**40]):
        with pytest.raises(ValueError, match="draft"):
            b.speculate_sync(pending, draft)
