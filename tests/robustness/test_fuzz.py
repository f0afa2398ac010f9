"""Stateful property test: random valid and invalid operations on branches of one context
(real model, small n_ctx and n_seq_max), checked after every step against a plain-Python
model of the tree, with greedy continuations compared to a fresh single-branch replay.

Bounded for CI; `KVFORK_FUZZ_EXAMPLES` / `KVFORK_FUZZ_STEPS` make it a longer soak."""

from __future__ import annotations

import asyncio
import contextlib
import math
import os
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import kvfork
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from ..conftest import GREEDY, assert_close_logits

N_CTX = 1024
N_SEQ = 5
N_BATCH = 24  # small: store operations over several branches split their decodes
PROMPTS = [
    "The history of the printing press begins with",
    "1, 2, 3, 4, 5,",
    "Once upon a time",
    "def fibonacci(n):",
]
WORDS = [235, 506, 529, 1902, 9259, 17410, 236764, 236888]  # ordinary token ids
GRAMMAR = 'root ::= [a-z ]+ "."'


@dataclass
class Node:
    branch: kvfork.Branch
    tokens: list[int]  # everything in its KV sequence, from position 0
    parent: Node | None = None
    children: list[Node] = field(default_factory=list)
    disposed: bool = False
    grammar: bool = False
    steered: bool = False
    tampered: bool = False  # raw KV ops removed its cells: no replay check

    @property
    def position(self) -> int:
        return len(self.tokens)


class BranchTree(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.model = kvfork.Model.load(kvfork.default_model_path())
        self.replay_ctx = kvfork.create_context_sync(self.model, n_ctx=N_CTX, n_seq_max=1)
        self.ctx = self._open()
        self.nodes: list[Node] = []
        # (handle, length) of histories already compared with a replay
        self.replayed: set[tuple[int, int]] = set()

    def _open(self) -> kvfork.Context:
        return kvfork.create_context_sync(self.model, n_ctx=N_CTX, n_batch=N_BATCH, n_seq_max=N_SEQ)

    def live(self) -> list[Node]:
        return [n for n in self.nodes if not n.disposed]

    def teardown(self) -> None:
        self.ctx.close()
        self.replay_ctx.close()

    # ---- helpers of the model

    def dispose(self, node: Node) -> None:
        node.disposed = True
        if node.parent is not None and node in node.parent.children:
            node.parent.children.remove(node)

    def store(self) -> kvfork.BranchStore:
        return kvfork.BranchStore(self.ctx)

    def roll_back_check(self, nodes: list[Node], exc: BaseException) -> None:
        """A failed decode changes nothing."""
        assert isinstance(exc, kvfork.KvCacheFullError | kvfork.DecodeError), exc
        for n in nodes:
            assert n.branch.position == n.position

    # ---- rules

    @initialize()
    def first_root(self) -> None:
        self.create(PROMPTS[0])

    @rule(text=st.sampled_from(PROMPTS))
    def create(self, text: str) -> None:
        if len(self.live()) == N_SEQ:
            with pytest.raises(kvfork.LeaseExhaustedError):
                kvfork.Branch.create(self.ctx, 0, GREEDY)
            return
        b = kvfork.Branch.create(self.ctx, 0, GREEDY)
        toks = self.ctx.tokenize(text)
        b.prefill_sync(toks)
        self.nodes.append(Node(b, list(toks)))

    @precondition(lambda self: self.live())
    @rule(data=st.data())
    def fork(self, data: st.DataObject) -> None:
        node = data.draw(st.sampled_from(self.live()))
        if len(self.live()) == N_SEQ:
            with pytest.raises(kvfork.LeaseExhaustedError):
                node.branch.fork_sync()
            return
        child = Node(
            node.branch.fork_sync(),
            list(node.tokens),
            parent=node,
            grammar=node.grammar,
            tampered=node.tampered,
        )
        node.children.append(child)
        self.nodes.append(child)

    @precondition(lambda self: self.live())
    @rule(data=st.data())
    def commit_greedy(self, data: st.DataObject) -> None:
        node = data.draw(st.sampled_from(self.live()))
        try:
            tok = node.branch.produce_sync()
        except kvfork.GrammarError:
            return  # the grammar reached its end
        if tok.is_stop:
            return
        try:
            node.branch.commit_sync(tok)
        except kvfork.KvforkError as e:
            self.roll_back_check([node], e)
            return
        node.tokens.append(tok.token)

    @precondition(lambda self: self.live())
    @rule(data=st.data(), n=st.integers(0, 40))
    def prefill(self, data: st.DataObject, n: int) -> None:
        node = data.draw(st.sampled_from(self.live()))
        toks = data.draw(st.lists(st.sampled_from(WORDS), min_size=n, max_size=n))
        if node.grammar:
            return  # prefill bypasses the grammar; keep grammar branches on grammar tokens
        try:
            node.branch.prefill_sync(toks)
        except kvfork.KvforkError as e:
            self.roll_back_check([node], e)
            return
        node.tokens += toks

    @precondition(lambda self: self.live())
    @rule(data=st.data())
    def store_step(self, data: st.DataObject) -> None:
        nodes = data.draw(st.lists(st.sampled_from(self.live()), min_size=1, unique_by=id))
        try:
            toks = self.store().step_sync([n.branch for n in nodes])
        except kvfork.GrammarError:
            return
        except kvfork.KvforkError as e:
            self.roll_back_check(nodes, e)
            return
        for n, t in zip(nodes, toks, strict=True):
            if not t.is_stop:
                n.tokens.append(t.token)

    @precondition(lambda self: self.live())
    @rule(data=st.data())
    def store_commit(self, data: st.DataObject) -> None:
        nodes = data.draw(st.lists(st.sampled_from(self.live()), min_size=1, unique_by=id))
        nodes = [n for n in nodes if not n.grammar]  # a forced token may break a grammar
        toks = [data.draw(st.sampled_from(WORDS)) for _ in nodes]
        try:
            self.store().commit_sync([(n.branch, t) for n, t in zip(nodes, toks, strict=True)])
        except kvfork.KvforkError as e:
            self.roll_back_check(nodes, e)
            return
        for n, t in zip(nodes, toks, strict=True):
            n.tokens.append(t)

    @precondition(lambda self: self.live())
    @rule(data=st.data())
    def store_prefill(self, data: st.DataObject) -> None:
        nodes = data.draw(st.lists(st.sampled_from(self.live()), min_size=1, unique_by=id))
        nodes = [n for n in nodes if not n.grammar]
        runs = [data.draw(st.lists(st.sampled_from(WORDS), max_size=30)) for _ in nodes]
        try:
            self.store().prefill_sync([(n.branch, r) for n, r in zip(nodes, runs, strict=True)])
        except kvfork.KvforkError as e:
            self.roll_back_check(nodes, e)
            return
        for n, r in zip(nodes, runs, strict=True):
            n.tokens += r

    @precondition(lambda self: self.live())
    @rule(data=st.data())
    def prune(self, data: st.DataObject) -> None:
        node = data.draw(st.sampled_from(self.live()))
        if node.children:
            with pytest.raises(kvfork.KvforkError, match="children"):
                node.branch.prune_sync()
            return
        node.branch.prune_sync()
        self.dispose(node)
        node.branch.prune_sync()  # a second prune is a no-op

    @precondition(lambda self: self.live())
    @rule(data=st.data(), how=st.sampled_from(["dropped", "cancelled"]))
    def prune_not_awaited(self, data: st.DataObject, how: str) -> None:
        """A prune that is dropped unawaited (it warns) or whose await is cancelled at once
        still happens, and the graph shows it at once: disposed, inactive, gone from its
        parent's children, the parent a leaf again if it was its only child."""
        node = data.draw(st.sampled_from(self.live()))
        if node.children:
            if how == "dropped":
                with pytest.warns(RuntimeWarning, match=r"Branch\.prune\(\) was never awaited"):
                    node.branch.prune()  # refused (live children): the error is lost
            else:
                with pytest.raises(kvfork.KvforkError, match="children"):
                    asyncio.run(_awaited(node.branch.prune()))
            assert not node.branch.disposed
            return
        if how == "dropped":
            with pytest.warns(RuntimeWarning, match=r"Branch\.prune\(\) was never awaited"):
                node.branch.prune()
        else:
            _cancelled_at_once(node.branch.prune)
        self.dispose(node)
        b = node.branch
        assert b.disposed and not b.is_active
        if node.parent is not None:
            parent = node.parent.branch
            assert b.handle not in {c.handle for c in parent.children}
            assert parent.is_leaf == (not node.parent.children)
        self.flush()

    @precondition(lambda self: self.live())
    @rule(data=st.data(), how=st.sampled_from(["dropped", "cancelled"]))
    def fork_not_awaited(self, data: st.DataObject, how: str) -> None:
        """A fork that is dropped or cancelled happened or not at all: once the engine has
        run the work queued before, the child is in its parent's children, or nowhere."""
        node = data.draw(st.sampled_from(self.live()))
        before = {c.handle for c in node.branch.children}
        if how == "dropped":
            with pytest.warns(RuntimeWarning, match=r"Branch\.fork\(\) was never awaited"):
                node.branch.fork()
        else:
            _cancelled_at_once(node.branch.fork)
        self.flush()
        made = [c for c in node.branch.children if c.handle not in before]
        assert len(made) <= 1
        if len(self.live()) == N_SEQ:
            assert not made  # no lease: the fork failed, its error lost with it
        if made:
            child = Node(made[0], list(node.tokens), parent=node, grammar=node.grammar)
            child.tampered = node.tampered
            node.children.append(child)
            self.nodes.append(child)

    def flush(self) -> None:
        """Wait until the engine has run everything queued (a call that queues behind it)."""
        self.ctx.kv_seq_pos_max_sync(0)

    @precondition(lambda self: self.live())
    @rule(data=st.data())
    def prune_subtree(self, data: st.DataObject) -> None:
        node = data.draw(st.sampled_from(self.live()))
        node.branch.prune_subtree_sync()
        stack = [node]
        while stack:
            n = stack.pop()
            stack += n.children
            self.dispose(n)

    @precondition(lambda self: self.live())
    @rule(data=st.data())
    def retain_only(self, data: st.DataObject) -> None:
        winner = data.draw(st.sampled_from(self.live()))
        self.store().retain_only_sync(winner.branch)
        for n in self.live():
            if n is not winner:
                n.disposed = True
        winner.parent, winner.children = None, []

    @precondition(lambda self: self.live())
    @rule(data=st.data(), on=st.booleans())
    def set_grammar(self, data: st.DataObject, on: bool) -> None:
        node = data.draw(st.sampled_from(self.live()))
        node.branch.set_grammar(GRAMMAR if on else None)
        node.grammar = on

    @precondition(lambda self: self.live())
    @rule(data=st.data(), on=st.booleans())
    def steer(self, data: st.DataObject, on: bool) -> None:
        node = data.draw(st.sampled_from(self.live()))
        if on:
            node.branch.steer(dict.fromkeys(WORDS, -5.0))
        else:
            node.branch.clear_steer()
        node.steered = on

    @rule()
    def kv_clear(self) -> None:
        self.ctx.kv_clear()
        for n in self.live():
            n.tampered = True

    @rule()
    def close_and_reopen(self) -> None:
        live = self.live()
        self.ctx.close()
        for n in live:
            assert n.branch.disposed
            with pytest.raises(kvfork.KvforkError):
                n.branch.commit_sync(WORDS[0])
        self.nodes = []
        self.replayed.clear()
        self.ctx = self._open()
        self.create(PROMPTS[1])

    # ---- invalid operations: refused, nothing changes

    @precondition(lambda self: self.live())
    @rule(data=st.data(), bad=st.sampled_from([-1, 262144, 2**40]))
    def commit_invalid_token(self, data: st.DataObject, bad: int) -> None:
        node = data.draw(st.sampled_from(self.live()))
        with pytest.raises(ValueError, match="token"):
            node.branch.commit_sync(bad)

    @precondition(lambda self: any(n.disposed for n in self.nodes))
    @rule(data=st.data())
    def use_disposed(self, data: st.DataObject) -> None:
        node = data.draw(st.sampled_from([n for n in self.nodes if n.disposed]))
        with pytest.raises(kvfork.KvforkError):
            node.branch.fork_sync()
        with pytest.raises(kvfork.KvforkError):
            node.branch.commit_sync(WORDS[0])

    @precondition(lambda self: self.live())
    @rule(data=st.data())
    def store_duplicate(self, data: st.DataObject) -> None:
        node = data.draw(st.sampled_from(self.live()))
        with pytest.raises(ValueError, match="twice"):
            self.store().step_sync([node.branch, node.branch])

    # ---- checks

    @invariant()
    def logits_equal_a_fresh_replay(self) -> None:
        """Every branch whose history changed since the last check continues like a fresh
        single branch prefilled with the same tokens (its KV is right)."""
        for node in self.live():
            key = (node.branch.handle, len(node.tokens))
            if node.grammar or node.steered or node.tampered or key in self.replayed:
                continue
            if not 0 < node.position < N_CTX:
                continue
            self.replayed.add(key)
            replay = kvfork.Branch.create(self.replay_ctx, 0, GREEDY)
            try:
                replay.prefill_sync(node.tokens)
                want, got = replay.logits(), node.branch.logits()
            finally:
                replay.prune_sync()
            # Batched decodes in other cells differ from one long prefill by noise: within
            # LOGIT_NOISE, the same argmax where the replay's margin is clear, and the same
            # distribution (conftest.assert_close_logits).
            assert_close_logits(got, want, f"branch {node.branch.handle} at {node.position}")

    @invariant()
    def tree_matches_the_model(self) -> None:
        live = self.live()
        assert self.store().available == N_SEQ - len(live)
        for n in self.nodes:
            assert n.branch.disposed == n.disposed
        for n in live:
            b = n.branch
            assert b.position == n.position
            assert b.is_active
            assert b.parent == (n.parent.branch if n.parent else None)
            assert {c.handle for c in b.children} == {c.branch.handle for c in n.children}
            assert b.is_leaf == (not n.children)
            if n.position and not n.tampered:
                assert math.isfinite(b.entropy())


async def _awaited(op: Awaitable[Any]) -> Any:
    return await op


def _cancelled_at_once(call: Callable[[], Awaitable[Any]]) -> None:
    """`call()`'s operation awaited in a task that is cancelled as soon as it suspends; returns
    once the cancelled await has handed control back (it happened, or never will)."""

    async def main() -> None:
        task = asyncio.ensure_future(_awaited(call()))
        await asyncio.sleep(0)
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError, kvfork.KvforkError):
            await task

    asyncio.run(main())


BranchTree.TestCase.settings = settings(
    max_examples=int(os.environ.get("KVFORK_FUZZ_EXAMPLES", "6")),
    stateful_step_count=int(os.environ.get("KVFORK_FUZZ_STEPS", "25")),
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    derandomize=os.environ.get("KVFORK_FUZZ_RANDOM") is None,
)
test_branch_tree_state_machine = BranchTree.TestCase
