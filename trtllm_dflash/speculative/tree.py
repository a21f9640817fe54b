"""DDTree (arXiv 2604.12989): a tree of drafts from one DFlash drafter pass, verified in one target pass.

A DFlash drafter drafts every position of its block in one pass, so its distribution at depth d does not depend on the
tokens chosen before it: a path [anchor, x_1 .. x_n] scores log p_1(x_1) + .. + log p_n(x_n). `build_trees` takes the
`budget` best such nodes best-first (a heap of frontier nodes: popping a node adds it to the tree and pushes its
children, the k best tokens of the next depth; scores only fall along a path, so the result is the `budget`
highest-scoring nodes, closed under ancestors: `tests/test_tree.py` checks it against brute force).

Verification runs the anchor and the tree's nodes as one target pass: node i sits at position start + depth(i) for
RoPE, in cache row start + i, and attends to the committed keys and to its ancestors and itself (`ancestor_mask`).
The target's token after node i is drawn exactly as a chain's would be at that position (speculative/core.py:
argmax, or the Gumbel-max draw of (seed, position)), so walking from the anchor to the child equal to the target's
token, while there is one, commits the target's own tokens: the same sequence as plain decoding, greedy or sampled
(the chain is the tree with one node per depth). The accepted path's cache rows then move to positions start ..
start + n (`TorchExecutor.verify_tree` / `keep_path`).
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class DraftTrees:
    """One tree per row, node 0 the anchor, every node after its parent (host lists: built on the host)."""

    tokens: list[list[int]]  # [B][N]
    parents: list[list[int]]  # [B][N] (-1 for the anchor)
    depths: list[list[int]]  # [B][N]

    @property
    def nodes(self) -> int:
        return len(self.tokens[0])


def build_trees(anchors: list[int], candidates: list[list[list[int]]], logprobs: list[list[list[float]]],
                budget: int) -> DraftTrees:
    """Per row: the anchor and the `budget` best draft nodes. candidates / logprobs [B][D][k]: each depth's k best
    tokens and their log-probabilities, best first (k >= 1; fewer than `budget` nodes only if D x k paths run out)."""
    tokens, parents, depths = [], [], []
    for anchor, cands, lps in zip(anchors, candidates, logprobs):
        t, p, d = [anchor], [-1], [0]
        # (negated score, tie-break order, parent node, depth of the child, rank of the child among that depth's k)
        heap = [(-lps[0][0], 0, 0, 1, 0)] if cands else []
        order = 1
        while heap and len(t) <= budget:
            neg, _, parent, depth, rank = heapq.heappop(heap)
            node = len(t)
            t.append(cands[depth - 1][rank])
            p.append(parent)
            d.append(depth)
            score = -neg
            if rank + 1 < len(cands[depth - 1]):  # its next sibling (same parent, next-best token)
                sibling = score - lps[depth - 1][rank] + lps[depth - 1][rank + 1]
                heapq.heappush(heap, (-sibling, order, parent, depth, rank + 1))
                order += 1
            if depth < len(cands):  # its best child
                heapq.heappush(heap, (-(score + lps[depth][0]), order, node, depth + 1, 0))
                order += 1
        tokens.append(t)
        parents.append(p)
        depths.append(d)
    width = max(len(t) for t in tokens)
    for t, p, d in zip(tokens, parents, depths):  # rows short of nodes: more children of the anchor with its own
        # token (well-formed nodes, accepted only where that is the target's token)
        while len(t) < width:
            t.append(t[0])
            p.append(0)
            d.append(1)
    return DraftTrees(tokens, parents, depths)


def ancestor_mask(parents: torch.Tensor) -> torch.Tensor:
    """parents [B, N] (every node after its parent, -1 for node 0) -> [B, N, N] bool: node i sees node j iff j is i or
    one of its ancestors."""
    b, n = parents.shape
    mask = torch.eye(n, dtype=torch.bool, device=parents.device).expand(b, n, n).clone()
    rows = torch.arange(b, device=parents.device)
    for i in range(1, n):
        mask[:, i] |= mask[rows, parents[:, i]]
    return mask


def accepted_paths(trees: DraftTrees, target: list[list[int]]) -> list[list[int]]:
    """Per row, the accepted nodes from the anchor: at each node the child whose token is the target's token there
    (target [B][N]: the target's token after each node), while one is."""
    paths = []
    for tokens, parents, chosen in zip(trees.tokens, trees.parents, target):
        children: dict[int, dict[int, int]] = {}
        for node in range(1, len(tokens)):
            children.setdefault(parents[node], {}).setdefault(tokens[node], node)
        path = [0]
        while (nxt := children.get(path[-1], {}).get(chosen[path[-1]])) is not None:
            path.append(nxt)
        paths.append(path)
    return paths


def chain_outcomes(trees: DraftTrees, paths: list[list[int]], target: list[list[int]], best: list[list[int]]
                   ) -> list[tuple[int, int]]:
    """Per row, what the chain of each depth's best draft (`best` [B][D], the drafter's argmax: a DFlash drafter drafts
    each position on its own, so the chain is the same whichever path) would have verified and accepted, as far as the
    tree's pass tells: (verify length, accepted), the drafts after the first unverified one unknown. The accepted path
    follows the chain for n drafts; if it then leaves it, the chain's draft n + 1 was the target's no more; if it ends
    there, the bonus says whether the chain's draft n + 1 was accepted. Example: best [5, 7, 9], path tokens
    [anchor, 5, 8] -> (3, 1): drafts 1 and 2 verified, 1 accepted."""
    out = []
    for row, path in enumerate(paths):
        tokens, drafts = trees.tokens[row], best[row]
        n = 0
        while n + 1 < len(path) and n < len(drafts) and tokens[path[n + 1]] == drafts[n]:
            n += 1
        more = n + 1 == len(path) and n < len(drafts) and target[row][path[-1]] == drafts[n]
        out.append((min(n + 2, len(drafts) + 1), n + more))
    return out
