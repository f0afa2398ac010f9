"""What recurrent-state checkpoints cost and save, on a hybrid of a real small model's shape.

A random-weight GGUF with LFM2-350M's configuration (1,024 wide, 16 layers: 10 short
convolutions and 6 attention layers, GQA 16/8, FFN 4,608, f16; SmolLM2's tokenizer) is written
once into the cache directory (~700 MB, a few seconds). A 64-wide toy says nothing about cost;
the weights' values do not matter to it. Reported:

1. bytes and time per checkpoint, against one decode step of one branch;
2. prompt tokens reused (and wall time) on a shared-preamble workload through `PrefixCache`,
   with checkpoints and with `checkpoints=0`;
3. what a rejected speculative guess costs, against a round whose guess is all kept and a
   one-token step: through a checkpoint (put back, the kept tokens decoded again) and with
   `recurrent_rollback=4` (llama.cpp's per-token snapshots: the state rolled back at once;
   its one-token step is timed too, as the snapshots cost every decode something).

    python benchmarks/bench_checkpoints.py [--threads N] [--repeat R]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import gguf
import kvfork
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from tests.family_models import _tokenizer_fields

# LFM2-350M (config.json): attention on layers 2, 5, 8, 10, 12, 14; short convolutions elsewhere.
N_EMBD, N_LAYER, N_HEAD, N_HEAD_KV, N_FF, L_CACHE = 1024, 16, 16, 8, 4608, 3
ATTENTION_LAYERS = {2, 5, 8, 10, 12, 14}
HEAD_DIM = N_EMBD // N_HEAD

PREAMBLE = "You are a meticulous research assistant for a history department. " * 24
QUESTIONS = [f"Question {i}: when did the {w} begin?" for i, w in enumerate("abcdefgh")]


def write_lfm2_350m(path: Path) -> Path:
    """The random-weight model, written once (through a temporary name)."""
    if path.exists():
        return path
    partial = path.with_suffix(".partial")
    rng = np.random.default_rng(0)
    w = gguf.GGUFWriter(str(partial), arch="lfm2")
    w.add_name("kvfork-bench-lfm2-350m-shape")
    w.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    w.add_context_length(32768)
    w.add_embedding_length(N_EMBD)
    w.add_block_count(N_LAYER)
    w.add_head_count(N_HEAD)
    w.add_head_count_kv([N_HEAD_KV if il in ATTENTION_LAYERS else 0 for il in range(N_LAYER)])
    w.add_feed_forward_length(N_FF)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(1_000_000.0)
    w.add_shortconv_l_cache(L_CACHE)
    tokenizer = _tokenizer_fields()
    for key, (value, vtype, sub_type) in tokenizer.items():
        w.add_key_value(key, value, vtype, sub_type)
    n_vocab = len(tokenizer["tokenizer.ggml.tokens"][0])
    w.add_vocab_size(n_vocab)

    def tensor(name: str, shape: tuple[int, ...], std: float, f16: bool = True) -> None:
        a = rng.standard_normal(shape, dtype=np.float32) * std
        w.add_tensor(name, a.astype(np.float16 if f16 else np.float32))

    def ones(name: str, n: int) -> None:
        w.add_tensor(name, np.ones(n, dtype=np.float32))

    def linear(name: str, n_in: int, n_out: int) -> None:
        tensor(name, (n_out, n_in), 1.0 / np.sqrt(n_in))

    tensor("token_embd.weight", (n_vocab, N_EMBD), 0.1)
    ones("token_embd_norm.weight", N_EMBD)
    tensor("output.weight", (n_vocab, N_EMBD), 1.0)
    for il in range(N_LAYER):
        ones(f"blk.{il}.attn_norm.weight", N_EMBD)
        ones(f"blk.{il}.ffn_norm.weight", N_EMBD)
        if il in ATTENTION_LAYERS:
            linear(f"blk.{il}.attn_q.weight", N_EMBD, N_HEAD * HEAD_DIM)
            linear(f"blk.{il}.attn_k.weight", N_EMBD, N_HEAD_KV * HEAD_DIM)
            linear(f"blk.{il}.attn_v.weight", N_EMBD, N_HEAD_KV * HEAD_DIM)
            linear(f"blk.{il}.attn_output.weight", N_HEAD * HEAD_DIM, N_EMBD)
            ones(f"blk.{il}.attn_q_norm.weight", HEAD_DIM)
            ones(f"blk.{il}.attn_k_norm.weight", HEAD_DIM)
        else:
            tensor(f"blk.{il}.shortconv.conv.weight", (N_EMBD, L_CACHE), 0.5, f16=False)
            linear(f"blk.{il}.shortconv.in_proj.weight", N_EMBD, 3 * N_EMBD)
            linear(f"blk.{il}.shortconv.out_proj.weight", N_EMBD, N_EMBD)
        linear(f"blk.{il}.ffn_gate.weight", N_EMBD, N_FF)
        linear(f"blk.{il}.ffn_up.weight", N_EMBD, N_FF)
        linear(f"blk.{il}.ffn_down.weight", N_FF, N_EMBD)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    partial.replace(path)
    return path


def step_seconds(ctx: kvfork.Context, prompt: list[int], n: int) -> float:
    """Seconds per token of plain greedy generation of one branch."""
    b = kvfork.Branch.create(ctx, 0, {"temperature": 0.0})
    b.prefill_sync(prompt)
    t0 = time.perf_counter()
    for _ in b.generate_sync(n):
        pass
    dt = (time.perf_counter() - t0) / n
    b.prune_sync()
    return dt


def checkpoint_cost(model: kvfork.Model, threads: int | None) -> None:
    with kvfork.create_context_sync(model, n_ctx=4096, n_seq_max=4, n_threads=threads) as ctx:
        prompt = ctx.tokenize(PREAMBLE)
        step = step_seconds(ctx, prompt, 32)
        before = ctx.stats()
        for _ in range(8):
            b = kvfork.Branch.create(ctx, 0, {"temperature": 0.0})
            b.prefill_sync(prompt[:64])
            b.prefill_sync(prompt[64:128])
            b.prune_sync()
        s = ctx.stats()
        taken = s["checkpoints_taken"] - before["checkpoints_taken"]
        size = (s["checkpoint_bytes_taken"] - before["checkpoint_bytes_taken"]) / taken
        seconds = (s["checkpoint_seconds"] - before["checkpoint_seconds"]) / taken
        print(
            f"checkpoint: {size / 1024:.0f} KiB, {seconds * 1e3:.3f} ms each "
            f"({taken} taken); one decode step {step * 1e3:.1f} ms: "
            f"{seconds / step:.2%} of a step"
        )


def shared_preamble(model: kvfork.Model, threads: int | None, checkpoints: int) -> None:
    with kvfork.create_context_sync(
        model, n_ctx=8192, n_seq_max=8, n_threads=threads, checkpoints=checkpoints
    ) as ctx:
        cache = kvfork.PrefixCache(ctx)
        pre = ctx.tokenize(PREAMBLE)
        shared = total = 0
        t0 = time.perf_counter()
        for q in QUESTIONS:
            tokens = pre + ctx.tokenize(q, add_special=False)
            b = cache.branch_sync(tokens, {"temperature": 0.0})
            shared += cache.shared_tokens(b) or 0
            total += len(tokens)
            for _ in b.generate_sync(8):
                pass
            cache.release(b)
        wall = time.perf_counter() - t0
        print(
            f"shared preamble ({len(QUESTIONS)} prompts of ~{total // len(QUESTIONS)} tokens, "
            f"checkpoints={checkpoints}): {shared} of {total} prompt tokens reused, "
            f"wall {wall:.2f} s"
        )


def rejected_guesses(model: kvfork.Model, threads: int | None, rollback: int) -> None:
    """Speculative rounds (`Branch.speculate`) whose guess is two right tokens and a wrong
    one, against rounds whose three guessed tokens are right: the difference is what the
    rejection costs: the checkpoint put back and the kept tokens decoded again, or with
    `recurrent_rollback` (llama.cpp's per-token snapshots) the state rolled back at once."""
    rounds = 10
    with kvfork.create_context_sync(
        model, n_ctx=4096, n_seq_max=4, n_threads=threads, recurrent_rollback=rollback
    ) as ctx:
        prompt = ctx.tokenize(PREAMBLE)[:128]
        step = step_seconds(ctx, prompt, 24)
        root = kvfork.Branch.create(ctx, 0, {"temperature": 0.0})
        root.prefill_sync(prompt)
        expected = [t.token for t in root.fork_sync().generate_sync(4 * rounds + 4)]
        times: dict[bool, float] = {}
        for wrong in (False, True):
            b = root.fork_sync()
            before = ctx.stats()
            pending = b.produce_sync().token
            i, spent = 0, 0.0
            for _ in range(rounds):
                right = expected[i + 1 : i + 4]
                draft = [*right[:2], 7] if wrong else right
                t0 = time.perf_counter()
                accepted, nxt = b.speculate_sync(pending, draft)
                spent += time.perf_counter() - t0
                got = [pending, *(t.token for t in accepted), nxt.token]
                assert got == expected[i : i + len(got)], "a round must draw what plain draws"
                i += len(got) - 1
                pending = nxt.token
            times[wrong] = spent / rounds
            s = ctx.stats()
            b.prune_sync()
        restores = s["checkpoint_restores"] - before["checkpoint_restores"]
        replayed = s["replayed_tokens"] - before["replayed_tokens"]
        extra = times[True] - times[False]
        print(
            f"recurrent_rollback={rollback}: speculative round of 1 + 3 tokens: {times[False] * 1e3:.1f} ms all kept, "
            f"{times[True] * 1e3:.1f} ms with the third rejected ({restores} restores, "
            f"{replayed / max(restores, 1):.0f} tokens decoded again each); the rejection "
            f"costs {extra * 1e3:.1f} ms = {extra / step:.2f} of a one-token step "
            f"({step * 1e3:.1f} ms)"
        )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--cache", type=Path, default=Path.home() / ".cache" / "kvfork-bench")
    args = ap.parse_args()
    args.cache.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    path = write_lfm2_350m(args.cache / "lfm2-350m-shape-random-f16.gguf")
    print(
        f"model: {path} ({path.stat().st_size / 1e6:.0f} MB, ready in {time.perf_counter() - t0:.1f} s)"
    )
    model = kvfork.Model.load(path)
    print(f"family: {model.family}, {model.n_layer} layers")
    for r in range(args.repeat):
        print(f"--- round {r + 1}")
        checkpoint_cost(model, args.threads)
        for checkpoints in (16, 0):
            shared_preamble(model, args.threads, checkpoints)
        for rollback in (0, 4):
            rejected_guesses(model, args.threads, rollback)


if __name__ == "__main__":
    main()
