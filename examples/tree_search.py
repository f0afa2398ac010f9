"""Tree search over continuations (MCTS-style), with the model's own confidence as value.

Each node of the tree is a branch that wrote a short segment of text. An iteration picks a
leaf by UCT, forks it `width` ways with different seeds and writes one segment in every
child at once (`BranchStore.step`: one decode per token for all of them); a child's value
is the mean log-probability of its segment under the raw logits (from `perplexity`), and
it is added to the child and every ancestor. When the context runs short of leases, the
worst leaf's subtree is pruned (`prune_subtree`). After each turn the best child of the
root wins and `retain_only` drops everything else: the next turn searches from there.

usage: python examples/tree_search.py
"""

from __future__ import annotations

import asyncio
import math
from dataclasses import dataclass, field

import kvfork

PROMPT = "The old lighthouse keeper opened the door and"


@dataclass(eq=False)
class Node:
    branch: kvfork.Branch
    accepted: int  # tokens the branch has accepted (its perplexity is over these)
    parent: Node | None = None
    children: list[Node] = field(default_factory=list)
    visits: int = 0
    total: float = 0.0
    text: str = ""

    def mean(self) -> float:
        return self.total / self.visits if self.visits else 0.0

    def uct(self, c: float = 0.5) -> float:
        if self.visits == 0 or self.parent is None:
            return math.inf
        return self.mean() + c * math.sqrt(math.log(self.parent.visits + 1) / self.visits)


def leaves(node: Node) -> list[Node]:
    return [node] if not node.children else [x for c in node.children for x in leaves(c)]


def log_ppl_sum(b: kvfork.Branch, accepted: int) -> float:
    """Sum of surprisals of the branch's accepted tokens (nats)."""
    return math.log(b.perplexity) * accepted if accepted else 0.0


@dataclass
class Stats:
    iterations: int = 0
    decodes: int = 0
    pruned_subtrees: int = 0
    turns: list[str] = field(default_factory=list)


async def expand(ctx: kvfork.Context, leaf: Node, width: int, segment: int, seed: int) -> None:
    """Fork `leaf` `width` ways and write one segment in every child, all in one decode per
    token; value each child and back the values up."""
    store = kvfork.BranchStore(ctx)
    kids = [await leaf.branch.fork(seed=seed + i) for i in range(width)]
    before = log_ppl_sum(leaf.branch, leaf.accepted)
    texts = ["" for _ in kids]
    for _ in range(segment):
        tokens = await store.step(kids)
        for i, t in enumerate(tokens):
            texts[i] += "" if t.is_stop else t.text
    for kid, text in zip(kids, texts):
        child = Node(kid, leaf.accepted + segment, parent=leaf, text=text)
        # Mean log-probability of the segment: higher is better.
        value = -(log_ppl_sum(kid, child.accepted) - before) / segment
        leaf.children.append(child)
        node: Node | None = child
        while node is not None:
            node.visits += 1
            node.total += value
            node = node.parent


async def free_leases(store: kvfork.BranchStore, root: Node, need: int, stats: Stats) -> None:
    """Prune the worst leaves' subtrees until `need` leases are free."""
    while store.available < need:
        candidates = [n for n in leaves(root) if n is not root and n.parent is not None]
        worst = min(candidates, key=lambda n: n.mean())
        parent = worst.parent
        assert parent is not None
        await worst.branch.prune_subtree()
        parent.children.remove(worst)
        stats.pruned_subtrees += 1


async def search(
    turns: int = 3, iterations: int = 4, width: int = 3, segment: int = 6, n_seq_max: int = 12
) -> Stats:
    stats = Stats()
    async with kvfork.create_context(kvfork.default_model_path(), n_seq_max=n_seq_max) as ctx:
        store = kvfork.BranchStore(ctx)
        first = kvfork.Branch.create(ctx, 0, kvfork.SamplingParams(temperature=0.9, seed=1))
        await first.prefill(ctx.tokenize(PROMPT))
        root = Node(first, 0, visits=1)
        calls = ctx.stats()["decode_calls"]
        seed = 100
        for _ in range(turns):
            for _ in range(iterations):
                # Make room first: the pruned subtree may hold the leaf UCT would pick.
                await free_leases(store, root, width, stats)
                leaf = root
                while leaf.children:  # select by UCT
                    leaf = max(leaf.children, key=Node.uct)
                await expand(ctx, leaf, width, segment, seed)
                seed += width
                stats.iterations += 1
            best = max(root.children, key=Node.mean)
            await store.retain_only(best.branch)  # every other branch is gone, at once
            stats.turns.append(best.text)
            root = Node(best.branch, best.accepted, visits=1)
        stats.decodes = int(ctx.stats()["decode_calls"] - calls)
        await root.branch.prune()
    return stats


async def main() -> None:
    stats = await search()
    print(PROMPT + "".join(stats.turns))
    print(
        f"\n{stats.iterations} expansions over {len(stats.turns)} turns, "
        f"{stats.decodes} decodes, {stats.pruned_subtrees} subtrees pruned for leases"
    )


if __name__ == "__main__":
    asyncio.run(main())
