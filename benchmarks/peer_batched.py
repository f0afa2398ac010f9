"""The peer's hand-written batched loop: llama-cpp-python's low-level API driven as a user
would without kvfork.

One prompt is decoded into sequence 0 and copied to sequences 1..N-1 with
`llama_memory_seq_cp`; then every step decodes one token of each sequence in ONE
`llama_decode` (greedy argmax in numpy over each row of logits). Prints generated tokens/s
per N. `bench_store.py` runs it as its peer column; it runs on its own too:

usage: python benchmarks/peer_batched.py [--peer-python .venv-peer/bin/python]
                                         [--steps 32] [--n 1 4 8 16] [--model PATH]
The peer's venv: `make peer` (llama-cpp-python 0.3.36 built for this CPU, without AMX).
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any

from _peer import run_peer

DEFAULT_PEER_PYTHON = str(Path(__file__).resolve().parent.parent / ".venv-peer" / "bin" / "python")
PROMPT = "The history of the printing press begins with"

# Runs under the peer's Python. Reads {"model", "prompt", "steps", "ns"}; writes {N: tok/s}.
PEER_CODE = r"""
import ctypes, json, sys, time
import numpy as np
import llama_cpp as L

job = json.load(sys.stdin)
L.llama_backend_init()
quiet = L.llama_log_callback(lambda *args: None)
L.llama_log_set(quiet, ctypes.c_void_p())
model = L.llama_model_load_from_file(job["model"].encode(), L.llama_model_default_params())
vocab = L.llama_model_get_vocab(model)
n_vocab = L.llama_vocab_n_tokens(vocab)
text = job["prompt"].encode()
ids = (L.llama_token * 512)()
prompt = list(ids[: L.llama_tokenize(vocab, text, len(text), ids, 512, True, False)])


def fill(batch, rows):
    # rows: (token, position, sequence, wants logits)
    batch.n_tokens = len(rows)
    for i, (token, pos, seq, logits) in enumerate(rows):
        batch.token[i], batch.pos[i], batch.logits[i] = token, pos, logits
        batch.n_seq_id[i] = 1
        batch.seq_id[i][0] = seq


def best(ctx, row):
    logits = np.ctypeslib.as_array(L.llama_get_logits_ith(ctx, row), shape=(n_vocab,))
    return int(logits.argmax())


def tokens_per_second(n):
    params = L.llama_context_default_params()
    params.n_ctx, params.n_batch, params.n_ubatch = 4096, 512, 512
    params.n_seq_max, params.n_threads, params.n_threads_batch = n, 2, 2
    params.kv_unified = True
    ctx = L.llama_init_from_model(model, params)
    batch = L.llama_batch_init(512, 0, n)
    last = len(prompt) - 1
    fill(batch, [(t, i, 0, i == last) for i, t in enumerate(prompt)])
    assert L.llama_decode(ctx, batch) == 0
    heads = [best(ctx, last)] * n
    for seq in range(1, n):
        L.llama_memory_seq_cp(L.llama_get_memory(ctx), 0, seq, -1, -1)
    start = time.perf_counter()
    for step in range(job["steps"]):
        fill(batch, [(heads[s], len(prompt) + step, s, True) for s in range(n)])
        assert L.llama_decode(ctx, batch) == 0
        heads = [best(ctx, s) for s in range(n)]
    elapsed = time.perf_counter() - start
    L.llama_batch_free(batch)
    L.llama_free(ctx)
    return n * job["steps"] / elapsed


json.dump({str(n): tokens_per_second(n) for n in job["ns"]}, sys.stdout)
"""


def peer_batched(python: str, model: str | Path, steps: int, ns: list[int]) -> dict[int, float]:
    """tokens/s of the peer's batched loop for each N (greedy, `steps` tokens per sequence)."""
    job: dict[str, Any] = {"model": str(model), "prompt": PROMPT, "steps": steps, "ns": ns}
    return {int(n): rate for n, rate in run_peer(python, PEER_CODE, job).items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--peer-python", default=os.environ.get("PEER_PYTHON", DEFAULT_PEER_PYTHON))
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--n", type=int, nargs="+", default=[1, 4, 8, 16])
    parser.add_argument("--model", help="GGUF path (default: kvfork's default model)")
    args = parser.parse_args()
    if not Path(args.peer_python).exists():
        raise SystemExit(f"no peer at {args.peer_python}: `make peer` installs it")
    if args.model is None:
        import kvfork

        args.model = str(kvfork.default_model_path())
    for n, rate in peer_batched(args.peer_python, args.model, args.steps, args.n).items():
        print(f"N={n:3d}  batch {rate:8.1f} tok/s")


if __name__ == "__main__":
    main()
