"""Random workloads against every decoder configuration: a mix of requests (greedy and sampled with top-k / top-p,
stop strings, prompts that share prefixes, one-token prompts and answers, requests as long as the engine allows)
arriving in random waves between steps, some cancelled at random; each configuration (static and paged caches,
preemption under a tight KV budget, fixed blocks, `--block-size auto`, draft trees, a DFlash2 drafter, onnxruntime's
static rows and their prefix pool) must give every request the tokens and finish reason plain decoding gives it
alone on the static cache, and a cancelled request a prefix of them.

The targeted tests (test_paged_kv, test_lossless, test_tree, test_onnxruntime_backend, ...) check each feature on
scripted cases; this one checks them mixed in orders nobody wrote down. Seeds are fixed, so a failure reproduces:
`pytest tests/test_random_schedules.py -k 'paged and tight'` with the round printed in the message. More rounds
(`TRTLLM_DFLASH_RANDOM_ROUNDS=40`) search further (docs/testing.md).
"""

from __future__ import annotations

import os
import random
from pathlib import Path

import pytest

from tests.conftest import build
from trtllm_dflash.runtime.cache_rows import _block_bytes
from trtllm_dflash.runtime.decoding import Request
from trtllm_dflash.runtime.executor import cache_shape
from trtllm_dflash.runtime.kv_blocks import BLOCK_TOKENS
from trtllm_dflash.runtime.runner import Engine

ROUNDS = int(os.environ.get("TRTLLM_DFLASH_RANDOM_ROUNDS", "3"))
MAX_SEQ_LEN = 160
pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def torch_engine_dir(biased_pairs, tmp_path_factory) -> Path:
    return build(biased_pairs[8], tmp_path_factory.mktemp("random_schedules") / "engine", max_batch_size=4,
                 max_seq_len=MAX_SEQ_LEN)


@pytest.fixture(scope="module")
def dflash2_engine_dir(dflash2_pair, tmp_path_factory) -> Path:
    return build(dflash2_pair, tmp_path_factory.mktemp("random_schedules_dflash2") / "engine", max_batch_size=4,
                 max_seq_len=MAX_SEQ_LEN)


@pytest.fixture(scope="module")
def reference(torch_engine_dir) -> Engine:
    return Engine.load(torch_engine_dir, kv_cache_memory="static")


# name -> (which engine, Engine.load options, mode, block size): the biased pair's torch or onnxruntime engine, or its
# target with a DFlash2 drafter. The tight budgets hold one request of max_seq_len, so requests preempt each other.
CONFIGS = {
    "static-block": ("torch", {"kv_cache_memory": "static"}, "dflash", None),
    "static-k3": ("torch", {"kv_cache_memory": "static"}, "dflash", 3),
    "paged-tight-dflash": ("torch", {"kv_cache_memory": "tight"}, "dflash", None),
    "paged-tight-ar": ("torch", {"kv_cache_memory": "tight"}, "ar", None),
    "paged-auto": ("torch", {"kv_cache_memory": "roomy", "block_size": "auto"}, "dflash", None),
    "paged-tree": ("torch", {"kv_cache_memory": "roomy", "tree_budget": 12}, "dflash", None),
    "static-tree-no-prefix-cache": ("torch", {"kv_cache_memory": "static", "tree_budget": 6, "prefix_cache": False},
                                    "dflash", None),
    "dflash2-paged": ("dflash2", {"kv_cache_memory": "roomy"}, "dflash", None),
    "onnxruntime-block": ("onnxruntime", {}, "dflash", None),
    "onnxruntime-auto": ("onnxruntime", {"block_size": "auto"}, "dflash", None),
    "onnxruntime-two-rows": ("onnxruntime", {"kv_cache_memory": "rows"}, "dflash", 5),
}


def budget(name: str, engine_dir: Path) -> str:
    """The KV budgets above: a paged cache of the blocks one request of max_seq_len takes and one more ("tight"), or
    of 3 times them ("roomy"), for the torch executor; two of onnxruntime's static rows and 6 blocks of prefix pool."""
    if name == "rows":
        ort = Engine.load(engine_dir).executor
        return str(2 * ort.rows_bytes // ort.num_slots + 6 * _block_bytes((ort._target, ort._drafter)))
    static = Engine.load(engine_dir, kv_cache_memory="static").executor
    per_block = BLOCK_TOKENS * sum(cache_shape(m).position_bytes() for m in (static.target, static.drafter))
    blocks = -(-(MAX_SEQ_LEN + static.block_size) // BLOCK_TOKENS)
    return str(per_block * (blocks + 1 if name == "tight" else 3 * blocks))


def requests(rng: random.Random, tokenizer, vocab: int, pressure: bool = False) -> list[Request]:
    """A round's requests; with `pressure`, the first two have short prompts and run to max_seq_len, so a budget of one
    such request preempts."""
    reqs: list[Request] = []
    if pressure:
        for i in range(2):
            prompt = [rng.randrange(4, vocab) for _ in range(rng.randint(20, 50))]
            reqs.append(Request(-1 - i, prompt, MAX_SEQ_LEN - len(prompt), 0.9, rng.randrange(2**63)))
    for i in range(rng.randint(4, 10)):
        seed, kind = rng.randrange(2**63), rng.random()
        if kind < 0.2:  # as long as the engine allows
            prompt = [rng.randrange(4, vocab) for _ in range(rng.randint(20, 80))]
            reqs.append(Request(i, prompt, MAX_SEQ_LEN - len(prompt), rng.choice([0.0, 0.9]), seed))
            continue
        if kind < 0.28:  # one token in, one or a few out
            reqs.append(Request(i, [rng.randrange(4, vocab)], rng.choice([1, 2, 9]), rng.choice([0.0, 1.0]), seed,
                                top_k=rng.choice([0, 1])))
            continue
        if kind < 0.6 and reqs:  # a prefix of an earlier prompt (often cut at a block's edge), then a tail of its own
            base = rng.choice(reqs).prompt_token_ids
            cut = rng.choice([rng.randint(1, len(base)), BLOCK_TOKENS * rng.randint(1, 4) + rng.choice([-1, 0, 1])])
            prompt = base[:cut] + [rng.randrange(4, vocab) for _ in range(rng.randint(0, 20))]
        else:
            prompt = [rng.randrange(4, vocab) for _ in range(rng.randint(1, 70))]
        stop = (tokenizer.decode([rng.randrange(4, vocab)]),) if rng.random() < 0.25 else ()
        temperature = 0.0 if rng.random() < 0.5 else rng.choice([0.5, 1.0, 1.5])
        reqs.append(Request(i, prompt, rng.randint(1, 40), temperature, seed, top_k=rng.choice([0, 0, 3, 40]),
                            top_p=rng.choice([1.0, 1.0, 0.8]), stop=tuple(s for s in stop if s.strip())))
    return reqs


def drive(decoder, reqs: list[Request], rng: random.Random) -> tuple[dict, set]:
    """Submit `reqs` in random waves between steps and cancel some: {id: (tokens, finish reason)}, cancelled ids."""
    waiting, done, cancelled = list(reqs), {}, set()
    while waiting or decoder.has_work:
        if waiting and (not decoder.has_work or rng.random() < 0.4):
            for _ in range(rng.randint(1, 3)):
                if waiting:
                    decoder.submit(waiting.pop(0))
        if rng.random() < 0.04:
            victim = rng.choice(reqs).id
            if victim not in done:
                decoder.cancel(victim)
                cancelled.add(victim)
        for update in decoder.step():
            if update.result is not None:
                assert update.request.id not in done, f"request {update.request.id} finished twice"
                done[update.request.id] = (update.result.output_token_ids, update.result.finish_reason)
    return done, cancelled


@pytest.mark.parametrize("config", CONFIGS)
def test_random_workloads_give_plain_decodings_tokens(config, torch_engine_dir, dflash2_engine_dir, biased_ort_engine,
                                                      reference):
    kind, options, mode, block_size = CONFIGS[config]
    directory = {"torch": torch_engine_dir, "dflash2": dflash2_engine_dir, "onnxruntime": biased_ort_engine}[kind]
    options = dict(options)
    if options.get("kv_cache_memory") in ("tight", "roomy", "rows"):
        options["kv_cache_memory"] = budget(options["kv_cache_memory"], directory)
    engine = Engine.load(directory, **options)
    plain = reference.decoder("ar")
    preempted = 0
    for round_ in range(ROUNDS):
        rng = random.Random(f"{config} {round_}")
        reqs = requests(rng, reference.tokenizer, reference.executor.vocab_size, pressure="tight" in config)
        want = {r.request.id: (r.output_token_ids, r.finish_reason) for q in reqs for r in plain.generate([q])}
        decoder = engine.decoder(mode, block_size=block_size)
        got, cancelled = drive(decoder, reqs, rng)
        preempted += decoder.preemptions
        assert set(got) == set(want), f"round {round_}"
        for r in reqs:
            tokens, reason = got[r.id]
            where = (f"round {round_}, request {r.id}: {len(r.prompt_token_ids)} prompt tokens, max_new_tokens "
                     f"{r.max_new_tokens}, temperature {r.temperature}, top_k {r.top_k}, top_p {r.top_p}, "
                     f"stop {r.stop}")
            if reason == "cancelled":
                assert r.id in cancelled and tokens == want[r.id][0][:len(tokens)], where
            else:
                assert (tokens, reason) == want[r.id], where
    if "tight" in config:  # the budget did what it is there for
        assert preempted, "no request was preempted"
