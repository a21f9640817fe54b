"""The paged KV cache (runtime/kv_blocks.py, issue 29): the same tokens as the static slots, admission by
reservation under a budget, blocks returned and reused, prompt blocks shared by prefix (prefill skipped, tokens
unchanged, evicted under pressure), and bad budgets refused in one sentence."""

from __future__ import annotations

import json
from collections import defaultdict

import pytest
import torch

from tests.conftest import CountingPrefill
from trtllm_dflash.cli import EXIT_USER_ERROR, main
from trtllm_dflash.errors import UserError
from trtllm_dflash.runtime.decoding import Request
from trtllm_dflash.runtime.kv_blocks import BLOCK_TOKENS, BlockTables, parse_size, prefix_hashes, resolve_budget
from trtllm_dflash.runtime.runner import Engine


def requests(n: int, max_new: int = 24) -> list[Request]:
    """Prompts of different lengths; odd ids sampled, some with top-k / top-p."""
    g = torch.Generator().manual_seed(1)
    return [Request(i, torch.randint(3, 500, (5 + 7 * i,), generator=g).tolist(), max_new,
                    temperature=0.9 if i % 2 else 0.0, top_k=20 if i % 4 == 1 else 0, seed=100 + i)
            for i in range(n)]


def outputs(engine: Engine, mode: str, reqs: list[Request]) -> list[list[int]]:
    return [r.output_token_ids for r in sorted(engine.decoder(mode).generate(reqs), key=lambda r: r.request.id)]


@pytest.fixture(scope="module")
def engines(qwen3_engine_dir):
    """The static engine and two paged ones: roomy (every slot's requests fit at once) and the smallest budget the
    engine accepts (one request of max_seq_len 512 + the block of 8: 33 blocks of 16 positions)."""
    static = Engine.load(qwen3_engine_dir, backend="torch")
    per_block = 16 * sum(s.position_bytes() for s in _shapes(static))
    roomy = Engine.load(qwen3_engine_dir, backend="torch", kv_cache_memory="64MiB")
    tight = Engine.load(qwen3_engine_dir, backend="torch", kv_cache_memory=str(34 * per_block))
    return static, roomy, tight


def _shapes(engine: Engine):
    from trtllm_dflash.runtime.executor import cache_shape

    ex = engine.executor
    return [cache_shape(ex.target), cache_shape(ex.drafter)]


@pytest.mark.parametrize("mode", ["dflash", "ar"])
def test_paged_gives_the_static_tokens(engines, mode):
    """12 requests on 8 slots (later ones join mid-run), greedy and sampled: token for token the static cache's; on
    the tight budget requests wait for blocks (fewer run at once) and still give the same tokens."""
    static, roomy, tight = engines
    reqs = requests(12)
    expected = outputs(static, mode, reqs)
    assert outputs(roomy, mode, reqs) == expected
    tables = tight.executor.kv_blocks
    assert tables.num_blocks == 33
    long = [Request(r.id, r.prompt_token_ids, 200,
                    temperature=r.temperature, top_k=r.top_k, seed=r.seed) for r in reqs[:6]]
    assert outputs(tight, mode, long) == outputs(static, mode, long)
    # prompt (5 .. 40) + 200 + 8 positions: 14 to 16 blocks each, 6 requests need 84+ of the 33 blocks: they start
    # together and the latest arrivals are preempted as the others grow (recomputed later, the same tokens)
    assert sum(-(-(len(r.prompt_token_ids) + 200 + 8) // 16) for r in long) > 2 * 33 and tables.peak_used == 33
    assert tables.free == 33  # every block returned
    assert outputs(tight, mode, reqs) == expected  # short requests: several at once again


def test_blocks_are_reserved_per_request_and_reused():
    tables = BlockTables(num_blocks=10, num_slots=4, max_positions=100, block_tokens=16, device="cpu")
    assert tables.can_reserve(160) and not tables.can_reserve(161)
    tables.reserve(2, 40)  # 3 blocks: 0, 1, 2
    tables.reserve(0, 17)  # 2 blocks: 3, 4
    assert tables.table[2, :3].tolist() == [0, 1, 2] and tables.table[2, 3:].tolist() == [tables.trash] * 4
    rows = tables.rows(torch.tensor([2, 0]), torch.tensor([[0, 33], [16, 99]]))
    assert rows.tolist() == [[0, 2 * 16 + 1], [4 * 16, tables.trash * 16 + 3]]  # past a reservation: the trash block
    # consecutive blocks: a one-slot read is a view from the slot's first row (past its blocks: masked rows)
    assert (tables.first_row(2, 48), tables.first_row(0, 80), tables.first_row(2, 10 ** 6)) == (0, 48, None)
    tables.release(2)
    assert tables.free == 8 and (tables.table[2] == tables.trash).all()
    tables.reserve(1, 48)  # the freed blocks first, lowest first
    assert tables.table[1, :3].tolist() == [0, 1, 2] and tables.peak_used == 5


def test_prefix_hashes_cover_every_token_of_their_blocks():
    """Block j's hash changes with any token of blocks 0 .. j (a block's last token too) and with the salt, and with
    no token after them; a partial block has none. (A hash that left out each block's last token passed this
    module's other tests; tests/test_random_schedules.py caught it too.)"""
    tokens = list(range(2 * BLOCK_TOKENS + 8))
    base = prefix_hashes(tokens, "target")
    assert len(base) == 2 and base[0] != base[1]
    for i in range(len(tokens)):
        changed, first = prefix_hashes(tokens[:i] + [999] + tokens[i + 1:], "target"), i // BLOCK_TOKENS
        assert changed[:first] == base[:first] and all(a != b for a, b in zip(changed[first:], base[first:])), i
    assert prefix_hashes(tokens, "target+drafter")[0] != base[0]


def test_sizes_and_fractions():
    assert parse_size("512MiB") == 512 * 2**20 and parse_size("2GiB") == 2 * 2**30 and parse_size("1.5GB") == 1.5e9
    assert parse_size("4096") == 4096
    assert resolve_budget("0.5", available=1000) == 500 and resolve_budget("1.0", available=1000) == 1000
    for bad, words in (("0", "must be positive"), ("abc", "is not a size"), ("-1MiB", "is not a size"),
                       ("1.5", "a fraction of the free memory must be in (0, 1]"), ("2KiB", "more than the 1000 B")):
        with pytest.raises(ValueError, match=words.replace("(", r"\(").replace(")", r"\)").replace(".", r"\.")):
            resolve_budget(bad, available=1000)


@pytest.mark.parametrize("value, extra, words", [
    ("0", (), "error: --kv-cache-memory 0: '0': a KV-cache size must be positive."),
    ("lots", (), "error: --kv-cache-memory lots: 'lots' is not a size (examples: 512MiB, 2GiB, 1.5GB, 1048576)."),
    ("64KiB", (), "error: --kv-cache-memory 64KiB: it holds 1 KV block of 16 positions (24.0 KiB each) and one "
                  "request of the engine's max_seq_len needs 33; give at least 816.0 KiB."),
    ("64PiB", (), "error: --kv-cache-memory 64PiB: '64PiB' is not a size"),
    ("9000GiB", (), "error: --kv-cache-memory 9000GiB: more than the"),
])
def test_bad_budgets_are_one_sentence(qwen3_engine_dir, tmp_path, capsys, value, extra, words):
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    inp.write_text(json.dumps({"id": 1, "prompt_token_ids": [5, 6, 7]}) + "\n")
    code = main(["run", str(qwen3_engine_dir), "--input", str(inp), "--output", str(out), "--kv-cache-memory", value,
                 *extra])
    err = capsys.readouterr().err.strip()
    assert code == EXIT_USER_ERROR and not out.exists()
    assert err.startswith(words) and "\n" not in err and err.endswith("."), err


def test_run_with_a_budget(qwen3_engine_dir, tmp_path, capsys):
    """`run --kv-cache-memory` writes the static run's tokens."""
    inp = tmp_path / "in.jsonl"
    inp.write_text("".join(json.dumps({"id": r.id, "prompt_token_ids": r.prompt_token_ids}) + "\n"
                           for r in requests(10)))
    got = {}
    for name, extra in (("static", ()), ("paged", ("--kv-cache-memory", "8MiB"))):
        out = tmp_path / f"{name}.jsonl"
        assert main(["run", str(qwen3_engine_dir), "--input", str(inp), "--output", str(out), "--max-new-tokens", "30",
                     *extra]) == 0, capsys.readouterr().err
        got[name] = [json.loads(line)["output_token_ids"] for line in out.read_text().splitlines()]
    assert got["paged"] == got["static"]


@pytest.mark.parametrize("mode", ["dflash", "ar"])
def test_static_passes_over_the_paged_cache_give_the_static_tokens(qwen3_engine_dir, engines, mode):
    """The torch executor's static passes (what its CUDA graphs replay; on the CPU they run eagerly) over a paged cache
    at the tightest budget: padding rows in the tables' scratch slot, every slot's rows gathered through the tables
    (never views) and computed afresh each pass. Requests preempted and recomputed, then prompt blocks shared: token for
    token the static cache's, greedy and sampled."""
    import dataclasses

    from trtllm_dflash.parallel.group import SINGLE
    from trtllm_dflash.runtime.executor import TorchExecutor

    static, _, tight = engines
    per_block = 16 * sum(s.position_bytes() for s in _shapes(static))
    graphed = dataclasses.replace(tight, executor=TorchExecutor.from_engine(
        qwen3_engine_dir, tight.config, 0, SINGLE, "cpu", None, cuda_graphs=True, kv_cache_memory=34 * per_block))
    ex = graphed.executor
    tables = ex.kv_blocks
    assert tables.num_blocks == 33 and tables.table.shape[0] == ex.num_slots + 1
    long = [Request(r.id, r.prompt_token_ids, 200, temperature=r.temperature, top_k=r.top_k, seed=r.seed)
            for r in requests(6)]
    assert outputs(graphed, mode, long) == outputs(static, mode, long)
    assert tables.peak_used == 33 and tables.free == 33  # preempted under pressure (as test_paged_gives_...)
    shared = shared_prefix_requests(6)
    assert outputs(graphed, mode, shared) == outputs(static, mode, shared)
    assert tables.prefix_blocks_hit > 0
    keys = ex.graphs.passes
    assert not any(k.views for k in keys) and {k.batch for k in keys} >= {1, 2, 4, 8}, sorted(keys, key=str)
    assert ("draft" in {k.kind for k in keys}) == (mode == "dflash")
    assert (tables.table[ex.num_slots] == tables.trash).all()  # the scratch slot held nothing


def test_static_passes_compute_a_paged_caches_rows_in_each_pass(qwen3_engine_dir):
    """Two target passes of one static shape whose slots differ (0, 1, then 1, 0) with no table changed between them:
    the second reads its own slots' rows, as a CUDA graph's replay must (rows remembered from the first pass, which
    also kept the static slots buffer, would be the other request's): the eager paged executor's logits."""
    from trtllm_dflash.parallel.group import SINGLE
    from trtllm_dflash.runtime.executor import HostRows, TorchExecutor

    cfg = Engine.load(qwen3_engine_dir).config
    eager, static = (TorchExecutor.from_engine(qwen3_engine_dir, cfg, 0, SINGLE, "cpu", None, cuda_graphs=graphs,
                                               kv_cache_memory=8 * 2**20) for graphs in (False, True))
    prompts = [[5, 9, 13, 17, 21], [30, 31, 32, 33, 34, 35, 36, 37, 38]]
    block = torch.randint(4, 500, (2, 8), generator=torch.Generator().manual_seed(0))
    got = []
    for ex in (eager, static):
        for slot, prompt in enumerate(prompts):
            assert ex.reserve(slot, prompt) == 0
            ex.target_forward(torch.tensor([prompt]), torch.zeros(1, dtype=torch.long), torch.tensor([slot]), False)
        passes = []
        for slots in ((0, 1), (1, 0)):
            starts = [len(prompts[s]) for s in slots]
            passes.append(ex.target_forward(block, torch.tensor(starts), torch.tensor(slots), False,
                                            rows=HostRows(slots, tuple(starts))).logits)
        got.append(passes)
    assert len(static.graphs.passes) == 1  # both passes ran the one static pass
    for want, have in zip(*got):
        torch.testing.assert_close(have, want, atol=1e-5, rtol=1e-5)


def test_bench_reports_the_paged_cache(engines, qwen3_engine_dir, tmp_path):
    """bench under the tightest budget: requests preempted, the blocks' peak, every block free at the end, and the
    static run's tokens."""
    from trtllm_dflash.bench.options import BenchOptions
    from trtllm_dflash.bench.runner import bench

    static = engines[0]
    per_block = 16 * sum(s.position_bytes() for s in _shapes(static))
    dataset = tmp_path / "p.jsonl"
    dataset.write_text("".join(json.dumps({"id": i, "prompt": "def f(x):\n    return x" * (i + 1)}) + "\n"
                               for i in range(6)))
    opts = BenchOptions(concurrency=(4,), modes=("ar",), max_new_tokens=200, warmup=0, repeats=1,
                        kv_cache_memory=str(34 * per_block))
    report = bench(qwen3_engine_dir, dataset, opts)
    kv = report["kv_cache"]
    assert kv == {"layout": "paged", "block_tokens": 16, "blocks": 33, "peak_blocks_used": kv["peak_blocks_used"],
                  "blocks_free_at_end": 33, "prefix_cache": True, "prefix_blocks_looked_up": kv["prefix_blocks_looked_up"],
                  "prefix_hit_rate": kv["prefix_hit_rate"]}
    assert kv["prefix_blocks_looked_up"] > 0 and 0 < kv["prefix_hit_rate"] < 1  # the prompts share their beginnings
    assert report["kv_cache"]["peak_blocks_used"] <= 33
    point = report["points"][0]
    # 13+ blocks each: four start, at most two of them can finish without a preemption
    assert point["request_info"]["peak_requests_in_flight"] == 4 and point["request_info"]["preemptions_per_run"] > 0
    static_report = bench(qwen3_engine_dir, dataset, BenchOptions(concurrency=(4,), modes=("ar",), max_new_tokens=200,
                                                                  warmup=0, repeats=1))
    assert static_report["kv_cache"] == {"layout": "static", "slots": 8}
    assert static_report["points"][0]["request_info"]["peak_requests_in_flight"] == 4
    assert static_report["points"][0]["request_info"]["preemptions_per_run"] == 0
    assert point["performance"]["num_output_tokens"] == static_report["points"][0]["performance"]["num_output_tokens"]


def shared_prefix_requests(n: int, prefix: int = 100, max_new: int = 20) -> list[Request]:
    """A system prompt of `prefix` tokens + a short user turn each; odd ids sampled."""
    g = torch.Generator().manual_seed(7)
    system = torch.randint(3, 500, (prefix,), generator=g).tolist()
    return [Request(i, system + torch.randint(3, 500, (3 + i,), generator=g).tolist(), max_new,
                    temperature=0.8 if i % 2 else 0.0, seed=i) for i in range(n)]


@pytest.mark.parametrize("mode", ["dflash", "ar"])
def test_prefix_hits_skip_the_prefill_and_keep_the_tokens(qwen3_engine_dir, engines, mode):
    """After one request of a 100-token system prompt, the next ones find its 6 full blocks (96 positions) cached: their
    prefill computes only the rest, and every request's tokens are the static cache's, greedy and sampled."""
    static = engines[0]
    reqs = shared_prefix_requests(6)
    expected = outputs(static, mode, reqs)
    engine = Engine.load(qwen3_engine_dir, backend="torch", kv_cache_memory="16MiB")
    counting = CountingPrefill(engine.executor)
    decoder = Engine(engine.config, engine.tokenizer, counting).decoder(mode)
    first = [r.output_token_ids for r in decoder.generate(reqs[:1])]
    assert counting.prefill_tokens == len(reqs[0].prompt_token_ids)
    counting.prefill_tokens = 0
    rest = [r.output_token_ids for r in sorted(decoder.generate(reqs[1:]), key=lambda r: r.request.id)]
    assert first + rest == expected
    uncached = [len(r.prompt_token_ids) - 96 for r in reqs[1:]]  # 7 .. 11 positions each, padded to the longest (11)
    assert counting.prefill_tokens == max(uncached) * len(uncached)
    tables = engine.executor.kv_blocks
    assert tables.prefix_blocks_hit == 5 * 6 and tables.free == tables.num_blocks


@pytest.mark.parametrize("mode", ["dflash", "ar"])
def test_requests_admitted_together_share_their_prefix(qwen3_engine_dir, engines, mode):
    """Requests of two system prompts arriving together, interleaved: the first of each prompt prefills it whole and
    the others wait for the step's second wave, after those prefills have published its blocks, so each system prompt
    is computed once; the tokens are the static cache's, greedy and sampled. --no-prefix-cache: one wave, every prompt
    whole."""
    g = torch.Generator().manual_seed(11)
    systems = [torch.randint(3, 500, (100,), generator=g).tolist() for _ in range(2)]
    reqs = [Request(i, systems[i % 2] + torch.randint(3, 500, (3 + i,), generator=g).tolist(), 12,
                    temperature=0.8 if i % 3 == 1 else 0.0, seed=i) for i in range(6)]
    expected = outputs(engines[0], mode, reqs)
    lengths = [len(r.prompt_token_ids) for r in reqs]
    for reuse in (True, False):
        engine = Engine.load(qwen3_engine_dir, backend="torch", kv_cache_memory="16MiB", prefix_cache=reuse)
        counting = CountingPrefill(engine.executor)
        assert outputs(Engine(engine.config, engine.tokenizer, counting), mode, reqs) == expected, reuse
        if reuse:  # the first two whole (one pass), then the rest of the others past their 6 cached blocks
            assert counting.computed == [lengths[:2], [n - 96 for n in lengths[2:]]], counting.computed
            assert engine.executor.kv_blocks.prefix_blocks_hit == 4 * 6
        else:
            assert counting.computed == [lengths], counting.computed


def test_requests_behind_a_held_one_are_let_by(qwen3_engine_dir, engines):
    """7 requests of one system prompt, then 2 of their own, on 8 slots: the 6 that wait for the first one's blocks do
    not hold back the next request (its prompt is in wave 1 too), and those let by leave each held request a slot: the
    last one waits for a free slot, not the held ones. Under a tight budget a request is let by only if it leaves the
    held ones their blocks (it waits instead, and the held one is admitted in wave 2). The static cache's tokens."""
    from trtllm_dflash.runtime.kv_blocks import blocks_for

    g = torch.Generator().manual_seed(5)
    system = torch.randint(3, 500, (100,), generator=g).tolist()
    own = [Request(i, system + torch.randint(3, 500, (3 + i,), generator=g).tolist(), 12, seed=i) for i in range(7)]
    others = [Request(7 + i, torch.randint(3, 500, (20 + i,), generator=g).tolist(), 12, temperature=0.8, seed=i)
              for i in range(2)]
    reqs = own + others
    lengths = [len(r.prompt_token_ids) for r in reqs]
    assert outputs(Engine(engines[1].config, engines[1].tokenizer, counting := CountingPrefill(engines[1].executor)),
                   "dflash", reqs) == outputs(engines[0], "dflash", reqs)
    passes = counting.computed  # wave 1 (in two prefill passes: prompts of such different lengths go apart), wave 2,
    # and the last request in a later step, when a slot is free
    assert sorted(passes[0] + passes[1]) == [lengths[7], lengths[0]], passes
    assert passes[2:] == [[n - 96 for n in lengths[1:7]], [lengths[8]]], passes

    # 33 blocks; the first request takes 7 (103 positions + the verify block's 8), the held one will take 1 more
    # block (8 positions past its 6 cached blocks, and 8) and a block of headroom each: a 370-token prompt (24
    # blocks) would leave the held one 2 where it needs 3, so it waits.
    tight = Engine.load(qwen3_engine_dir, backend="torch", kv_cache_memory=str(34 * 16 * sum(
        s.position_bytes() for s in _shapes(engines[0]))))
    margin = tight.executor.block_size
    first, held = own[0], own[1]
    big = Request(9, torch.randint(3, 500, (370,), generator=g).tolist(), 12)
    assert tight.executor.kv_blocks.free == 33
    assert 33 - blocks_for(len(first.prompt_token_ids) + margin) - 2 == blocks_for(370 + margin) \
        < blocks_for(370 + margin) + blocks_for(len(held.prompt_token_ids) - 96 + margin, BLOCK_TOKENS)
    counting = CountingPrefill(tight.executor)
    got = outputs(Engine(tight.config, tight.tokenizer, counting), "dflash", [first, held, big])
    assert got == outputs(engines[0], "dflash", [first, held, big])
    assert counting.computed[:2] == [[len(first.prompt_token_ids)], [len(held.prompt_token_ids) - 96]], \
        counting.computed


def published_drafter_rows(engine: Engine, request: Request, layer: int) -> torch.Tensor:
    """The drafter's K and V of a drafter layer in the published blocks of `request`'s prompt, in order."""
    tables, cache = engine.executor.kv_blocks, engine.executor.draft_cache
    blocks = [tables._by_hash[h] for h in prefix_hashes(request.prompt_token_ids[:-1], "target+drafter")]
    rows = torch.cat([torch.arange(b * tables.block_tokens, (b + 1) * tables.block_tokens) for b in blocks])
    return torch.cat([cache.k[layer][rows].flatten(1), cache.v[layer][rows].flatten(1)], dim=1)


def test_block_size_auto_shares_a_prompt_once_the_drafter_holds_it(qwen3_engine_dir, engines):
    """--block-size auto holds a prompt's features back from the drafter until a speculative step needs them: the
    prompt's blocks (the target's K/V and the drafter's context) are published once that step has added them, and
    later requests with the same system prompt find them and prefill only their own turns; the tokens are the static
    cache's (auto's are dflash's), greedy and sampled. Where auto runs plain steps only (drafting made dear), the
    drafter gets the prompt's blocks when the request ends (one pass over their 96 positions), and they are published
    then: the later requests find them alike."""
    from tests.test_block_size_auto import hand_costs
    from trtllm_dflash.runtime.decoding import Decoder
    from trtllm_dflash.runtime.verify import AutoBlock
    from trtllm_dflash.speculative.schedule import AutoBlockSize

    reqs = shared_prefix_requests(4)
    expected = outputs(engines[0], "dflash", reqs)
    lengths = [len(r.prompt_token_ids) for r in reqs]
    # hand-made pass costs: at batch 1 a whole block of 8 pays, so the first request speculates at once; with a draft
    # pass of a second, no block ever pays
    for draft_ms in (1.0, 1e3):
        engine = Engine.load(qwen3_engine_dir, backend="torch", kv_cache_memory="16MiB")
        counting = CountingPrefill(engine.executor)
        decoder = Decoder(counting, AutoBlock(AutoBlockSize(hand_costs(draft_ms), block_size=8)),
                          engine.config.eos_token_ids)
        got = [r.output_token_ids for wave in (reqs[:1], reqs[1:])
               for r in sorted(decoder.generate(wave), key=lambda r: r.request.id)]
        assert got == expected, draft_ms
        assert counting.computed == [lengths[:1], [n - 96 for n in lengths[1:]]], (draft_ms, counting.computed)
        assert engine.executor.kv_blocks.prefix_blocks_hit == 3 * 6
        if draft_ms == 1e3:  # plain steps only: the drafter's context of the first one's prompt blocks was written
            # at its end (the others found those blocks and have no more of their own)
            assert counting.contexts == [96], counting.contexts
            # and they hold what a fixed block's decoder publishes with its prefill: the drafter's K/V of the prompt
            fixed = Engine.load(qwen3_engine_dir, backend="torch", kv_cache_memory="16MiB")
            outputs(fixed, "dflash", reqs[:1])
            for layer in range(len(engine.executor.draft_cache.k)):
                torch.testing.assert_close(published_drafter_rows(engine, reqs[0], layer),
                                           published_drafter_rows(fixed, reqs[0], layer))


def test_no_prefix_cache_and_eviction(qwen3_engine_dir, engines):
    """--no-prefix-cache shares nothing; under the smallest budget, published blocks nobody holds are taken back when
    new requests need them (the least recently released first), and the tokens stay the static cache's."""
    static = engines[0]
    reqs = shared_prefix_requests(4)
    off = Engine.load(qwen3_engine_dir, backend="torch", kv_cache_memory="16MiB", prefix_cache=False)
    assert outputs(off, "dflash", reqs) == outputs(static, "dflash", reqs)
    assert off.executor.kv_blocks.prefix_blocks_hit == 0 and off.executor.kv_blocks.cached == 0

    per_block = 16 * sum(s.position_bytes() for s in _shapes(static))
    tight = Engine.load(qwen3_engine_dir, backend="torch", kv_cache_memory=str(34 * per_block))  # 33 blocks
    tables = tight.executor.kv_blocks
    assert outputs(tight, "ar", reqs[:1]) == outputs(static, "ar", reqs[:1])
    assert tables.cached == 6 and tables.free == 33  # published, held by nobody, still reusable
    g = torch.Generator().manual_seed(3)
    other = [Request(10 + i, torch.randint(3, 500, (40,), generator=g).tolist(), 400) for i in range(2)]
    for one in other:  # 28 blocks each, one at a time: cached ones are taken back
        assert outputs(tight, "ar", [one]) == outputs(static, "ar", [one])
    assert tables.free == 33
    hits = tables.prefix_blocks_hit
    assert outputs(tight, "ar", reqs[:1]) == outputs(static, "ar", reqs[:1])
    assert 0 < tables.prefix_blocks_hit - hits < 6  # the tail blocks were taken back first: the head still hits
    hits = tables.prefix_blocks_hit
    assert outputs(tight, "ar", reqs[1:]) == outputs(static, "ar", reqs[1:])
    assert tables.prefix_blocks_hit - hits == 3 * 6  # the first one published its blocks again


def test_the_build_config_sets_the_default(qwen3_pair, tmp_path, capsys):
    """kv_cache_memory in the build config: the engine's default for run (paged), `--kv-cache-memory static` turns it
    off; a bad form or another backend is refused by build in one sentence."""
    from trtllm_dflash.config import BuildConfig
    from trtllm_dflash.engine.builder import build_engine

    base = dict(target=qwen3_pair / "target", drafter=qwen3_pair / "drafter", dtype="float32", max_seq_len=512)
    engine_dir = build_engine(BuildConfig(**base, output=tmp_path / "e", kv_cache_memory="8MiB"), progress=False)
    assert Engine.load(engine_dir).executor.kv_blocks is not None
    assert Engine.load(engine_dir, kv_cache_memory="static").executor.kv_blocks is None
    assert Engine.load(engine_dir, kv_cache_memory="64MiB").executor.kv_blocks.num_blocks > 300
    inp = tmp_path / "in.jsonl"
    inp.write_text(json.dumps({"id": 1, "prompt_token_ids": [5, 6, 7]}) + "\n")
    outs = []
    for extra in ((), ("--kv-cache-memory", "static")):
        out = tmp_path / f"out{len(outs)}.jsonl"
        assert main(["run", str(engine_dir), "--input", str(inp), "--output", str(out), *extra]) == 0
        outs.append(json.loads(out.read_text())["output_token_ids"])
    assert outs[0] == outs[1]
    for bad, words in (({"kv_cache_memory": "lots"}, "build config: kv_cache_memory lots: 'lots' is not a size"),):
        with pytest.raises(UserError, match=words.replace("(", r"\(").replace(")", r"\)")):
            build_engine(BuildConfig(**base, output=tmp_path / "bad", **bad), progress=False)
        assert not (tmp_path / "bad").exists()


def test_blocks_are_taken_as_a_request_grows():
    tables = BlockTables(num_blocks=6, num_slots=2, max_positions=64, block_tokens=16, device="cpu")
    tables.reserve(0, 20)  # blocks 0, 1
    tables.reserve(1, 10)  # block 2
    assert tables.extend(0, 32) and tables.free == 3  # already held
    assert tables.extend(0, 40) and tables.table[0, :3].tolist() == [0, 1, 3]
    assert tables.first_row(0, 40) is None  # no longer consecutive: read by index
    assert not tables.extend(1, 64) and tables.table[1, 1:].tolist() == [tables.trash] * 3  # 3 more: nothing taken
    assert tables.extend(1, 48) and tables.table[1].tolist() == [2, 4, 5, tables.trash] and tables.free == 0
    assert not tables.extend(0, 64) and tables.peak_used == 6
    tables.release(1)
    assert tables.extend(0, 10 ** 6) and tables.table[0].tolist() == [0, 1, 3, 2] and tables.free == 2  # the width


def _tight(qwen3_engine_dir, static) -> Engine:
    """The smallest budget the engine accepts: 33 blocks, one request of max_seq_len 512 + the block of 8."""
    per_block = 16 * sum(s.position_bytes() for s in _shapes(static))
    return Engine.load(qwen3_engine_dir, backend="torch", kv_cache_memory=str(34 * per_block))


def _decode_all(decoder, reqs: list[Request]) -> tuple[dict, dict]:
    """Every request's result and the tokens its Updates streamed, by id (those submitted before too)."""
    for r in reqs:
        decoder.submit(r)
    results, streamed = {}, defaultdict(list)
    while decoder.has_work:
        for update in decoder.step():
            streamed[update.request.id] += update.new_token_ids
            if update.result is not None:
                results[update.request.id] = update.result
    return results, streamed


@pytest.mark.parametrize("policy", ["dflash", "ar", "auto"])
def test_preempted_requests_are_recomputed_with_the_same_tokens(qwen3_engine_dir, engines, policy):
    """Six requests of 200 new tokens start together on 33 blocks; as they grow the latest arrivals are preempted, wait,
    and are recomputed from their prompt and committed tokens: every request's tokens are the static cache's (greedy
    and sampled, with --block-size auto's deferred drafter context too), each streamed once, every block returned."""
    from tests.test_block_size_auto import hand_costs
    from trtllm_dflash.runtime.decoding import Decoder
    from trtllm_dflash.runtime.verify import AutoBlock
    from trtllm_dflash.speculative.schedule import AutoBlockSize

    static = engines[0]
    tight = _tight(qwen3_engine_dir, static)
    reqs = [Request(r.id, r.prompt_token_ids, 200, temperature=r.temperature, top_k=r.top_k, seed=r.seed)
            for r in requests(6)]
    mode = "ar" if policy == "ar" else "dflash"
    expected = dict(zip(range(6), outputs(static, mode, reqs)))
    if policy == "auto":
        decoder = Decoder(tight.executor, AutoBlock(AutoBlockSize(hand_costs(), block_size=8)),
                          tight.config.eos_token_ids)
    else:
        decoder = tight.decoder(mode)
    results, streamed = _decode_all(decoder, reqs)
    assert decoder.preemptions >= 3
    assert {i: r.output_token_ids for i, r in results.items()} == expected
    assert dict(streamed) == expected
    tables = tight.executor.kv_blocks
    assert tables.free == tables.num_blocks and tables.peak_used == tables.num_blocks


def test_a_preempted_request_finds_its_prompt_cached_and_can_be_cancelled(qwen3_engine_dir, engines):
    """A preempted request's published prompt blocks wait in the cache: its recompute prefills only the rest. Cancelled
    while it waits, it leaves with the tokens it had committed."""
    static = engines[0]
    tight = _tight(qwen3_engine_dir, static)
    g = torch.Generator().manual_seed(5)
    reqs = [Request(i, torch.randint(3, 500, (70,), generator=g).tolist(), 300) for i in range(3)]
    counting = CountingPrefill(tight.executor)
    decoder = Engine(tight.config, tight.tokenizer, counting).decoder("ar")
    results = {}

    def step():
        results.update({u.request.id: u.result for u in decoder.step() if u.result is not None})

    for r in reqs:
        decoder.submit(r)
    while not decoder.preemptions:
        step()
    waiting = decoder._pending[0]
    assert waiting.preempted == 1 and waiting.output and waiting.slot == -1
    counting.prefill_tokens, committed = 0, len(waiting.output)
    hits = tight.executor.kv_blocks.prefix_blocks_hit
    while waiting.slot == -1:
        step()
    assert tight.executor.kv_blocks.prefix_blocks_hit - hits == 4  # its prompt's 4 full blocks (69 positions)
    assert counting.prefill_tokens == 70 + committed - 1 - 64  # the rest of its prompt, its tokens but the anchor
    while decoder.has_work:
        step()
    assert [results[i].output_token_ids for i in range(3)] == outputs(static, "ar", reqs)

    decoder, results = tight.decoder("ar"), {}
    for r in reqs:
        decoder.submit(r)
    while not decoder.preemptions:
        step()
    victim = decoder._pending[0]
    committed = list(victim.output)
    decoder.cancel(victim.request.id)
    while decoder.has_work:
        step()
    assert results[victim.request.id].finish_reason == "cancelled"
    assert results[victim.request.id].output_token_ids == committed
    assert tight.executor.kv_blocks.free == tight.executor.kv_blocks.num_blocks


# --- sliding-window layers in rings (gpt-oss, Gemma 4: tiny pairs with a window of 4) ------------------------------

@pytest.fixture(scope="module", params=["gpt_oss", "gemma4"])
def windowed(request, tmp_path_factory):
    """(engine directory, its static engine) of a random pair whose target mixes sliding-window layers (window 4) and
    full ones."""
    from tests.conftest import write_random_pair
    from trtllm_dflash.config import BuildConfig
    from trtllm_dflash.engine.builder import build_engine

    root = tmp_path_factory.mktemp(f"{request.param}_windowed")
    write_random_pair(root, request.param, block_size=8, seed=0)
    engine_dir = build_engine(BuildConfig(target=root / "target", drafter=root / "drafter", dtype="float32",
                                          max_seq_len=256, max_batch_size=4, output=root / "engine"), progress=False)
    static = Engine.load(engine_dir, backend="torch")
    assert static.executor.target.spec.sliding_window == 4
    return engine_dir, static


def _windowed_budget(static: Engine, full_blocks: int) -> int:
    """Bytes of a budget whose full layers hold `full_blocks` blocks (the rings' share on top)."""
    from trtllm_dflash.runtime.executor import cache_shape
    from trtllm_dflash.runtime.kv_blocks import window_pool

    ex = static.executor
    spec = ex.target.spec
    shape = cache_shape(ex.target)
    sliding = [i for i in range(spec.num_layers) if spec.is_sliding(i)]
    full = shape.of_layers([i for i in range(spec.num_layers) if i not in sliding])
    _, rings = window_pool(4, 8, 4, 256 + 8, shape.of_layers(sliding))
    return rings + (full_blocks + 1) * 16 * (full.position_bytes() + cache_shape(ex.drafter).position_bytes())


@pytest.mark.parametrize("mode", ["dflash", "ar"])
def test_windowed_layers_keep_only_their_window(windowed, mode):
    """Requests of 150 positions: the static cache's tokens (greedy and sampled, joining mid-run), while the sliding
    layers' tables hold at most the ring of each request (2 blocks: 3 keys before a verify block of 8, unaligned) after
    every step, against the 10 blocks of the full layers; a shared prefix is found again through both."""
    engine_dir, static = windowed
    paged = Engine.load(engine_dir, backend="torch", kv_cache_memory=str(_windowed_budget(static, 24)))
    ex = paged.executor
    rings, full = ex.window_blocks, ex.kv_blocks
    assert rings.window == 4 and full.num_blocks == 24
    reqs = [Request(r.id, r.prompt_token_ids, 100, temperature=r.temperature, top_k=r.top_k, seed=r.seed)
            for r in requests(6)]
    expected = outputs(static, mode, reqs)
    decoder = paged.decoder(mode)
    results, most = {}, 0
    for r in reqs:
        decoder.submit(r)
    while decoder.has_work:
        results.update({u.request.id: u.result for u in decoder.step() if u.result is not None})
        running = [a for a in decoder._active if a.finish_reason is None and a.output]
        most = max([most] + [rings.held(a.slot) for a in running])
        assert all(-(-a.start // 16) <= full.held(a.slot) <= -(-(a.start + 8) // 16) for a in running)  # no ring
    assert [results[i].output_token_ids for i in range(6)] == expected
    assert most == 2 and rings.free == rings.num_blocks and full.free == full.num_blocks
    assert decoder.preemptions > 0  # 4 slots of 7-10 full blocks in 24: preempted for the full layers

    shared = shared_prefix_requests(3, prefix=60)
    hits = (full.prefix_blocks_hit, rings.prefix_blocks_hit)
    assert outputs(paged, mode, shared[:1]) + outputs(paged, mode, shared[1:]) == outputs(static, mode, shared)
    # 3 blocks (48 positions) of the prefix: the full layers' 3 and the rings' last one (keys 45 .. 47) each
    assert (full.prefix_blocks_hit - hits[0], rings.prefix_blocks_hit - hits[1]) == (2 * 3, 2 * 3)


@pytest.mark.parametrize("windowed", ["gemma4"], indirect=True)  # (gpt-oss has experts: no CUDA graphs)
def test_static_passes_over_rings_give_the_static_tokens(windowed):
    """The static passes (what CUDA graphs replay) over a paged cache whose sliding layers keep rings: a ring's given
    back blocks read as the trash block, masked by the window; requests preempted: the static cache's tokens, greedy
    and sampled."""
    import dataclasses

    from trtllm_dflash.parallel.group import SINGLE
    from trtllm_dflash.runtime.executor import TorchExecutor

    engine_dir, static = windowed
    ex = TorchExecutor.from_engine(engine_dir, static.config, 0, SINGLE, "cpu", None, cuda_graphs=True,
                                   kv_cache_memory=_windowed_budget(static, 24))
    reqs = [Request(r.id, r.prompt_token_ids, 100, temperature=r.temperature, top_k=r.top_k, seed=r.seed)
            for r in requests(6)]
    decoder = dataclasses.replace(static, executor=ex).decoder("dflash")
    got = [r.output_token_ids for r in sorted(decoder.generate(reqs), key=lambda r: r.request.id)]
    assert got == outputs(static, "dflash", reqs) and decoder.preemptions > 0
    kinds = {k.kind for k in ex.graphs.passes}
    assert ex.window_blocks.table.shape[0] == ex.num_slots + 1 and kinds == {"target", "draft"}


def test_a_budget_too_small_for_the_rings_is_one_sentence(windowed, tmp_path, capsys):
    engine_dir, static = windowed
    budget = _windowed_budget(static, 10)  # one request of 256 + 8 positions needs 17 full blocks
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    inp.write_text(json.dumps({"id": 1, "prompt_token_ids": [5, 6, 7]}) + "\n")
    code = main(["run", str(engine_dir), "--input", str(inp), "--output", str(out), "--kv-cache-memory", str(budget)])
    err = capsys.readouterr().err.strip()
    assert code == EXIT_USER_ERROR and not out.exists() and "\n" not in err
    assert "it holds 10 KV blocks of 16 positions" in err and "after the sliding-window layers'" in err, err
    assert "one request of the engine's max_seq_len needs 17" in err


def test_a_fraction_is_of_the_memory_free_once_the_weights_are_loaded(qwen3_engine_dir, engines, monkeypatch):
    """`--kv-cache-memory 0.5` is half of what is free after the weights are on the device (TensorRT-LLM's
    free_gpu_memory_fraction), not before: the form is checked first, the amount read after loading."""
    from trtllm_dflash.runtime import runner

    free = iter([2**30, 2**28])  # 1 GiB free when the option is checked, 256 MiB once the weights are loaded
    monkeypatch.setattr(runner, "available_memory", lambda: next(free))
    engine = Engine.load(qwen3_engine_dir, backend="torch", kv_cache_memory="0.5")
    per_block = 16 * sum(s.position_bytes() for s in _shapes(engines[0]))
    assert engine.executor.kv_blocks.num_blocks == 2**27 // per_block - 1
