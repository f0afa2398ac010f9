"""The `kvfork` command and its demo, on the real models."""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import math
import os
import pty
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import kvfork
import pytest
from kvfork import _demo, cli
from kvfork._progress import Progress

from .conftest import assert_same_text, greedy_with_margins


def run_cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    """Run `kvfork ARGV` in this process; (exit status, stdout, stderr)."""
    try:
        status = cli.main(list(argv))
    except SystemExit as exc:  # argparse and parser.exit
        status = int(exc.code or 0)
    out, err = capsys.readouterr()
    return status, out, err


def test_demo_steps_all_forks_in_one_decode_and_compares_with_sequential() -> None:
    out = io.StringIO()
    demo = asyncio.run(
        _demo.run(kvfork.default_model_path(), n=3, max_tokens=8, out=out, live=False)
    )
    steps = max(len(demo.texts), 1)
    assert demo.batched_decodes <= 8  # one decode per step, whatever the number of forks
    assert demo.batched_tokens > demo.batched_decodes  # several tokens in each decode
    assert demo.sequential_decodes == demo.sequential_tokens  # one decode per token
    assert demo.winner == min(range(steps), key=lambda i: demo.perplexities[i])
    text = out.getvalue()
    assert text.count(" fork ") >= 3 and "winner (lowest perplexity): fork" in text
    assert "decodes" in text and "× the speed" in text


def test_demo_redraws_lanes_in_place_on_a_terminal() -> None:
    out = io.StringIO()
    asyncio.run(_demo.run(kvfork.default_model_path(), n=2, max_tokens=4, out=out, live=True))
    text = out.getvalue()
    assert text.count("\x1b[3F") >= 3  # back up over 2 lanes and the status line each step
    assert "step 4/4" in text or "step 3/4" in text  # a lane may end early at a stop token


def test_help_lists_every_command() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "kvfork", "--help"], capture_output=True, text=True, check=True
    )
    for command in ("demo", "generate", "chat", "embed", "bench", "info"):
        assert command in done.stdout
    bare = subprocess.run(
        [sys.executable, "-m", "kvfork"], capture_output=True, text=True, check=False
    )
    assert bare.returncode == 2 and "generate" in bare.stdout


def test_generate_streams_greedy_text(capsys: pytest.CaptureFixture[str]) -> None:
    prompt = "The capital of France is"
    status, out, err = run_cli(
        capsys, "generate", "default", prompt, "--max-tokens", "8", "--temperature", "0"
    )
    assert status == 0 and out.startswith(prompt) and len(out) > len(prompt)
    assert "tokens in" in err and "perplexity" in err


def test_generate_best_of_n_ranks_candidates_by_perplexity(
    capsys: pytest.CaptureFixture[str],
) -> None:
    status, out, _ = run_cli(
        capsys, "generate", "default", "Once upon a time", "--n", "3", "--max-tokens", "8"
    )
    assert status == 0
    headers = [line for line in out.splitlines() if line.startswith("--- candidate")]
    assert len(headers) == 3 and "best" in headers[0]
    ppl = [float(h.rsplit("perplexity ", 1)[1].rstrip(")")) for h in headers]
    assert ppl == sorted(ppl)


def test_best_of_n_takes_any_seed_and_keeps_its_candidates_at_the_context_s_end(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """The largest seed (forks derive theirs from it), and more tokens than the context
    holds: the candidates as far as they went (they were all lost, exit status 1)."""
    argv = ["generate", "chat", "Write a story:", "--n", "2", "--n-ctx", "256"]
    status, out, err = run_cli(capsys, *argv, "--max-tokens", "300", "--seed", str(2**32 - 1))
    assert status == 0, err
    assert len([line for line in out.splitlines() if line.startswith("--- candidate")]) == 2
    assert "stopped at the context's end" in err


def test_generate_follows_a_json_schema_file(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    schema = {
        "type": "object",
        "properties": {"answer": {"enum": ["yes", "no"]}},
        "required": ["answer"],
        "additionalProperties": False,
    }
    path = tmp_path / "schema.json"
    path.write_text(json.dumps(schema))
    prompt = "Is the sky blue? Answer in JSON: "
    status, out, _ = run_cli(
        capsys, "generate", "default", prompt, "--json-schema", str(path), "--max-tokens", "40"
    )
    assert status == 0
    assert json.loads(out[len(prompt) :])["answer"] in ("yes", "no")


def test_generate_follows_a_gbnf_grammar_file(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    path = tmp_path / "answer.gbnf"
    path.write_text('root ::= "yes" | "no"\n')
    prompt = "Is water wet? "
    status, out, _ = run_cli(
        capsys, "generate", "default", prompt, "--grammar", str(path), "--max-tokens", "8"
    )
    assert status == 0 and out[len(prompt) :] in ("yes", "no")


def test_generate_with_prompt_lookup_draft_matches_plain_greedy(
    capsys: pytest.CaptureFixture[str], model: kvfork.Model
) -> None:
    prompt = "one two three four five one two three four five one two three"
    args = ("generate", "default", prompt, "--max-tokens", "12", "--temperature", "0")
    status, plain, _ = run_cli(capsys, *args)
    assert status == 0
    status, drafted, err = run_cli(capsys, *args, "--draft", "prompt-lookup")
    assert status == 0 and "tokens in" in err
    assert plain.startswith(prompt) and drafted.startswith(prompt)
    # The same tokens up to a near-tie (verification batches round their rows otherwise than
    # one-token decodes: conftest.LOGIT_NOISE), as a reference prefilled here says where.
    with kvfork.create_context_sync(model, n_ctx=512, n_seq_max=1) as ctx:
        b = kvfork.Branch.create(ctx, 0, {"temperature": 0.0})
        b.prefill_sync(ctx.tokenize(prompt))
        tokens, margins = greedy_with_margins(b, 12)
        pieces = [ctx.token_to_text(t) for t in tokens]
    assert_same_text(drafted[len(prompt) :], plain[len(prompt) :], pieces, margins)


@pytest.mark.parametrize(
    ("argv", "status", "message"),
    [
        (["generate", "default", "x", "--n", "2", "--draft", "prompt-lookup"], 2, "--draft"),
        (["generate", "default", "x", "--n", "0"], 2, "--n: must be in [1, 255], got 0"),
        (["generate", "default", "x", "--max-tokens", "-4"], 2, "--max-tokens: must be at"),
        (["bench", "--steps", "0"], 2, "--steps: must be at least 1"),
        (["bench", "--n", "4,-3"], 2, "--n: must be in [1, 255], got -3"),
        (["bench", "--n", "4,x"], 2, "--n: not an int: 'x'"),
        (["demo", "--n", "0"], 2, "--n: must be at least 1"),
        # An event loop wraps a port past 65535 around (99999 listened on 34463).
        (["serve", "default", "--port", "99999"], 2, "--port: must be in [1, 65535]"),
        (["serve", "default", "--max-queue", "-1"], 2, "--max-queue: must be at least 0"),
        (["serve", "default", "--shutdown-seconds", "inf"], 2, "--shutdown-seconds: must be a"),
        (["serve", "default", "--stored-responses-mb", "nan"], 2, "--stored-responses-mb: must"),
        (["serve", "default", "--stall-seconds", "0"], 2, "--stall-seconds: must be a finite"),
        (["generate", "/no/such/model.gguf", "x"], 2, "no such model file"),
        (["generate", "default", "x", "--json-schema", "/no/such.json"], 2, "cannot read"),
        (["embed", "default"], 2, "nothing to embed"),
        (["serve", "default", "--ray", "local", "--n-batch", "64"], 2, "--n-batch"),
        (["serve", "default", "--ray", "local", "--warmup", "on"], 2, "--warmup on"),
        (["serve", "default", "--cache-ram", str(1 << 43)], 2, "--cache-ram must be in"),
        (["serve", "default", "--cache-disk", "-1"], 2, "--cache-disk must be in"),
        (["serve", "default", "--log-level", "bogus"], 2, "--log-level: invalid choice"),
        (["serve", "default", "--n-seq-max", "0"], 2, "--n-seq-max: must be at least 1"),
        (["generate", "default", "x", "--top-p", "5"], 2, "--top-p: must be in [0, 1]"),
        (["generate", "default", "x", "--seed", "-1"], 2, "--seed: must be in [0, 4294967295]"),
        (["chat", "--temperature", "nan"], 2, "--temperature: must be a finite number"),
        (["generate", "chat", ""], 2, "the prompt is empty"),
        (["serve", "chat", "--cache-dir", ""], 2, "--cache-dir: empty: give a directory"),
        (["serve", "chat", "--actors", "3"], 2, "--actors and --route apply to --ray"),
        (["serve", "chat", "--route", "hash"], 2, "--actors and --route apply to --ray"),
        (["serve", "chat", "--cache-dir", __file__], 2, "is not a directory"),
        (["serve", "chat", "--api-key", ""], 2, "--api-key must be a printable ASCII token"),
        (["serve", "chat", "--api-key", "clé"], 2, "--api-key must be a printable ASCII token"),
        (
            ["serve", "chat", "--warmup", "off", "--chat-template", "chatmll"],
            2,
            "--chat-template 'chatmll' does not render the messages",
        ),
        (["serve", "chat", "--warmup", "off", "--chat-template", "{{ x"], 2, "syntax error"),
    ],
)
def test_usage_errors_exit_2_with_a_message(
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    argv: list[str],
    status: int,
    message: str,
) -> None:
    monkeypatch.setattr(sys, "stdin", io.StringIO(""))
    got, _, err = run_cli(capsys, *argv)
    assert got == status and message in err


def test_a_bad_schema_is_reported_not_raised(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    path = tmp_path / "bad.json"
    path.write_text('{"type": "object", "properties": ')
    status, _, err = run_cli(capsys, "generate", "default", "x", "--json-schema", str(path))
    assert status == 1 and "GrammarError" in err


def test_chat_reads_turns_from_piped_stdin_and_keeps_the_conversation_warm(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    turns = "What is the capital of France?\n\nAnd of Italy?\n/exit\nnever read\n"
    monkeypatch.setattr(sys, "stdin", io.StringIO(turns))
    status, out, err = run_cli(capsys, "chat", "--max-tokens", "24", "--verbose")
    assert status == 0
    replies = out.strip("\n").split("\n")
    assert len(replies) >= 2 and all(replies)
    prefilled = [int(line.split()[1]) for line in err.splitlines() if "prefilled" in line]
    assert len(prefilled) == 2  # the blank line is skipped, /exit ends before the last line
    assert prefilled[1] < prefilled[0]  # the second turn prefills only what it adds


def test_chat_goes_on_past_a_full_context_and_a_turn_too_long_for_it(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A turn longer than the context is refused alone (the next is answered), and a session
    longer than the context shifts it (it ended with KvCacheFullError, exit status 1)."""
    turns = "word " * 700 + "\n" + "".join(f"Tell me about the sea, part {i}.\n" for i in range(8))
    monkeypatch.setattr(sys, "stdin", io.StringIO(turns))
    status, out, err = run_cli(capsys, "chat", "--n-ctx", "512", "--max-tokens", "60", "--verbose")
    assert status == 0, err
    assert "does not fit (--n-ctx 512)" in err
    assert len([line for line in err.splitlines() if "prefilled" in line]) == 8  # all answered
    assert out.strip()


def test_chat_stream_holds_back_a_partial_stop_string() -> None:
    ctx = kvfork.create_context_sync(kvfork.default_chat_model_path(), n_ctx=1024, n_seq_max=1)
    with ctx:
        chat = kvfork.Chat(ctx, params=kvfork.SamplingParams(temperature=0.0))
        pieces = list(chat.stream_sync("Say hello.", max_tokens=32))
        reply = chat.messages[-1]["content"]
        assert "".join(pieces) == reply and reply
        for stop in ctx.format_chat(chat.messages).stop:
            assert not stop or stop not in "".join(pieces)


def test_embed_ranks_texts_and_prints_json_lines(capsys: pytest.CaptureFixture[str]) -> None:
    texts = ["A cat was sitting on a mat.", "Stock markets fell sharply today."]
    status, out, _ = run_cli(capsys, "embed", "default", *texts, "--rank", "A kitten on a rug.")
    assert status == 0 and out.splitlines()[0].endswith(texts[0])
    status, out, _ = run_cli(capsys, "embed", "default", *texts)
    rows = [json.loads(line) for line in out.splitlines()]
    assert [r["text"] for r in rows] == texts
    norm = sum(x * x for x in rows[0]["embedding"])
    assert len(rows[0]["embedding"]) == 640 and abs(norm - 1) < 1e-3


def test_embed_sizes_its_context_for_a_long_text(capsys: pytest.CaptureFixture[str]) -> None:
    """A text longer than a batch gets a context that holds it (one text is one batch); one
    longer than the model was trained on is a usage error that says so."""
    status, out, _ = run_cli(capsys, "embed", "default", "word " * 700)
    assert status == 0 and len(json.loads(out)["embedding"]) == 640
    status, _, err = run_cli(capsys, "embed", "default", "word " * 33000)
    assert status == 2 and "embeds at most 32768" in err


def test_perplexity_scores_each_chunk_s_second_half(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """`kvfork perplexity` as llama-perplexity computes it: chunks of --n-ctx tokens, the
    first made BOS, the tokens after the middle scored; the same perplexity as committing
    those tokens one by one gives (up to the rounding of other batch shapes). Too short a
    text is a usage error."""
    text = " ".join(f"Line {i}: the printing press spread across Europe." for i in range(40))
    (tmp_path / "text.txt").write_text(text)
    status, out, _ = run_cli(
        capsys,
        "perplexity",
        "default",
        str(tmp_path / "text.txt"),
        "--n-ctx",
        "64",
        "--max-chunks",
        "2",
    )
    assert status == 0, out
    ppl = float(out.split()[1])
    assert "2 chunks of 64 tokens, 62 tokens scored" in out
    with kvfork.create_context_sync(kvfork.default_model_path(), n_ctx=64) as ctx:
        tokens = ctx.tokenize(text)
        total = 0.0
        for i in range(2):
            chunk = tokens[i * 64 : (i + 1) * 64]
            chunk[0] = ctx.bos_token or chunk[0]
            b = kvfork.Branch.create(ctx)
            b.prefill_sync(chunk[:33])
            for t in chunk[33:]:
                b.commit_sync(t)
            total += 31 * math.log(b.perplexity)
            b.prune_sync()
    assert ppl == pytest.approx(math.exp(total / 62), rel=0.03)
    status, _, err = run_cli(
        capsys, "perplexity", "default", str(tmp_path / "text.txt"), "--n-ctx", "4096"
    )
    assert status == 2 and "at least --n-ctx (4096)" in err
    status, _, err = run_cli(
        capsys, "perplexity", "default", str(tmp_path / "text.txt"), "--n-ctx", "40000"
    )
    assert status == 2 and "more than this model was trained on (32768)" in err
    # Bytes that are not UTF-8 read as U+FFFD, as llama-perplexity reads any file.
    (tmp_path / "binary").write_bytes(bytes(range(256)) * 4)
    status, out, _ = run_cli(
        capsys, "perplexity", "default", str(tmp_path / "binary"), "--n-ctx", "64"
    )
    assert status == 0 and "tokens scored" in out
    (tmp_path / "schema.json").write_bytes(b"\xff{}")
    status, _, err = run_cli(
        capsys, "generate", "default", "x", "--json-schema", str(tmp_path / "schema.json")
    )
    assert status == 2 and "is not UTF-8 text" in err


def test_bench_prints_one_row_per_width(capsys: pytest.CaptureFixture[str]) -> None:
    status, out, _ = run_cli(capsys, "bench", "--n", "2", "--steps", "2")
    assert status == 0 and "prefill:" in out
    rows = [line.split() for line in out.splitlines() if line.strip()[:1].isdigit()]
    assert [row[0] for row in rows] == ["1", "2"]


def test_info_describes_the_model_and_the_build(capsys: pytest.CaptureFixture[str]) -> None:
    status, out, _ = run_cli(capsys, "info", "chat", "--json")
    info = json.loads(out)
    assert status == 0 and info["vocab_size"] > 1000 and "<|im_start|>" in info["chat_template"]
    assert info["system"]["backend"] == kvfork.system_info()["backend"]
    status, out, _ = run_cli(capsys, "info", "default")
    assert status == 0 and "metadata:" in out and "general.architecture: gemma3" in out


def test_info_without_a_model_shows_the_system_and_where_the_models_are(
    capsys: pytest.CaptureFixture[str],
) -> None:
    status, out, _ = run_cli(capsys, "info")
    assert status == 0 and f"kvfork {kvfork.__version__}" in out and "system:" in out
    assert str(kvfork.default_model_path()) in out and "chat" in out
    status, out, _ = run_cli(capsys, "info", "--json")
    info = json.loads(out)
    assert info["models"]["default"] == {"path": str(kvfork.default_model_path()), "present": True}
    assert info["system"] == kvfork.system_info()


def test_chat_answers_with_its_default_system_prompt(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(sys, "stdin", io.StringIO("What is the capital of France?\n"))
    status, out, _ = run_cli(capsys, "chat", "--max-tokens", "24")
    assert status == 0 and "Paris" in out


def test_progress_shows_only_for_slow_work_and_erases_its_line() -> None:
    quick = io.StringIO()
    with Progress("quick", stream=quick, delay=0.5, enabled=True):
        pass
    assert quick.getvalue() == ""
    slow = io.StringIO()
    with Progress("slow", total=10, stream=slow, delay=0.05, enabled=True) as progress:
        progress.update(4)
        time.sleep(0.3)
    text = slow.getvalue()
    assert "slow … 4/10" in text and text.endswith("slow: done in 0.3s\n")


def test_ctrl_c_at_the_chat_prompt_ends_the_chat_at_once() -> None:
    """On a terminal, Ctrl-C while `kvfork chat` waits at `you>` exits with 130 at once (the
    thread reading stdin kept the process until the next Enter)."""
    pid, fd = pty.fork()
    if pid == 0:  # the child: the chat on the pseudo-terminal
        os.execv(sys.executable, [sys.executable, "-m", "kvfork", "chat", "chat", "--n-ctx", "512"])
    try:
        seen, deadline = b"", time.monotonic() + 120
        while b"you> " not in seen:
            assert time.monotonic() < deadline, seen
            seen += os.read(fd, 4096)
        os.kill(pid, signal.SIGINT)
        deadline = time.monotonic() + 10
        while not (status := os.waitpid(pid, os.WNOHANG))[0]:
            assert time.monotonic() < deadline, "the chat went on after Ctrl-C"
            time.sleep(0.05)
        assert os.waitstatus_to_exitcode(status[1]) == 130
    finally:
        with contextlib.suppress(ProcessLookupError, ChildProcessError):
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
        os.close(fd)


def test_a_reader_that_goes_away_ends_the_command_quietly() -> None:
    """`kvfork generate ... | head -c 5`: the pipe closed under it ends the command with 141
    (as SIGPIPE ends other tools) and nothing on stderr (it printed a BrokenPipeError and
    exited 1)."""
    command = [sys.executable, "-m", "kvfork", "generate", "chat", "Count from one to a thousand:"]
    process = subprocess.Popen(
        [*command, "--max-tokens", "400"], stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    assert process.stdout is not None and process.stderr is not None
    assert process.stdout.read(5)
    process.stdout.close()
    assert process.wait(timeout=300) == 141
    with process.stderr:
        said = process.stderr.read().decode().splitlines()
    assert [line for line in said if not line.startswith(("llama", "load"))] == []


def test_chat_reads_lines_that_are_not_utf_8() -> None:
    """Bytes on stdin that are not UTF-8 are read as U+FFFD: the turn and the next one are
    answered (a codec error ended the chat)."""
    done = subprocess.run(
        [sys.executable, "-m", "kvfork", "chat", "chat", "--max-tokens", "4", "--verbose"],
        input=b"Hi \xff\xfe there\nWhat is 2+2?\n",
        capture_output=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-500:]
    assert done.stderr.decode().count("prefilled") == 2


def test_serve_on_a_port_taken_is_a_usage_error_before_the_model_loads() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        done = subprocess.run(
            [sys.executable, "-m", "kvfork", "serve", "chat", "--port", str(port)],
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
    assert done.returncode == 2
    assert f"cannot listen on 127.0.0.1:{port}: Address already in use" in done.stderr
    assert "kvfork serve:" not in done.stderr  # no start-up line announced it
