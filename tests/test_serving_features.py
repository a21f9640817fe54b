"""Serving features: top-k / top-p sampling, stop strings, request cancellation, in `run` and behind Triton.

- top-k / top-p: hand-made logits against the definition; dflash == ar token for token for the same seeds; a
  chi-square test of DFlash samples against the target's truncated distribution computed by HF transformers'
  own TopKLogitsWarper / TopPLogitsWarper (an independent implementation).
- stop strings: a stop string that spans two tokens and is completed in the middle of an accepted DFlash
  block ends the text right before it, with the same tokens in dflash and ar, in `run` and in `serve`.
- cancellation: the serving loop ends a cancelled request at the next step and gives its slot to a waiting
  request in that same step; with the real tritonserver (one slot), a cancelled gRPC stream or a closed HTTP
  stream frees the slot for the next request.
"""

from __future__ import annotations

import http.client
import json
import queue
import threading
import time

import numpy as np
import pytest
import torch
from scipy.stats import chisquare
from transformers import AutoModelForCausalLM
from transformers.generation.logits_process import TopKLogitsWarper, TopPLogitsWarper

from tests.test_sampling import ALPHA, PROMPT
from tests.test_serve import HELD_OUT, MODEL, ROOT, Server, Stream, _generate, _inputs, _text, _triton_cli
from trtllm_dflash.cli import EXIT_USER_ERROR, main
from trtllm_dflash.compile.accept_graph import INPUTS, OUTPUTS, export_accept_graph
from trtllm_dflash.config import load_build_config
from trtllm_dflash.engine.builder import build_engine
from trtllm_dflash.runtime.decoding import Decoder, Request
from trtllm_dflash.runtime.runner import Engine
from trtllm_dflash.runtime.stop_strings import decode, find_stop, output_text
from trtllm_dflash.serve.scheduler import Event, ServingLoop
from trtllm_dflash.speculative.core import (
    Sampling, acceptance_inputs, block_positions, request_seed, sample_tokens, truncate_logits, verify_block,
)

MAX_TOKENS = 40
SEED = 5
SAMPLED = {"id": "warm", "temperature": 0.9, "top_k": 20, "top_p": 0.8}  # prompt p0, `run --seed SEED`


# --- top-k / top-p ----------------------------------------------------------------------------------------

def _sampling(temperature: float, top_k: int, top_p: float) -> Sampling:
    return Sampling(torch.tensor([temperature]), torch.tensor([top_k]), torch.tensor([top_p]), [0])


@pytest.mark.parametrize("temperature, top_k, top_p, kept", [
    (1.0, 0, 1.0, [0, 1, 2, 3, 4]),  # no truncation
    (1.0, 2, 1.0, [0, 1]),
    (1.0, 0, 0.75, [0, 1]),  # 0.5 + 0.3 reaches 0.75
    (1.0, 0, 0.82, [0, 1, 2]),  # 0.5 + 0.3 does not reach 0.82
    (1.0, 3, 0.82, [0, 1]),  # ... but renormalised to the top 3 it does: (0.5 + 0.3) / 0.95 = 0.84
    (1.0, 0, 0.45, [0]),
    (4.0, 0, 0.45, [0, 1]),  # top-p applies to softmax(logits / T), flatter at T = 4: 0.28, 0.25, 0.21, ...
    (0.0, 1, 0.1, [0, 1, 2, 3, 4]),  # greedy rows are not truncated (their argmax is kept anyway)
], ids=["none", "top_k", "top_p", "top_p wider", "top_k then top_p", "top_p one", "temperature", "greedy"])
def test_truncate_logits_keeps_the_top_k_then_top_p_set(temperature, top_k, top_p, kept):
    probs = torch.tensor([0.5, 0.3, 0.15, 0.04, 0.01])
    order = torch.tensor([2, 0, 4, 1, 3])  # the vocabulary order is not the probability order
    logits = torch.empty(5)
    logits[order] = probs.log()
    out = truncate_logits(logits[None, None], _sampling(temperature, top_k, top_p))[0, 0]
    assert torch.isfinite(out).nonzero().flatten().tolist() == sorted(order[kept].tolist())
    assert torch.equal(out[order[kept]], logits[order[kept]])  # kept logits are untouched


def test_truncate_logits_keeps_ties_with_the_kth_token():
    logits = torch.tensor([[[3.0, 1.0, 2.0, 2.0, 0.0]]])
    out = truncate_logits(logits, _sampling(1.0, 2, 1.0))
    assert torch.isfinite(out[0, 0]).tolist() == [True, False, True, True, False]


def test_the_onnx_acceptance_graph_samples_from_the_truncated_logits(tmp_path):
    """accept.onnx (onnxruntime and TensorRT executors) scores argmax(logits / T + noise): given the truncated
    logits (acceptance_inputs), it accepts and picks the bonus token exactly as verify_block does."""
    ort = pytest.importorskip("onnxruntime")
    session = ort.InferenceSession(str(export_accept_graph(tmp_path / "accept.onnx", 3)),
                                   providers=["CPUExecutionProvider"])
    g = torch.Generator().manual_seed(0)
    B, K, V = 24, 5, 60
    logits = torch.randn(B, K + 1, V, generator=g) * 3
    sampling = Sampling(torch.tensor([0.0, 0.7, 1.0, 1.6] * 6), torch.tensor([0, 0, 3, 10, 1, 25] * 4),
                        torch.tensor([1.0, 0.5, 0.9, 1.0, 0.3, 0.95] * 4), list(range(B)))
    starts = torch.randint(0, 100, (B,), generator=g)
    positions = block_positions(starts, K + 1)
    target = sample_tokens(logits, sampling, positions)
    assert not torch.equal(target, sample_tokens(logits, Sampling.plain(sampling.temperature, sampling.seeds),
                                                 positions))  # the truncation changes tokens
    draft = target[:, :-1].clone()
    for b, keep in enumerate(torch.randint(0, K + 1, (B,), generator=g).tolist()):
        draft[b, keep:] = (draft[b, keep:] + 1) % V
    truncated, noise = acceptance_inputs(logits, sampling, positions)
    inputs = dict(zip(INPUTS, (draft, truncated, sampling.temperature, noise, starts)))
    got = dict(zip(OUTPUTS, session.run(list(OUTPUTS), {k: v.numpy() for k, v in inputs.items()})))
    accepted, bonus = verify_block(draft, logits, sampling, starts)
    assert torch.equal(torch.from_numpy(got["accepted"]), accepted)
    assert torch.equal(torch.from_numpy(got["next_block"][:, 0]), bonus)
    assert len(set(accepted.tolist())) > 3


def _requests(n: int, max_new: int, configs: list[tuple[int, float]]) -> list[Request]:
    return [Request(id=i, prompt_token_ids=PROMPT, max_new_tokens=max_new, temperature=1.0,
                    seed=request_seed(0, str(i)), top_k=configs[i % len(configs)][0],
                    top_p=configs[i % len(configs)][1]) for i in range(n)]


@pytest.mark.slow
def test_dflash_and_ar_sample_identical_tokens_with_top_k_and_top_p(wide_engine):
    reqs = _requests(64, 20, [(5, 1.0), (0, 0.7), (10, 0.8)])
    dflash = {r.request.id: r for r in Decoder.for_mode(wide_engine.executor, "dflash", ()).generate(reqs)}
    ar = {r.request.id: r for r in Decoder.for_mode(wide_engine.executor, "ar", ()).generate(reqs)}
    assert all(dflash[i].output_token_ids == ar[i].output_token_ids for i in range(len(reqs)))
    assert len({tuple(r.output_token_ids) for r in dflash.values()}) > 32  # really sampled
    assert sum(n > 1 for r in dflash.values() for n in r.acceptance_lengths) > 0  # drafts were accepted


def _truncated_probs(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """HF transformers' top-k then top-p warpers (temperature 1), as probabilities."""
    scores = TopKLogitsWarper(top_k)(None, logits[None])
    return TopPLogitsWarper(top_p)(None, scores)[0].softmax(-1)


def _chi_square_pvalue(observed: list[int], probs: torch.Tensor) -> float:
    """Chi-square over the tokens of non-zero probability (rare ones pooled into one bin)."""
    counts = torch.bincount(torch.tensor(observed), minlength=probs.numel()).double()
    expected = probs.double() * len(observed)
    support, big = probs > 0, expected >= 5
    obs, exp = [counts[big]], [expected[big]]
    if (support & ~big).any():
        obs.append(counts[support & ~big].sum()[None])
        exp.append(expected[support & ~big].sum()[None])
    obs, exp = torch.cat(obs), torch.cat(exp)
    return float(chisquare(obs.numpy(), exp.numpy() * obs.sum().item() / exp.sum().item()).pvalue)


@pytest.mark.slow
def test_dflash_samples_follow_the_truncated_target_distribution(wide_engine, peaky_pair):
    """Positions 0, 1, 2 (the later ones partly reached through accepted drafts): every sample lies in HF's
    truncated set and the counts fit its renormalised probabilities; untruncated samples leave the set."""
    top_k, top_p, n = 12, 0.88, 1200
    hf = AutoModelForCausalLM.from_pretrained(str(peaky_pair / "target"), dtype=torch.float32).eval()
    results = Decoder.for_mode(wide_engine.executor, "dflash", ()).generate(_requests(n, 3, [(top_k, top_p)]))
    outs = [r.output_token_ids for r in results]
    prefix: list[int] = []
    for position in range(3):
        group = [o[position] for o in outs if o[:position] == prefix]
        with torch.no_grad():
            logits = hf(torch.tensor([PROMPT + prefix])).logits[0, -1]
        probs = _truncated_probs(logits, top_k, top_p)
        kept = set(probs.nonzero().flatten().tolist())
        assert 1 < len(kept) < top_k or position > 0, kept  # both limits bind at position 0
        assert len(group) >= 200 and len(kept) > 1, (position, len(group), kept)
        assert set(group) <= kept, (position, set(group) - kept)
        assert _chi_square_pvalue(group, probs) > ALPHA, f"position {position} after {prefix}"
        prefix = prefix + [max(set(group), key=group.count)]

    plain = [r.output_token_ids[0] for r in Decoder.for_mode(wide_engine.executor, "dflash", ()).generate(
        _requests(500, 1, [(0, 1.0)]))]
    with torch.no_grad():
        kept = set(_truncated_probs(hf(torch.tensor([PROMPT])).logits[0, -1], top_k, top_p).nonzero().flatten().tolist())
    assert not set(plain) <= kept  # the check has power: the untruncated sampler leaves the set


# --- the demo engine: stop strings, run == serve ---------------------------------------------------------------

@pytest.fixture(scope="module")
def engine_dir(tmp_path_factory):
    cfg = load_build_config(ROOT / "build_configs" / "demo.yaml", output=tmp_path_factory.mktemp("demo") / "engine")
    return build_engine(cfg.model_copy(update={"backend": "torch"}), progress=False)


@pytest.fixture(scope="module")
def demo(engine_dir) -> Engine:
    return Engine.load(engine_dir)


def _prompts() -> list[str]:
    return [json.loads(line)["prompt"] for line in HELD_OUT.read_text().splitlines()[:4]]


def _run(engine_dir, tmp_path, lines: list[dict], *args: str) -> dict:
    (tmp_path / "in.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    assert main(["run", str(engine_dir), "--input", str(tmp_path / "in.jsonl"), "--output",
                 str(tmp_path / "out.jsonl"), "--max-new-tokens", str(MAX_TOKENS), *args]) == 0
    return {r["id"]: r for r in map(json.loads, (tmp_path / "out.jsonl").read_text().splitlines())}


def _stop_inside_a_block(tokenizer, record: dict) -> tuple[str, int, str] | None:
    """(stop string, tokens up to the one that completes it, text before it): a stop string that spans two tokens
    and is completed by a token in the middle of a verify step that committed >= 3 tokens, or None."""
    ids = record["output_token_ids"]
    step_ends, end = [], 1  # the prefill commits token 0; each verify step commits acceptance_length tokens
    for n in record["acceptance_lengths"]:
        step_ends.append((end, end + n))
        end += n
    full = decode(tokenizer, ids)
    for start, stop_end in step_ends:
        for j in range(start, stop_end - 1) if stop_end - start >= 3 else ():
            before, through = decode(tokenizer, ids[:j]), decode(tokenizer, ids[: j + 1])
            if not before or len(through) <= len(before) or not through.startswith(before):
                continue
            stop = before[-1] + through[len(before):]  # the last character of token j - 1, then token j's text
            if "\ufffd" not in stop and find_stop(full, [stop]) == (len(before) - 1, stop):
                return stop, j + 1, full[: len(before) - 1]
    return None


@pytest.fixture(scope="module")
def stop_cases(demo, engine_dir, tmp_path_factory) -> dict:
    """Per prompt of `run` (no stop strings): its record, and a stop string completed inside an accepted block."""
    lines = [{"id": f"p{i}", "prompt": p} for i, p in enumerate(_prompts())]
    records = _run(engine_dir, tmp_path_factory.mktemp("plain"), lines)
    cases = {}
    for line in lines:
        found = _stop_inside_a_block(demo.tokenizer, records[line["id"]])
        if found is not None:
            cases[line["id"]] = {"prompt": line["prompt"], "stop": found[0], "num_tokens": found[1],
                                 "text": found[2], "ids": records[line["id"]]["output_token_ids"]}
    assert len(cases) >= 2, "the demo's outputs should have stop strings inside accepted blocks"
    return cases


def test_stop_string_inside_a_block_ends_dflash_and_ar_at_the_same_token(demo, stop_cases):
    for rid, case in stop_cases.items():
        ids = demo.tokenizer(case["prompt"])["input_ids"]
        req = Request(rid, ids, MAX_TOKENS, stop=("never seen", case["stop"]))
        for mode in ("dflash", "ar"):
            (result,) = demo.decoder(mode).generate([req])
            assert result.output_token_ids == case["ids"][: case["num_tokens"]], (rid, mode)
            assert (result.finish_reason, result.stop_reason) == ("stop", case["stop"])
            assert output_text(demo.tokenizer, result.output_token_ids, req.stop) == case["text"]


def test_run_ends_the_text_before_the_stop_string(engine_dir, stop_cases, tmp_path):
    lines = [{"id": rid, "prompt": c["prompt"], "stop": [c["stop"], "never seen"]} for rid, c in stop_cases.items()]
    for mode in ("dflash", "ar"):
        records = _run(engine_dir, tmp_path, lines, "--mode", mode)
        for rid, case in stop_cases.items():
            r = records[rid]
            assert (r["text"], r["finish_reason"], r["stop_reason"]) == (case["text"], "stop", case["stop"])
            assert r["output_token_ids"] == case["ids"][: case["num_tokens"]]
            assert r["stop"] == [case["stop"], "never seen"]


BAD_LINES = [
    ({"top_k": -1}, "'top_k' must be an integer from 0 to 2147483647 (0: no limit), got -1"),
    ({"top_k": 2.5}, "'top_k' must be an integer from 0 to 2147483647"),
    ({"top_p": 0}, "'top_p' must be a number in (0, 1] (1: no limit), got 0"),
    ({"top_p": 1.5}, "'top_p' must be a number in (0, 1]"),
    ({"stop": "\n"}, "'stop' must be a list of strings, got '\\n'"),
    ({"stop": ["a", 3]}, "'stop' must be a list of strings"),
    ({"stop": [""]}, "'stop' has an empty string"),
]


def test_bad_sampling_fields_are_reported_with_their_line(engine_dir, tmp_path, capsys):
    lines = [{"id": f"bad{i}", "prompt": "def f():", **fields} for i, (fields, _) in enumerate(BAD_LINES)]
    lines.append({"id": "good", "prompt": "def f():", "top_k": 3, "top_p": 0.5, "stop": ["\n"], "temperature": 1})
    (tmp_path / "in.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    code = main(["run", str(engine_dir), "--input", str(tmp_path / "in.jsonl"), "--output", str(tmp_path / "o.jsonl"),
                 "--max-new-tokens", "8"])
    err = capsys.readouterr().err
    assert code == 1
    for number, (_, message) in enumerate(BAD_LINES, start=1):
        assert f"{tmp_path / 'in.jsonl'}:{number}: {message}" in err, (number, err)
    (good,) = map(json.loads, (tmp_path / "o.jsonl").read_text().splitlines())
    assert (good["top_k"], good["top_p"], good["stop"]) == (3, 0.5, ["\n"])


def test_resume_refuses_results_made_with_another_top_p(engine_dir, tmp_path, capsys):
    line = {"id": "a", "prompt": "def f():", "temperature": 1.0, "top_p": 0.9}
    _run(engine_dir, tmp_path, [line])
    (tmp_path / "in.jsonl").write_text(json.dumps({**line, "top_p": 0.5}) + "\n")
    code = main(["run", str(engine_dir), "--input", str(tmp_path / "in.jsonl"), "--output", str(tmp_path / "out.jsonl"),
                 "--max-new-tokens", str(MAX_TOKENS), "--resume"])
    assert code == EXIT_USER_ERROR
    assert "written with another top_p (0.9, this run: 0.5)" in capsys.readouterr().err


# --- cancellation in the serving loop (no Triton) -------------------------------------------------------------

def test_a_cancelled_request_stops_at_the_next_step_and_its_slot_serves_the_next(demo):
    """One slot: request A streams; on its 3rd event its client cancels. The step after that commits nothing for
    A (its last event says "cancelled"), and B, which was waiting, is decoded in that same step."""
    loop = ServingLoop(demo.decoder("dflash"), demo.tokenizer, max_batch_size=1)
    events: dict[str, list[Event]] = {"A": [], "B": []}
    cancelled, done = threading.Event(), threading.Semaphore(0)
    steps_at_cancel = []

    def on_event(name: str):
        def callback(event: Event) -> None:
            events[name].append(event)
            if name == "A" and len(events["A"]) == 3:
                cancelled.set()
                steps_at_cancel.append(loop.stats.steps)
            if event.last:
                done.release()
        return callback

    prompt = demo.tokenizer(_prompts()[0])["input_ids"]
    (alone,) = demo.decoder("dflash").generate([Request("B", prompt, MAX_TOKENS)])
    loop.start()
    loop.submit(Request("A", prompt, 1000), on_event("A"), True, cancelled.is_set)
    loop.submit(Request("B", prompt, MAX_TOKENS), on_event("B"), False)
    assert done.acquire(timeout=120) and done.acquire(timeout=120)
    loop.stop()
    a_last, b_last = events["A"][-1], events["B"][-1]
    assert a_last.result.finish_reason == "cancelled" and a_last.text == ""
    assert a_last.num_output_tokens == events["A"][-2].num_output_tokens  # nothing after the cancel
    assert b_last.result.output_token_ids == alone.output_token_ids
    # B's prefill and first step ran in the first step after the cancel: B took as many steps as it has verify
    # steps, and no step ran in between.
    assert loop.stats.steps == steps_at_cancel[0] + len(b_last.result.acceptance_lengths)
    assert loop.stats.cancelled == 1


class _Wire:
    """torch.distributed's broadcasts for a lockstep run in one process: rank 0's run records what it sends, then
    a follower's run replays it."""

    def __init__(self):
        self.sent: list = []
        self.replaying = False

    def broadcast(self, tensor: torch.Tensor, src: int) -> None:
        if self.replaying:
            tensor.copy_(self.sent.pop(0))
        else:
            self.sent.append(tensor.clone())

    def broadcast_object_list(self, objects: list, src: int) -> None:
        if self.replaying:
            objects[:] = self.sent.pop(0)
        else:
            self.sent.append(list(objects))


def test_a_cancel_reaches_every_tensor_parallel_rank(demo, monkeypatch):
    """LockstepDriver sends cancellations with the next step: the follower drops the request at the same step,
    commits the same tokens and ends with every slot free, like rank 0."""
    import trtllm_dflash.runtime.lockstep as lockstep

    wire = _Wire()
    monkeypatch.setattr(lockstep.dist, "broadcast", wire.broadcast)
    monkeypatch.setattr(lockstep.dist, "broadcast_object_list", wire.broadcast_object_list)
    prompt = demo.tokenizer(_prompts()[0])["input_ids"]

    def recorded(decoder: Decoder) -> list:
        """Keep every Update the decoder's steps return."""
        updates, step = [], decoder.step

        def step_and_keep() -> list:
            new = step()
            updates.extend(new)
            return new
        decoder.step = step_and_keep
        return updates

    rank0 = demo.decoder("dflash")
    sent = recorded(rank0)
    driver = lockstep.LockstepDriver(rank0)
    driver.submit(Request("long", prompt, 500))
    driver.submit(Request("short", prompt, MAX_TOKENS))
    for step in range(1000):
        if step == 2:
            driver.cancel("long")
        driver.step()
        if not driver.has_work:
            break
    driver.close()

    wire.replaying = True
    follower = demo.decoder("dflash")
    followed = recorded(follower)
    lockstep.follow(follower)
    assert not wire.sent  # every message was consumed
    finish = {u.request.id: u.result.finish_reason for u in sent if u.result is not None}
    assert finish == {"long": "cancelled", "short": "length"}
    assert [(u.request.id, u.new_token_ids) for u in followed] == [(u.request.id, u.new_token_ids) for u in sent]
    slots = list(range(demo.executor.num_slots))
    assert [(d.num_active, sorted(d._free)) for d in (rank0, follower)] == [(0, slots), (0, slots)]


# --- the real tritonserver, one KV-cache slot ------------------------------------------------------------------

@pytest.fixture(scope="module")
def server(engine_dir, tmp_path_factory, request):
    cli = _triton_cli()
    started = Server(cli, engine_dir, tmp_path_factory.mktemp("one_slot"), "--max-batch-size", "1",
                     "--seed", str(SEED))
    try:
        request.getfixturevalue("served_expected")  # `run` in this process while the server loads
        started.wait_ready()
        yield started
    finally:
        code = started.stop()
    assert code == 0, started.log.read_text()[-3000:]


@pytest.fixture(scope="module")
def served_expected(engine_dir, stop_cases, tmp_path_factory) -> dict:
    """`run` records of the stop-string cases and of a top-k / top-p sampled request (prompt p0)."""
    lines = [{"id": rid, "prompt": c["prompt"], "stop": [c["stop"]]} for rid, c in stop_cases.items()]
    lines.append({**SAMPLED, "prompt": _prompts()[0]})
    records = _run(engine_dir, tmp_path_factory.mktemp("served"), lines, "--seed", str(SEED))
    return {x["id"]: {**records[x["id"]], "prompt": x["prompt"]} for x in lines}


def _feature_inputs(module, prompt: str, streaming: bool | None = None, stop: list[str] | None = None,
                    top_k: int | None = None, top_p: float | None = None, temperature: float | None = None,
                    max_tokens: int = MAX_TOKENS) -> list:
    out = _inputs(module, prompt, max_tokens=max_tokens, streaming=streaming, temperature=temperature)
    for name, dtype, values in (("sampling_param_stop", "BYTES", stop), ("sampling_param_top_k", "INT32", top_k),
                                ("sampling_param_top_p", "FP32", top_p)):
        if values is None:
            continue
        array = (np.array([s.encode() for s in values], dtype=object) if dtype == "BYTES" else
                 np.array([values], dtype=np.int32 if dtype == "INT32" else np.float32))
        tensor = module.InferInput(name, list(array.shape), dtype)
        tensor.set_data_from_numpy(array)
        out.append(tensor)
    return out


@pytest.mark.triton
def test_serve_ends_the_text_where_run_ends_it(server, served_expected, stop_cases):
    stream = Stream(server.grpc)
    try:
        for rid in stop_cases:
            rec = served_expected[rid]
            (result,) = stream.request(_feature_inputs(stream.module, rec["prompt"], stop=rec["stop"]))
            assert _text(result) == rec["text"] == stop_cases[rid]["text"]
            assert result.as_numpy("finish_reason")[0] == b"stop"
            assert result.as_numpy("stop_reason")[0].decode() == stop_cases[rid]["stop"]
            responses = stream.request(_feature_inputs(stream.module, rec["prompt"], streaming=True, stop=rec["stop"]))
            assert "".join(_text(r) for r in responses) == rec["text"]  # nothing of the stop string was streamed
            (body,) = _generate(server.http, {"text_input": rec["prompt"], "sampling_param_max_tokens": MAX_TOKENS,
                                              "sampling_param_stop": rec["stop"]})
            assert body["text_output"] == rec["text"] and body["stop_reason"] == stop_cases[rid]["stop"]
    finally:
        stream.close()


@pytest.mark.triton
def test_serve_samples_with_top_k_and_top_p_as_run_does(server, served_expected):
    rec = served_expected[SAMPLED["id"]]
    stream = Stream(server.grpc)
    try:
        (result,) = stream.request(_feature_inputs(stream.module, rec["prompt"], temperature=SAMPLED["temperature"],
                                                   top_k=SAMPLED["top_k"], top_p=SAMPLED["top_p"]),
                                   request_id=SAMPLED["id"])
    finally:
        stream.close()
    assert _text(result) == rec["text"]


@pytest.mark.triton
@pytest.mark.parametrize("inputs, words", [
    ({"top_k": -2}, "'sampling_param_top_k' must be an integer from 0 to 2147483647 (0: no limit), got -2"),
    ({"top_p": 0.0}, "'sampling_param_top_p' must be a number in (0, 1] (1: no limit), got 0.0"),
    ({"stop": [""]}, "'sampling_param_stop' has an empty string"),
], ids=["top_k", "top_p", "stop"])
def test_bad_sampling_inputs_get_an_error(server, served_expected, inputs, words):
    from tritonclient.utils import InferenceServerException

    stream = Stream(server.grpc)
    try:
        with pytest.raises(InferenceServerException) as exc:
            stream.request(_feature_inputs(stream.module, "def f():", **inputs))
        assert words in str(exc.value), str(exc.value)
    finally:
        stream.close()


def _wait_cancelled(server: Server, count: int) -> None:
    deadline = time.monotonic() + 30
    while server.metric("trtllm_dflash_requests_cancelled") < count:
        assert time.monotonic() < deadline, "the server did not count the cancellation"
        time.sleep(0.1)


@pytest.mark.triton
def test_a_cancelled_grpc_stream_frees_the_slot_for_the_next_request(server, served_expected):
    """The only slot decodes a 1500-token stream; a second request waits. Cancelling the stream
    (`stop_stream(cancel_requests=True)`) lets the waiting request run at once."""
    import tritonclient.grpc as grpcclient

    before = server.metric("trtllm_dflash_requests_cancelled")
    prompt = served_expected[SAMPLED["id"]]["prompt"]
    long_client = grpcclient.InferenceServerClient(f"127.0.0.1:{server.grpc}")
    long_responses: queue.Queue = queue.Queue()
    long_client.start_stream(callback=lambda result, error: long_responses.put((result, error)))
    long_client.async_stream_infer(MODEL, _feature_inputs(grpcclient, prompt, streaming=True, max_tokens=1500))
    result, error = long_responses.get(timeout=120)  # it is decoding
    assert error is None
    waiting = Stream(server.grpc)
    try:
        waiting.client.async_stream_infer(MODEL, _feature_inputs(grpcclient, prompt))
        time.sleep(1.0)
        assert waiting.responses.empty()  # no free slot
        long_client.stop_stream(cancel_requests=True)
        started = time.monotonic()
        result, error = waiting.responses.get(timeout=60)
        assert error is None and result.as_numpy("finish_reason") is not None
        assert time.monotonic() - started < 30
        _wait_cancelled(server, before + 1)
        received = []
        while not long_responses.empty():
            result, error = long_responses.get()
            if result is not None:
                received.append(int(result.as_numpy("num_output_tokens")[0]))
        assert received and max(received) < 1500  # it was cut short
    finally:
        waiting.close()
        long_client.close()


@pytest.mark.triton
def test_a_closed_http_stream_frees_the_slot_for_the_next_request(server, served_expected):
    before = server.metric("trtllm_dflash_requests_cancelled")
    prompt = served_expected[SAMPLED["id"]]["prompt"]
    conn = http.client.HTTPConnection("127.0.0.1", server.http, timeout=60)
    conn.request("POST", f"/v2/models/{MODEL}/generate_stream",
                 json.dumps({"text_input": prompt, "sampling_param_max_tokens": 1500, "streaming": True}),
                 {"Content-Type": "application/json"})
    response = conn.getresponse()
    assert response.status == 200 and response.fp.readline()  # the first event is on its way
    conn.sock.close()  # the client goes away mid-stream
    conn.close()
    started = time.monotonic()
    (body,) = _generate(server.http, {"text_input": prompt, "sampling_param_max_tokens": MAX_TOKENS})
    assert body["finish_reason"] in ("stop", "length") and time.monotonic() - started < 30
    _wait_cancelled(server, before + 1)
