"""Type stubs of kvfork._native (the Rust extension)."""

from collections.abc import AsyncIterator, Awaitable, Generator, Iterable, Iterator, Sequence
from os import PathLike
from pathlib import Path
from types import TracebackType
from typing import (
    Any,
    Generic,
    Literal,
    SupportsIndex,
    TypeAlias,
    TypedDict,
    TypeVar,
    final,
    overload,
)

import numpy as np
import numpy.typing as npt
from typing_extensions import Self, Unpack

from ._speculative import Drafter, SpeculativeStream, SpeculativeStreamSync

__all__ = [
    "ArgumentTypeError",
    "Branch",
    "BranchDisposedError",
    "BranchStore",
    "ChatTemplateError",
    "Context",
    "ControlVector",
    "DecodeError",
    "FormattedChat",
    "GrammarError",
    "KvCacheFullError",
    "KvforkError",
    "KvforkWarning",
    "LeaseExhaustedError",
    "LoraAdapter",
    "Model",
    "ModelLoadError",
    "Operation",
    "PrefixCache",
    "Ready",
    "SamplingParams",
    "SpeculativeSchedule",
    "StateFileError",
    "Token",
    "TokenStream",
    "TokenStreamSync",
    "__version__",
    "_after_fork_in_child",
    "_check_main_interpreter",
    "_close_all_contexts",
    "_set_log_level",
    "_set_module_dirs",
    "_use_speculative_streams",
    "create_context",
    "create_context_sync",
    "json_schema_to_grammar",
    "system_info",
]

__version__: str

_T = TypeVar("_T")
_T_co = TypeVar("_T_co", covariant=True)

@final
class Ready(Generic[_T]):
    def __await__(self) -> Generator[Any, None, _T]: ...
    def __iter__(self) -> Generator[Any, None, _T]: ...
    def __next__(self) -> Any: ...

@final
class Operation(Generic[_T_co]):
    """The awaitable of a call that runs on the engine (a `Branch`, `BranchStore`, `Context` or
    `PrefixCache` method without `_sync`). The work is queued when the call is made; awaiting
    it gives the result. Cancelled, it either never ran, was rolled back, or completed. Never
    awaited (nor closed), it warns with a RuntimeWarning when dropped, as a never-awaited
    coroutine does: its work still happens, but its result and any error are lost."""

    def __await__(self) -> Generator[Any, None, _T_co]: ...
    def __iter__(self) -> Generator[Any, None, _T_co]: ...
    def __next__(self) -> Any: ...
    def send(self, _value: Any) -> Any:
        """Called by asyncio as it drives the await (the value sent in is not used)."""
    def throw(self, typ: Any, val: Any = None, _tb: Any = None) -> Any:
        """Called by asyncio with CancelledError when the awaiting task is cancelled."""
    def close(self) -> None:
        """Called when the awaiting coroutine is closed: stop the job if it has not started."""
    def done(self) -> bool:
        """Whether the reply has arrived."""

class KvforkError(Exception):
    """Base class of every kvfork error."""

class ModelLoadError(KvforkError):
    """A model file could not be loaded."""

class DecodeError(KvforkError):
    """llama_decode failed."""

class KvCacheFullError(DecodeError):
    """No room left in the KV cache."""

class LeaseExhaustedError(KvforkError):
    """Every KV sequence of the context is leased."""

class BranchDisposedError(KvforkError):
    """The branch was pruned."""

class GrammarError(KvforkError):
    """A grammar failed to parse or has no legal continuation."""

class ChatTemplateError(KvforkError):
    """A chat template is missing or failed to render."""

class StateFileError(KvforkError):
    """A saved state file is corrupt, truncated, foreign, or from another model."""

class KvforkWarning(UserWarning):
    """A call that works but likely not as meant (e.g. a branch created with nothing behind it)."""

class ArgumentTypeError(TypeError):
    """A TypeError about one argument, named in the message."""
    def add_note(self, note: str, /) -> None: ...

_Tokens: TypeAlias = Sequence[int] | npt.NDArray[np.integer[Any]]
_Base: TypeAlias = Literal["nats", "bits"]

@final
class Model:
    """Loaded GGUF weights and vocabulary, shareable by several contexts (loaded once).
    Load with `Model.load(path)`, or pass a path straight to `create_context`.
    """
    @staticmethod
    def load(
        path: str | PathLike[str], *, n_gpu_layers: int | None = None, use_mmap: bool = True
    ) -> Model:
        """Load a GGUF model (blocking; weights are memory-mapped by default). `n_gpu_layers`:
        layers to offload to the GPU (None: all on a GPU build, else 0). Raises ModelLoadError
        for a file that cannot be loaded.
        """
    @property
    def vocab_size(self) -> int:
        """Number of tokens in the vocabulary (the length of a logits row)."""
    @property
    def n_ctx_train(self) -> int:
        """The context length the model was trained with (GGUF metadata), in tokens."""
    @property
    def n_embd(self) -> int:
        """Width of the model's hidden state (the embedding size)."""
    @property
    def name(self) -> str:
        """The GGUF `general.name`, or the file name without its extension when that is missing."""
    @property
    def path(self) -> Path:
        """The path the model was loaded from."""
    @property
    def metadata(self) -> dict[str, str]:
        """Every GGUF metadata key with its value as a string (llama.cpp summarises arrays)."""
    @property
    def chat_template(self) -> str | None:
        """The GGUF's Jinja chat template (`tokenizer.chat_template`), or None when it has none."""
    @property
    def n_layer(self) -> int:
        """Transformer blocks (layers)."""
    @property
    def family(self) -> str:
        """The model's family: `"transformer"`, `"recurrent"` (Mamba, RWKV) or `"hybrid"`
        (attention beside recurrent or convolution layers: LFM2, Granite 4 hybrids, Jamba,
        Nemotron-H), with `"+sliding-window"` and `"+moe"` where they apply. On a recurrent or
        hybrid model a fork inside a sequence or a rollback goes through recurrent-state
        checkpoints (see the model-families table in the docs).
        """
    @property
    def is_recurrent(self) -> bool:
        """Whether the model keeps a recurrent state, alone (`"recurrent"`) or beside a KV cache
        (`"hybrid"`).
        """
    @property
    def n_swa(self) -> int:
        """The window of its sliding-window attention layers; 0 when it has none."""
    @property
    def n_expert(self) -> int:
        """Experts of a mixture-of-experts model; 0 for a dense one."""
    def load_lora(self, path: str | PathLike[str]) -> LoraAdapter:
        """Load a LoRA adapter (GGUF) for this model (blocking). Raises ModelLoadError for a
        file of another architecture, with shapes that do not fit, truncated, or not a LoRA.
        """
    def load_control_vector(self, source: str | PathLike[str] | npt.ArrayLike) -> ControlVector:
        """A control vector from a GGUF file (llama.cpp's `direction.N` tensors) or from an
        array of shape `(n_layer, n_embd)`.
        """

@final
class LoraAdapter:
    """A LoRA adapter (GGUF) loaded for one model: `model.load_lora(path)`. Apply it to branches
    with `branch.set_adapters({adapter: scale})`; it lives as long as its model.
    """
    @property
    def path(self) -> Path:
        """The file it was loaded from."""
    @property
    def fingerprint(self) -> int:
        """A checksum of the file's bytes (saved with the branches that use it)."""
    def __eq__(self, value: object, /) -> bool: ...
    def __hash__(self) -> int: ...

@final
class ControlVector:
    """A control vector (activation steering): one direction per layer, shape
    `(n_layer, n_embd)`, row r added to the output of llama.cpp's layer r + 1 (its layer 0
    takes none). `model.load_control_vector(path_or_array)`; apply it with
    `branch.set_control_vector(cv, scale, layers=(start, end))`.
    """
    @property
    def shape(self) -> tuple[int, int]:
        """`(n_layer, n_embd)`."""
    def to_numpy(self) -> npt.NDArray[np.float32]:
        """The directions as a float32 numpy array of `shape` (a copy)."""
    @property
    def path(self) -> Path | None:
        """The file it was loaded from, or None (made from an array)."""

@final
class SamplingParams:
    """Parameters of a branch's sampler chain. `temperature <= 0` means greedy; `seed=None`
    draws a fresh random seed. Order: penalties → DRY → top-n-sigma → top-k → typical →
    top-p → min-p → XTC → temperature → draw (Mirostat replaces the truncations).
    Immutable: `replace(**changes)` makes a copy; a bad value raises TypeError or
    ValueError naming the field.
    """
    def __new__(
        cls,
        *,
        temperature: float = 0.8,
        top_k: int = 40,
        top_p: float = 0.95,
        min_p: float = 0.05,
        typical_p: float = 1.0,
        top_n_sigma: float = -1.0,
        seed: int | None = None,
        repeat_penalty: float = 1.0,
        frequency_penalty: float = 0.0,
        presence_penalty: float = 0.0,
        penalty_last_n: int = 64,
        mirostat: int = 0,
        mirostat_tau: float = 5.0,
        mirostat_eta: float = 0.1,
        dry_multiplier: float = 0.0,
        dry_base: float = 1.75,
        dry_allowed_length: int = 2,
        dry_penalty_last_n: int = -1,
        xtc_probability: float = 0.0,
        xtc_threshold: float = 0.1,
    ) -> SamplingParams: ...
    @property
    def temperature(self) -> float:
        """Divides the logits before the draw: higher is more random. `<= 0` keeps only the most
        likely token: greedy (with Mirostat on, after its filters, as llama.cpp's). Default 0.8.
        """
    @property
    def top_k(self) -> int:
        """Keep only the `top_k` most likely tokens; 0 disables. Default 40."""
    @property
    def top_p(self) -> float:
        """Nucleus sampling: keep the most likely tokens until their probabilities sum to
        `top_p`; 1.0 disables. Default 0.95.
        """
    @property
    def min_p(self) -> float:
        """Drop tokens less likely than `min_p` times the most likely one; 0 disables.
        Default 0.05.
        """
    @property
    def typical_p(self) -> float:
        """Locally typical sampling: keep the tokens whose surprisal is closest to the entropy,
        up to this total probability; 1.0 disables (the default).
        """
    @property
    def top_n_sigma(self) -> float:
        """Keep tokens whose logit is within `top_n_sigma` standard deviations of the best;
        `<= 0` disables (default -1.0).
        """
    @property
    def seed(self) -> int | None:
        """Seed of the branch's RNG (XTC, the draw, Mirostat), an int in [0, 2**32); None (the
        default) draws a fresh random seed.
        """
    @property
    def repeat_penalty(self) -> float:
        """Divides positive logits (multiplies negative ones) of tokens in the penalty window;
        1.0 disables (the default).
        """
    @property
    def frequency_penalty(self) -> float:
        """Subtracted from a token's logit once per occurrence in the penalty window; 0 disables
        (the default).
        """
    @property
    def presence_penalty(self) -> float:
        """Subtracted from the logit of every token present in the penalty window; 0 disables
        (the default).
        """
    @property
    def penalty_last_n(self) -> int:
        """The penalty window: how many recently accepted tokens the repeat, frequency and
        presence penalties look at; -1 = the whole context, 0 disables them. Default 64. A
        window longer than the model's training context is that long.
        """
    @property
    def mirostat(self) -> int:
        """Mirostat: 0 off (the default), 1 Mirostat, 2 Mirostat 2.0. When on it replaces the
        truncation filters (top-k, typical, top-p, min-p) and XTC, and aims at a steady surprise.
        """
    @property
    def mirostat_tau(self) -> float:
        """Mirostat's target surprise, in bits; its threshold `mu` starts at 2 * tau. Default 5.0."""
    @property
    def mirostat_eta(self) -> float:
        """Mirostat's learning rate: how fast `mu` moves towards the target. Default 0.1."""
    @property
    def dry_multiplier(self) -> float:
        """Strength of the DRY penalty on tokens that would extend a repeated sequence; 0 disables
        (the default).
        """
    @property
    def dry_base(self) -> float:
        """DRY's penalty grows as `dry_base` to the power of the repeat's length past
        `dry_allowed_length`; must be >= 1. Default 1.75.
        """
    @property
    def dry_allowed_length(self) -> int:
        """Repeats up to this many tokens long go unpenalised by DRY. Default 2."""
    @property
    def dry_penalty_last_n(self) -> int:
        """How many recent tokens DRY scans for repeats (at most the model's training context);
        -1 = the whole context (the default),
        0 disables DRY.
        """
    @property
    def xtc_probability(self) -> float:
        """XTC: the chance, per draw, that it removes the top choices; 0 disables (the default)."""
    @property
    def xtc_threshold(self) -> float:
        """XTC removes every token at least this likely except the least likely of them; above
        0.5 it never fires. Default 0.1.
        """
    def __getnewargs_ex__(self) -> tuple[tuple[()], dict[str, Any]]:
        """Pickling (Ray job arguments): `SamplingParams(**fields)` again."""
    def replace(self, **changes: Any) -> SamplingParams:
        """A copy with some fields changed."""
    def to_dict(self) -> dict[str, Any]:
        """The fields as a dict."""
    def __hash__(self) -> int: ...

_Params: TypeAlias = SamplingParams | dict[str, Any] | None

@final
class Token:
    """A sampled token: immutable `(token, text, is_stop)` that unpacks, indexes, slices,
    compares and hashes like that tuple, as a NamedTuple does (`tok, text, stop = t`;
    `t == (tok, text, stop)`). Returned by `produce`, `generate` and `BranchStore.step`, and
    accepted wherever a token id is.
    """
    def __new__(cls, token: int, text: str, is_stop: bool) -> Token: ...
    @property
    def token(self) -> int:
        """The token id."""
    @property
    def text(self) -> str:
        """The token's text piece (special tokens rendered; invalid UTF-8 replaced)."""
    @property
    def is_stop(self) -> bool:
        """True for an end-of-generation token (as `Context.is_stop_token`); generation stops
        there without committing it.
        """
    def __getnewargs__(self) -> tuple[int, str, bool]:
        """Pickling (Ray jobs return tokens): `Token(token, text, is_stop)` again."""
    def __index__(self) -> int: ...
    def __len__(self) -> int: ...
    @overload
    def __getitem__(self, key: SupportsIndex, /) -> int | str | bool: ...
    @overload
    def __getitem__(self, key: slice, /) -> tuple[int | str | bool, ...]: ...
    def __iter__(self) -> Iterator[Any]: ...
    def __eq__(self, other: object, /) -> bool: ...
    def __ne__(self, other: object, /) -> bool: ...
    def __lt__(self, other: Token | tuple[Any, ...], /) -> bool: ...
    def __le__(self, other: Token | tuple[Any, ...], /) -> bool: ...
    def __gt__(self, other: Token | tuple[Any, ...], /) -> bool: ...
    def __ge__(self, other: Token | tuple[Any, ...], /) -> bool: ...
    def __hash__(self) -> int: ...

@final
class FormattedChat:
    """A rendered conversation: the prompt to tokenize (with `parse_special=True`) and the strings
    that end an assistant turn besides end-of-generation tokens.
    """
    @property
    def prompt(self) -> str:
        """The rendered text; tokenize it with `parse_special=True` so the template's markup
        becomes special tokens.
        """
    @property
    def stop(self) -> list[str]:
        """The template's turn-end strings (a list, possibly empty): cut the reply at the first
        one. End-of-generation tokens stop generation anyway.
        """

@final
class Context:
    """A llama context: owns a unified KV cache and the engine thread that runs every decode."""
    @property
    def model(self) -> Model:
        """The Model this context runs (possibly shared with other contexts)."""
    @property
    def n_ctx(self) -> int:
        """Size of the unified KV cache in cells, shared by all branches (a shared prefix counts
        once); also the furthest position a branch can reach. llama.cpp rounds the `n_ctx`
        asked for up to a multiple of 256: this is the size it made (64 asked gives 256).
        """
    @property
    def n_batch(self) -> int:
        """Most tokens one llama_decode takes; longer prefills and wider commits are split into
        ceil(total / n_batch) decodes.
        """
    @property
    def n_seq_max(self) -> int:
        """Number of KV sequences (leases): how many branches can be live at once."""
    @property
    def vocab_size(self) -> int:
        """Number of tokens in the model's vocabulary (the length of a logits row)."""
    @property
    def device_sampling(self) -> bool:
        """True when the context samples on the device (`create_context(device_sampling=True)`):
        a branch's row is decoded again the first time it is read, and a grammar, logit bias
        or steer set before the decode whose output it samples spares that decode.
        """
    @property
    def closed(self) -> bool:
        """True once the context is closed (by `close`, leaving a `with` block, or an internal
        error); most calls then raise KvforkError.
        """
    @property
    def n_threads(self) -> int:
        """Threads single-token decodes use now. Unless `create_context` fixed `n_threads`, the
        count adapts to the machine's load: it drops while other processes take the cores
        (busy-waiting threads would only slow each other down) and comes back when they leave.
        """
    @property
    def n_threads_batch(self) -> int:
        """Threads multi-token decodes (prefills, batched steps) use now; adapts like
        `n_threads` unless `create_context` fixed `n_threads_batch`.
        """
    @property
    def eog_token(self) -> int | None:
        """The model's end-of-sequence token id, or None if the vocabulary has none. Other tokens
        may also end generation (e.g. end-of-turn): test with `is_stop_token`.
        """
    @property
    def bos_token(self) -> int | None:
        """The model's beginning-of-sequence token id, or None if the vocabulary has none."""
    def tokenize(
        self, text: str, add_special: bool = True, parse_special: bool = False
    ) -> list[int]:
        """Token ids of `text`, exactly as llama.cpp tokenizes it. `add_special` adds BOS etc. as
        the model asks; `parse_special` reads special-token text (e.g. "<|im_start|>") as those
        tokens. Raises KvforkError when the context is closed.
        """
    def detokenize(
        self, tokens: _Tokens, *, remove_special: bool = False, unparse_special: bool = False
    ) -> str:
        """The text of `tokens`, as llama.cpp detokenizes it. `remove_special` drops the BOS/EOS the
        model adds; `unparse_special` renders special tokens as their text. Raises
        KvforkError when the context is closed, ValueError for a token id out of range.
        """
    def token_to_bytes(self, token: int) -> bytes:
        """The raw bytes of one token's piece (special tokens rendered): a piece may be part of a
        UTF-8 character, which `token_to_text` replaces. Raises KvforkError when the context is
        closed, ValueError for a token id out of range.
        """
    def token_to_text(self, token: int) -> str:
        """The text piece of one token (special tokens rendered, invalid UTF-8 replaced). Raises
        KvforkError when the context is closed, ValueError for a token id out of range.
        """
    def is_stop_token(self, token: int) -> bool:
        """True when `token` ends generation in this vocabulary (EOS, end-of-turn and the other
        end-of-generation tokens). ValueError for a token id out of range.
        """
    def kv_seq_copy(self, src: int, dst: int, p0: int = 0, p1: int = -1) -> None:
        """Copy cells of `src` into `dst` (positions [p0, p1), -1 = open). Bypasses branch tenancy.
        Queued in order with all engine work; returns without waiting. On a recurrent or
        hybrid model only the whole sequence can be copied: a part is a ValueError.
        """
    def kv_seq_keep(self, seq: int) -> None:
        """Remove every cell not of `seq`. Bypasses branch tenancy. Returns without waiting."""
    def kv_seq_remove(self, seq: int, p0: int = 0, p1: int = -1) -> bool:
        """Remove the cells of `seq` in [p0, p1) (-1 = open). Returns False, removing nothing, when
        a partial removal is impossible (recurrent models). Returns without waiting.
        """
    def kv_seq_pos_max(self, seq: int) -> Operation[int]:
        """Largest position stored for `seq` (-1 when empty), after all queued work."""
    def kv_seq_pos_max_sync(self, seq: int) -> int:
        """Blocking twin of `kv_seq_pos_max`: returns the position. Waits without the GIL; Ctrl-C cancels it all-or-nothing and raises KeyboardInterrupt."""
    def kv_clear(self) -> None:
        """Empty the whole KV cache. Bypasses branch tenancy. Returns without waiting."""
    def decode(self, tokens: _Tokens, position: int, seq_id: int) -> Operation[None]:
        """Raw decode (lloyal.node's `ctx.decode(tokens, position, seqId)`): `tokens` into
        sequence `seq_id` from `position`, in ceil(n / n_batch) decodes, keeping the last
        token's logits as the sequence's output (`Branch.create(ctx, position, params,
        seq_id=...)` then `capture_logits()` takes both over). `position` must follow the
        sequence's cells when it has any. ValueError for a sequence a branch holds (decode
        through the branch), a bad id, position or token, or no tokens; KvCacheFullError
        past n_ctx. All or nothing; cancelled, it either never ran or completed.
        """
    def decode_sync(self, tokens: _Tokens, position: int, seq_id: int) -> None:
        """Blocking twin of `decode`: returns None once the tokens are decoded. Waits without the GIL; Ctrl-C cancels it all-or-nothing, as an await would, and raises KeyboardInterrupt."""
    def model_entropy(self, base: _Base = "nats") -> float:
        """Entropy of the context's last output (the logits of the last `decode`, or the
        snapshot of the branch whose decode ran last), in nats (or bits with `base="bits"`).
        KvforkError before any decode; ValueError for another `base`.
        """
    def model_surprisal(self, token: int, base: _Base = "nats") -> float:
        """-log p(`token`) under the context's last output (see `model_entropy`), in nats (or
        bits with `base="bits"`); inf for a masked token. KvforkError before any decode;
        ValueError for a token id out of range or another `base`.
        """
    def snapshot(self) -> Operation[bytes]:
        """Every live branch and the whole KV cache as bytes, after queued work: what
        `save_state` writes to a file (the same framing and checks), kept in memory.
        """
    def snapshot_sync(self) -> bytes:
        """Blocking twin of `snapshot`: returns the snapshot as bytes. Waits without the GIL; Ctrl-C cancels it all-or-nothing, as an await would, and raises KeyboardInterrupt."""
    def restore(self, data: bytes | bytearray) -> Operation[list[Branch]]:
        """Return to a `snapshot` (or a `save_state` file's bytes): the bytes are checked
        first, and a corrupt, truncated or foreign snapshot raises StateFileError,
        changing nothing. Then every live branch is disposed (its handles raise
        BranchDisposedError), the whole KV cache is replaced, and the snapshot's branches
        come back as new Branch objects, each after its parent, on the sequences they had
        (an await cancelled after they came back prunes them: nobody holds them).
        """
    def restore_sync(self, data: bytes | bytearray) -> list[Branch]:
        """Blocking twin of `restore`: returns the restored branches, each after its parent;
        StateFileError for a corrupt, truncated or foreign snapshot. Waits without the GIL;
        Ctrl-C cancels it all-or-nothing, as an await would, and raises KeyboardInterrupt.
        """
    def save_state(self, path: str | PathLike[str]) -> Operation[None]:
        """Save every live branch (its record and tree links) and the whole KV cache to
        `path`, after queued work. Shared prefixes are stored once.
        """
    def save_state_sync(self, path: str | PathLike[str]) -> None:
        """Blocking twin of `save_state`: returns None once the file is written. Waits without the GIL; Ctrl-C cancels it all-or-nothing, as an await would, and raises KeyboardInterrupt."""
    def load_state(self, path: str | PathLike[str]) -> Operation[list[Branch]]:
        """Restore a `save_state` file into this context, which must have no live branch; the
        model must be the same. Returns the restored branches, each after its parent (an await
        cancelled after they came back prunes them: nobody holds them).
        A corrupt, truncated or foreign file raises StateFileError.
        """
    def load_state_sync(self, path: str | PathLike[str]) -> list[Branch]:
        """Blocking twin of `load_state`: returns the restored branches, each after its parent;
        StateFileError for a corrupt, truncated or foreign file. Waits without the GIL; Ctrl-C
        cancels it all-or-nothing, as an await would, and raises KeyboardInterrupt.
        """
    @property
    def embedding_dim(self) -> int:
        """Width of the vectors `embed` returns."""
    def embed(
        self, text_or_tokens: str | _Tokens, *, normalize: bool = True
    ) -> Operation[npt.NDArray[np.float32]]:
        """Embedding of one text (str) or token list, as a float32 array of `embedding_dim`
        (shape `(n_tokens, embedding_dim)` on a context with pooling "none"). Needs a context
        created with `embeddings=True` and no live branches.
        """
    def embed_sync(
        self, text_or_tokens: str | _Tokens, *, normalize: bool = True
    ) -> npt.NDArray[np.float32]:
        """Blocking twin of `embed`: returns the float32 array. KvforkError on a context without
        `embeddings=True`. Waits without the GIL; Ctrl-C cancels it all-or-nothing, as an await
        would, and raises KeyboardInterrupt.
        """
    def embed_batch(
        self, texts: Iterable[str | _Tokens], *, normalize: bool = True
    ) -> Operation[npt.NDArray[np.float32]]:
        """Embeddings of many texts (str or token lists), shape `(len(texts), embedding_dim)`,
        packed into as few decodes as fit (one text per sequence, each text whole in a batch).
        """
    def embed_batch_sync(
        self, texts: Iterable[str | _Tokens], *, normalize: bool = True
    ) -> npt.NDArray[np.float32]:
        """Blocking twin of `embed_batch`: returns a float32 array of shape
        `(len(texts), embedding_dim)`. Waits without the GIL; Ctrl-C cancels it all-or-nothing,
        as an await would, and raises KeyboardInterrupt.
        """
    def format_chat(
        self,
        messages: Sequence[dict[str, Any]],
        *,
        add_generation_prompt: bool = True,
        tools: Sequence[dict[str, Any]] | None = None,
        template: str | None = None,
        **kwargs: Any,
    ) -> FormattedChat:
        """Render `messages` (OpenAI-style dicts: role, content, optional tool_calls /
        tool_call_id) with the model's own chat template (GGUF `tokenizer.chat_template`, as
        Hugging Face's `apply_chat_template` renders it), or with `template`: a Jinja string or
        a llama.cpp built-in name such as "chatml". Extra keyword arguments become template
        variables. Raises ChatTemplateError for a bad message, a template error, or a model
        without a template when none is given.
        """
    def _debug_panic(self) -> None:
        """Make the engine thread panic (tests of the panic path only)."""
    def stats(self) -> dict[str, int | float]:
        """Counters since the context was created:
        - `decode_calls`: `llama_decode` invocations (one per BranchStore step or coalesced
          group of commits, ceil(tokens / n_batch) per prefill, one per embed group);
        - `decoded_tokens`: tokens those decodes wrote (failed decodes not counted);
        - `decode_seconds`: wall time spent in `llama_decode` (on a GPU, until its outputs
          are ready);
        - `padded_rows`: rows added to decodes (their logits unread) so that the outputs fill
          whole tiles of the CPU's output matmul, where that is cheaper (x86 with AVX-512 and
          Q8_0/Q4_0/Q5_0/IQ4_NL output weights; `KVFORK_NO_OUTPUT_PADDING` turns it off);
        - `scratch_tokens`: tokens of new prompts prefilled in a scratch context that holds
          only them (a busy cache slows every prefill decode; `KVFORK_NO_SCRATCH_PREFILL`
          turns it off), then moved into the cache;
        - `mixed_decodes`: decodes that held the next chunk of prompts being prefilled and
          one token of each stream stepping meanwhile (continuous prefill;
          `KVFORK_NO_CONTINUOUS_PREFILL` turns it off);
        - `commit_requests`: commit requests served — each `commit` or generation step, and
          each `store.commit` / `store.step` (one request for all its branches); concurrent
          requests coalesced into one decode each count;
        - `commit_seconds`: wall time the engine thread spent on groups of those requests,
          their decodes included: with `decode_seconds`, the engine's own time per step, and
          what a caller's step takes besides (the hand-over to the engine thread and back,
          Python). A step replies once its decode is queued, and the engine then waits for
          the decode's rows and reads them while the caller goes on (a row read waits for
          them; `KVFORK_LAND_BEFORE_REPLY` reads them first): that part is counted, in both
          counters, when it ends, so stats read right after a step may not hold it yet;
        - `parked_branches`, `parked_bytes`: branches parked in host memory now and the bytes
          of KV cells they hold there (`park=True` contexts; 0 otherwise);
        - `parks`, `unparks`: times a branch was moved to host memory and brought back;
        - `checkpoints`, `checkpoint_bytes`: recurrent-state checkpoints the live branches
          hold now and their bytes in host memory (recurrent and hybrid models; 0 otherwise);
        - `checkpoints_taken`, `checkpoint_bytes_taken`: checkpoints taken so far (at the end
          of each prefill decode and before a speculative guess) and their bytes;
          `checkpoint_seconds`: time spent copying them out;
        - `checkpoint_restores`: checkpoints put back (a fork inside a sequence, a rejected
          guess, a rolled-back decode); `replayed_tokens`: tokens decoded again after them.
        """
    def close(self) -> None:
        """Free the context (after queued work). Idempotent; later use raises KvforkError."""
    def __enter__(self) -> Self:
        """A closed context is refused here, not at its first call inside the block."""
    def __exit__(
        self,
        exc_type: type[BaseException] | None = None,
        exc: BaseException | None = None,
        tb: TracebackType | None = None,
    ) -> Literal[False]: ...
    def __aenter__(self) -> Awaitable[Self]: ...
    def __aexit__(
        self,
        exc_type: type[BaseException] | None = None,
        exc: BaseException | None = None,
        tb: TracebackType | None = None,
    ) -> Operation[Literal[False]]: ...

class _ContextOptions(TypedDict, total=False):
    """The keyword options of `create_context` and `create_context_sync`, written once;
    `kvfork.create_context` documents them, with their defaults."""

    n_ctx: int
    n_batch: int
    n_seq_max: int
    n_threads: int | None
    n_threads_batch: int | None
    type_k: str
    type_v: str
    embeddings: bool
    pooling: str | None
    n_gpu_layers: int | None
    park: bool
    checkpoints: int
    checkpoint_bytes: int
    recurrent_rollback: int
    device_sampling: bool

def create_context(
    path_or_model: str | PathLike[str] | Model,
    **options: Unpack[_ContextOptions],
) -> Operation[Context]:
    """Create a context (async): loads the model if given a path, on a thread of its own (the
    event loop never waits). Cancelled before it finishes, it creates nothing: the context is
    freed as soon as it is built.
    """

def create_context_sync(
    path_or_model: str | PathLike[str] | Model,
    **options: Unpack[_ContextOptions],
) -> Context:
    """Create a context (blocking twin of `create_context`)."""

_StopReason: TypeAlias = Literal["stop_token", "max_tokens", "context_full"]
_OnContextFull: TypeAlias = Literal["stop", "shift"]

@final
class TokenStream:
    """`async for tok in branch.generate(max_tokens)`. A cancelled step either never ran or
    completed (its token is committed but not yielded).
    """
    @property
    def stop_reason(self) -> _StopReason | None:
        """Why the stream ended: "stop_token" (an end-of-generation token, not committed),
        "max_tokens", or "context_full" (the branch reached n_ctx with
        `on_context_full="stop"`: `shift_context` or `reseed_context` makes room); None while
        it runs.
        """
    @property
    def shifts(self) -> int:
        """Context shifts so far (`on_context_full="shift"`)."""
    def __aiter__(self) -> TokenStream: ...
    def __anext__(self) -> Operation[Token]: ...

@final
class TokenStreamSync:
    """`for tok in branch.generate_sync(max_tokens)`."""
    @property
    def stop_reason(self) -> _StopReason | None:
        """Why the stream ended: "stop_token", "max_tokens" or "context_full"; None while it runs."""
    @property
    def shifts(self) -> int:
        """Context shifts so far (`on_context_full="shift"`)."""
    def __iter__(self) -> TokenStreamSync: ...
    def __next__(self) -> Token: ...

@final
class SpeculativeSchedule:
    """The budget and guess length of speculative rounds (`kvfork::SpeculativeSchedule`), for the
    streams of `kvfork._speculative`, which only await the drafter and the engine.
    """
    def __new__(
        cls,
        max_tokens: int | None = None,
        *,
        on_context_full: _OnContextFull = "stop",
        keep: int = 4,
    ) -> Self: ...
    def shift_due(self, branch: Branch) -> int | None:
        """Before a round: the `keep` of the context shift the stream must make first (the
        branch is at n_ctx and the stream shifts; counted in `shifts`), else None.
        """
    @property
    def shifts(self) -> int:
        """Context shifts so far."""
    @property
    def resting(self) -> bool:
        """Whether the guess-length policy found that guessing does not pay here (it decodes
        the pending token alone, with a short probe now and then).
        """
    def yielded_one(self) -> None:
        """Count one token handed to the caller."""
    def ended(self) -> bool:
        """Whether the stream is over before another round (setting `stop_reason`)."""
    def guess_len(self, branch: Branch, pending: Token) -> int | None:
        """How many guessed tokens this round may decode after `pending` on `branch` (0: decode
        `pending` alone), or None when the stream ends at `pending` (a stop token, or a full
        context).
        """
    @property
    def shadowing(self) -> bool:
        """Whether this round asks the drafter even when `guess_len` gave 0: the guess is not
        decoded but checked against the tokens the chain draws next (the acceptance measured
        for free, while the drafter costs at most a small share of a one-token round).
        """
    def proposed(self, guess: Sequence[int], len: int) -> list[int]:
        """The drafter guessed `guess` for a round of `len` guessed tokens (from `guess_len`):
        records the drafter's time, keeps the tokens after the draft for shadow checks, and
        starts timing the decode. Returns the draft: `guess` cut to `len` (ValueError for a
        token in it out of range).
        """
    def took(self, drafted: int, accepted: int, next: Token) -> None:
        """Record a round: `drafted` guessed tokens decoded, `accepted` of them kept, `next` the
        token the chain drew after them.
        """
    @property
    def stop_reason(self) -> _StopReason | None:
        """Why the stream ended: "stop_token", "max_tokens" or "context_full"; None while it runs."""
    @property
    def rounds(self) -> int:
        """Rounds run (decodes of a pending token plus its guess)."""
    @property
    def drafted(self) -> int:
        """Guessed tokens decoded over all rounds."""
    @property
    def accepted(self) -> int:
        """Guessed tokens the chain drew too."""
    @property
    def acceptance(self) -> float:
        """Share of guessed tokens the chain drew too (0 before any guess)."""

@final
class Branch:
    """One decode sequence on its own KV lease, with its own sampler chain, grammar, logit bias,
    steer, logits snapshot and perplexity trackers; forks share their parent's KV prefix.
    Made by `Branch.create(ctx, ...)` or `fork()`; it holds its lease until `prune()`, and any
    use after that raises BranchDisposedError.
    """
    @classmethod
    def create(
        cls,
        ctx: Context,
        position: int = 0,
        params: _Params = None,
        *,
        grammar: str | None = None,
        seq_id: int | None = None,
    ) -> Branch:
        """A new root branch on a fresh KV lease. At position 0 (the usual start: prefill the
        prompt next) it is cheap and non-blocking: no decode, and no wait for the engine
        (emptying the lease is queued ahead of the branch's own work).

        Past 0 or with `seq_id` it takes cells over (the raw layer: after
        `await ctx.decode(prompt, 0, seq)`), waiting without the GIL for the engine to check
        them after queued work. `seq_id` leases that very sequence, whose cells must end at
        `position - 1` (ValueError otherwise; LeaseExhaustedError when a branch holds it).
        Without `seq_id` the lowest free lease is taken, its cells kept when they end at
        `position - 1`, else emptied with a KvforkWarning (nothing would be behind the
        branch). LeaseExhaustedError when all `n_seq_max` leases are taken; ValueError for a
        bad argument. A blank `grammar` means none.
        """
    def prefill(self, tokens: _Tokens) -> Operation[None]:
        """Decode external tokens at the branch's position (no accept); captures the last
        logits. Prefills of other tasks issued at the same time are packed into the same
        decodes. Cancelled, it either never ran or was aborted and rolled back: nothing
        happened.
        """
    def prefill_sync(self, tokens: _Tokens) -> None:
        """Blocking twin of `prefill`: returns None once the tokens are decoded. Waits without the GIL; Ctrl-C aborts and rolls the prefill back, then raises KeyboardInterrupt."""
    @overload
    def score(self, tokens: _Tokens, top_logprobs: None = None) -> Operation[list[float]]:
        """Prefill `tokens` (as `prefill`: no accept, the last logits become the snapshot) and
        score each: its natural-log probability given the branch's tokens and those before
        it, under the raw logits (model level: no grammar, bias or chain; -inf for a masked
        token). `sum(await b.score(continuation))` is the continuation's log-likelihood.
        The first token is scored from the snapshot: KvforkError before the first prefill
        or commit (prefill a text's first token, BOS, then score the rest). With
        `top_logprobs=k` (at most 1024), each entry is `(logprob, [(token, logprob), ...])`,
        the `k` most likely tokens at its position, best first. Costs about a prefill plus
        the output layer at every position; on failure nothing changed. Cancelled, it
        either never ran or completed.
        """
    @overload
    def score(
        self, tokens: _Tokens, top_logprobs: int
    ) -> Operation[list[tuple[float, list[tuple[int, float]]]]]: ...
    @overload
    def score_sync(self, tokens: _Tokens, top_logprobs: None = None) -> list[float]:
        """Blocking twin of `score`: returns the scores once the tokens are decoded. Waits without the GIL; on Ctrl-C a started scoring completes, then KeyboardInterrupt is raised."""
    @overload
    def score_sync(
        self, tokens: _Tokens, top_logprobs: int
    ) -> list[tuple[float, list[tuple[int, float]]]]: ...
    def produce(self) -> Operation[Token]:
        """Sample a token from the snapshot on the engine thread, after any queued work on
        this branch (no KV write, no accept; only a stochastic sampler's RNG moves).
        """
    def produce_sync(self) -> Token:
        """Blocking twin of `produce`: returns the sampled Token, not committed. Waits without the GIL; Ctrl-C cancels it all-or-nothing, as an await would, and raises KeyboardInterrupt."""
    def commit(self, token: int | Token) -> Operation[None]:
        """Accept `token` (an int or a Token), decode it, capture logits; rolled back if the
        decode fails. Cancelled, it either never ran (nothing happened) or had started (it
        completed).
        """
    def commit_sync(self, token: int | Token) -> None:
        """Blocking twin of `commit`: returns None once the token is accepted and decoded (a failed decode is rolled back and raised). Waits without the GIL; on Ctrl-C a started commit completes, then KeyboardInterrupt is raised."""
    def sample(self) -> int:
        """Sample a token id (low level: no state change but the sampler RNG)."""
    def accept(self, token: int | Token) -> None:
        """Accept a token into penalties, grammar and perplexity without decoding it (low level)."""
    @overload
    def generate(
        self,
        max_tokens: int | None = None,
        *,
        draft: None = None,
        on_context_full: _OnContextFull = "stop",
        keep: int = 4,
    ) -> TokenStream:
        """Async iterator of Tokens: commit-before-yield, ends at a stop token (not committed).
        Each step samples and commits on the engine thread (steps of concurrent tasks share
        decodes). A cancelled step either never ran or completed (committed, not yielded).
        With `draft` (e.g. `kvfork.PromptLookup()`, or any object with
        `propose(tokens) -> list[int]`): exact speculative decoding, the same tokens drawn more
        decodes at a time (see `kvfork.SpeculativeStream`). At the end of the context the
        stream stops (`on_context_full="stop"`, stop_reason "context_full") or shifts the
        context and goes on (`"shift"`, as llama.cpp's --context-shift: the first `keep`
        tokens of the branch's sequence and the most recent half of the rest are kept;
        `stream.shifts` counts the shifts). The end of the context is the branch's position
        reaching n_ctx: cells other branches hold fill the same cache, so with neighbours a
        step may raise KvCacheFullError first (the branch as it was: free cells, or call
        `shift_context`, and go on).
        """
    @overload
    def generate(
        self,
        max_tokens: int | None = None,
        *,
        draft: Drafter,
        on_context_full: _OnContextFull = "stop",
        keep: int = 4,
    ) -> SpeculativeStream: ...
    @overload
    def generate_sync(
        self,
        max_tokens: int | None = None,
        *,
        draft: None = None,
        on_context_full: _OnContextFull = "stop",
        keep: int = 4,
    ) -> TokenStreamSync:
        """Blocking twin of `generate`: a TokenStreamSync for `for tok in b.generate_sync(...)`.
        Each step waits without the GIL; on Ctrl-C a started step completes (its token is
        committed, not yielded), then KeyboardInterrupt is raised.
        """
    @overload
    def generate_sync(
        self,
        max_tokens: int | None = None,
        *,
        draft: Drafter,
        on_context_full: _OnContextFull = "stop",
        keep: int = 4,
    ) -> SpeculativeStreamSync: ...
    def speculate(
        self, pending: int | Token, draft: list[int]
    ) -> Operation[tuple[list[Token], Token]]:
        """One round of exact speculative decoding (low level; `generate(draft=...)` drives
        it). `pending`: the token the sampler drew last (from `produce`, not committed);
        `draft`: guessed tokens after it. Decodes both in one llama_decode, then samples the
        branch's chain position by position, accepting while it agrees with the draft.
        Returns `(accepted, next)`: the draft Tokens drawn (committed, with `pending`) and
        the Token drawn after them (sampled, not committed).
        """
    def speculate_sync(self, pending: int | Token, draft: list[int]) -> tuple[list[Token], Token]:
        """Blocking twin of `speculate`: returns `(accepted, next)`. Waits without the GIL; on Ctrl-C a started round completes, then KeyboardInterrupt is raised."""
    @property
    def history(self) -> list[int]:
        """The tokens decoded into the branch's sequence since it was created (or reseeded):
        prefills and commits in order, a fork's starting with its parent's. Saved by `save`.
        """
    def __aiter__(self) -> AsyncIterator[Token]: ...
    def fork(self, *, seed: int | None = None, seq_id: int | None = None) -> Operation[Branch]:
        """A child on a new lease sharing the whole KV prefix; clones sampler (with RNG),
        grammar, perplexity, logits and logit bias; not steer. Cancelled, it either never
        ran (no lease taken) or the child it made is pruned (nobody holds it).

        Without `seed` the child samples exactly like its parent until reseeded: forks made
        for diversity need `seed=` (or `reseed_sampler`). LeaseExhaustedError when no lease
        is free. `seq_id` (lloyal.node's `fork(newSeqId)`) puts the child on that very
        sequence: LeaseExhaustedError when a branch holds it; cells it held are replaced.
        """
    def fork_sync(self, *, seed: int | None = None, seq_id: int | None = None) -> Branch:
        """Blocking twin of `fork`: returns the child Branch; LeaseExhaustedError when no lease
        is free. Waits without the GIL; on Ctrl-C a fork made is pruned, and
        KeyboardInterrupt is raised.
        """
    def save(self, path: str | PathLike[str]) -> Operation[None]:
        """Save the branch to `path` (its KV cells, position, history, sampler params and RNG
        state, grammar, biases, steer, perplexity accumulators), after queued work on it.
        """
    def save_sync(self, path: str | PathLike[str]) -> None:
        """Blocking twin of `save`: returns None once the file is written. Waits without the GIL; Ctrl-C cancels it all-or-nothing, as an await would, and raises KeyboardInterrupt."""
    @classmethod
    def load(cls, ctx: Context, path: str | PathLike[str]) -> Operation[Branch]:
        """A new root branch on a fresh lease of `ctx` (any context of the same model), restored
        from a file `save` wrote; it continues exactly as the saved branch would have.
        A corrupt, truncated or foreign file raises StateFileError.
        """
    @classmethod
    def load_sync(cls, ctx: Context, path: str | PathLike[str]) -> Branch:
        """Blocking twin of `load`: returns the restored Branch; StateFileError for a corrupt,
        truncated or foreign file. Waits without the GIL; Ctrl-C cancels it all-or-nothing, as
        an await would, and raises KeyboardInterrupt.
        """
    def snapshot(self) -> Operation[bytes]:
        """The branch as bytes, after queued work on it: what `save` writes to a file (its
        KV cells, position, history, sampler and RNG state, grammar, biases, metrics; the
        same framing and checks), kept in memory. `Branch.restore(ctx, data)` brings it
        back.
        """
    def snapshot_sync(self) -> bytes:
        """Blocking twin of `snapshot`: returns the snapshot as bytes. Waits without the GIL; Ctrl-C cancels it all-or-nothing, as an await would, and raises KeyboardInterrupt."""
    @classmethod
    def restore(cls, ctx: Context, data: bytes | bytearray) -> Operation[Branch]:
        """A new root branch on a fresh lease of `ctx` (any context of the same model), restored
        from `snapshot()` bytes (or a `save` file's): it continues exactly as the snapshot's
        branch would have. StateFileError for corrupt, truncated or foreign bytes.
        """
    @classmethod
    def restore_sync(cls, ctx: Context, data: bytes | bytearray) -> Branch:
        """Blocking twin of `restore`: returns the restored Branch; StateFileError for corrupt,
        truncated or foreign bytes. Waits without the GIL; Ctrl-C cancels it all-or-nothing,
        as an await would, and raises KeyboardInterrupt.
        """
    def capture_logits(self) -> None:
        """The context's last output for this branch's sequence becomes its logits snapshot
        (lloyal.node's `captureLogits()`): the logits a `ctx.decode` into the sequence left
        before this branch took it over. A branch that decoded since already holds that
        output (nothing changes). KvforkError when the sequence has no output at all.
        """
    def decode_and_capture_one(self, token: int | Token) -> Operation[None]:
        """Decode `token` (an int or a Token) at the branch's position and capture its
        logits, without accepting it (penalties, grammar and perplexity untouched; the
        reference's `decodeAndCaptureOne`). A token `accept`ed just before is decoded by
        it (`accept` + this = `commit`). Cancelled, it either never ran or was aborted
        and rolled back.
        """
    def decode_and_capture_one_sync(self, token: int | Token) -> None:
        """Blocking twin of `decode_and_capture_one`: returns None once the token is decoded. Waits without the GIL; Ctrl-C aborts and rolls it back, then raises KeyboardInterrupt."""
    def destroy(self) -> None:
        """Release the handle and the KV lease but keep the cells (lloyal.node's `destroy()`:
        carry on with `ctx.decode` on `seq_id`, or take the cells over again with
        `Branch.create(ctx, position, params, seq_id=...)`). RESTRICT like `prune`:
        KvforkError while it has live children. `disposed` is True at once; a second call is
        a no-op.
        """
    def reseed_context(self, sinks: _Tokens, tail: int) -> Operation[None]:
        """Infinite context: empty the branch's KV, then prefill `sinks` (e.g. the prompt's
        first tokens) followed by the last `tail` tokens of its sequence (prompt included;
        a sequence that begins with `sinks` gives its tail from after them), from position
        0. Sampler, grammar, biases and metrics carry on. When the prefill fails
        (KvCacheFullError), the branch's cells come back from a host copy: it keeps its
        tokens and logits. Only when the cache cannot hold them again is it left empty at
        position 0, with no logits (prefill it again); the error says which. Cells it shared
        with forks come back as copies of their own, so a branch whose forks share much of
        a full cache (the case where the prefill found no room: their cells stay theirs)
        is most often left empty.
        """
    def reseed_context_sync(self, sinks: _Tokens, tail: int) -> None:
        """Blocking twin of `reseed_context`: returns None once `sinks` and the tail are prefilled. Waits without the GIL; Ctrl-C cancels it all-or-nothing, as an await would, and raises KeyboardInterrupt."""
    def shift_context(self, keep: int = 4) -> Operation[None]:
        """Context shift (llama.cpp's --context-shift): empty the branch's KV, then prefill
        the first `keep` tokens of its sequence and the most recent half of the rest, from
        position 0. Sampler, grammar, biases and metrics carry on. `keep` is at most
        n_ctx - 2 (ValueError). `generate(on_context_full="shift")` calls it at n_ctx. A
        failed prefill puts the branch back as `reseed_context` does.
        """
    def shift_context_sync(self, keep: int = 4) -> None:
        """Blocking twin of `shift_context`: returns None once the kept tokens are prefilled. Waits without the GIL; Ctrl-C cancels it all-or-nothing, as an await would, and raises KeyboardInterrupt."""
    @property
    def context(self) -> Context:
        """The context the branch lives in (a handle to the same context as the one it was made
        with).
        """
    def prune(self, *, keep_children: bool = False) -> Operation[None]:
        """Dispose the branch and free its KV lease; siblings and the shared prefix are
        untouched. RESTRICT by default: raises KvforkError while it has live children.
        `keep_children=True` frees the lease anyway: the children keep the cells they share
        with it and move to its parent (or become roots) — e.g. a dropped beam whose forks
        survive. `disposed` is True at once and the rest always happens, even if the await
        is cancelled; a second prune is a no-op.
        """
    def prune_sync(self, *, keep_children: bool = False) -> None:
        """Blocking twin of `prune`: returns None once the lease is freed; KvforkError while the branch has live children, unless `keep_children=True`. Always completes, even on Ctrl-C."""
    def prune_subtree(self) -> Operation[None]:
        """Dispose this branch and its whole subtree (CASCADE). Always completes once called."""
    def prune_subtree_sync(self) -> None:
        """Blocking twin of `prune_subtree`: returns None once the branch and all its descendants are disposed. Waits without the GIL; always completes, even on Ctrl-C."""
    @property
    def parent(self) -> Branch | None:
        """The Branch this one was forked from, or None for a root (and for a disposed branch)."""
    @property
    def children(self) -> list[Branch]:
        """The live branches forked from this one, as a list (empty for a leaf or a disposed
        branch).
        """
    @property
    def is_leaf(self) -> bool:
        """True when the branch has no live children (also True once it is disposed)."""
    @property
    def is_active(self) -> bool:
        """True while the branch holds its KV lease; False once it is pruned or its context closed."""
    @property
    def disposed(self) -> bool:
        """True once the branch is disposed (by `prune`, `prune_subtree`, `retain_only` or the
        context's `close`, or this handle by `PrefixCache.release`), from the moment the call
        is made; any use then raises BranchDisposedError (KvforkError "the context is closed"
        after a close).
        """
    @property
    def fork_head(self) -> int:
        """The position at which this branch was forked from its parent (0 for a root).
        Raises BranchDisposedError once the branch is pruned.
        """
    @property
    def position(self) -> int:
        """Tokens in the branch's KV sequence: the position its next token is decoded at (the
        `position` it was created at, before any prefill). Raises BranchDisposedError once pruned.
        """
    @property
    def handle(self) -> int:
        """A stable integer id (index and generation of the branch's slot)."""
    @property
    def seq_id(self) -> int:
        """The KV sequence id leased by this branch."""
    @property
    def params(self) -> SamplingParams:
        """The branch's current SamplingParams (from `create` or the last `set_sampler_params`).
        Raises BranchDisposedError once pruned.
        """
    def reseed_sampler(self, seed: int) -> None:
        """Restart the sampler's RNG stream from `seed` (an int in [0, 2**32)), keeping the params,
        penalty/DRY history and Mirostat state. Forks sample like their parent until reseeded.
        ValueError for a seed out of range.
        """
    def set_sampler_params(self, params: SamplingParams | dict[str, Any]) -> None:
        """Rebuild the sampler chain from `params` (a SamplingParams or a dict); a no-op when equal.
        The RNG stream, penalty/DRY history and Mirostat state carry on, unless `params` names a
        new seed. ValueError (naming the field) for a bad value.
        """
    def set_grammar(self, gbnf: str | None) -> None:
        """Replace the GBNF grammar, or remove it with None or "" (a blank grammar, as the
        reference's `setGrammar("")`).
        """
    def set_json_schema(self, schema: dict[str, Any] | str) -> None:
        """Constrain the output to a JSON schema (a dict, or its JSON text), through llguidance:
        the same slot as `set_grammar` (one constraint at a time), cloned on fork. The first
        use on a model indexes its vocabulary (a fraction of a second, once).
        """
    def set_regex(self, pattern: str) -> None:
        """Constrain the whole output to match a regular expression (Rust `regex` syntax), through
        llguidance; the same slot as `set_grammar`.
        """
    def set_lark(self, grammar: str) -> None:
        """Constrain the output to a grammar in llguidance's Lark syntax (`start` is the root
        rule; `%json {...}` embeds a JSON schema); the same slot as `set_grammar`.
        """
    def set_grammar_lazy(
        self, gbnf: str, triggers: Iterable[str | int], *, patterns: list[str] | None = None
    ) -> None:
        """Grammar that stays inactive until a trigger fires. `triggers`: strings are trigger
        words, ints are token ids; `patterns`: regexes searched in the output since the grammar
        was set, the grammar starting at the first non-empty capture group (else at the match),
        as llama.cpp's lazy grammars (words first, then patterns: the first that matches
        fires). Patterns are in Rust `regex` syntax (Unicode-aware; no look-around or
        back-references: GrammarError; an empty word too); after each token all are searched
        in one pass over the output since the grammar was set (time linear in it, so a long
        wait costs more per token). A token whose text would fire a trigger on text the
        grammar refuses is never drawn (masked, as an active grammar masks the tokens it
        refuses).
        """
    def set_adapters(self, adapters: dict[LoraAdapter, float]) -> None:
        """Decode under these LoRA adapters from now on: `{adapter: scale}` replaces the set
        (scale 0 is the same as leaving the adapter out). Inherited on fork. A commit or step
        over branches with different sets decodes one group per distinct set.
        """
    def clear_adapters(self) -> None:
        """Back to the base model: no LoRA adapter and no control vector (for this branch and the
        forks made after).
        """
    @property
    def adapters(self) -> dict[LoraAdapter, float]:
        """`{adapter: scale}` of the LoRA adapters this branch decodes under."""
    def set_control_vector(
        self, cv: ControlVector | None, scale: float = 1.0, layers: tuple[int, int] | None = None
    ) -> None:
        """Add `cv` × `scale` to the outputs of the rows `layers = (start, end)` (0-based, end
        exclusive; all when None) from now on; `cv=None` removes the control vector.
        Inherited on fork; grouped like adapters.
        """
    def set_logit_bias(self, bias: dict[int, float]) -> None:
        """Static biases {token: bias} added to the logits (-inf bans); inherited on fork."""
    def clear_logit_bias(self) -> None:
        """Remove every static bias set by `set_logit_bias`."""
    def steer(self, bias: dict[int, float]) -> None:
        """Dynamic biases {token: bias} applied after the logit bias; NOT inherited on fork."""
    def clear_steer(self) -> None:
        """Remove every dynamic bias set by `steer`."""
    @property
    def perplexity(self) -> float:
        """exp(mean surprisal) of the accepted tokens under the raw logits (model level);
        prefilled tokens do not count. inf before any accepted token.
        """
    @property
    def sampling_perplexity(self) -> float:
        """Like `perplexity`, under the filtered distribution the sampler drew from (grammar,
        biases and chain applied): inf before any accepted token, and once a token it had
        filtered out was accepted.
        """
    def entropy(self, base: _Base = "nats") -> float:
        """Entropy of the raw logits snapshot, in nats (or bits with `base="bits"`). Raises
        KvforkError before the first prefill or commit, ValueError for another `base`.
        """
    def surprisal(self, token: int, base: _Base = "nats") -> float:
        """-log p(`token`) under the raw logits snapshot, in nats (or bits with `base="bits"`);
        inf for a masked token. Raises KvforkError before the first prefill or commit,
        ValueError for a token id out of range or another `base`.
        """
    def logprob(self, token: int) -> float:
        """Natural-log probability of `token` under the raw snapshot: log-softmax of the logits,
        computed in Rust (no copy of the row). -inf for a masked token. Raises KvforkError
        before the first prefill or commit (no snapshot yet).
        """
    def top_logprobs(self, k: int) -> list[tuple[int, float]]:
        """The `k` most likely tokens of the raw snapshot as `[(token, logprob), ...]`, best
        first, natural log. One pass over the row in Rust; fewer pairs when fewer logits are
        finite. Raises KvforkError before the first prefill or commit.
        """
    def logits(self) -> npt.NDArray[np.float32]:
        """A copy of the raw logits snapshot, float32 of shape (vocab_size,). Raises KvforkError
        before the first prefill or commit. On a `device_sampling` context a row the device
        kept is decoded again first (one decode), and the branch gets rows from then on.
        """
    def set_logits(self, logits: npt.NDArray[np.float32]) -> None:
        """Replace the snapshot with a float32 array of shape (vocab_size,)."""
    def __hash__(self) -> int: ...

class _SpillLevelStats(TypedDict):
    entries: int
    bytes: int
    hits: int
    restored_tokens: int

class _PrefixCacheStats(TypedDict):
    branches: int
    hit_tokens: int
    prefilled_tokens: int
    evictions: int
    entries: int
    cached_tokens: int
    live: int
    host: _SpillLevelStats
    disk: _SpillLevelStats

@final
class PrefixCache:
    """Automatic prefix reuse on one context: `await cache.branch(tokens, params)` makes a branch
    positioned at the end of `tokens` by sharing the longest prefix any branch of the cache
    holds in the KV — an entry handed back with `release`, or a branch still generating (a
    fork at a position inside it) — and prefilling only the rest (at least the last token, so
    the snapshot is fresh). A prefix under 16 tokens is shared only when it is half the prompt
    (a few common first tokens are cheaper to prefill again). Entries are evicted least recently used when a lease or KV cells
    are needed, or past `max_cached_tokens`; with `host_bytes` (and `disk_dir`, whose
    `disk_bytes` None leaves unbounded; a positive `disk_bytes` alone is a ValueError, a
    directory that cannot be made or written to an OSError) an evicted entry without adapters is kept as a snapshot in host memory (then
    on disk, least recently used first at each level) and copied back into the KV when a
    prompt shares 16+ more tokens with it than with the cache (~170× faster than prefilling
    them on a CPU); a restarted cache with the same `disk_dir` finds its entries there (a
    file of another model, cache layout or kvfork version is left alone; a restored entry
    keeps its file). Caches may share a `disk_dir`: each numbers its files apart; one opened
    later also finds the others' files there (of the same model), and a file trimmed by one
    is gone for the others (their prompts are prefilled, never served another prompt's
    cells). On recurrent and hybrid
    models an entry carries its recurrent-state checkpoints: a prompt that parts from it
    inside gets it back up to the last checkpoint before that point. `fork` adds forks of its branches (a request's
    other choices), making room the same way. The branches it hands out and its entries are the
    account of the sequences its users hold (`stats()["live"]`, `stats()["entries"]`). On a
    `park=True` context it makes room as `Branch.create` does, parking the least recently used
    branches (its entries and yours alike) rather than evicting entries (`make_room` is then
    0); sharing a prefix needs its source and the new branch active at once, so with a single
    lease a prompt sharing one with a branch handed out raises LeaseExhaustedError (each
    operation admits its branches). With `max_cached_tokens=0`, a
    released entry's lease comes back once its background eviction ran (at once for the
    cache's own `branch`, which waits for it; a `Branch.create` right after may not find it).

    Nothing leaks when an await is cancelled: a `branch` cancelled while its prompt is being
    prefilled aborts the prefill (rolled back: nothing is kept), a `branch` or `fork` whose
    work completed anyway is handed back as an entry, and `release` never waits (call it from
    any clean-up).
    """
    def __new__(
        cls,
        ctx: Context,
        *,
        max_cached_tokens: int | None = None,
        host_bytes: int | None = None,
        disk_dir: str | PathLike[str] | None = None,
        disk_bytes: int | None = None,
    ) -> Self: ...
    def branch(
        self,
        tokens: _Tokens,
        params: SamplingParams | dict[str, Any] | None = None,
        *,
        adapters: dict[LoraAdapter, float] | None = None,
    ) -> Operation[Branch]:
        """A new root branch positioned at the end of `tokens` with fresh logits, sharing the
        longest prefix the cache's branches hold (see the class). LeaseExhaustedError when
        every lease is held by branches handed out; ValueError for tokens that leave no room
        in the context. `adapters` (`{LoraAdapter: scale}`): the branch decodes under them,
        and shares only prefixes computed under the same set. Cancelled during its prefill, the
        prefill is aborted and rolled back (the engine is free at once); cancelled after the
        branch was made, it is handed back as an entry.
        """
    def branch_sync(
        self,
        tokens: _Tokens,
        params: SamplingParams | dict[str, Any] | None = None,
        *,
        adapters: dict[LoraAdapter, float] | None = None,
    ) -> Branch:
        """Blocking twin of `branch`: returns the Branch. Waits without the GIL; on Ctrl-C a
        started call completes (the branch is made and handed back as an entry), then
        KeyboardInterrupt is raised.
        """
    def release(self, branch: Branch) -> None:
        """Hand back a branch `branch` or `fork` made: its KV stays as an entry for later requests
        (the caller's handle is spent: it raises BranchDisposedError as a pruned one, and its
        `prune` does nothing). Never waits: safe in the clean-up of a cancelled task.
        ValueError for a branch the cache did not make or already has, and for one pruned
        already (the cache forgets it: it holds no KV to keep).
        """
    def fork(self, branch: Branch, *, seed: int | None = None) -> Operation[Branch]:
        """A fork of `branch` (a branch of the cache's context, usually one it handed out) on a
        lease made free by evicting entries when none is: the other choices of a request. It
        is handed out like a `branch` result (`release` keeps it as an entry).
        LeaseExhaustedError when branches handed out hold every lease. Cancelled after the fork
        was made, the fork is handed back as an entry.
        """
    def fork_sync(self, branch: Branch, *, seed: int | None = None) -> Branch:
        """Blocking twin of `fork`: returns the Branch. Waits without the GIL; on Ctrl-C a started
        fork completes (and is handed back as an entry), then KeyboardInterrupt is raised.
        """
    def make_room(self, n: int) -> Operation[int]:
        """Evict entries, least recently used first, until `n` leases are free (room for a
        request's `n` branches); resolves to how many were evicted. LeaseExhaustedError when
        the entries are not enough (branches handed out hold the rest); KvforkError once the
        context is closed.
        """
    def make_room_sync(self, n: int) -> int:
        """Blocking twin of `make_room`: returns how many entries were evicted. Waits without the
        GIL; evictions always complete, even on Ctrl-C.
        """
    def evict_oldest(self) -> Operation[bool]:
        """Evict the least recently used entry: its cells that no other branch shares go back to
        the KV (room for the next decode of a branch handed out, which raised
        KvCacheFullError); resolves to False when no entry is left. KvforkError once the
        context is closed.
        """
    def evict_oldest_sync(self) -> bool:
        """Blocking twin of `evict_oldest`: returns whether an entry was evicted. Waits without
        the GIL; the eviction always completes, even on Ctrl-C.
        """
    def shared_tokens(self, branch: Branch) -> int | None:
        """How many of `branch`'s prompt tokens came from the KV cache when it was made (shared,
        not prefilled); None for a branch the cache did not make or no longer holds.
        """
    def clear(self) -> None:
        """Prune every entry (branches handed out stay)."""
    def spill_all(self) -> int:
        """Evict every entry into host memory and disk (`host_bytes`, `disk_dir`), then write
        those in host memory to disk, so that a cache opened later on the same `disk_dir`
        finds them (a server's shutdown); how many entries are on disk then. Without a spill
        level it prunes every entry, as `clear` does. Blocking; branches handed out stay.
        """
    def stats(self) -> _PrefixCacheStats:
        """`{"branches", "hit_tokens", "prefilled_tokens", "evictions", "entries",
        "cached_tokens", "live", "host", "disk"}`: branches handed out, prompt tokens shared
        from the KV and prefilled, entries evicted, and the entries, their tokens and the live
        branches now; `host` and `disk`, for entries spilled there when evicted
        (`host_bytes`, `disk_dir`): `{"entries", "bytes", "hits", "restored_tokens"}`, the
        entries and bytes held now, the entries brought back and the prompt tokens they held
        (restored instead of prefilled).
        """

@final
class BranchStore:
    """Batched operations over many branches of one context: `commit`, `prefill` and `step`
    advance N branches in one llama_decode (ceil(N / n_batch) over more than n_batch), and
    `retain_only` keeps one branch's KV. `BranchStore(ctx)` is cheap and holds no lease.
    """
    def __new__(cls, ctx: Context) -> BranchStore: ...
    @property
    def available(self) -> int:
        """Leases free now (0 once the context is closed)."""
    def commit(self, entries: Iterable[tuple[Branch, int | Token]]) -> Operation[None]:
        """Accept every `(branch, token)` then ONE llama_decode; all rolled back if it fails.
        Over more than n_batch branches it takes ceil(N / n_batch) decodes, one rollback
        unit. Cancelled, it either never ran (nothing happened) or had started (it
        completed).
        """
    def commit_sync(self, entries: Iterable[tuple[Branch, int | Token]]) -> None:
        """Blocking twin of `commit`: returns None once every token is accepted and decoded (a failed decode rolls all of them back and raises). Waits without the GIL; on Ctrl-C a started commit completes, then KeyboardInterrupt is raised."""
    def prefill(self, entries: Iterable[tuple[Branch, _Tokens]]) -> Operation[None]:
        """Decode `(branch, tokens)` runs packed into ceil(total / n_batch) decodes, all or
        nothing. Cancelled, it either never ran or was aborted and rolled back.
        """
    def prefill_sync(self, entries: Iterable[tuple[Branch, _Tokens]]) -> None:
        """Blocking twin of `prefill`: returns None once every run is decoded. Waits without the GIL; Ctrl-C aborts and rolls the whole prefill back, then raises KeyboardInterrupt."""
    @overload
    def score(
        self, entries: Iterable[tuple[Branch, _Tokens]], top_logprobs: None = None
    ) -> Operation[list[list[float]]]:
        """`Branch.score` for many branches: each `(branch, tokens)` run scored as that call
        scores it (the first token from the branch's snapshot), the runs packed into the
        same decodes, so a handful of short continuations (the answers to rank, forks of
        one prompt) take one decode, not one each. All or nothing. Returns one list per
        entry, in order: logprobs, or with `top_logprobs=k` (at most 1024) `(logprob,
        [(token, logprob), ...])` pairs. Cancelled, it either never ran or completed.
        """
    @overload
    def score(
        self, entries: Iterable[tuple[Branch, _Tokens]], top_logprobs: int
    ) -> Operation[list[list[tuple[float, list[tuple[int, float]]]]]]: ...
    @overload
    def score_sync(
        self, entries: Iterable[tuple[Branch, _Tokens]], top_logprobs: None = None
    ) -> list[list[float]]:
        """Blocking twin of `score`: returns the scores once every run is decoded. Waits without the GIL; on Ctrl-C a started scoring completes, then KeyboardInterrupt is raised."""
    @overload
    def score_sync(
        self, entries: Iterable[tuple[Branch, _Tokens]], top_logprobs: int
    ) -> list[list[tuple[float, list[tuple[int, float]]]]]: ...
    def retain_only(self, winner: Branch) -> Operation[None]:
        """Keep `winner`'s KV only; every other branch of the context is disposed at once, and
        the rest always happens, even if the await is cancelled.
        """
    def retain_only_sync(self, winner: Branch) -> None:
        """Blocking twin of `retain_only`: returns None once every other branch is disposed and its lease freed. Always completes, even on Ctrl-C."""
    def step(self, branches: Iterable[Branch]) -> Operation[list[Token]]:
        """Sample every branch (in Rust, in parallel) and commit the non-stop tokens in one
        decode (ceil(N / n_batch) over more than n_batch branches). Returns one Token per
        branch, in order (stop tokens are not committed). Cancelled, it either never ran or
        completed. It returns once the decode is queued: on a GPU the device still runs it
        while the caller takes the tokens, and a call that reads a branch's new row
        (`logits`, `entropy`, `top_logprobs`, the next step) waits for it; `position`,
        `perplexity` and the history are up to date at once.
        """
    def step_sync(self, branches: Iterable[Branch]) -> list[Token]:
        """Blocking twin of `step`: returns one Token per branch, in order (stop tokens are not committed). Waits without the GIL; on Ctrl-C a started step completes, then KeyboardInterrupt is raised."""

def system_info() -> dict[str, Any]:
    """What llama.cpp and kvfork were built with and run on: `backend` (`cpu`, or the GPU in
    use), `backends` (one line per backend found), `cpu_variant` (the CPU code in use: the
    module of llama.cpp's CPU backend the release wheel loaded, or `built-in` for a build that
    links it in) and `cpu_variant_reason` (why), `cpu_features` (its instruction sets) and
    `host_cpu_features` (this CPU's), `llama_cpp`, `llama_system_info`, `gpu_offload`, `mmap`.
    """

def json_schema_to_grammar(schema: str) -> str:
    """GBNF grammar from a JSON schema (a dict is serialised by the Python wrapper)."""

def _after_fork_in_child() -> None:
    """`os.register_at_fork(after_in_child=...)`: the child has none of the engines' threads, so
    the contexts it inherited are closed, and using one says why (it hung).
    """

def _check_main_interpreter() -> None:
    """Refuse a subinterpreter (`kvfork/__init__.py`, at import): CPython hands a subinterpreter
    a copy of this module's dict without running its init, and the extension keeps Python
    objects process-wide (the event loops' deliveries, the logger); with those of a destroyed
    subinterpreter, the main interpreter's awaits failed.
    """

def _close_all_contexts() -> None:
    """Close every live context (`atexit`): a thread frozen at exit holding one would leave its
    engine decoding while the process's static destructors run.
    """

def _set_log_level(level: int) -> None:
    """Lowest Python logging level forwarded from llama.cpp (10 debug … 40 error)."""

def _set_module_dirs(dirs: list[str]) -> None:
    """Called once by `kvfork/__init__.py` with the directories that may hold ggml's backend
    modules (the wheel's `kvfork/ggml`, the GPU companion packages), before anything loads.
    """

def _use_speculative_streams(async_stream: object, sync_stream: object) -> None:
    """Called once by `kvfork._speculative` with its `SpeculativeStream` and
    `SpeculativeStreamSync` classes.
    """
