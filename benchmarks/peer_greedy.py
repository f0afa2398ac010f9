"""Greedy tokens of kvfork against llama-cpp-python (the peer), per model and prompt.

Both sides decode the same token ids (kvfork's tokenization, also compared) on one
sequence: the prompt in one batch, then one token per step. Different builds of ggml may
round differently, so tokens are compared up to the first near-tie of kvfork's logits (the
best two within 1.0): beyond that point either choice is correct.

usage: python benchmarks/peer_greedy.py --peer-python .venv-peer/bin/python [--tokens 48]
The peer: llama-cpp-python 0.3.36 in its own venv (BENCHMARKS.md, "peer").
"""

from __future__ import annotations

import argparse
import sys

import kvfork
import numpy as np
from _peer import run_peer
from peer_batched import DEFAULT_PEER_PYTHON

# Runs under the peer's Python: greedy argmax over llama-cpp-python's logits.
PEER_CODE = r"""
import json, sys
import numpy as np
from llama_cpp import Llama

job = json.load(sys.stdin)
llm = Llama(model_path=job["model"], n_ctx=2048, n_batch=512, logits_all=True, verbose=False)
out = {}
for name, case in job["cases"].items():
    llm.reset()
    tokens = case["tokens"]
    llm.eval(tokens)
    row = llm.scores[llm.n_tokens - 1]
    top = [int(i) for i in np.argsort(-row)[:50]]
    first = {"ids": top, "logits": [float(row[i]) for i in top]}
    got = []
    for _ in range(job["n"]):
        t = int(np.argmax(llm.scores[llm.n_tokens - 1]))
        got.append(t)
        if llm.token_eos() == t or t in job["stops"]:
            break
        llm.eval([t])
    peer_tokens = llm.tokenize(case["text"].encode(), add_bos=True, special=True)
    out[name] = {"greedy": got, "tokenized": peer_tokens, "first": first}
json.dump(out, sys.stdout)
"""


def kvfork_greedy(
    ctx: kvfork.Context, tokens: list[int], n: int
) -> tuple[list[int], list[float], np.ndarray]:
    """Greedy tokens, each one's margin over the runner-up, and the prompt's logits row."""
    b = kvfork.Branch.create(ctx, 0, {"temperature": 0.0})
    b.prefill_sync(tokens)
    first = b.logits()
    got, margins = [], []
    for _ in range(n):
        top2 = np.partition(b.logits(), -2)[-2:]
        margins.append(float(top2[1] - top2[0]))
        t = b.produce_sync()
        got.append(t.token)
        if t.is_stop:
            break
        b.commit_sync(t)
    b.prune_sync()
    return got, margins, first


def agreement(ours: list[int], peer: list[int], margins: list[float]) -> tuple[int, int, bool]:
    """(tokens equal before the first near-tie, tokens compared, whether all compared agree)."""
    compared = 0
    for i, (a, b) in enumerate(zip(ours, peer, strict=False)):
        if margins[i] < 1.0:
            break
        compared += 1
        if a != b:
            return i, compared, False
    return compared, compared, True


def cases(ctx: kvfork.Context) -> dict[str, str]:
    plain = {
        "completion": "The history of the printing press begins with",
        "counting": "1, 2, 3, 4, 5, 6, 7, 8, 9, 10,",
    }
    if ctx.model.chat_template is not None:
        chat = ctx.format_chat([{"role": "user", "content": "What is the capital of France?"}])
        plain["chat"] = chat.prompt
    return plain


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--peer-python", default=DEFAULT_PEER_PYTHON)
    ap.add_argument("--tokens", type=int, default=48)
    args = ap.parse_args()
    models = {
        "Gemma 3 270M": kvfork.default_model_path(),
        "SmolLM2-135M-Instruct": kvfork.default_chat_model_path(),
    }
    print(
        "| model | prompt | tokenization equal | equal before the first near-tie "
        "| whole sequences equal | max abs logit diff, prompt row (top 50) | agree |"
    )
    print("|---|---|---|---|---|---|---|")
    failures = 0
    for label, path in models.items():
        with kvfork.create_context_sync(path, n_ctx=2048, n_seq_max=1) as ctx:
            texts = cases(ctx)
            job_cases = {
                name: {"text": text, "tokens": ctx.tokenize(text, parse_special=True)}
                for name, text in texts.items()
            }
            stops = [t for t in range(ctx.vocab_size) if ctx.is_stop_token(t)]
            job = {"model": str(path), "cases": job_cases, "n": args.tokens, "stops": stops}
            peer = run_peer(args.peer_python, PEER_CODE, job)
            for name, case in job_cases.items():
                ours, margins, first = kvfork_greedy(ctx, case["tokens"], args.tokens)
                theirs = peer[name]["first"]
                diff = float(np.max(np.abs(first[theirs["ids"]] - np.array(theirs["logits"]))))
                equal, compared, ok = agreement(ours, peer[name]["greedy"], margins)
                same_tok = peer[name]["tokenized"] == case["tokens"]
                failures += not ok
                same = ours == peer[name]["greedy"]
                whole = f"{same} ({len(ours)} tokens)"
                print(
                    f"| {label} | {name} | {same_tok} | {equal} / {compared} | {whole} "
                    f"| {diff:.3f} | {ok} |"
                )
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
