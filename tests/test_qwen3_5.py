"""Qwen3.5 targets (hybrid: Gated DeltaNet + gated full attention; dense and MoE): the published multimodal directory
read as a causal LM, our decoder == transformers' Qwen3_5ForConditionalGeneration on text, the recurrent state rolled
back to the accepted prefix (a drafter right for a few positions and then wrong: dflash == ar == HF generate()), sampled
dflash == ar, paged caches with preemption, tensor parallelism under mpiexec == one process, onnxruntime engines and
the TensorRT executor (stand-ins) == the torch executor, the published config, and the build options not supported
yet refused in one sentence.

The tiny targets (train/random_pair.py) have three Gated DeltaNet layers (2 key heads, 4 value heads) and one full
attention layer; the MoE one 8 routed experts (top 2) and a gated shared expert in every layer. Every test runs on both.
"""

from __future__ import annotations

import json
import shutil
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForImageTextToText

from tests.conftest import (
    CountingPrefill,
    assert_dflash_equals_ar_equals_generate,
    assert_dflash_equals_ar_greedy_and_sampled,
    assert_mpiexec_run_equals_one_process,
    build,
    write_family_config,
)
from tests.conftest import family_requests as requests
from trtllm_dflash.checkpoint.formats import load_target, target_tensor_shapes
from trtllm_dflash.cli import EXIT_USER_ERROR, main
from trtllm_dflash.engine_dir import rank_file
from trtllm_dflash.errors import UserError
from trtllm_dflash.models.shard import check_tp
from trtllm_dflash.models.spec import DecoderSpec, hf_config_from_dict
from trtllm_dflash.models.target import TargetModel
from trtllm_dflash.parallel.group import SINGLE
from trtllm_dflash.runtime.decoding import Decoder, Request
from trtllm_dflash.runtime.executor import TorchExecutor
from trtllm_dflash.runtime.runner import Engine
from trtllm_dflash.train.random_pair import write_random_pair

ROOT = Path(__file__).resolve().parents[1]
MPIEXEC = Path(sys.executable).parent / "mpiexec"
PROMPT_LENGTHS = (7, 19, 12, 70)  # 70: a prompt pass longer than a chunk of the gated delta rule (64)


@pytest.fixture(scope="module", params=["qwen3_5", "qwen3_5_moe"])
def pair(request, tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp(f"{request.param}_pair")
    write_random_pair(root, request.param, block_size=8, seed=0)
    return root


def model_type(pair: Path) -> str:
    return json.loads((pair / "target" / "config.json").read_text())["model_type"]


@pytest.fixture(scope="module")
def hf(pair):
    return AutoModelForImageTextToText.from_pretrained(str(pair / "target"), dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def engine_dir(pair, tmp_path_factory) -> Path:
    return build(pair, tmp_path_factory.mktemp("qwen3_5_engine") / "engine", max_batch_size=4)


@pytest.fixture(scope="module")
def engine(engine_dir) -> Engine:
    return Engine.load(engine_dir)


@pytest.fixture(scope="module")
def ort_engine_dir(pair, tmp_path_factory) -> Path:
    """The pair built for onnxruntime."""
    from trtllm_dflash.config import BuildConfig
    from trtllm_dflash.engine.builder import build_engine

    return build_engine(BuildConfig(target=pair / "target", drafter=pair / "drafter", dtype="float32",
                                    max_batch_size=4, max_seq_len=256, backend="onnxruntime",
                                    output=tmp_path_factory.mktemp("qwen3_5_ort") / "engine"), progress=False)


def ours(target: Path) -> TargetModel:
    ckpt = load_target(target)
    return TargetModel.from_state_dict(ckpt.spec, {n: ckpt.tensors.get(n).float() for n in ckpt.tensors.names()})


def test_the_multimodal_directory_reads_as_its_text_model(pair):
    """Qwen3_5ForConditionalGeneration's directory: the text_config's Gated DeltaNet fields, the text weights renamed
    from `model.language_model.`, the lm_head kept, the vision tower not read."""
    raw = json.loads((pair / "target" / "config.json").read_text())
    moe = raw["model_type"] == "qwen3_5_moe"
    assert raw["architectures"] == ["Qwen3_5MoeForConditionalGeneration" if moe else "Qwen3_5ForConditionalGeneration"]
    ckpt = load_target(pair / "target")
    spec = ckpt.spec
    assert spec.layer_types == ("linear_attention",) * 3 + ("full_attention",)
    assert (spec.linear_num_key_heads, spec.linear_num_value_heads, spec.linear_key_head_dim,
            spec.linear_value_head_dim, spec.linear_conv_kernel) == (2, 4, 16, 16, 4)
    assert spec.rope_parameters["partial_rotary_factor"] == 0.25 and spec.has_recurrent_state
    assert set(ckpt.tensors.names()) == set(target_tensor_shapes(spec))
    assert "model.layers.0.linear_attn.in_proj_qkv.weight" in ckpt.tensors.names()
    assert ckpt.tensors.get("model.layers.3.self_attn.q_proj.weight").shape == (2 * 4 * 16, 64)  # query + gate
    assert DecoderSpec.from_hf(hf_config_from_dict(spec.to_hf_dict(), "round trip")) == spec
    if moe:  # every layer sparse: 8 experts of 64, top 2, renormalized, and a shared expert of 96 with its gate
        assert (spec.routed_experts, spec.num_experts_per_tok, spec.moe_intermediate_size, spec.intermediate_size,
                spec.norm_topk_prob, spec.shared_expert, spec.dense_layers) == (8, 2, 64, 96, True, True, ())
        assert ckpt.tensors.get("model.layers.2.mlp.shared_expert_gate.weight").shape == (1, 64)
        assert "model.layers.0.mlp.experts.7.down_proj.weight" in ckpt.tensors.names()


def test_padded_prefill_and_rolled_back_steps_equal_hf(pair, hf):
    """A batched prefill of prompts of different lengths (the padding leaves each row's recurrent state at its own last
    token), then per row a verify block of which only a prefix is kept and the next block from there: logits and
    every layer's hidden states == transformers on the true sequence."""
    model = ours(pair / "target")
    spec, H = model.spec, model.spec.hidden_size
    g = torch.Generator().manual_seed(0)
    seqs = [torch.randint(4, spec.vocab_size, (n + 16,), generator=g) for n in PROMPT_LENGTHS]
    with torch.no_grad():
        ref = [hf(s[None], output_hidden_states=True) for s in seqs]
    B, T, layers = len(seqs), max(PROMPT_LENGTHS), tuple(range(spec.num_layers))
    tokens = torch.zeros(B, T, dtype=torch.long)
    for row, n in enumerate(PROMPT_LENGTHS):
        tokens[row, :n] = seqs[row][:n]
    slots = torch.tensor([2, 0, 3, 1])
    cache, states = model.new_cache(4, 128), model.new_states(4, 8)
    last = torch.tensor(PROMPT_LENGTHS) - 1
    out = model(tokens, torch.arange(T).expand(B, T), slots, cache, layers, states=states)
    for row, n in enumerate(PROMPT_LENGTHS):
        torch.testing.assert_close(out.logits[row, :n], ref[row].logits[0, :n], atol=2e-5, rtol=1e-4)
        for k, layer in enumerate(layers):
            torch.testing.assert_close(out.hidden[row, :n, k * H:(k + 1) * H], ref[row].hidden_states[layer + 1][0, :n],
                                       atol=1e-4, rtol=1e-4)
    model(tokens, torch.arange(T).expand(B, T), slots, cache, states=states, last_index=last)  # as a prefill runs it
    starts = torch.tensor(PROMPT_LENGTHS)
    wrong = (torch.stack([s[n:n + 8] for s, n in zip(seqs, PROMPT_LENGTHS)]) + 1) % spec.vocab_size
    block = torch.cat([torch.stack([s[n:n + 2] for s, n in zip(seqs, PROMPT_LENGTHS)]), wrong[:, 2:]], dim=1)
    model(block, starts[:, None] + torch.arange(8), slots, cache, states=states)  # 2 right, then wrong: keep 2
    for kept in (2, 0, 5):  # ... and from there: a block of which `kept` are kept next
        starts = starts + (2 if kept == 2 else 0)
        block = torch.stack([s[p:p + 8] for s, p in zip(seqs, starts.tolist())])
        out = model(block, starts[:, None] + torch.arange(8), slots, cache, states=states)
        for row, p in enumerate(starts.tolist()):
            torch.testing.assert_close(out.logits[row], ref[row].logits[0, p:p + 8], atol=2e-5, rtol=1e-4)
        starts = starts + kept - (2 if kept == 2 else 0)


class ScriptedDrafts:
    """The real executor, whose drafts are the target's own greedy tokens for the first j positions of each block and
    then wrong ones, j cycling over 0 .. k - 1 (instrumentation: the passes are the real ones; only the drafter's
    guesses are scripted, so that every accepted-prefix length occurs)."""

    def __init__(self, executor, greedy: dict[tuple[int, ...], list[int]]):
        self.executor, self.greedy, self.of_slot, self.step = executor, greedy, {}, 0
        self.accepted: list[int] = []

    def __getattr__(self, name):
        return getattr(self.executor, name)

    def target_forward(self, token_ids, starts, slots, capture, last_index=None, rows=None):
        if last_index is not None:  # a prefill pass (of a prompt from `start` on): whose request each slot now holds
            for row, (slot, start, n) in enumerate(zip(slots.tolist(), starts.tolist(), (last_index + 1).tolist())):
                ids = token_ids[row, :n].tolist()
                self.of_slot[slot] = next(seq for seq in self.greedy.values() if ids == seq[start:start + n])
        return self.executor.target_forward(token_ids, starts, slots, capture, last_index, rows=rows)

    def draft(self, anchors, starts, slots, num_drafts=None, context=None, rows=None, width=None):
        real = self.executor.draft(anchors, starts, slots, num_drafts, context, rows=rows, width=width)
        drafts = []
        for row, (slot, start) in enumerate(zip(slots.tolist(), starts.tolist())):
            seq = self.of_slot[slot]
            right = [seq[p] if p < len(seq) else 0 for p in range(start + 1, start + 1 + real.shape[1])]
            j = (self.step + row) % (real.shape[1] + 1)
            drafts.append(right[:j] + [(t + 1) % self.executor.vocab_size for t in right[j:]])
        self.step += 1
        return torch.tensor(drafts, dtype=real.dtype, device=real.device)

    def accept(self, draft, logits, sampling, starts):
        accepted, bonus = self.executor.accept(draft, logits, sampling, starts)
        self.accepted += accepted.tolist()
        return accepted, bonus


def test_rejected_drafts_roll_the_recurrent_state_back(engine, hf):
    """Greedy, drafts right for 0 .. 7 positions then wrong: dflash (blocks of 8 and 3) == ar == HF generate(), with
    every accepted length seen; the drafter's own (random) drafts too."""
    reqs = [replace(r, max_new_tokens=48) for r in requests(engine.executor.vocab_size)]
    ar = {r.request.id: r.output_token_ids for r in engine.decoder("ar").generate(reqs)}
    greedy = {tuple(r.prompt_token_ids): r.prompt_token_ids + ar[r.id] for r in reqs}
    for k in (8, 3):
        scripted = ScriptedDrafts(engine.executor, greedy)
        got = {r.request.id: r.output_token_ids for r in
               Decoder(scripted, engine.decoder("dflash", block_size=k).policy, engine.config.eos_token_ids)
               .generate(reqs)}
        assert got == ar, k
        assert set(scripted.accepted) == set(range(k)), (k, sorted(set(scripted.accepted)))
    assert_dflash_equals_ar_equals_generate(engine, hf, requests(engine.executor.vocab_size))


def test_one_token_passes_advance_the_state_or_keep_their_inputs_alike(engine):
    """A plain step's one token is never dropped, so its pass leaves each Gated DeltaNet state after it (the next pass
    replays nothing); keeping its inputs instead, as the graphs of engines built before 2026-12-05 do, gives the same
    tokens, ar and dflash, greedy and sampled."""
    states = engine.executor.target_states
    assert states.one_token_advances
    reqs = [replace(r, temperature=0.9 if r.id % 2 else 0.0, seed=r.id) for r in requests(engine.executor.vocab_size)]
    tokens = {}
    try:
        for advances in (True, False):
            states.one_token_advances = advances
            tokens[advances] = {mode: {r.request.id: r.output_token_ids for r in engine.decoder(mode).generate(reqs)}
                                for mode in ("ar", "dflash")}
    finally:
        states.one_token_advances = True
    assert tokens[True] == tokens[False]


def test_sampled_dflash_equals_ar(engine):
    reqs = [Request(r.id, r.prompt_token_ids, r.max_new_tokens, temperature=0.9, top_k=50, seed=11 + r.id)
            for r in requests(engine.executor.vocab_size)]
    tokens = {mode: {r.request.id: r.output_token_ids for r in engine.decoder(mode).generate(reqs)}
              for mode in ("dflash", "ar")}
    assert tokens["dflash"] == tokens["ar"]


def test_paged_cache_with_preemption_gives_the_static_tokens(engine, pair, tmp_path):
    """A paged KV budget that preempts: a preempted request's states are recomputed from its prompt and tokens (its
    first pass starts from zeros, or, with prefix reuse, from a state kept at a block of them). The states (4 slots x 3
    layers: a state, a block's inputs, conv inputs; and, with prefix reuse, 4 kept: a state and conv inputs) come out
    of the budget first."""
    short = build(pair, tmp_path / "engine", max_batch_size=4, max_seq_len=64)
    with pytest.raises(UserError, match=r"after the Gated DeltaNet layers' states 165\.0 KiB and one request of the "
                                        r"engine's max_seq_len needs 5; give at least"):
        Engine.load(short, kv_cache_memory="170KiB", prefix_cache=False)
    with pytest.raises(UserError, match=r"after the Gated DeltaNet layers' states, 4 slots' and 4 kept for prefix "
                                        r"reuse, 231\.0 KiB and one request of the engine's max_seq_len needs 5"):
        Engine.load(short, kv_cache_memory="240KiB")
    reqs = [replace(r, max_new_tokens=40) for r in requests(engine.executor.vocab_size)]
    for budget, reuse in (("240KiB", False), ("306KiB", True)):  # 5 blocks of 16 positions (12 KiB each)
        paged = Engine.load(short, kv_cache_memory=budget, prefix_cache=reuse)
        for mode in ("dflash", "ar"):
            want = {r.request.id: r.output_token_ids for r in engine.decoder(mode).generate(reqs)}
            decoder = paged.decoder(mode)
            assert {r.request.id: r.output_token_ids for r in decoder.generate(reqs)} == want, (mode, reuse)
            assert decoder.preemptions > 0, (mode, reuse)
        assert reuse == (paged.executor.prefix_states is not None and paged.executor.prefix_states.kept > 0)


@pytest.mark.parametrize("pair", ["qwen3_5_moe"], indirect=True)  # (the MoE target: states and grouped experts)
def test_static_passes_give_the_eager_tokens(engine, engine_dir, pair, tmp_path):
    """The padded static passes that the CUDA graphs replay (eagerly here: the capture needs a GPU), the states with a
    scratch slot for the padding rows as the caches have: the eager executor's tokens, dflash and ar, greedy and
    sampled, five requests on four slots (batch buckets 1, 2 and 4); over a paged cache with prefix reuse (a shared
    system prompt), and over one that preempts. Each decode step reads the host once, as a dense target's does."""
    from tests.test_decode_step import _reads_per_step
    from tests.test_static_shapes import _requests

    def tokens(executor, mode: str, reqs: list[Request]) -> dict:
        decoder = replace(engine, executor=executor).decoder(mode)
        return {r.request.id: r.output_token_ids for r in decoder.generate(reqs)}

    static = TorchExecutor.from_engine(engine_dir, engine.config, 0, SINGLE, "cpu", None, cuda_graphs=True)
    assert static.target_states.kept_from.shape[0] == static.num_slots + 1
    shared = system_prompt_requests(engine.executor.vocab_size)
    paged = TorchExecutor.from_engine(engine_dir, engine.config, 0, SINGLE, "cpu", None, cuda_graphs=True,
                                      kv_cache_memory=8 << 20)
    short = build(pair, tmp_path / "short", max_batch_size=4, max_seq_len=64)
    tight = Engine.load(short)
    preempting = TorchExecutor.from_engine(short, tight.config, 0, SINGLE, "cpu", None, cuda_graphs=True,
                                           kv_cache_memory=360 << 10)
    few = [replace(r, max_new_tokens=40) for r in requests(engine.executor.vocab_size)]
    for mode in ("dflash", "ar"):
        for sampled in (False, True):
            assert tokens(static, mode, _requests(sampled)) == tokens(engine.executor, mode, _requests(sampled))
        assert tokens(paged, mode, shared) == tokens(engine.executor, mode, shared)
        decoder = replace(tight, executor=preempting).decoder(mode)
        assert {r.request.id: r.output_token_ids for r in decoder.generate(few)} == \
            {r.request.id: r.output_token_ids for r in tight.decoder(mode).generate(few)}
        assert decoder.preemptions > 0
    assert {k.batch for k in static.graphs.passes if k.kind == "target"} == {1, 2, 4}
    assert paged.prefix_states is not None and paged.prefix_states.kept > 0
    steps = _reads_per_step(replace(engine, executor=static).decoder("dflash"), _requests(False)[:3])
    counts = [n for n, admitting, _ in steps if not admitting]
    assert len(counts) > 5 and set(counts) == {1}, counts


def system_prompt_requests(vocab_size: int, n: int = 6) -> list[Request]:
    """A 40-token system prompt (2 full blocks of 16 and 8 tokens) + a user turn of 30 + i tokens each, so that every
    prompt's last full block (its fourth, positions 48 .. 63) is its own; odd ids sampled."""
    g = torch.Generator().manual_seed(3)
    system = torch.randint(4, vocab_size, (40,), generator=g).tolist()
    return [Request(i, system + torch.randint(4, vocab_size, (30 + i,), generator=g).tolist(), 12,
                    temperature=0.8 if i % 2 else 0.0, seed=i) for i in range(n)]


def decoder_of(engine: Engine, mode: str) -> Decoder:
    """`engine`'s decoder of mode "dflash" or "ar", or "auto": --block-size auto with hand-made pass costs at which a
    whole block pays, so that it holds a prompt's features back from the drafter until its first speculative step."""
    from tests.test_block_size_auto import hand_costs
    from trtllm_dflash.runtime.verify import AutoBlock
    from trtllm_dflash.speculative.schedule import AutoBlockSize

    if mode != "auto":
        return engine.decoder(mode)
    return Decoder(engine.executor, AutoBlock(AutoBlockSize(hand_costs(1.0), block_size=8)),
                   engine.config.eos_token_ids)


def assert_one_at_a_time_resumes(reuse: Engine, plain: Engine, mode: str, reqs: list[Request],
                                  want: dict[int, list[int]]) -> None:
    """system_prompt_requests one at a time, request 0's second turn (its prompt, answer and 20 more tokens) right
    after it, on `reuse` (prefix reuse) and on `plain` (none): the passes `reuse` computes, its tokens (those of `want`
    and `plain`'s), and the logits at each prompt's last token within 1e-5 of `plain`'s. Request 0 ends a pass at its
    last full block (64); its second turn resumes there; request 1 finds the system prompt's 2 blocks but no state
    there, so computes its prompt whole, ending a pass where it leaves them (32) and at 64; requests 2-5 resume at
    32."""
    lengths = [len(r.prompt_token_ids) for r in reqs]
    ours, theirs = CountingPrefill(reuse.executor), CountingPrefill(plain.executor)
    decoder, plain_decoder = (decoder_of(Engine(e.config, e.tokenizer, c), mode)
                              for e, c in ((reuse, ours), (plain, theirs)))
    turn = Request(9, reqs[0].prompt_token_ids + want[0] + list(range(4, 24)), 12, temperature=0.8, seed=9)
    got, logits = {}, []
    for req in (reqs[0], turn, *reqs[1:]):
        got |= {r.request.id: r.output_token_ids for r in decoder.generate([req])}
        assert [r.output_token_ids for r in plain_decoder.generate([req])] == [want.get(req.id, got[req.id])]
        logits.append((ours.logits[-1], theirs.logits[-1]))
    assert got.keys() == {*want, 9}
    for mine, plain_logits in logits:
        torch.testing.assert_close(mine, plain_logits, atol=1e-5, rtol=0)
    last_block = (len(turn.prompt_token_ids) - 1) // 16 * 16
    assert ours.computed == [[64], [lengths[0] - 64], [last_block - 64], [len(turn.prompt_token_ids) - last_block],
                             [32], [32], [lengths[1] - 64]] + \
        [part for n in lengths[2:] for part in ([32], [n - 64])], ours.computed
    states = reuse.executor.prefix_states
    assert (states.kept, states.resumed) == (8, 5)  # the last block of each, 32 for request 1; the rest resumed


@pytest.mark.parametrize("mode", ["dflash", "ar", "auto"])
def test_prefix_reuse_resumes_the_recurrent_states(engine, engine_dir, mode):
    """Prefix reuse of a hybrid target (runtime/prefix_states.py): the paged cache keeps the Gated DeltaNet states
    where prefill passes end at checkpoints, and a request resumes from the last kept state its cached blocks reach:
    one at a time (assert_one_at_a_time_resumes, against the static cache), and submitted together: the first one also
    ends a pass at 32 for the others, held for the step's second wave, which resume there (not under --block-size
    auto, which publishes a prompt's blocks only once the drafter holds them). The tokens are the static cache's,
    greedy and sampled; --block-size auto holds the prompts' features back from the drafter alike; --no-prefix-cache
    computes every prompt whole."""
    from trtllm_dflash.bench.runner import _kv_cache_report

    reqs = system_prompt_requests(engine.executor.vocab_size)
    want = {r.request.id: r.output_token_ids for r in decoder_of(engine, mode).generate(reqs)}
    lengths = [len(r.prompt_token_ids) for r in reqs]

    def paged(**options) -> tuple[Engine, CountingPrefill]:
        loaded = Engine.load(engine_dir, kv_cache_memory="8MiB", **options)
        return Engine(loaded.config, loaded.tokenizer, counting := CountingPrefill(loaded.executor)), counting

    reuse = Engine.load(engine_dir, kv_cache_memory="8MiB")
    assert_one_at_a_time_resumes(reuse, engine, mode, reqs, want)
    report = _kv_cache_report(reuse)  # (what bench reports)
    assert (report["kept_states"], report["states_kept"], report["requests_resumed"]) == (4, 8, 5)
    assert report["kept_states_bytes"] == reuse.executor.prefix_states.nbytes > 0
    together, counting = paged()
    assert {r.request.id: r.output_token_ids for r in decoder_of(together, mode).generate(reqs)} == want
    if mode != "auto":  # (auto: a prompt held back from the drafter is published later, so none waits for it)
        assert counting.computed[:3] == [[32], [32], [lengths[0] - 64]], counting.computed
        assert sorted(n for part in counting.computed[3:] for n in part) == \
            sorted([32] * 5 + [n - 64 for n in lengths[1:]])

    whole, counting = paged(prefix_cache=False)
    assert {r.request.id: r.output_token_ids for r in decoder_of(whole, mode).generate(reqs)} == want
    assert sorted(n for part in counting.computed for n in part) == sorted(lengths)


def conversations(vocab_size: int, n: int = 5) -> list[Request]:
    """n prompts of 50 tokens with nothing in common (each keeps one state, at its last full block: 48)."""
    g = torch.Generator().manual_seed(11)
    return [Request(i, torch.randint(4, vocab_size, (50,), generator=g).tolist(), 8) for i in range(n)]


@pytest.mark.parametrize("pair", ["qwen3_5_moe"], indirect=True)  # (the dense target's layers and more)
@pytest.mark.parametrize("backend", ["torch", "onnxruntime"])
def test_prefix_states_keeps_more_conversations_than_slots(engine, engine_dir, ort_engine_dir, backend):
    """--prefix-states N: five conversations one at a time on 4 request slots, then the first one's next turn. One kept
    state per slot (the default) has evicted the first conversation's by then, so its next turn computes its prompt
    whole; 8 kept states resume it at its last full block. The tokens are the same either way (the torch executor's
    static cache's), and --kv-cache-memory counts the 8 states."""
    from trtllm_dflash.runtime.cache_rows import _block_bytes

    reqs = conversations(engine.executor.vocab_size)
    first = {r.request.id: r.output_token_ids for r in engine.decoder("dflash").generate(reqs[:1])}[0]
    turn = Request(9, reqs[0].prompt_token_ids + first + list(range(4, 24)), 8)
    want = {r.request.id: r.output_token_ids for r in engine.decoder("dflash").generate([*reqs, turn])}
    where = {"backend": "onnxruntime"} if backend == "onnxruntime" else {"kv_cache_memory": "8MiB"}
    directory = ort_engine_dir if backend == "onnxruntime" else engine_dir
    # (the default: the turn finds its first turn's 3 blocks without their state, computes them again and keeps a
    # state there and at its own last full block)
    n = len(turn.prompt_token_ids)  # (78: passes end at its checkpoints, 48 and 64, then its last 14 tokens)
    for kept, (states_kept, resumed, computed) in ((None, (7, 0, [48, 16, n - 64])), (8, (6, 1, [16, n - 64]))):
        loaded = Engine.load(directory, prefix_states=kept, **where)
        counting = CountingPrefill(loaded.executor)
        decoder = Engine(loaded.config, loaded.tokenizer, counting).decoder("dflash")
        got = {r.request.id: r.output_token_ids for req in reqs for r in decoder.generate([req])}
        before = len(counting.computed)
        got |= {r.request.id: r.output_token_ids for r in decoder.generate([turn])}
        states = loaded.executor.prefix_states
        assert got == want and states.capacity == (kept or 4)
        assert (states.kept, states.resumed) == (states_kept, resumed), (states.kept, states.resumed)
        assert [n for part in counting.computed[before:] for n in part] == computed, counting.computed
    if backend == "torch":  # the paged budget gives the 4 more kept states' bytes from its blocks
        blocks = {kept: Engine.load(directory, prefix_states=kept, **where).executor.kv_blocks.num_blocks
                  for kept in (None, 8)}
        assert blocks[8] < blocks[None], blocks
    if backend == "onnxruntime":  # the budget counts 8 kept states beside the 4 rows, not one a row
        ort = Engine.load(directory, prefix_states=8, **where).executor
        rows_and_kept, block = ort.rows_bytes + ort.prefix_states.nbytes, _block_bytes((ort._target, ort._drafter))
        assert ort.prefix_states.nbytes == 8 * ort.prefix_states.bytes_each(ort._states)
        tight = Engine.load(directory, prefix_states=8, kv_cache_memory=str(rows_and_kept + block), **where).executor
        assert (tight.num_slots, tight.prefix_rows.num_blocks, tight.prefix_states.capacity) == (4, 1, 8)
        with pytest.raises(UserError, match="beside the static rows' and the recurrent states kept for them"):
            Engine.load(directory, prefix_states=8, kv_cache_memory=str(rows_and_kept + block // 2), **where)


def test_prefix_states_bad_inputs_are_one_sentence(engine_dir, qwen3_engine_dir, tmp_path, capsys):
    """Where no state would be kept (no recurrent layers, --no-prefix-cache, the torch executor's static cache) and a
    count below 1: one sentence, a non-zero exit, no output file."""
    prompts, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    prompts.write_text('{"prompt": "def f():"}\n')
    run = ["run", "--input", str(prompts), "--output", str(out), "--prefix-states"]
    for directory, args, words in (
            (qwen3_engine_dir, ["4", "--kv-cache-memory", "8MiB"],
             "--prefix-states 4: this engine's qwen3 target has no recurrent states to keep (only Gated DeltaNet "
             "layers, as Qwen3.5's, do); drop --prefix-states."),
            (engine_dir, ["4", "--no-prefix-cache", "--kv-cache-memory", "8MiB"],
             "--prefix-states 4: the states are kept for prefix reuse, which --no-prefix-cache turns off; drop one."),
            (engine_dir, ["4"], "--prefix-states 4: the torch executor reuses prefixes in its paged cache only; give "
             "--kv-cache-memory SIZE too.")):
        assert main([run[0], str(directory), *run[1:], *args]) == EXIT_USER_ERROR
        err = capsys.readouterr().err.strip()
        assert words in err and len(err.splitlines()) == 1 and not out.exists(), err
    with pytest.raises(SystemExit) as exited:  # (argparse's own sentence, after its usage line)
        main([run[0], str(engine_dir), *run[1:], "0"])
    assert exited.value.code != 0 and capsys.readouterr().err.strip().endswith(
        "argument --prefix-states: must be an integer >= 1, got 0")


# --- tensor parallelism, bad build options, the published config -------------------------------------------


@pytest.mark.mpi
@pytest.mark.skipif(not MPIEXEC.exists(), reason="MPICH's mpiexec is not installed: pip install -e '.[mpi]'")
def test_tp_under_mpiexec_equals_one_process(pair, tmp_path):
    """2 ranks, each with one key head and two value heads of every Gated DeltaNet layer: in_proj_qkv and the conv cut
    in their q, k and v parts, the rank files exact slices; the tokens of one process."""
    one, two = tmp_path / "tp1", tmp_path / "tp2"
    assert main(["build", str(write_family_config(tmp_path / "1.yaml", pair)), "--output", str(one)]) == 0
    assert main(["build", str(write_family_config(tmp_path / "2.yaml", pair, tp_size=2)), "--output", str(two)]) == 0
    full, ranks = load_file(str(one / rank_file(0))), [load_file(str(two / rank_file(r))) for r in range(2)]
    prefix = "target.model.layers.1.linear_attn."
    for leaf in ("in_proj_qkv.weight", "conv1d.weight"):
        q, k, v = full[prefix + leaf].split([32, 32, 64])
        for r, rank in enumerate(ranks):
            assert torch.equal(rank[prefix + leaf], torch.cat([q.chunk(2)[r], k.chunk(2)[r], v.chunk(2)[r]]))
    for leaf, dim in (("in_proj_z.weight", 0), ("A_log", 0), ("dt_bias", 0), ("out_proj.weight", 1)):
        assert torch.equal(torch.cat([r[prefix + leaf] for r in ranks], dim=dim), full[prefix + leaf]), leaf
    assert torch.equal(ranks[1][prefix + "norm.weight"], full[prefix + "norm.weight"])
    if model_type(pair) == "qwen3_5_moe":  # the routed experts and the shared one each cut like a dense MLP
        for name, dim in (("mlp.experts.5.gate_proj.weight", 0), ("mlp.experts.5.down_proj.weight", 1),
                          ("mlp.shared_expert.up_proj.weight", 0), ("mlp.shared_expert.down_proj.weight", 1)):
            name = "target.model.layers.1." + name
            assert torch.equal(torch.cat([r[name] for r in ranks], dim=dim), full[name]), name
        gate = "target.model.layers.1.mlp.shared_expert_gate.weight"
        assert torch.equal(ranks[1][gate], full[gate])

    assert_mpiexec_run_equals_one_process(one, two, tmp_path)


@pytest.mark.parametrize("tokens, chunk", [(1, 16), (15, 16), (16, 16), (17, 16), (70, 16), (150, 64), (40, 8)])
def test_the_graphs_chunked_delta_rule_gives_the_token_by_token_rule(tokens, chunk):
    """chunk_scanned (the exported graphs' form: each chunk's (I - L)^-1 as a product of squarings, a scan over chunks)
    == token_by_token (transformers' token-by-token rule) within float32 rounding: outputs and the final state, from a
    non-zero state, rows whose padding (g = beta = 0) starts anywhere, passes shorter than, equal to and across chunks;
    the state-only form (q None: the replay's) gives the same state."""
    import torch.nn.functional as F

    from trtllm_dflash.models.linear_attention import chunk_scanned, token_by_token

    g = torch.Generator().manual_seed(tokens)
    B, H, dk, dv = 3, 2, 32, 24
    q = F.normalize(torch.randn(B, tokens, H, dk, generator=g), dim=-1)
    # keys close to each other: a chunk's tokens then depend on each other strongly (L's high powers are not small)
    k = F.normalize(torch.randn(B, 1, H, dk, generator=g) + 0.3 * torch.randn(B, tokens, H, dk, generator=g), dim=-1)
    v, state = torch.randn(B, tokens, H, dv, generator=g), torch.randn(B, H, dk, dv, generator=g)
    real = (torch.arange(tokens)[None] < torch.tensor([tokens, max(tokens // 2, 1), 1])[:, None])[..., None]
    decay = -0.1 * torch.rand(B, tokens, H, generator=g) * real
    beta = (0.5 + 0.5 * torch.rand(B, tokens, H, generator=g)) * real
    want_out, want_state = token_by_token(q, k, v, decay, beta, state)
    out, final = chunk_scanned(q, k, v, decay, beta, state, chunk)
    torch.testing.assert_close(out, want_out, atol=2e-6, rtol=0)
    torch.testing.assert_close(final, want_state, atol=2e-6, rtol=0)
    torch.testing.assert_close(chunk_scanned(None, k, v, decay, beta, state, chunk)[1], want_state, atol=2e-6, rtol=0)


@pytest.mark.slow
@pytest.mark.parametrize("pair", ["qwen3_5_moe"], indirect=True)  # (the dense target's layers and more)
def test_onnxruntime_engine_runs_the_recurrent_layers_and_rolls_them_back(pair, engine, ort_engine_dir, tmp_path):
    """backend onnxruntime: target_step carries each Gated DeltaNet layer's conv and state in place (an ONNX Scan over
    the pass's chunks of 16 tokens) and target_replay resumes them at the next pass's start; the onnxruntime
    executor's tokens equal the torch executor's: drafts right for 0 .. k - 1 positions then wrong (blocks of 8 and
    3: every accepted length, so every replay length), the drafter's own drafts (same acceptance lengths), a 70-token
    prompt (five chunks: the state after it kept), greedy and sampled, dflash and ar; the MoE target's experts one
    node per layer. One-token passes run target_decode (the rule's step without Scan, conv and state in place); an
    engine without it (built before) runs them through target_step, same tokens."""
    import onnx

    from trtllm_dflash.engine_dir import graph_dir, write_manifest

    engine_dir = ort_engine_dir
    graphs = graph_dir(engine_dir, 0)
    step = onnx.load(str(graphs / "target_step.onnx"), load_external_data=False).graph
    assert sum(n.op_type == "Scan" for n in step.node) == 3  # the three Gated DeltaNet layers
    # the MoE target's routed experts: one com.microsoft.MoE node per layer
    assert sum(n.op_type == "MoE" for n in step.node) == (4 if "moe" in model_type(pair) else 0)
    inputs, outputs = {i.name for i in step.input}, {o.name for o in step.output}
    assert {"kept", "valid", "past_conv_0", "past_state_0", "past_key_3"} <= inputs and "past_delta_k_0" not in inputs
    assert {"present_delta_k_0", "present_delta_beta_2", "present_state_1"} <= outputs and "past_key_0" not in inputs
    assert not (graphs / "target_tree.onnx").exists()  # (a recurrent state follows one sequence: no trees)
    decode = onnx.load(str(graphs / "target_decode.onnx"), load_external_data=False).graph
    assert not any(n.op_type == "Scan" for n in decode.node)  # one token: the rule's step as plain ops
    assert sum(n.op_type == "GroupQueryAttention" for n in decode.node) == 1  # the attention layer, in place
    inputs, outputs = {i.name for i in decode.input}, {o.name for o in decode.output}
    assert {"kept", "past_conv_0", "past_state_2", "past_key_3"} <= inputs and not {"valid", "key_positions"} & inputs
    assert {"present_conv_0", "present_state_2"} <= outputs and not any("delta" in name for name in outputs)
    # (no prefix reuse: its checkpoint at a prompt's last full block leaves a pass of at most a block after it, which
    # keeps its inputs like a verify block, and the first step replays them: the counts below are of plain passes)
    ort = Engine.load(engine_dir, backend="onnxruntime", prefix_cache=False)
    assert type(ort.executor).__name__ == "OnnxRuntimeExecutor"
    g = torch.Generator().manual_seed(1)
    reqs = [replace(r, max_new_tokens=40) for r in requests(ort.executor.vocab_size)]
    reqs.append(Request(5, torch.randint(4, ort.executor.vocab_size, (70,), generator=g).tolist(), 24))
    ar = {r.request.id: r.output_token_ids for r in engine.decoder("ar").generate(reqs)}
    runs = {name: [] for name in ("target_replay.onnx", "target_decode.onnx", "target_step.onnx")}
    for name, calls in runs.items():
        session = ort.executor._sessions[name]
        session.run_with_iobinding = lambda binding, run=session.run_with_iobinding, calls=calls: (calls.append(1),
                                                                                                  run(binding))
    replays = runs["target_replay.onnx"]
    assert {r.request.id: r.output_token_ids for r in ort.decoder("ar").generate(reqs)} == ar
    assert not replays  # (a one-token pass leaves the states after its token: ONE_TOKEN_ADVANCES_KEY)
    # plain steps run target_decode (no Scan), only prompts target_step (a run of rows at most once each)
    assert len(runs["target_decode.onnx"]) >= 39 and len(runs["target_step.onnx"]) <= len(reqs), runs
    greedy = {tuple(r.prompt_token_ids): r.prompt_token_ids + ar[r.id] for r in reqs}
    for k in (8, 3):
        scripted = ScriptedDrafts(ort.executor, greedy)
        got = {r.request.id: r.output_token_ids for r in
               Decoder(scripted, ort.decoder("dflash", block_size=k).policy, ort.config.eos_token_ids).generate(reqs)}
        assert got == ar, k
        assert set(scripted.accepted) == set(range(k)), (k, sorted(set(scripted.accepted)))
    assert replays  # (verify blocks keep their inputs: the next pass replays the accepted ones)
    own = [{r.request.id: (r.output_token_ids, r.acceptance_lengths) for r in e.decoder("dflash").generate(reqs)}
           for e in (ort, engine)]
    assert own[0] == own[1]
    sampled = [Request(r.id, r.prompt_token_ids, r.max_new_tokens, temperature=0.9, top_k=50, seed=11 + r.id)
               for r in reqs]
    for mode in ("dflash", "ar"):
        got, expected = ({r.request.id: r.output_token_ids for r in e.decoder(mode).generate(sampled)}
                         for e in (ort, engine))
        assert got == expected, mode

    # an engine built before 2026-12-05 12:00 has no target_decode: its one-token passes run target_step, same tokens
    older = tmp_path / "older"
    shutil.copytree(engine_dir, older)
    (graph_dir(older, 0) / "target_decode.onnx").unlink()
    write_manifest(older)
    old = Engine.load(older, backend="onnxruntime")
    assert "target_decode.onnx" not in old.executor._sessions
    assert {r.request.id: r.output_token_ids for r in old.decoder("ar").generate(reqs)} == ar


@pytest.mark.parametrize("pair", ["qwen3_5_moe"], indirect=True)  # (the dense target's layers and more)
def test_onnxruntime_prefix_reuse_resumes_the_recurrent_states(engine, ort_engine_dir):
    """The onnxruntime executor's prefix pool (prompt blocks copied into a request's static row) with the Gated
    DeltaNet states kept at checkpoints (runtime/prefix_states.py, as the torch executor's paged cache): one at a time
    (assert_one_at_a_time_resumes, against the same engine loaded with --no-prefix-cache), dflash and ar, greedy and
    sampled; the tokens are the torch executor's. --kv-cache-memory counts the kept states."""
    from trtllm_dflash.runtime.cache_rows import _block_bytes

    reqs = system_prompt_requests(engine.executor.vocab_size)
    plain = Engine.load(ort_engine_dir, backend="onnxruntime", prefix_cache=False)
    assert not plain.executor.resumes_states
    # --kv-cache-memory counts a kept state per row beside the rows: a budget that leaves less than a prefix block
    # beside both is refused in one sentence, one that leaves a block runs
    ort = Engine.load(ort_engine_dir, backend="onnxruntime").executor
    rows_and_kept = ort.rows_bytes + ort.prefix_states.nbytes
    block = _block_bytes((ort._target, ort._drafter))
    with pytest.raises(UserError, match="beside the static rows' and the recurrent states kept for them"):
        Engine.load(ort_engine_dir, backend="onnxruntime", kv_cache_memory=str(rows_and_kept + block // 2))
    tight = Engine.load(ort_engine_dir, backend="onnxruntime", kv_cache_memory=str(rows_and_kept + block)).executor
    assert (tight.num_slots, tight.prefix_rows.num_blocks) == (4, 1)
    for mode in ("dflash", "ar"):
        want = {r.request.id: r.output_token_ids for r in engine.decoder(mode).generate(reqs)}
        assert_one_at_a_time_resumes(Engine.load(ort_engine_dir, backend="onnxruntime"), plain, mode, reqs, want)


@pytest.mark.slow
@pytest.mark.extended  # FP8 on onnxruntime: test_onnxruntime_backend's; Qwen3.5 on onnxruntime: the test above
@pytest.mark.parametrize("pair", ["qwen3_5"], indirect=True)
def test_fp8_onnxruntime_engine_gives_the_torch_executors_tokens(pair, tmp_path):
    """quantization fp8 + backend onnxruntime (ModelOpt's FP8 linears as Q/DQ nodes beside the Scans): the onnxruntime
    executor's tokens and acceptance lengths equal the torch executor's on the same engine. The dense target only: an
    engine build of its own costs 2 minutes (the extended tier's), and FP8 experts in the dense form on onnxruntime
    are test_qwen3_moe's (test_quantized_experts_are_modelopts_and_lossless)."""
    from trtllm_dflash.config import BuildConfig
    from trtllm_dflash.engine.builder import build_engine

    engine_dir = build_engine(BuildConfig(target=pair / "target", drafter=pair / "drafter", dtype="float32",
                                          max_batch_size=4, max_seq_len=256, backend="onnxruntime",
                                          quantization="fp8", output=tmp_path / "engine"), progress=False)
    engines = [Engine.load(engine_dir, backend=b) for b in ("onnxruntime", "torch")]
    reqs = [replace(r, max_new_tokens=40) for r in requests(engines[0].executor.vocab_size)]
    for mode in ("dflash", "ar"):
        got, expected = ({r.request.id: (r.output_token_ids, r.acceptance_lengths)
                          for r in e.decoder(mode).generate(reqs)} for e in engines)
        assert got == expected, mode


@pytest.mark.slow
@pytest.mark.extended  # the TensorRT executor's bindings: test_tensorrt_build's; the states' graphs: onnxruntime's
@pytest.mark.parametrize("pair", ["qwen3_5_moe"], indirect=True)
def test_tensorrt_executor_binds_the_states_and_its_plans_build(pair, engine, tmp_path):
    """backend tensorrt: the TensorRT executor, its execution contexts stood in for by onnxruntime over exactly the
    memory it binds (tests/tensorrt_standin.py), gives the torch executor's tokens with drafts right for 0 .. k - 1
    positions (blocks of 8 and 3), in one pass per prompt and with prompts cut into passes of 16 tokens, and plain
    decoding without a target_replay run (the host knows one-token passes left nothing to replay), and with the decode
    steps' calls made CUDA graphs (on the CPU: each on a context bound once over static buffers); a padded batch
    of prompts cut into passes (a row whose prompt ends in the first) then decodes the torch executor's logits; and
    TensorRT-RTX builds target_step (a TensorRT loop per Gated DeltaNet layer), target_token (plain steps' one token
    per row: no loop) and target_replay into plans, their state outputs not aliased to inputs (TensorRT aliases only
    KV-cache updates: the executor copies them back). Prefix reuse keeps the states at checkpoints
    (assert_one_at_a_time_resumes). The MoE target only: its layers are the dense one's Gated DeltaNet and gated
    attention layers with experts for MLPs (a dense MLP in the plans is every Qwen3 engine's), and a tensorrt engine
    build of its own costs 2.5 minutes (the extended tier's)."""
    import onnx

    from tests.tensorrt_standin import standin_executor
    from trtllm_dflash.compile.tensorrt_build import build_plan, cache_length, engine_shapes, layer_types, parse_graph
    from trtllm_dflash.runtime.tensorrt_executor import bound_dtypes
    from trtllm_dflash.config import BuildConfig
    from trtllm_dflash.engine.builder import build_engine
    from trtllm_dflash.engine_dir import graph_dir, read_engine_config

    engine_dir = build_engine(BuildConfig(target=pair / "target", drafter=pair / "drafter", dtype="float32",
                                          max_batch_size=4, max_seq_len=256, backend="tensorrt",
                                          output=tmp_path / "engine"), progress=False)
    g = torch.Generator().manual_seed(1)
    reqs = [replace(r, max_new_tokens=32) for r in requests(engine.executor.vocab_size)]
    reqs.append(Request(5, torch.randint(4, engine.executor.vocab_size, (70,), generator=g).tolist(), 16))
    ar = {r.request.id: r.output_token_ids for r in engine.decoder("ar").generate(reqs)}
    greedy = {tuple(r.prompt_token_ids): r.prompt_token_ids + ar[r.id] for r in reqs}
    for pass_tokens, graphs in ((None, False), (16, False), (None, True)):
        made: list = []
        executor = standin_executor(engine_dir, pass_tokens=pass_tokens, cuda_graphs=graphs, made=made)
        for k in (8, 3):
            scripted = ScriptedDrafts(executor, greedy)
            got = {r.request.id: r.output_token_ids for r in
                   Decoder(scripted, engine.decoder("dflash", block_size=k).policy, engine.config.eos_token_ids)
                   .generate(reqs)}
            assert got == ar, (pass_tokens, graphs, k)
            assert set(scripted.accepted) == set(range(k)), (k, sorted(set(scripted.accepted)))
        # --cuda-graphs: verify passes and their replays each on a context bound once (runtime/plan_graphs.py), the
        # states' copies back into the rows made with them
        assert {plan for plan, _ in made} == ({"target_step", "target_replay", "drafter_draft", "accept"} if graphs
                                              else set())
        assert all(context.rebinds == 0 for _, context in made)
    # prefix reuse: the prompt blocks copied from the pool and the states kept at checkpoints, as onnxruntime's
    sys_reqs = system_prompt_requests(engine.executor.vocab_size)
    want = {r.request.id: r.output_token_ids for r in engine.decoder("dflash").generate(sys_reqs)}
    assert_one_at_a_time_resumes(*(Engine(engine.config, engine.tokenizer, standin_executor(engine_dir, prefix_cache=c))
                                   for c in (True, False)), "dflash", sys_reqs, want)
    # plain steps leave the states after their token: the host knows no replay is needed, and none runs; they run
    # the loop-free target_token plan (prompts: target_step; no prefix reuse, whose checkpoint at a prompt's last full
    # block leaves a pass of at most a block after it, which keeps its inputs for the first step to replay)
    executor, replays = standin_executor(engine_dir, prefix_cache=False), []
    replay = executor._contexts["target_replay"]
    run_replay = replay.execute_async_v3
    replay.execute_async_v3 = lambda stream: (replays.append(1), run_replay(stream))[1]
    got = {r.request.id: r.output_token_ids for r in
           Decoder(executor, engine.decoder("ar").policy, engine.config.eos_token_ids).generate(reqs)}
    assert got == ar and not replays
    one_token = sum(len(t) - 1 for t in ar.values())  # every token but each request's first (its prefill's)
    assert executor._contexts["target_token"].calls >= one_token // 4  # (4 rows a pass at most)
    assert executor._contexts["target_step"].calls <= len(reqs)  # the prefills only
    # Prompts of 3, 20 and 17 tokens padded to 20, in passes of 16: the first row's real tokens end in the first pass
    # (fails when a later pass replays tokens of a pass that kept its final state)
    executor, eager = standin_executor(engine_dir, pass_tokens=16), engine.executor
    lengths = torch.tensor([3, 20, 17])
    ids = torch.randint(4, eager.vocab_size, (3, 20), generator=g)
    slots, starts = torch.arange(3), torch.zeros(3, dtype=torch.long)
    for step in range(4):
        last = lengths - 1 if step == 0 else None
        want, got = (e.target_forward(ids, starts, slots, False, last_index=last) for e in (eager, executor))
        torch.testing.assert_close(got.logits, want.logits, atol=1e-4, rtol=0)
        ids, starts = want.logits[:, -1].argmax(-1)[:, None], lengths + step
    # what the executor binds, by name and dtype, is each plan's graph's inputs and outputs
    cfg = read_engine_config(engine_dir)
    onnx_types = {onnx.TensorProto.FLOAT: torch.float32, onnx.TensorProto.INT64: torch.int64}
    for graph in ("target_step", "target_token", "target_replay"):
        model = onnx.load(str(graph_dir(engine_dir, 0) / f"{graph}.onnx"), load_external_data=False).graph
        assert bound_dtypes(cfg, graph, False) == {v.name: onnx_types[v.type.tensor_type.elem_type]
                                                   for v in (*model.input, *model.output)}, graph
    rtx = pytest.importorskip("tensorrt_rtx_bindings", reason="TensorRT-RTX is not installed")
    for graph, loops in (("target_step", 3), ("target_token", 0), ("target_replay", 3)):
        path = graph_dir(engine_dir, 0) / f"{graph}.onnx"
        parsed = parse_graph(rtx, path, static_dims={"max_len": cache_length(cfg)})
        assert layer_types(parsed.network).get("RECURRENCE", 0) == loops, graph
        assert len(build_plan(rtx, path, dtype_note=cfg.dtype, shapes=engine_shapes(cfg), targets=["SM89"])) > 100_000


@pytest.mark.parametrize("fields, message", [
    ({"tp_size": 4}, "linear_num_key_heads 2 is not divisible by tp_size 4."),
])
def test_unsupported_build_options_are_one_sentence(pair, tmp_path, capsys, fields, message):
    message = message.format(model_type(pair))
    out = tmp_path / "engine"
    assert main(["build", str(write_family_config(tmp_path / "b.yaml", pair, **fields)), "--output", str(out)]) == \
        EXIT_USER_ERROR
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1, err
    assert not out.exists()


@pytest.mark.slow
def test_nvfp4_and_fp8_through_modelopt_are_stored_as_exported_cut_exactly_and_lossless(pair, tmp_path):
    """quantization nvfp4 (and fp8): ModelOpt quantizes the text model's linears (the Gated DeltaNet's in_proj_qkv /
    in_proj_z / out_proj included; in_proj_a / in_proj_b, the conv and the norms not), the engine holds them as
    exported, a tp 2 build cuts in_proj_qkv's packed weight and block scales in their q / k / v parts, and decoding is
    lossless against itself (greedy and sampled dflash == ar)."""
    pytest.importorskip("modelopt.torch.quantization")
    calibration = {"calibration_samples": 4, "calibration_max_tokens": 24}
    one, two = tmp_path / "nvfp4", tmp_path / "nvfp4_tp2"
    assert main(["build", str(write_family_config(tmp_path / "1.yaml", pair, quantization="nvfp4", **calibration)),
                 "--output", str(one)]) == 0
    assert main(["build", str(write_family_config(tmp_path / "2.yaml", pair, quantization="nvfp4", tp_size=2,
                                                  **calibration)), "--output", str(two)]) == 0
    full, ranks = load_file(str(one / rank_file(0))), [load_file(str(two / rank_file(r))) for r in range(2)]
    prefix = "target.model.layers.0.linear_attn."
    assert {k.removeprefix(prefix): v.dtype for k, v in full.items() if k.startswith(prefix + "in_proj_")} == {
        "in_proj_qkv.weight": torch.uint8, "in_proj_qkv.weight_scale": torch.float8_e4m3fn,
        "in_proj_qkv.weight_scale_2": torch.float32, "in_proj_qkv.input_scale": torch.float32,
        "in_proj_z.weight": torch.uint8, "in_proj_z.weight_scale": torch.float8_e4m3fn,
        "in_proj_z.weight_scale_2": torch.float32, "in_proj_z.input_scale": torch.float32,
        "in_proj_a.weight": torch.float32, "in_proj_b.weight": torch.float32}
    assert full["target.model.layers.3.self_attn.q_proj.weight"].dtype == torch.uint8
    for leaf in ("weight", "weight_scale"):
        q, k, v = full[f"{prefix}in_proj_qkv.{leaf}"].view(torch.uint8).split([32, 32, 64])
        for r, rank in enumerate(ranks):
            assert torch.equal(rank[f"{prefix}in_proj_qkv.{leaf}"].view(torch.uint8),
                               torch.cat([q.chunk(2)[r], k.chunk(2)[r], v.chunk(2)[r]]))
        assert torch.equal(torch.cat([r[f"{prefix}out_proj.{leaf}"].view(torch.uint8) for r in ranks], dim=1),
                           full[f"{prefix}out_proj.{leaf}"].view(torch.uint8))
    fp8 = tmp_path / "fp8"
    assert main(["build", str(write_family_config(tmp_path / "3.yaml", pair, quantization="fp8", **calibration)),
                 "--output", str(fp8)]) == 0
    assert load_file(str(fp8 / rank_file(0)))[f"{prefix}in_proj_qkv.weight"].dtype == torch.float8_e4m3fn
    for engine in (Engine.load(one), Engine.load(fp8)):
        assert_dflash_equals_ar_greedy_and_sampled(engine)


QWEN3_5_27B_TEXT_CONFIG = {  # Qwen/Qwen3.5-27B config.json's text_config, as published (vision_config left out)
    "attention_bias": False, "attention_dropout": 0.0, "attn_output_gate": True, "dtype": "bfloat16",
    "eos_token_id": 248044, "full_attention_interval": 4, "head_dim": 256, "hidden_act": "silu", "hidden_size": 5120,
    "initializer_range": 0.02, "intermediate_size": 17408,
    "layer_types": (["linear_attention"] * 3 + ["full_attention"]) * 16, "linear_conv_kernel_dim": 4,
    "linear_key_head_dim": 128, "linear_num_key_heads": 16, "linear_num_value_heads": 48,
    "linear_value_head_dim": 128, "max_position_embeddings": 262144, "model_type": "qwen3_5_text",
    "mtp_num_hidden_layers": 1, "mtp_use_dedicated_embeddings": False, "num_attention_heads": 24,
    "num_hidden_layers": 64, "num_key_value_heads": 4, "rms_norm_eps": 1e-06, "use_cache": True,
    "vocab_size": 248320,
    "rope_parameters": {"mrope_interleaved": True, "mrope_section": [11, 11, 10], "rope_type": "default",
                        "rope_theta": 10000000, "partial_rotary_factor": 0.25},
}


def test_published_moe_shape_parses_and_splits():
    """Qwen3.5-35B-A3B's text model (transformers' Qwen3_5MoeTextConfig defaults are its shape): 40 layers, 256
    experts of 512 (top 8) and a shared expert of 512 in each."""
    from transformers import Qwen3_5MoeTextConfig

    raw = {"architectures": ["Qwen3_5MoeForConditionalGeneration"], "model_type": "qwen3_5_moe",
           "text_config": Qwen3_5MoeTextConfig().to_dict(), "tie_word_embeddings": False}
    spec = DecoderSpec.from_hf(hf_config_from_dict(raw, "Qwen3.5-35B-A3B"))
    assert (spec.routed_experts, spec.num_experts_per_tok, spec.moe_intermediate_size, spec.intermediate_size,
            spec.shared_expert, sum(map(spec.is_sparse, range(40)))) == (256, 8, 512, 512, True, 40)
    assert DecoderSpec.from_hf(hf_config_from_dict(spec.to_hf_dict(), "round trip")) == spec
    # 3 + per layer: 2 norms, the router, 256 x 3 expert weights, 3 shared-expert weights and its gate; full layers
    # (10) q/k/v/o and q/k norms, linear ones (30) 9 Gated DeltaNet tensors
    assert len(target_tensor_shapes(spec)) == 3 + 40 * (2 + 1 + 256 * 3 + 4) + 10 * 6 + 30 * 9
    for tp in (2, 4, 8):
        check_tp(spec, tp, "Qwen3.5-35B-A3B", quantized=False, moe_parallel="ep")


def test_published_config_parses_and_splits():
    raw = {"architectures": ["Qwen3_5ForConditionalGeneration"], "model_type": "qwen3_5",
           "text_config": QWEN3_5_27B_TEXT_CONFIG, "tie_word_embeddings": False}
    spec = DecoderSpec.from_hf(hf_config_from_dict(raw, "Qwen3.5-27B"))
    assert sum(spec.is_linear(i) for i in range(spec.num_layers)) == 48 and spec.is_qwen3_5
    inv_freq, _ = spec.rope_inv_freq()
    assert inv_freq.shape == (32,)  # a quarter of head_dim 256 rotated
    assert DecoderSpec.from_hf(hf_config_from_dict(spec.to_hf_dict(), "round trip")) == spec
    # 3 + per full layer: 2 norms, q/k/v/o, q/k norms; per linear layer: 2 norms and 9 Gated DeltaNet tensors; 3 MLP
    # tensors each
    assert len(target_tensor_shapes(spec)) == 3 + 16 * (2 + 4 + 2 + 3) + 48 * (2 + 9 + 3)
    for tp in (2, 4, 8):
        check_tp(spec, tp, "Qwen3.5-27B", quantized=False)
    with pytest.raises(UserError, match=r"^odd: linear_num_value_heads 48 is not divisible by tp_size 32\.$"):
        check_tp(replace(spec, linear_num_key_heads=32, num_heads=32, num_kv_heads=32), 32, "odd", quantized=False)
