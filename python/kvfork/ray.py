"""Scale-out on Ray: a pool of actors, each owning one kvfork `Context`, that run async
branch programs where the KV lives.

    import kvfork.ray as kray

    async def best_of(ctx: kvfork.Context, prompt: str, n: int) -> str: ...

    async with kray.ContextPool(path, num_actors=2, n_ctx=2048) as pool:
        text = await pool.run(best_of, "Once upon a time", 4)

Each actor is a Ray async actor in its own process: it loads the model once, owns one
context, and runs every job it gets as a task on its event loop, so concurrent jobs on one
actor share decodes exactly as tasks do in one process. Jobs go to the least-busy actor, or
with ``affinity=key`` always to the actor first chosen for that key, where `shared` keeps
per-key state (a warm system-prompt branch) alive between jobs.

Ray starts a local cluster on first use unless ``ray.init(...)`` was called; on an existing
cluster call ``ray.init(address="auto")`` first and place actors with
``actor_options={"num_gpus": 1}``. Install with ``pip install 'kvfork[ray]'``.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import pickle
import traceback
from collections.abc import Awaitable, Callable, Hashable
from dataclasses import dataclass
from os import PathLike
from types import TracebackType
from typing import TYPE_CHECKING, Any, Literal, TypeVar

try:
    import ray
    import ray.exceptions
    from ray import cloudpickle
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError("kvfork.ray needs Ray: pip install 'kvfork[ray]'") from exc

from . import _native
from ._native import Context, KvforkError

if TYPE_CHECKING:
    from typing_extensions import Self

__all__ = ["ContextPool", "shared"]

T = TypeVar("T")


class _ContextActor:
    """The Ray actor (one per worker process): one context, jobs as tasks on its loop."""

    def __init__(self, model_path: str, context_options: dict[str, Any]) -> None:
        self._model_path = model_path
        self._context_options = context_options
        self._opening: asyncio.Future[Context] | None = None
        self._running = 0
        self._jobs_done = 0

    async def _context(self) -> Context:
        # Opened on first use, from the actor's loop; concurrent first jobs share the opening.
        if self._opening is None:
            self._opening = asyncio.ensure_future(
                _native.create_context(self._model_path, **self._context_options)
            )
        return await self._opening

    async def warm(self) -> tuple[bool, bytes]:
        """Open the context now: the actor's pid, or the failure, packed as `run` packs them
        (so the spawn's fire-and-forget call never leaves an unhandled Ray error behind)."""
        try:
            await self._context()
        except Exception as exc:  # noqa: BLE001  (a bad option or model goes to the caller)
            return False, _pickled_failure(exc, traceback.format_exc())
        return True, _dumps(os.getpid())

    async def run(
        self, fn: Callable[..., Awaitable[Any]], args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[bool, bytes]:
        """Run `await fn(ctx, *args, **kwargs)`: (True, pickled result) or (False, pickled
        (exception, remote traceback)). Pickling here, not in Ray, is what lets the caller
        tell "the job raised" from "the result cannot be pickled" from "the actor died"."""
        self._running += 1
        try:
            ctx = await self._context()
            result = await fn(ctx, *args, **kwargs)
        except Exception as exc:  # noqa: BLE001  (any job error goes back to the caller)
            return False, _pickled_failure(exc, traceback.format_exc())
        except BaseException as exc:  # noqa: BLE001  (see below: none may stop the actor)
            # A job's KeyboardInterrupt or SystemExit would stop the actor's event loop (every
            # later call would hang), and a cancellation (the caller's, through `ray.cancel`)
            # needs no answer: each becomes the job's error, and the actor goes on.
            error = KvforkError(f"the job raised {type(exc).__name__}: {exc}".rstrip(": "))
            return False, _pickled_failure(error, traceback.format_exc())
        finally:
            self._running -= 1
            self._jobs_done += 1
        try:
            return True, _dumps(result)
        except Exception as exc:  # noqa: BLE001  (pickling can raise anything)
            name = getattr(fn, "__qualname__", repr(fn))
            error = KvforkError(
                f"the result of {name} ({type(result).__name__}) cannot be pickled, so it "
                f"cannot leave the actor: {exc}. Return plain data (str, list, dict, numbers)."
            )
            return False, _pickled_failure(error, traceback.format_exc())

    async def stats(self) -> dict[str, Any]:
        """The context's counters plus this actor's: pid, jobs_done, running, free_leases."""
        ctx = await self._context()
        out: dict[str, Any] = dict(ctx.stats())
        out.update(
            pid=os.getpid(),
            jobs_done=self._jobs_done,
            running=self._running,
            free_leases=_native.BranchStore(ctx).available,
        )
        return out


def _pickled_failure(exc: Exception, remote_traceback: str) -> bytes:
    """Pickle (exc, traceback) so the caller re-raises the same type; an exception that does
    not survive a pickle round trip becomes a KvforkError that names it."""
    try:
        data: bytes = _dumps((exc, remote_traceback))
        pickle.loads(data)
        return data
    except Exception:  # noqa: BLE001  (pickling can raise anything)
        stand_in = KvforkError(f"{type(exc).__module__}.{type(exc).__qualname__}: {exc}")
        return _dumps((stand_in, remote_traceback))


def _dumps(obj: object) -> bytes:
    data: bytes = cloudpickle.dumps(obj)  # type: ignore[no-untyped-call]
    return data


_RemoteContextActor = ray.remote(_ContextActor)


@dataclass
class _Slot:
    """One place in the pool: the live actor handle and what the caller knows of it."""

    handle: Any
    running: int = 0
    replaced: int = 0


class ContextPool:
    """A pool of Ray actors, each owning one `Context` on `model_path`.

    ``num_actors`` actors are started at once, each loading the model in its own process;
    ``actor_options`` goes to Ray's ``.options()`` (``num_cpus``, ``num_gpus``, ``resources``,
    ``runtime_env`` ...) and ``context_options`` to `kvfork.create_context` in each actor
    (``n_ctx``, ``n_seq_max``, ``n_threads`` ...). Use it as ``async with`` / ``with`` or call
    `shutdown`. A pool is used from one thread (one event loop).
    """

    def __init__(
        self,
        model_path: str | PathLike[str],
        *,
        num_actors: int = 1,
        actor_options: dict[str, Any] | None = None,
        **context_options: Any,
    ) -> None:
        if isinstance(num_actors, bool) or not isinstance(num_actors, int) or num_actors < 1:
            raise ValueError(f"num_actors must be an int >= 1, got {num_actors!r}")
        if actor_options is not None and not isinstance(actor_options, dict):
            raise TypeError("actor_options must be a dict of Ray actor options or None")
        self._model_path = os.fspath(model_path)
        self._actor_options = dict(actor_options or {})
        self._context_options = context_options
        self._closed = False
        self._slots = [_Slot(self._spawn()) for _ in range(num_actors)]
        self._affinity: dict[Hashable, int] = {}
        self._turn = itertools.count()

    def _spawn(self) -> Any:
        actor: Any = _RemoteContextActor.options(**self._actor_options).remote(
            self._model_path, self._context_options
        )
        actor.warm.remote()  # start loading the model now; jobs wait for the same opening
        return actor

    @property
    def num_actors(self) -> int:
        """How many actors the pool keeps."""
        return len(self._slots)

    @property
    def actors(self) -> list[Any]:
        """The Ray actor handles, in pool order (``ray.kill`` one to see the pool replace it)."""
        return [slot.handle for slot in self._slots]

    async def ready(self) -> list[int]:
        """Wait until every actor has loaded the model; their process ids. Raises what the
        first failing actor raised (ModelLoadError for a bad path)."""
        self._check_open()
        refs = [(slot, slot.handle, slot.handle.warm.remote()) for slot in self._slots]
        return [self._unwrap(*await self._await(slot, handle, ref)) for slot, handle, ref in refs]

    async def run(
        self,
        fn: Callable[..., Awaitable[T]],
        /,
        *args: Any,
        affinity: Hashable | None = None,
        **kwargs: Any,
    ) -> T:
        """Run ``await fn(ctx, *args, **kwargs)`` in an actor and return its result.

        ``fn`` must be picklable by Ray (a module-level function importable where the actor
        runs, or one defined in ``__main__``), and so must its arguments and result. The job
        goes to the least-busy actor, or with ``affinity=key`` to the actor first chosen for
        that key. An exception raised by ``fn`` is raised here with the same type (the
        actor's traceback attached as a note); a result that cannot be pickled raises
        KvforkError; so does a job whose actor died, and the pool replaces that actor."""
        slot, handle, ref = self._submit(fn, args, kwargs, affinity)
        try:
            ok, data = await self._await(slot, handle, ref)
        except asyncio.CancelledError:
            ray.cancel(ref)  # the job stops at its next await in the actor, not later
            raise
        finally:
            slot.running -= 1
        result: T = self._unwrap(ok, data)
        return result

    def run_sync(
        self,
        fn: Callable[..., Awaitable[T]],
        /,
        *args: Any,
        affinity: Hashable | None = None,
        **kwargs: Any,
    ) -> T:
        """`run`, blocking the calling thread until the result is back."""
        slot, handle, ref = self._submit(fn, args, kwargs, affinity)
        try:
            ok, data = self._get(slot, handle, ref)
        except KeyboardInterrupt:
            ray.cancel(ref)
            raise
        finally:
            slot.running -= 1
        result: T = self._unwrap(ok, data)
        return result

    async def stats(self) -> list[dict[str, Any]]:
        """Each actor's ``ctx.stats()`` plus ``actor`` (its index), ``pid``, ``jobs_done``,
        ``running``, ``free_leases`` (a job that leaves a branch unpruned keeps its lease as
        long as the actor lives) and ``replaced`` (how many times the pool replaced that
        actor)."""
        self._check_open()
        refs = [(slot, slot.handle, slot.handle.stats.remote()) for slot in self._slots]
        out = []
        for index, (slot, handle, ref) in enumerate(refs):
            row: dict[str, Any] = await self._await(slot, handle, ref)
            row.update(actor=index, replaced=slot.replaced)
            out.append(row)
        return out

    def shutdown(self) -> None:
        """Kill every actor (their contexts go with their processes). Idempotent; later
        jobs raise KvforkError."""
        if self._closed:
            return
        self._closed = True
        for slot in self._slots:
            ray.kill(slot.handle, no_restart=True)

    def _check_open(self) -> None:
        if self._closed:
            raise KvforkError("this ContextPool is shut down")

    def _pick(self, affinity: Hashable | None) -> _Slot:
        if affinity is not None and affinity in self._affinity:
            return self._slots[self._affinity[affinity]]
        # Least busy; ties go round-robin so that sequential jobs spread over the actors.
        start = next(self._turn) % len(self._slots)
        order = self._slots[start:] + self._slots[:start]
        slot = min(order, key=lambda s: s.running)
        if affinity is not None:
            self._affinity[affinity] = self._slots.index(slot)
        return slot

    def _submit(
        self,
        fn: Callable[..., Awaitable[Any]],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        affinity: Hashable | None,
    ) -> tuple[_Slot, Any, Any]:
        self._check_open()
        if not callable(fn):
            raise TypeError(f"fn must be an async function taking the context, got {fn!r}")
        if affinity is not None and not isinstance(affinity, Hashable):
            raise TypeError(f"affinity must be hashable, got {type(affinity).__name__}")
        slot = self._pick(affinity)
        handle = slot.handle
        ref = handle.run.remote(fn, args, kwargs)
        slot.running += 1
        return slot, handle, ref

    async def _await(self, slot: _Slot, handle: Any, ref: Any) -> Any:
        try:
            return await ref
        except ray.exceptions.RayActorError as exc:
            raise self._actor_died(slot, handle, exc) from exc

    def _get(self, slot: _Slot, handle: Any, ref: Any) -> Any:
        try:
            return ray.get(ref)
        except ray.exceptions.RayActorError as exc:
            raise self._actor_died(slot, handle, exc) from exc

    def _actor_died(self, slot: _Slot, handle: Any, exc: BaseException) -> KvforkError:
        if self._closed:
            return KvforkError("the pool was shut down while this job ran")
        # Several jobs may see the same death: only the first replaces the actor.
        if slot.handle is handle:
            ray.kill(handle, no_restart=True)
            slot.handle = self._spawn()
            slot.replaced += 1
        return KvforkError(
            f"the actor running this job died ({type(exc).__name__}); the pool has "
            "replaced it, so later jobs run on a new actor"
        )

    @staticmethod
    def _unwrap(ok: bool, data: bytes) -> Any:
        value = pickle.loads(data)
        if ok:
            return value
        exc, remote_traceback = value
        if hasattr(exc, "add_note"):  # Python 3.11+
            exc.add_note(f"raised in the kvfork.ray actor:\n{remote_traceback}")
        raise exc

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> Literal[False]:
        self.shutdown()
        return False

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> Literal[False]:
        return self.__exit__(exc_type, exc, tb)


_SHARED: dict[tuple[int, Hashable], tuple[Context, asyncio.Future[Any]]] = {}


async def shared(ctx: Context, key: Hashable, factory: Callable[[], Awaitable[T]]) -> T:
    """``await factory()`` once per context and key, and the same value on later calls:
    per-actor state that outlives one job, such as a warm branch holding a shared system
    prompt that jobs fork from (send them with ``affinity=key`` so they meet it). Concurrent
    callers share one run of ``factory``; if it raises, the next call tries again. Works the
    same in-process, where it is per context."""
    slot = (id(ctx), key)
    entry = _SHARED.get(slot)
    if entry is None:
        # The entry holds `ctx` so that its id cannot be reused while the entry lives.
        entry = (ctx, asyncio.ensure_future(factory()))
        _SHARED[slot] = entry
    try:
        value: T = await asyncio.shield(entry[1])
    except Exception:
        if _SHARED.get(slot) is entry:
            del _SHARED[slot]
        raise
    return value
