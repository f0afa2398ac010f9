"""Tiny random-weight GGUF models of other llama.cpp architecture families, written with the
`gguf` package, so tests can run the library on recurrent, hybrid, mixture-of-experts and
sliding-window models without downloading any.

Each model is 2-4 layers, 64 wide, f32, with SmolLM2's tokenizer (every `tokenizer.*` field,
chat template included, copied from the chat model's GGUF), so `vocab_size` is 49,152 and
prompts tokenize as they do for the chat model. The weights are random but fixed by a seed,
and scaled so that greedy generation is not degenerate:

- `token_embd` is small (std 0.1) and the layers' matrices ~1/sqrt(fan_in), so what the
  layers add outweighs the token's own embedding in the residual stream;
- the output matrix is the model's own (`output.weight`, std 1) where the architecture allows:
  with a random output tied to the embeddings, the logits are largest for the token just read
  and greedy repeats it forever.

`write_model(path, family)` writes one; `model_path(family, directory)` writes it once into a
directory and returns its path. Shapes here are numpy's, the reverse of ggml's:
ggml `{n_embd, n_vocab}` is numpy `(n_vocab, n_embd)`. The keys and tensors each architecture
needs are those of llama.cpp's `src/models/<arch>.cpp` (`load_arch_hparams`,
`load_arch_tensors`); a tensor the architecture does not use makes loading fail.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from pathlib import Path
from typing import Any

import gguf
import numpy as np

N_EMBD = 64
N_HEAD = 4
HEAD_DIM = N_EMBD // N_HEAD
N_FF = 128
CONTEXT_LENGTH = 4096
#: Small enough that tests with ~40-token prompts reach past the window.
SLIDING_WINDOW = 16
RMS_EPS = 1e-5
SEED = 1234

# Mamba (1 and 2) mixers
SSM_CONV_KERNEL = 4
SSM_D_INNER = 2 * N_EMBD  # llama.cpp's mamba and granitehybrid insist on an expansion of 2
SSM_D_STATE = 16
SSM_DT_RANK = 4
MAMBA2_D_STATE = 128  # what the CUDA scan supports (others fall back to the CPU)
MAMBA2_N_HEAD = 4  # ssm.time_step_rank: head_dim = d_inner / 4 = 32

# qwen3moe
N_EXPERT = 4
N_EXPERT_USED = 2
N_FF_EXP = 64

#: What each family exercises in the library's memory handling: "recurrent" (state, no KV
#: cache), "hybrid" (recurrent state and a KV cache), "hybrid_swa" (the same with a sliding
#: window on the attention layers), "moe" (a plain KV cache; experts routed per token) and
#: "swa" (sliding window on some layers).
KIND: dict[str, str] = {
    "mamba": "recurrent",
    "mamba2": "recurrent",
    "lfm2": "hybrid",
    "lfm2_swa": "hybrid_swa",
    "granitehybrid": "hybrid",
    "qwen3moe": "moe",
    "cohere2": "swa",
}

#: Every family `write_model` knows.
FAMILIES: tuple[str, ...] = tuple(KIND)
#: Families with a recurrent state: llama.cpp refuses to cut their sequences back (`seq_rm`
#: of a partial range returns false) and copies only the final state on `seq_cp`.
RECURRENT: frozenset[str] = frozenset(
    f for f, k in KIND.items() if k.startswith(("recurrent", "hybrid"))
)
#: Families with a sliding window (SLIDING_WINDOW tokens) on some attention layers.
SLIDING: frozenset[str] = frozenset(f for f, k in KIND.items() if k.endswith("swa"))


_Field = tuple[Any, gguf.GGUFValueType, gguf.GGUFValueType | None]


@functools.cache
def _tokenizer_fields() -> dict[str, _Field]:
    """SmolLM2's `tokenizer.*` fields: key -> (value, type, element type of an array). Read
    once per process (decoding its 49,152 tokens and merges takes ~2 s)."""
    import kvfork

    reader = gguf.GGUFReader(str(kvfork.default_chat_model_path()))
    fields = {}
    for key, field in reader.fields.items():
        if key.startswith("tokenizer."):
            vtype = field.types[0]
            sub_type = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
            fields[key] = (field.contents(), vtype, sub_type)
    return fields


class _Builder:
    """A GGUFWriter with the common keys written and random tensors drawn from one seed."""

    def __init__(self, path: Path, arch: str, family: str, n_layer: int, seed: int) -> None:
        self.writer = gguf.GGUFWriter(str(path), arch=arch)
        self.rng = np.random.default_rng(seed)
        self.n_layer = n_layer
        w = self.writer
        w.add_name(f"kvfork-tiny-{family}")
        w.add_file_type(gguf.LlamaFileType.ALL_F32)
        w.add_context_length(CONTEXT_LENGTH)
        w.add_embedding_length(N_EMBD)
        w.add_block_count(n_layer)
        tokenizer = _tokenizer_fields()
        for key, (value, vtype, sub_type) in tokenizer.items():
            w.add_key_value(key, value, vtype, sub_type)
        self.n_vocab = len(tokenizer["tokenizer.ggml.tokens"][0])
        w.add_vocab_size(self.n_vocab)

    def tensor(self, name: str, array: np.ndarray) -> None:
        self.writer.add_tensor(name, np.ascontiguousarray(array, dtype=np.float32))

    def normal(self, name: str, shape: tuple[int, ...], std: float) -> None:
        self.tensor(name, self.rng.standard_normal(shape) * std)

    def linear(self, name: str, n_in: int, n_out: int) -> None:
        """ggml `{n_in, n_out}`: maps n_in features to n_out."""
        self.normal(name, (n_out, n_in), 1.0 / np.sqrt(n_in))

    def ones(self, name: str, shape: tuple[int, ...]) -> None:
        self.tensor(name, np.ones(shape))

    def embeddings(self, output_norm: str = "output_norm", untied: bool = True) -> None:
        self.normal("token_embd.weight", (self.n_vocab, N_EMBD), 0.1)
        self.ones(f"{output_norm}.weight", (N_EMBD,))
        if untied:
            self.normal("output.weight", (self.n_vocab, N_EMBD), 1.0)

    def attention(self, il: int, n_head_kv: int, qk_norm: bool) -> None:
        self.linear(f"blk.{il}.attn_q.weight", N_EMBD, N_HEAD * HEAD_DIM)
        self.linear(f"blk.{il}.attn_k.weight", N_EMBD, n_head_kv * HEAD_DIM)
        self.linear(f"blk.{il}.attn_v.weight", N_EMBD, n_head_kv * HEAD_DIM)
        self.linear(f"blk.{il}.attn_output.weight", N_HEAD * HEAD_DIM, N_EMBD)
        if qk_norm:
            self.ones(f"blk.{il}.attn_q_norm.weight", (HEAD_DIM,))
            self.ones(f"blk.{il}.attn_k_norm.weight", (HEAD_DIM,))

    def ffn(self, il: int, norm: bool = True) -> None:
        if norm:
            self.ones(f"blk.{il}.ffn_norm.weight", (N_EMBD,))
        self.linear(f"blk.{il}.ffn_gate.weight", N_EMBD, N_FF)
        self.linear(f"blk.{il}.ffn_up.weight", N_EMBD, N_FF)
        self.linear(f"blk.{il}.ffn_down.weight", N_FF, N_EMBD)

    def dt_bias(self, name: str, n: int) -> None:
        """Inverse softplus of time steps drawn log-uniformly in [0.001, 0.1], as Mamba inits."""
        dt = np.exp(self.rng.uniform(np.log(1e-3), np.log(1e-1), n))
        self.tensor(name, dt + np.log(-np.expm1(-dt)))

    def mamba2_layer(
        self, il: int, d_inner: int, d_state: int, n_group: int, n_ssm_head: int
    ) -> None:
        """A Mamba-2 mixer (the `ssm_*` tensors of mamba2 and granitehybrid layers)."""
        conv_dim = d_inner + 2 * n_group * d_state
        d_in_proj = 2 * d_inner + 2 * n_group * d_state + n_ssm_head
        self.linear(f"blk.{il}.ssm_in.weight", N_EMBD, d_in_proj)
        self.normal(f"blk.{il}.ssm_conv1d.weight", (conv_dim, SSM_CONV_KERNEL), 0.5)
        self.tensor(f"blk.{il}.ssm_conv1d.bias", np.zeros(conv_dim))
        self.dt_bias(f"blk.{il}.ssm_dt.bias", n_ssm_head)
        # A = -exp(A_log) < 0 (decay); no ".weight" suffix on ssm_a and ssm_d.
        self.tensor(f"blk.{il}.ssm_a", -self.rng.uniform(1.0, 16.0, (n_ssm_head, 1)))
        self.ones(f"blk.{il}.ssm_d", (n_ssm_head, 1))
        self.ones(f"blk.{il}.ssm_norm.weight", (n_group, d_inner // n_group))
        self.linear(f"blk.{il}.ssm_out.weight", d_inner, N_EMBD)

    def finish(self) -> None:
        w = self.writer
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()


def _pure_ssm_keys(w: gguf.GGUFWriter, state_size: int, time_step_rank: int) -> None:
    """The keys of a model of state-space layers only (mamba, mamba2): no attention heads,
    no feed-forward, one inner size."""
    w.add_head_count(0)
    w.add_feed_forward_length(0)
    w.add_layer_norm_rms_eps(RMS_EPS)
    w.add_ssm_conv_kernel(SSM_CONV_KERNEL)
    w.add_ssm_inner_size(SSM_D_INNER)
    w.add_ssm_state_size(state_size)
    w.add_ssm_time_step_rank(time_step_rank)


def _mamba(path: Path, family: str, seed: int) -> None:
    b = _Builder(path, "mamba", family, n_layer=2, seed=seed)
    _pure_ssm_keys(b.writer, SSM_D_STATE, SSM_DT_RANK)
    b.embeddings()
    d, s, r = SSM_D_INNER, SSM_D_STATE, SSM_DT_RANK
    for il in range(b.n_layer):
        b.ones(f"blk.{il}.attn_norm.weight", (N_EMBD,))
        b.linear(f"blk.{il}.ssm_in.weight", N_EMBD, 2 * d)
        b.normal(f"blk.{il}.ssm_conv1d.weight", (d, SSM_CONV_KERNEL), 0.5)
        b.tensor(f"blk.{il}.ssm_conv1d.bias", np.zeros(d))
        b.linear(f"blk.{il}.ssm_x.weight", d, r + 2 * s)
        b.linear(f"blk.{il}.ssm_dt.weight", r, d)
        b.dt_bias(f"blk.{il}.ssm_dt.bias", d)
        # S4D-real init: A[:, n] = -(n + 1), the same for every channel.
        b.tensor(f"blk.{il}.ssm_a", -np.tile(np.arange(1, s + 1, dtype=np.float32), (d, 1)))
        b.ones(f"blk.{il}.ssm_d", (d,))
        b.linear(f"blk.{il}.ssm_out.weight", d, N_EMBD)
    b.finish()


def _mamba2(path: Path, family: str, seed: int) -> None:
    b = _Builder(path, "mamba2", family, n_layer=2, seed=seed)
    _pure_ssm_keys(b.writer, MAMBA2_D_STATE, MAMBA2_N_HEAD)
    b.writer.add_ssm_group_count(1)
    b.embeddings()
    for il in range(b.n_layer):
        b.ones(f"blk.{il}.attn_norm.weight", (N_EMBD,))
        b.mamba2_layer(il, SSM_D_INNER, MAMBA2_D_STATE, 1, MAMBA2_N_HEAD)
    b.finish()


def _lfm2(path: Path, family: str, seed: int, sliding_window: int = 0) -> None:
    # Short-convolution layers where head_count_kv is 0, attention (GQA) on the others.
    head_count_kv = [0, 2, 0, 2]
    b = _Builder(path, "lfm2", family, n_layer=len(head_count_kv), seed=seed)
    w = b.writer
    w.add_head_count(N_HEAD)
    w.add_head_count_kv(head_count_kv)
    w.add_feed_forward_length(N_FF)
    w.add_layer_norm_rms_eps(RMS_EPS)
    w.add_rope_freq_base(1_000_000.0)
    w.add_shortconv_l_cache(3)
    if sliding_window:
        w.add_sliding_window(sliding_window)
    b.embeddings(output_norm="token_embd_norm")  # lfm2's final norm has this name
    for il, n_kv in enumerate(head_count_kv):
        b.ones(f"blk.{il}.attn_norm.weight", (N_EMBD,))
        if n_kv:
            b.attention(il, n_kv, qk_norm=True)
        else:
            b.normal(f"blk.{il}.shortconv.conv.weight", (N_EMBD, 3), 0.5)
            b.linear(f"blk.{il}.shortconv.in_proj.weight", N_EMBD, 3 * N_EMBD)
            b.linear(f"blk.{il}.shortconv.out_proj.weight", N_EMBD, N_EMBD)
        b.ffn(il)
    b.finish()


def _granitehybrid(path: Path, family: str, seed: int) -> None:
    # Mamba-2 layers where head_count_kv is 0, attention on the others; dense FFN everywhere.
    head_count_kv = [0, 2, 0, 2]
    b = _Builder(path, "granitehybrid", family, n_layer=len(head_count_kv), seed=seed)
    w = b.writer
    w.add_head_count(N_HEAD)
    w.add_head_count_kv(head_count_kv)
    w.add_feed_forward_length(N_FF)
    w.add_layer_norm_rms_eps(RMS_EPS)
    w.add_ssm_conv_kernel(SSM_CONV_KERNEL)
    w.add_ssm_inner_size(SSM_D_INNER)
    w.add_ssm_state_size(MAMBA2_D_STATE)
    w.add_ssm_time_step_rank(MAMBA2_N_HEAD)
    w.add_ssm_group_count(1)
    b.embeddings()
    for il, n_kv in enumerate(head_count_kv):
        b.ones(f"blk.{il}.attn_norm.weight", (N_EMBD,))
        if n_kv:
            b.attention(il, n_kv, qk_norm=False)
        else:
            b.mamba2_layer(il, SSM_D_INNER, MAMBA2_D_STATE, 1, MAMBA2_N_HEAD)
        b.ffn(il)
    b.finish()


def _qwen3moe(path: Path, family: str, seed: int) -> None:
    b = _Builder(path, "qwen3moe", family, n_layer=2, seed=seed)
    w = b.writer
    w.add_head_count(N_HEAD)
    w.add_head_count_kv(2)
    w.add_key_length(HEAD_DIM)
    w.add_value_length(HEAD_DIM)
    w.add_rope_dimension_count(HEAD_DIM)
    w.add_rope_freq_base(1_000_000.0)
    w.add_feed_forward_length(N_FF)
    w.add_layer_norm_rms_eps(RMS_EPS)
    w.add_expert_count(N_EXPERT)
    w.add_expert_used_count(N_EXPERT_USED)
    w.add_expert_feed_forward_length(N_FF_EXP)
    b.embeddings()
    for il in range(b.n_layer):
        b.ones(f"blk.{il}.attn_norm.weight", (N_EMBD,))
        b.attention(il, 2, qk_norm=True)
        b.ones(f"blk.{il}.ffn_norm.weight", (N_EMBD,))
        # The router is larger than 1/sqrt(fan_in) so that the experts picked vary by token.
        b.normal(f"blk.{il}.ffn_gate_inp.weight", (N_EXPERT, N_EMBD), 1.0)
        # ggml {n_embd, n_ff_exp, n_expert} = numpy (n_expert, n_ff_exp, n_embd)
        b.normal(f"blk.{il}.ffn_gate_exps.weight", (N_EXPERT, N_FF_EXP, N_EMBD), N_EMBD**-0.5)
        b.normal(f"blk.{il}.ffn_up_exps.weight", (N_EXPERT, N_FF_EXP, N_EMBD), N_EMBD**-0.5)
        b.normal(f"blk.{il}.ffn_down_exps.weight", (N_EXPERT, N_EMBD, N_FF_EXP), N_FF_EXP**-0.5)
    b.finish()


def _cohere2(path: Path, family: str, seed: int) -> None:
    # llama.cpp's cohere2 always ties its output to token_embd: the embeddings stay small
    # (std 0.1) against what the layers add, which keeps greedy from echoing its input.
    # The default sliding_window_pattern (4) puts layers 0-2 in the window, layer 3 global.
    b = _Builder(path, "cohere2", family, n_layer=4, seed=seed)
    w = b.writer
    w.add_head_count(N_HEAD)
    w.add_head_count_kv(N_HEAD)
    w.add_feed_forward_length(N_FF)
    w.add_layer_norm_eps(RMS_EPS)
    w.add_rope_freq_base(10_000.0)
    w.add_sliding_window(SLIDING_WINDOW)
    w.add_logit_scale(10.0)
    b.embeddings(untied=False)
    for il in range(b.n_layer):
        b.ones(f"blk.{il}.attn_norm.weight", (N_EMBD,))
        b.attention(il, N_HEAD, qk_norm=False)
        b.ffn(il, norm=False)  # cohere2 runs attention and FFN in parallel off attn_norm
    b.finish()


_WRITERS: dict[str, Callable[[Path, str, int], None]] = {
    "mamba": _mamba,
    "mamba2": _mamba2,
    "lfm2": _lfm2,
    "lfm2_swa": functools.partial(_lfm2, sliding_window=SLIDING_WINDOW),
    "granitehybrid": _granitehybrid,
    "qwen3moe": _qwen3moe,
    "cohere2": _cohere2,
}
assert tuple(_WRITERS) == FAMILIES


def write_model(path: Path, family: str, seed: int = SEED) -> Path:
    """Write the tiny `family` model (one of FAMILIES) to `path`; the same seed gives the same
    bytes. Raises KeyError for an unknown family."""
    _WRITERS[family](path, family, seed)
    return path


def model_path(family: str, directory: Path) -> Path:
    """`directory/<family>.gguf`, written first if absent (through a temporary name, so a
    half-written file is never taken for a model)."""
    path = directory / f"{family}.gguf"
    if not path.exists():
        partial = directory / f"{family}.gguf.partial"
        write_model(partial, family)
        partial.replace(path)
    return path
