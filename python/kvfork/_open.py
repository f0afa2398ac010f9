"""`create_context`: the awaitable that also works directly in `async with`."""

from __future__ import annotations

from collections.abc import Awaitable, Generator
from os import PathLike
from types import TracebackType
from typing import TYPE_CHECKING, Any, Literal

from . import _native
from ._native import Context, Model

if TYPE_CHECKING:
    from typing_extensions import Unpack

    from ._native import _ContextOptions


class ContextOpening(Awaitable[Context]):
    """What `create_context` returns. `await` it for the Context, or enter it directly:
    `async with kvfork.create_context(path) as ctx:` builds the context (off the event loop)
    and closes it on exit."""

    def __init__(self, pending: Awaitable[Context]) -> None:
        """Wrap the awaitable of a context being built; made by `create_context`, not by
        hand. Await it or enter it once."""
        self._pending = pending
        self._ctx: Context | None = None

    def __await__(self) -> Generator[Any, None, Context]:
        return self._pending.__await__()

    async def __aenter__(self) -> Context:
        self._ctx = await self._pending
        return self._ctx

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> Literal[False]:
        if self._ctx is not None:
            self._ctx.close()
        return False


def create_context(
    path_or_model: str | PathLike[str] | Model, **options: Unpack[_ContextOptions]
) -> ContextOpening:
    """Create a context (a unified KV cache and its engine thread) on a model or a GGUF path,
    without blocking the event loop: `ctx = await create_context(...)`, or
    `async with create_context(...) as ctx:`.

    The keyword options (the same for `create_context_sync`), with their defaults:

    - `n_ctx=4096`: cells of the unified KV cache, shared by all branches (a shared prefix
      counts once); also the furthest position a branch can reach. 16 to `2**24`,
      rounded up to a multiple of 256 (llama.cpp's; `Context.n_ctx` says the size made).
    - `n_batch=512`: the most tokens one `llama_decode` takes; longer prefills and wider
      steps are split. 1 to 65536.
    - `n_seq_max=8`: KV sequences (leases), so how many branches can be live at once.
      1 to 256.
    - `n_threads=None`, `n_threads_batch=None`: threads of single-token decodes and of
      multi-token decodes (prefills, batched steps). None adapts the count to the cores
      other processes leave free (at most 8); a number (1 to 512) fixes it.
    - `type_k="f16"`, `type_v="f16"`: element type of the cached keys and values: "f32",
      "f16", "bf16", "q8_0" or "q4_0".
    - `embeddings=False`: True makes an embedding context (`Context.embed`).
    - `pooling=None`: how `embed` pools token vectors: "none", "mean", "cls" or "last";
      None uses the model's own.
    - `n_gpu_layers=None`: layers to offload to the GPU when `path_or_model` is a path
      (None: all on a GPU build, else 0); a loaded `Model` keeps its own.
    - `park=False`: True lets branches outnumber leases: `fork` and `Branch.create` with no
      free lease return a parked branch (`is_active` False, its own KV cells in host
      memory) instead of raising LeaseExhaustedError, and any operation that needs a parked
      branch's KV brings it back, parking the least recently used idle branch. Results equal
      those with enough leases up to cell-order noise (a cell may land in a hole below
      older ones, as after a prune: logits move by up to ~1, greedy tokens agree up to the
      first near-tie: concepts.md, "More branches than leases"). `n_seq_max` then counts leases (at most 255), not branches;
      `save_state`/`load_state` are refused (save branches one by one).
    - `checkpoints=16`, `checkpoint_bytes=268435456`: on a recurrent or hybrid model
      (`Model.is_recurrent`), the most recurrent-state checkpoints each branch keeps in host
      memory, and their bytes. Taken at the end of each prefill decode and before each
      speculative guess, they let a fork inside a sequence (`PrefixCache`) start from the
      last one at or before the fork and prefill the rest, and a rejected guess or failed
      decode roll back exactly. 0 keeps none: such forks then prefill everything, rollbacks
      decode the branch's tokens again. Ignored on other models.
    - `recurrent_rollback=0`: on the recurrent and hybrid architectures for which llama.cpp
      keeps per-token snapshots of the last decode (`n_rs_seq`, experimental there: LFM2,
      Qwen3.5, Nemotron-H and a few others), how many trailing tokens it can drop at once: a
      rejected speculative guess that long is undone without decoding the kept tokens
      again (one decode saved a rejection). 0 to 64; ignored elsewhere.
    - `device_sampling=False`: True finds each output row's best 64 logits (with their
      tokens) and its log-partition inside llama.cpp's graph, on the device that computed
      the logits, and copies only those back, not the row (on a GPU, one copy of
      `vocab_size` floats per branch per step saved). Each branch's own chain then draws
      from them with its own RNG, so greedy and every chain that cuts to `top_k <= 64`
      first (temperature, top-p, min-p, seeds, forks, reseeds) draw exactly what they draw
      from a row. Such branches keep no rows: reading one (`logits()`, entropies,
      `top_logprobs(k > 64)`, `logprob` of another token) or committing a token outside the
      64 decodes the branch's last token again to get it (one decode; on recurrent and
      hybrid models, the tokens since the branch's last checkpoint too), and the branch gets
      rows from then on. A branch whose chain needs its whole row (a grammar, a logit bias,
      steering, `top_k=0` or above 64, penalties, DRY, Mirostat) gets it: its sequence gives
      rows from the next decode on, beside branches drawing on the device in the same
      decode (which then copies every output's row back; switching a sequence costs one
      graph reservation, ~10 ms on a CPU). A chain that comes to need the row after the
      device drew the output it samples (a grammar set after the prefill, a fork given a
      bias) gets it from `sample`, `produce`, `step` and `BranchStore.step` the same way:
      set such chains before the prefill to spare the decode. With `n_seq_max=256` there is
      no spare sequence to decode again on, and those calls raise KvforkError instead; a
      full KV cache raises KvCacheFullError (the decode needs free cells).
      `Context.decode`'s outputs are whole rows (the raw layer keeps no tokens to decode
      again), so only a device draw captured before its branch decoded anything (a
      destroyed branch's) stays unreadable (KvforkError). Not with
      `embeddings=True`. Meant for GPUs: on the CPU backend it is slower than host rows.
      It takes more host memory: llama.cpp keeps, beside the rows' buffer, room for
      `vocab_size` sampled logits, probabilities and token ids for each of `n_batch`
      outputs (with rows, 4 x `n_batch` x `vocab_size` x 4 bytes: 2 GiB for Gemma 3 at
      `n_batch=512`; pinned memory on a GPU). A branch saved from such a context loads
      into one without: its last token is decoded again there for its row.

    A bad option raises ValueError naming it, an unknown one TypeError, and a model that
    cannot be loaded ModelLoadError."""
    return ContextOpening(_native.create_context(path_or_model, **options))
