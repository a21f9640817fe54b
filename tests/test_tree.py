"""DDTree drafting (speculative/tree.py, `--tree-budget`): the best-first tree against brute force, the ancestor mask,
one tree pass against every path run as a chain, and decoding that commits the target's own tokens (greedy and sampled
== ar, static and paged caches; dense, latent-attention, sliding-window and Gated DeltaNet targets) with a drafter whose
right token sits at varying ranks, so that accepted paths run through the tree's side branches; bad inputs in one
sentence."""

from __future__ import annotations

import itertools
import json
import shutil
from dataclasses import replace
from pathlib import Path

import onnx
import pytest
import torch

from tests.conftest import MPIEXEC, assert_mpiexec_run_equals_one_process, build, write_family_config
from tests.conftest import family_requests as requests
from trtllm_dflash.checkpoint.formats import load_target
from trtllm_dflash.cli import EXIT_USER_ERROR, main
from trtllm_dflash.models.target import TargetModel
from trtllm_dflash.runtime.decoding import Decoder, Request
from trtllm_dflash.runtime.runner import Engine
from trtllm_dflash.runtime.verify import TreeDrafting
from trtllm_dflash.speculative.tree import accepted_paths, ancestor_mask, build_trees, chain_outcomes
from trtllm_dflash.train.random_pair import write_random_pair


def paths_of(trees, row: int) -> set[tuple[int, ...]]:
    """Each node's tokens from the first draft down to it."""
    tokens, parents = trees.tokens[row], trees.parents[row]
    out = set()
    for node in range(1, len(tokens)):
        path, n = [], node
        while n > 0:
            path.append(tokens[n])
            n = parents[n]
        out.add(tuple(reversed(path)))
    return out


@pytest.mark.parametrize("budget", [1, 5, 12, 39])
def test_the_tree_is_the_best_nodes_by_brute_force(budget):
    """Depth 4, 3 candidates a position (120 possible nodes): the tree's nodes are the `budget` best paths by total
    log-probability, every node's parent is in it, and parents come before children."""
    g = torch.Generator().manual_seed(budget)
    depth, k = 4, 3
    for trial in range(5):
        lps = torch.rand(depth, k, generator=g).log().sort(descending=True).values
        tokens = torch.randperm(50, generator=g)[: depth * k].view(depth, k)
        trees = build_trees([7], [tokens.tolist()], [lps.tolist()], budget)
        every = {}
        for n in range(1, depth + 1):
            for ranks in itertools.product(range(k), repeat=n):
                every[tuple(tokens[d, r].item() for d, r in enumerate(ranks))] = sum(lps[d, r].item()
                                                                                     for d, r in enumerate(ranks))
        best = set(sorted(every, key=every.get, reverse=True)[:budget])
        assert paths_of(trees, 0) == best, trial
        assert all(p < i for i, p in enumerate(trees.parents[0]) if i) and trees.tokens[0][0] == 7
        assert trees.depths[0] == [0] + [len(p) for p in sorted(best, key=every.get, reverse=True)]


def test_ancestor_mask_and_the_accepted_path():
    #        0
    #      1   2
    #      3     4
    #      5
    parents = torch.tensor([[-1, 0, 0, 1, 2, 3]])
    mask = ancestor_mask(parents)[0]
    want = {0: {0}, 1: {0, 1}, 2: {0, 2}, 3: {0, 1, 3}, 4: {0, 2, 4}, 5: {0, 1, 3, 5}}
    assert {i: set(mask[i].nonzero().flatten().tolist()) for i in range(6)} == want
    from trtllm_dflash.speculative.tree import DraftTrees

    trees = DraftTrees([[9, 10, 11, 12, 13, 14]], [parents[0].tolist()], [[0, 1, 1, 2, 2, 3]])
    # the target's token after each node: 11 after the anchor (node 2), 13 after node 2 (node 4), then 99: stop
    assert accepted_paths(trees, [[11, 0, 13, 0, 99, 0]]) == [[0, 2, 4]]
    assert accepted_paths(trees, [[50, 0, 0, 0, 0, 0]]) == [[0]]


def test_chain_outcomes_against_the_chain_run_on_its_own():
    """What a tree step says about the chain of the best drafts (for --block-size auto's estimates): the accepted
    count equals the chain's own, run against the same target, up to the drafts the tree's pass verified (and the
    first rejected one is among them)."""
    g = torch.Generator().manual_seed(5)
    D, k, vocab = 6, 3, 12
    checked = 0
    for trial in range(300):
        cands = [torch.randperm(vocab, generator=g)[:k].tolist() for _ in range(D)]
        lps = [torch.rand(k, generator=g).log().sort(descending=True).values.tolist() for _ in range(D)]
        trees = build_trees([0], [cands], [lps], int(torch.randint(1, 20, (1,), generator=g)))
        bias = torch.rand(1, generator=g).item()

        def target_after(prefix: tuple[int, ...]) -> int:  # the target's token after a prefix: often the best draft
            h = hash((trial, prefix)) % 1000
            depth = len(prefix) - 1
            return cands[depth][0] if depth < D and h < 1000 * bias else h % vocab

        def path_to(node: int) -> tuple[int, ...]:
            out = []
            while node >= 0:
                out.append(trees.tokens[0][node])
                node = trees.parents[0][node]
            return tuple(reversed(out))

        target = [[target_after(path_to(n)) for n in range(trees.nodes)]]
        paths = accepted_paths(trees, target)
        best = [[c[0] for c in cands]]
        (verify_length, n), = chain_outcomes(trees, paths, target, best)
        true = 0
        while true < D and target_after(tuple([0] + best[0][:true])) == best[0][true]:
            true += 1
        verified = verify_length - 1
        assert n == min(true, verified), (true, verify_length, n)
        assert true >= verified or verified == true + 1
        checked += true < verified
    assert checked > 50  # the chain's rejection seen by the tree, often


# plain attention, latent attention, sliding windows of 4 positions beside full attention (gpt-oss with attention
# sinks and experts, Gemma 4 with its own RoPE per layer kind: windows shorter than a tree's deepest paths), and Gated
# DeltaNet layers beside gated attention (Qwen3.5: a recurrent state and a convolution along each node's path)
TREE_FAMILIES = ("qwen3", "deepseek_v3", "gpt_oss", "gemma4", "qwen3_5")


@pytest.fixture(scope="module")
def pairs(tmp_path_factory) -> dict[str, Path]:
    out = {}
    for family in TREE_FAMILIES:
        root = tmp_path_factory.mktemp(f"tree_{family}")
        write_random_pair(root, family, block_size=8, seed=3)
        out[family] = root
    return out


@pytest.fixture(scope="module")
def engines(pairs, tmp_path_factory) -> dict[str, Path]:
    return {f: build(p, tmp_path_factory.mktemp(f"tree_engine_{f}") / "engine", max_batch_size=4)
            for f, p in pairs.items()}


@pytest.mark.parametrize("family", TREE_FAMILIES)
def test_one_tree_pass_equals_every_path_as_a_chain(pairs, family):
    """Logits at every node of a 24-node tree after a 9-token prompt == those of a plain pass over the node's own path
    (its ancestors and itself) from the same prompt: the ancestor mask, the nodes' RoPE positions and cache rows. The
    tree is 6 deep, so a sliding window of 4 drops ancestors too, three of them cached at rows that a window counted
    in rows instead of positions would keep."""
    ckpt = load_target(pairs[family] / "target")
    model = TargetModel.from_state_dict(ckpt.spec, {n: ckpt.tensors.get(n).float() for n in ckpt.tensors.names()})
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(4, ckpt.spec.vocab_size, (1, 9), generator=g)
    lps = torch.rand(7, 3, generator=g).log().sort(descending=True).values
    cands = torch.randint(4, ckpt.spec.vocab_size, (7, 3), generator=g)
    trees = build_trees([int(prompt[0, -1])], [cands.tolist()], [lps.tolist()], 24)
    assert max(trees.depths[0]) == 6
    start = prompt.shape[1] - 1  # the prompt's last token is the anchor

    def prefilled():  # (Qwen3.5: its Gated DeltaNet layers' states too, kept for passes of up to the tree's nodes)
        cache, states = model.new_cache(1, 64), model.new_states(1, trees.nodes)
        model(prompt[:, :-1], torch.arange(start)[None], torch.tensor([0]), cache, states=states)
        return dict(cache=cache, states=states)

    tokens, depths = torch.tensor(trees.tokens), torch.tensor(trees.depths)
    tree = ancestor_mask(torch.tensor(trees.parents))
    out = model(tokens, start + depths, torch.tensor([0]), **prefilled(), tree=tree)
    for node in range(trees.nodes):
        path, n = [], node
        while n >= 0:
            path.append(trees.tokens[0][n])
            n = trees.parents[0][n]
        path = torch.tensor([list(reversed(path))])
        chain = model(path, start + torch.arange(path.shape[1])[None], torch.tensor([0]), **prefilled())
        torch.testing.assert_close(out.logits[0, node], chain.logits[0, -1], atol=2e-5, rtol=1e-4)


class RankedCandidates:
    """The real executor, whose drafter candidates are rewritten (instrumentation: every pass is the real one): at each
    position the reference sequence's token is the best of 4 candidates, or at every third position (shifting by
    step and row) the second best, the others wrong, so a chain of the best drafts would stop there while a tree
    follows the side branch, and keep_path moves nodes from all over the tree."""

    def __init__(self, executor, reference: dict[tuple[int, ...], list[int]]):
        self.executor, self.reference, self.of_slot, self.step = executor, reference, {}, 0
        self.ranks_accepted: list[int] = []

    def __getattr__(self, name):
        return getattr(self.executor, name)

    def target_forward(self, token_ids, starts, slots, capture, last_index=None, rows=None):
        if last_index is not None:  # a prefill (of a prompt's uncached part, or a preempted request's recompute)
            for row, (slot, start, last) in enumerate(zip(slots.tolist(), starts.tolist(), last_index.tolist())):
                ids = token_ids[row, : last + 1].tolist()
                self.of_slot[slot] = next(seq for seq in self.reference.values() if seq[start:start + last + 1] == ids)
        return self.executor.target_forward(token_ids, starts, slots, capture, last_index, rows=rows)

    def draft_candidates(self, anchors, starts, slots, k, context=None, rows=None):
        ids, lps = self.executor.draft_candidates(anchors, starts, slots, k, context, rows=rows)
        vocab = self.executor.vocab_size
        new = torch.empty_like(ids)
        for row, (slot, start) in enumerate(zip(slots.tolist(), starts.tolist())):
            seq = self.of_slot[slot]
            for d in range(ids.shape[1]):
                right = seq[start + 1 + d] if start + 1 + d < len(seq) else 0
                rank = 1 if (d + self.step + row) % 3 == 2 else 0
                wrong = [(right + 1 + j) % vocab for j in range(k - 1)]
                new[row, d] = torch.tensor(wrong[:rank] + [right] + wrong[rank:])
        self.step += 1
        return new, torch.arange(k, dtype=lps.dtype).neg().expand_as(lps) * 0.7 - 0.1

    def keep_path(self, slots, starts, nodes):
        self.ranks_accepted += [n for n in nodes.flatten().tolist() if n > 0]
        return self.executor.keep_path(slots, starts, nodes)


@pytest.mark.parametrize("family", TREE_FAMILIES)
def test_trees_commit_the_targets_own_tokens(engines, family):
    """Budget 24, the right token best or second best: greedy and sampled tree decoding == ar for the same seeds, paths
    of several nodes accepted, through side branches (and, for gpt-oss and Gemma 4, past their windows of 4)."""
    engine = Engine.load(engines[family], tree_budget=24)
    assert_ranked_trees_commit_ar(engine, engine, max_new_tokens=30)


def assert_ranked_trees_commit_ar(engine: Engine, reference_engine: Engine, max_new_tokens: int, budget: int = 24
                                  ) -> None:
    """With RankedCandidates on `engine`'s executor (4 candidates), greedy and sampled requests commit
    `reference_engine`'s ar tokens, through paths of several nodes and past the first branch."""
    base = [replace(r, max_new_tokens=max_new_tokens) for r in requests(engine.executor.vocab_size)]
    sampled = [Request(r.id, r.prompt_token_ids, r.max_new_tokens, temperature=0.9, top_k=50, seed=3 + r.id)
               for r in base]
    for reqs in (base, sampled):
        ar = {r.request.id: r.output_token_ids for r in reference_engine.decoder("ar").generate(reqs)}
        reference = {tuple(r.prompt_token_ids): r.prompt_token_ids + ar[r.id] for r in reqs}
        ranked = RankedCandidates(engine.executor, reference)
        results = list(Decoder(ranked, TreeDrafting(budget, candidates=4), engine.config.eos_token_ids).generate(reqs))
        assert {r.request.id: r.output_token_ids for r in results} == ar
        lengths = [n for r in results for n in r.acceptance_lengths]
        assert max(lengths) >= 4 and sum(lengths) / len(lengths) > 2, lengths
        assert max(ranked.ranks_accepted) > 8  # nodes past the first branch's (depth-first) 7 were accepted


def test_qwen3_5_trees_among_chains_and_plain_steps(engines):
    """A Qwen3.5 engine under --block-size auto --tree-budget 7, the steps chosen at random: tree steps that accept
    paths of several nodes (ranked candidates), chains and plain steps, each resuming the Gated DeltaNet states where
    the step before left them (a tree's path replayed as a chain); ar's tokens, greedy and sampled, requests joining
    mid-run."""
    from tests.test_block_size_auto import RandomVerifyOrTree, mixed_requests

    engine = Engine.load(engines["qwen3_5"], tree_budget=7)
    ex = engine.executor
    reqs = mixed_requests(ex.vocab_size)
    ar = {r.request.id: r.output_token_ids for r in engine.decoder("ar").generate(reqs)}
    ranked = RankedCandidates(ex, {tuple(r.prompt_token_ids): r.prompt_token_ids + ar[r.id] for r in reqs})
    policy = RandomVerifyOrTree(ex.block_size, tree_budget=7)
    results = Decoder.for_mode(ranked, "dflash", engine.config.eos_token_ids, policy).generate(reqs)
    assert {r.request.id: r.output_token_ids for r in results} == ar
    assert None in policy.chosen and 1 in policy.chosen and any(k and k > 1 for k in policy.chosen)
    assert max(ranked.ranks_accepted) >= 2  # paths of two drafted nodes or more


def test_onnxruntime_trees_are_the_torch_executors(ort_engine_dir):
    """The exported graphs (drafter_candidates, target_tree) and the onnxruntime executor's keep_path: with the
    drafter's own candidates, the same trees, paths and tokens as the torch executor; with ranked candidates (right
    tokens on side branches), greedy and sampled == ar through paths of several nodes."""
    root = ort_engine_dir("qwen3")
    ort, eager = (Engine.load(root, backend=b, tree_budget=24) for b in ("onnxruntime", "torch"))
    assert type(ort.executor).__name__ == "OnnxRuntimeExecutor"
    base = [replace(r, max_new_tokens=24) for r in requests(ort.executor.vocab_size)]
    own = [{r.request.id: (r.output_token_ids, r.acceptance_lengths)
            for r in Decoder(e.executor, TreeDrafting(12), e.config.eos_token_ids).generate(base)} for e in (ort, eager)]
    assert own[0] == own[1]
    assert_ranked_trees_commit_ar(ort, eager, max_new_tokens=24)


def test_onnxruntime_trees_over_rings_are_the_torch_executors(gpt_oss_ort_engine, tmp_path):
    """gpt-oss's onnxruntime engine, whose sliding-window layers (window 4) keep rings of window + 16 positions:
    target_tree.onnx over those rings and keep_path within them give the torch executor's trees, paths and tokens, and
    ar's tokens through side branches; a budget whose pass would overrun the rings, or a tree graph exported before
    its windows followed the tree, is one sentence."""
    from trtllm_dflash.engine_dir import graph_dir
    from trtllm_dflash.errors import UserError
    from trtllm_dflash.runtime.onnxruntime_executor import OnnxRuntimeExecutor

    ort, eager = (Engine.load(gpt_oss_ort_engine, backend=b, tree_budget=15) for b in ("onnxruntime", "torch"))
    assert ort.executor.window_ring == 4 + 16 < ort.executor._cache_length
    base = [replace(r, max_new_tokens=40) for r in requests(ort.executor.vocab_size)]
    own = [{r.request.id: (r.output_token_ids, r.acceptance_lengths)
            for r in Decoder(e.executor, TreeDrafting(15), e.config.eos_token_ids).generate(base)}
           for e in (ort, eager)]
    assert own[0] == own[1]
    assert_ranked_trees_commit_ar(ort, eager, max_new_tokens=40, budget=15)
    with pytest.raises(UserError, match=r"^--tree-budget 16: this engine's sliding-window layers keep the last 20 "
                                        r"positions, room for trees of at most 15 nodes beside their window on "
                                        r"onnxruntime; use --tree-budget 15 or less\.$"):
        Engine.load(gpt_oss_ort_engine, backend="onnxruntime", tree_budget=16)
    old = tmp_path / "engine"
    shutil.copytree(gpt_oss_ort_engine, old)
    graph = graph_dir(old, 0) / "target_tree.onnx"
    model = onnx.load(graph, load_external_data=False)
    del model.metadata_props[[p.key for p in model.metadata_props].index("tree_sliding_windows")]
    onnx.save(model, graph)
    with pytest.raises(UserError, match=r"target_tree\.onnx: this gpt_oss engine's tree graph was exported by an "
                                        r"earlier trtllm-dflash, whose sliding-window layers ignored the tree; build "
                                        r"it again with `trtllm-dflash build CONFIG --force` to run --tree-budget\.$"):
        OnnxRuntimeExecutor.from_engine(old, ort.config, 0, None, 1, tree_budget=8)


def test_compare_with_a_tree_budget(engines, tmp_path, capsys):
    """`compare --tree-budget N`: dflash decodes with trees, identical to ar; with --block-size, one sentence."""
    prompts = tmp_path / "in.jsonl"
    prompts.write_text("".join(json.dumps({"prompt_token_ids": [5 + i, 6, 7], "max_new_tokens": 12}) + "\n"
                               for i in range(3)))
    compare = ["compare", str(engines["qwen3"]), "--input", str(prompts), "--show", "0"]
    assert main(compare + ["--tree-budget", "12"]) == 0
    out = " ".join(capsys.readouterr().out.split())  # (rich wraps lines)
    assert "a tree of 12 draft nodes a step, 3 prompts" in out and "outputs identical: yes" in out
    assert main(compare + ["--tree-budget", "12", "--block-size", "4"]) == EXIT_USER_ERROR
    assert ("--tree-budget drafts a tree every step of --mode dflash (or, with --block-size auto, where it pays); it "
            "does not take --mode ar or a fixed --block-size.") in capsys.readouterr().err


def test_run_with_auto_and_a_tree_budget(engines, tmp_path):
    """`run --block-size auto --tree-budget 7`: auto measures the passes and chooses chains, plain steps or the tree
    step by step; the tokens are ar's."""
    prompts = tmp_path / "in.jsonl"
    prompts.write_text("".join(json.dumps({"id": i, "prompt_token_ids": [5 + i, 6, 7, 8], "max_new_tokens": 24}) + "\n"
                               for i in range(4)))
    outs = {}
    for name, extra in (("auto-tree", ["--block-size", "auto", "--tree-budget", "7"]), ("ar", ["--mode", "ar"])):
        assert main(["run", str(engines["qwen3"]), "--input", str(prompts), "--output", str(tmp_path / name), *extra]) == 0
        outs[name] = {r["id"]: r["output_token_ids"] for r in map(json.loads, (tmp_path / name).read_text().splitlines())}
    assert outs["auto-tree"] == outs["ar"] and len(outs["ar"]) == 4


def test_graphs_without_the_tree_graphs_refuse_trees(ort_engine_dir, tmp_path):
    """An onnxruntime engine exported before the tree graphs existed: --tree-budget is one sentence."""
    from trtllm_dflash.engine_dir import graph_dir
    from trtllm_dflash.errors import UserError
    from trtllm_dflash.runtime.onnxruntime_executor import OnnxRuntimeExecutor

    root = ort_engine_dir("qwen3")
    old = tmp_path / "engine"
    shutil.copytree(root, old)
    (graph_dir(old, 0) / "target_tree.onnx").unlink()
    cfg = Engine.load(root, backend="torch").config
    with pytest.raises(UserError, match=r"target_tree\.onnx, which engines built by an earlier trtllm-dflash lack; "
                                        r"build it again with `trtllm-dflash build CONFIG --force`\.$"):
        OnnxRuntimeExecutor.from_engine(old, cfg, 0, None, 1, tree_budget=8)
    assert OnnxRuntimeExecutor.from_engine(old, cfg, 0, None, 1).tree_budget == 0  # chains still run


def tight_budget(root: Path, blocks: int, tree_budget: int) -> int:
    """Bytes of a paged cache for the engine at `root` whose full-attention layers and drafter hold `blocks` blocks
    beside what the executor sets aside first (sliding-window rings, Gated DeltaNet states): the blocks a probe of
    64 MiB gets, less the bytes of those beyond `blocks`."""
    from trtllm_dflash.runtime.executor import cache_shape
    from trtllm_dflash.runtime.kv_blocks import BLOCK_TOKENS

    probe = 64 << 20
    ex = Engine.load(root, tree_budget=tree_budget, kv_cache_memory=str(probe)).executor
    spec, shape = ex.target.spec, cache_shape(ex.target)
    full = shape.of_layers([i for i in range(spec.num_layers) if not spec.is_sliding(i)])
    per_block = BLOCK_TOKENS * (full.position_bytes() + cache_shape(ex.drafter).position_bytes())
    return probe - (ex.kv_blocks.num_blocks - blocks) * per_block


@pytest.mark.parametrize("family", ["qwen3", "gpt_oss", "qwen3_5"])
def test_a_paged_cache_moves_the_path_too(engines, pairs, tmp_path, family):
    """keep_path on a paged cache (blocks on demand, preemption; gpt-oss's sliding-window layers in rings of blocks;
    Qwen3.5's states recomputed for a preempted request): the static cache's tokens."""
    engine = Engine.load(engines[family], tree_budget=24)
    short = build(pairs[family], tmp_path / "engine", max_batch_size=4, max_seq_len=64)
    budget = tight_budget(short, 8, tree_budget=24)  # 8 blocks: one request of 64 + 25
    paged = Engine.load(short, tree_budget=24, kv_cache_memory=str(budget))
    assert paged.executor.kv_blocks.num_blocks == 8
    assert (paged.executor.window_blocks is not None) == (family == "gpt_oss")
    reqs = [replace(r, max_new_tokens=40) for r in requests(engine.executor.vocab_size)]
    ar = {r.request.id: r.output_token_ids for r in engine.decoder("ar").generate(reqs)}
    reference = {tuple(r.prompt_token_ids): r.prompt_token_ids + ar[r.id] for r in reqs}
    ranked = RankedCandidates(paged.executor, reference)
    decoder = Decoder(ranked, TreeDrafting(24, candidates=4), engine.config.eos_token_ids)
    assert {r.request.id: r.output_token_ids for r in decoder.generate(reqs)} == ar
    assert decoder.preemptions > 0


TREE_OPTIONS = ("--tree-budget drafts a tree every step of --mode dflash (or, with --block-size auto, where it pays); "
                "it does not take --mode ar or a fixed --block-size.")


def test_bad_tree_budgets_are_one_sentence(engines, tmp_path, capsys):
    prompts = tmp_path / "in.jsonl"
    prompts.write_text(json.dumps({"prompt_token_ids": [5, 6, 7]}) + "\n")
    run = ["run", str(engines["qwen3"]), "--input", str(prompts), "--output", str(tmp_path / "out.jsonl")]
    for extra, message in (
            (["--tree-budget", "8", "--mode", "ar"], TREE_OPTIONS),
            (["--tree-budget", "8", "--block-size", "4"], TREE_OPTIONS),
            (["--tree-budget", "8", "--block-size", "auto"],
             "a tree budget of 8 (--tree-budget, bench's treeN) with --block-size auto: auto prices trees of at most "
             "block_size - 1 = 7 nodes"),
            (["--tree-budget", "8", "--backend", "tensorrt"],
             "--tree-budget: the tensorrt executor does not verify draft trees yet; drop --tree-budget or use --backend "
             "torch or onnxruntime.")):
        assert main(run + extra) == EXIT_USER_ERROR
        err = capsys.readouterr().err
        assert message in err and err.count("\n") == 1, err
    with pytest.raises(SystemExit):
        main(run + ["--tree-budget", "0"])
    assert "--tree-budget: must be an integer from 1 to 1024, got 0" in capsys.readouterr().err
    assert not (tmp_path / "out.jsonl").exists()


def test_recurrent_trees_run_on_the_torch_executor_only(engines, tmp_path, capsys):
    """A Qwen3.5 engine's trees (Gated DeltaNet layers: each node's state along its own path) run on the torch
    executor; another backend is one sentence, nothing written."""
    prompts = tmp_path / "in.jsonl"
    prompts.write_text(json.dumps({"prompt_token_ids": [5, 6, 7]}) + "\n")
    out = tmp_path / "o.jsonl"
    assert main(["run", str(engines["qwen3_5"]), "--input", str(prompts), "--output", str(out), "--tree-budget", "8",
                 "--backend", "onnxruntime"]) == EXIT_USER_ERROR
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    assert ("--tree-budget: this engine's qwen3_5_text target has Gated DeltaNet layers, whose trees run on the torch "
            "executor only (each node's state follows its own path); use --backend torch, or drop "
            "--tree-budget.") in err
    assert not out.exists()
    assert main(["run", str(engines["qwen3_5"]), "--input", str(prompts), "--output", str(out), "--tree-budget",
                 "8"]) == 0


@pytest.mark.mpi
@pytest.mark.skipif(not MPIEXEC.exists(), reason="MPICH's mpiexec is not installed: pip install -e '.[mpi]'")
@pytest.mark.parametrize("family", ["qwen3", "gpt_oss", "qwen3_5"])
def test_trees_under_mpiexec_equal_one_process(pairs, tmp_path, family):
    """2 ranks build the same trees from the same gathered logits and take the same paths: `run --tree-budget 16`,
    greedy and sampled, gives one process's tokens (gpt-oss: its windows and sinks split by heads; Qwen3.5: its
    Gated DeltaNet heads)."""
    one, two = tmp_path / "tp1", tmp_path / "tp2"
    assert main(["build", str(write_family_config(tmp_path / "1.yaml", pairs[family])), "--output", str(one)]) == 0
    assert main(["build", str(write_family_config(tmp_path / "2.yaml", pairs[family], tp_size=2)), "--output",
                 str(two)]) == 0
    lines = [{"id": i, "prompt_token_ids": list(range(5 + i, 12 + 5 * i)), "max_new_tokens": 12 + 2 * i,
              "temperature": 0.8 if i % 2 else 0.0} for i in range(5)]
    assert_mpiexec_run_equals_one_process(one, two, tmp_path, "--tree-budget", "16", lines=lines)
