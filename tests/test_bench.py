"""`trtllm-dflash bench`: a smoke run on a tiny engine (report structure and consistency, PNG) and the dataset loader.

No timed assertions: the smoke run only checks that the numbers agree with each other and with `run`.
"""

import json
import statistics

import pytest
import torch

from trtllm_dflash.bench.datasets import load_dataset, to_requests
from trtllm_dflash.bench.options import BenchOptions
from trtllm_dflash.bench.runner import bench
from trtllm_dflash.cli import EXIT_USER_ERROR, main
from trtllm_dflash.errors import UserError
from trtllm_dflash.runtime.runner import Engine

from .conftest import build

SPEED_BENCH = [
    {"question_id": "q-code", "category": "coding", "sub_category": "python", "source": "x", "difficulty": "easy",
     "multiturn": True, "turns": ["Write a function that reverses a string.", "Now make it faster."]},
    {"question_id": "q-math", "category": "math", "turns": ["What is 12 times 7?"]},
]
PERCENTILE_KEYS = ["minimum", "p50", "p90", "p95", "p99", "maximum"]


def write_jsonl(path, records):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))
    return path


@pytest.fixture(scope="module")
def bench_engine(biased_pairs, tmp_path_factory):
    """A biased random pair (block 8): its drafts are accepted in varied numbers, so acceptance is non-trivial."""
    return build(biased_pairs[8], tmp_path_factory.mktemp("bench") / "engine", max_batch_size=4)


def assert_ordered(block):
    values = [block[k] for k in PERCENTILE_KEYS]
    assert values == sorted(values) and block["minimum"] <= block["average"] <= block["maximum"]


@pytest.mark.slow
def test_bench_smoke(bench_engine, tmp_path, capsys):
    dataset = write_jsonl(tmp_path / "speed.jsonl", SPEED_BENCH)
    report_path, png = tmp_path / "report.json", tmp_path / "plot.png"
    code = main(["bench", str(bench_engine), "--dataset", str(dataset), "--concurrency", "1,2",
                 "--max-new-tokens", "24", "--warmup", "1", "--repeats", "2", "--report-json", str(report_path),
                 "--plot", str(png)])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert "Total Output Throughput (tokens/sec)" in out and "Per User Output Speed (tps/user)" in out
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    report = json.loads(report_path.read_text())
    assert report["dataset_format"] == "speed-bench" and report["num_requests"] == 2
    assert {"cpu", "cpu_cores", "torch_threads"} <= set(report["machine"])
    assert report["backend"] == "torch"  # the executor that ran, named in the report
    points = {(p["mode"], p["concurrency"]): p for p in report["points"]}
    assert set(points) == {("ar", 1), ("ar", 2), ("dflash", 1), ("dflash", 2)}
    for p in points.values():
        perf, stream = p["performance"], p["streaming_metrics"]
        wall_s = perf["total_latency_ms"] / 1e3
        median = statistics.median(perf["total_latency_ms_per_repeat"])
        assert perf["total_latency_ms"] == pytest.approx(median, abs=1e-3)
        assert perf["system_output_throughput_tok_s"] == pytest.approx(perf["num_output_tokens"] / wall_s, rel=1e-3)
        assert perf["request_throughput_req_s"] == pytest.approx(2 / wall_s, rel=1e-3)
        assert p["request_info"]["avg_output_length"] * 2 == perf["num_output_tokens"]
        for block in (perf["request_latency_percentiles_ms"], stream["ttft_percentiles"], stream["tpot_percentiles"]):
            assert_ordered(block)
        assert stream["ttft_percentiles"]["maximum"] <= perf["request_latency_percentiles_ms"]["maximum"]
        assert sum(c["num_requests"] for c in p["per_category"].values()) == 2
        assert set(p["per_category"]) == {"coding", "math"}

    for c in (1, 2):
        p = points["dflash", c]
        dec = p["decoding_stats"]
        al, rates = dec["acceptance_length"], dec["acceptance_rate_per_position"]
        assert p["block_size"] == 8 and len(rates) == 7 and 1 <= al <= 8
        assert all(1 >= a >= b >= 0 for a, b in zip(rates, rates[1:]))  # non-increasing in the position
        assert al == pytest.approx(1 + sum(rates), abs=1e-3)  # E[accepted] = sum_k P(k-th draft accepted)
        assert dec["draft_acceptance_rate"] == pytest.approx((al - 1) / 7, abs=1e-3)
        steps = dec["num_draft_tokens_percentiles"]["average"] / 7  # verify steps per request
        assert al == pytest.approx(1 + dec["num_accepted_draft_tokens_percentiles"]["average"] / steps, abs=1e-3)
        assert_ordered(dec["acceptance_length_percentiles"])
        assert p["outputs_identical_to_ar"] is True
        # The speedup divides by the AR runs of the same phase, not by the AR point (all phases' median).
        assert p["speedup_vs_ar"] == pytest.approx(
            p["performance"]["system_output_throughput_tok_s"] / p["ar_same_phase_tok_s"], abs=1e-3)
        assert p["performance"]["num_output_tokens"] == points["ar", c]["performance"]["num_output_tokens"]

    dflash_1 = points["dflash", 1]["decoding_stats"]
    (bound,) = report["speedup_bound"]
    costs = bound["step_costs_ms"]
    assert bound["block_size"] == 8 and bound["acceptance_length"] == dflash_1["acceptance_length"]
    assert all(t > 0 for t in costs.values())
    expected = bound["acceptance_length"] * costs["ar"] / (costs["verify"] + costs["draft"])
    assert bound["speedup_bound"] == pytest.approx(expected, rel=2e-2)

    # The same requests through `run`: the same tokens and acceptance lengths.
    messages = write_jsonl(tmp_path / "run.jsonl", [
        {"id": r["question_id"], "messages": [{"role": "user", "content": r["turns"][0]}]} for r in SPEED_BENCH])
    summary = tmp_path / "summary.json"
    assert main(["run", str(bench_engine), "--input", str(messages), "--output", str(tmp_path / "out.jsonl"),
                 "--summary", str(summary), "--max-new-tokens", "24"]) == 0
    run_summary = json.loads(summary.read_text())
    assert run_summary["num_output_tokens"] == points["dflash", 1]["performance"]["num_output_tokens"]
    assert run_summary["mean_acceptance_length"] == pytest.approx(dflash_1["acceptance_length"])
    assert run_summary["acceptance_rate_per_position"] == dflash_1["acceptance_rate_per_position"]


def test_ar_runs_beside_every_block_size(bench_engine, tmp_path):
    """Each block size is a phase of its own; AR runs in every phase, and a DFlash point's speedup divides by the
    AR runs of its phase, so a machine that drifts between phases does not enter the ratio."""
    dataset = write_jsonl(tmp_path / "p.jsonl", [{"id": "a", "prompt": "def f():"}, {"id": "b", "prompt": "x = 1"}])
    opts = BenchOptions((1,), ("ar", "dflash"), (4, 8), num_requests=2, max_new_tokens=8, warmup=0, repeats=2)
    report = bench(bench_engine, dataset, opts)
    ar = [p for p in report["points"] if p["mode"] == "ar"]
    dflash = {p["block_size"]: p for p in report["points"] if p["mode"] == "dflash"}
    assert len(ar) == 1 and set(dflash) == {4, 8}
    assert len(ar[0]["performance"]["total_latency_ms_per_repeat"]) == 4  # 2 phases x 2 repeats
    for p in dflash.values():
        assert p["outputs_identical_to_ar"] is True
        assert p["speedup_vs_ar"] == pytest.approx(
            p["performance"]["system_output_throughput_tok_s"] / p["ar_same_phase_tok_s"], abs=1e-3)
    assert [b["measured_speedup"] for b in report["speedup_bound"]] == [dflash[4]["speedup_vs_ar"],
                                                                       dflash[8]["speedup_vs_ar"]]
    for b in report["speedup_bound"]:
        p = dflash[b["block_size"]]
        assert b["measured_tpot_speedup"] == p["tpot_speedup_vs_ar"] > 0


def test_trees_are_points_of_their_own(bench_engine, tmp_path, capsys):
    """--block-sizes 8,tree12: a DDTree of 12 nodes is a point beside the chain, with the same tokens as AR; a tree
    of the block's size or more with auto, or of 0 nodes, is refused in one sentence."""
    dataset = write_jsonl(tmp_path / "p.jsonl", [{"id": "a", "prompt": "def f():"}, {"id": "b", "prompt": "x = 1"}])
    opts = BenchOptions((1, 2), ("ar", "dflash"), (8, "tree12"), num_requests=2, max_new_tokens=12, warmup=0,
                        repeats=1)
    report = bench(bench_engine, dataset, opts)
    dflash = {(p["block_size"], p["concurrency"]): p for p in report["points"] if p["mode"] == "dflash"}
    assert set(dflash) == {(8, 1), (8, 2), ("tree12", 1), ("tree12", 2)}
    assert all(p["outputs_identical_to_ar"] for p in dflash.values())
    assert [b["block_size"] for b in report["speedup_bound"]] == [8]  # (the bound models chains)
    assert main(["bench", str(bench_engine), "--dataset", str(dataset), "--block-sizes", "auto,tree8"]) == \
        EXIT_USER_ERROR
    err = capsys.readouterr().err
    assert ("a tree budget of 8 (--tree-budget, bench's treeN) with --block-size auto: auto prices trees of at most "
            "block_size - 1 = 7 nodes") in err and len(err.strip().splitlines()) == 1, err
    with pytest.raises(SystemExit):
        main(["bench", str(bench_engine), "--dataset", str(dataset), "--block-sizes", "tree0"])
    assert "argument --block-sizes: a tree has 1 to 1024 nodes, got 'tree0'" in capsys.readouterr().err


def test_bench_refuses_more_concurrency_than_slots(bench_engine, tmp_path, capsys):
    dataset = write_jsonl(tmp_path / "p.jsonl", [{"prompt": f"def f{i}():"} for i in range(8)])
    code = main(["bench", str(bench_engine), "--dataset", str(dataset), "--concurrency", "1,8"])
    err = capsys.readouterr().err
    assert code == EXIT_USER_ERROR
    assert "--concurrency 8: exceeds the engine's max_batch_size 4" in err and len(err.strip().splitlines()) == 1


@pytest.mark.parametrize("args, words", [
    (["--num-requests", "5"], "--num-requests 5: "),
    (["--block-sizes", "4,9"], "--block-sizes 9: must be between 2 and the engine's trained block_size 8"),
    (["--block-sizes", "auto,9"], "--block-sizes 9: must be between 2 and the engine's trained block_size 8"),
    (["--max-new-tokens", "600"], "exceeds the engine's max_seq_len 512"),
    (["--concurrency", "4"], "--concurrency 4: more than the 2 requests"),
], ids=["too-many-requests", "block-too-large", "block-too-large-beside-auto", "too-long", "concurrency-over-requests"])
def test_bench_option_errors(bench_engine, tmp_path, capsys, monkeypatch, args, words):
    """One sentence, exit 2; a block size the engine cannot run is refused before `auto` measures the pass costs
    (nothing cached)."""
    monkeypatch.setenv("TRTLLM_DFLASH_CACHE_DIR", str(tmp_path / "cache"))
    dataset = write_jsonl(tmp_path / "p.jsonl", [{"id": "a", "prompt": "def f():"}, {"id": "b", "prompt": "x = 1"}])
    code = main(["bench", str(bench_engine), "--dataset", str(dataset), *args])
    err = capsys.readouterr().err
    assert code == EXIT_USER_ERROR and words in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "cache").exists()  # (auto's pass costs were never measured)


def test_loader_formats(tmp_path):
    speed = load_dataset(write_jsonl(tmp_path / "speed.jsonl", SPEED_BENCH))
    assert speed.format == "speed-bench"
    assert [(p.id, p.text, p.category) for p in speed.prompts] == [
        ("q-code", "Write a function that reverses a string.", "coding"), ("q-math", "What is 12 times 7?", "math")]
    held_out = load_dataset(write_jsonl(tmp_path / "ids.jsonl", [{"id": "a", "prompt": "def f():"}, "",
                                                                 {"id": 7, "prompt": "x"}]))
    assert held_out.format == "prompt" and [p.id for p in held_out.prompts] == ["a", 7]
    plain = load_dataset(write_jsonl(tmp_path / "plain.jsonl", [{"prompt": "a"}, {"prompt": "b", "category": "c"}]))
    assert [(p.id, p.category) for p in plain.prompts] == [(1, None), (2, "c")]  # ids: line numbers
    assert plain.categories == {2: "c"}


BAD_DATASETS = {
    "empty": ([], "the dataset has no records"),
    "not-json": ([{"prompt": "a"}, "{oops"], ":2: not valid JSON"),
    "not-object": (["[1, 2]"], ":1: a record must be a JSON object, got list"),
    "unknown-shape": ([{"text": "a"}], ":1: unrecognized record with keys ['text']"),
    "extra-key": ([{"prompt": "a", "max_new_tokens": 3}],
                  ":1: unrecognized record with keys ['max_new_tokens', 'prompt']"),
    "empty-turns": ([{"question_id": "q", "category": "c", "turns": []}], ":1: 'turns' must be a non-empty list"),
    "turn-not-str": ([{"question_id": "q", "category": "c", "turns": [3]}], ":1: 'turns' must be a non-empty list"),
    "no-category": ([{"question_id": "q", "turns": ["hi"]}], ":1: 'category' must be a non-empty string"),
    "mixed": ([SPEED_BENCH[0], {"prompt": "a"}], ":2: a prompt record in a file whose first record (line 1) is a "
                                                 "speed-bench record"),
    "empty-prompt": ([{"id": "a", "prompt": ""}], ":1: 'prompt' must be a non-empty string"),
    "bad-id": ([{"id": 1.5, "prompt": "a"}], ":1: the id must be a string or an integer, got 1.5"),
    "duplicate-id": ([{"id": "a", "prompt": "x"}, {"id": "a", "prompt": "y"}], ":2: duplicate id 'a'"),
}


@pytest.mark.parametrize("name", BAD_DATASETS)
def test_loader_rejects_bad_datasets(tmp_path, name):
    records, words = BAD_DATASETS[name]
    path = write_jsonl(tmp_path / "bad.jsonl", records)
    with pytest.raises(UserError) as exc:
        load_dataset(path)
    message = str(exc.value)
    assert message.startswith(str(path)) and words in message
    assert "\n" not in message and message.endswith(".")


def test_cli_reports_a_bad_dataset_in_one_line(qwen3_engine_dir, tmp_path, capsys):
    path = write_jsonl(tmp_path / "bad.jsonl", [{"prompt": "a"}, {"text": "b"}])
    assert main(["bench", str(qwen3_engine_dir), "--dataset", str(path)]) == EXIT_USER_ERROR
    err = capsys.readouterr().err.strip()
    assert err == (f"error: {path}:2: unrecognized record with keys ['text']; expected a SPEED-Bench record "
                   '({"question_id", "category", "turns": [str, ...]}), an {"id", "prompt"} record '
                   'or a {"prompt"} record.')
    assert main(["bench", str(qwen3_engine_dir), "--dataset", str(tmp_path / "missing.jsonl")]) == EXIT_USER_ERROR
    assert capsys.readouterr().err.strip() == f"error: {tmp_path / 'missing.jsonl'}: dataset file does not exist."


def test_one_loaded_engine_serves_every_block_size(bench_engine, tmp_path, monkeypatch):
    """bench loads the engine once for all its block sizes (each a decoder with its own verify policy), and a
    block size there drafts as `run --block-size` does (a shorter block of the drafter: the same acceptance)."""
    loads = []
    real_load = Engine.load.__func__

    def counting_load(cls, *args, **kwargs):
        loads.append(kwargs.get("block_size"))
        return real_load(cls, *args, **kwargs)

    monkeypatch.setattr(Engine, "load", classmethod(counting_load))
    dataset = write_jsonl(tmp_path / "p.jsonl", [{"id": "a", "prompt": "def f():"}, {"id": "b", "prompt": "x = 1"}])
    opts = BenchOptions((1,), ("ar", "dflash"), (4, "auto", 8), num_requests=2, max_new_tokens=12, warmup=0, repeats=1)
    report = bench(bench_engine, dataset, opts)
    assert loads == ["auto"]
    dflash = {p["block_size"]: p for p in report["points"] if p["mode"] == "dflash"}
    assert set(dflash) == {4, 8, "auto"} and all(p["outputs_identical_to_ar"] for p in dflash.values())
    monkeypatch.undo()
    engine = Engine.load(bench_engine, block_size=4)
    requests = to_requests(load_dataset(dataset), engine.tokenizer, 12, engine.config.max_seq_len, 2)
    steps = [n for r in engine.decoder("dflash").generate(requests) for n in r.acceptance_lengths]
    assert dflash[4]["decoding_stats"]["acceptance_length"] == round(sum(steps) / len(steps), 4)  # reported to 4 places
    # the drafter's block of 4 on the trained-width executor is the shorter block's executor's, not 4 of its 8
    full, one = Engine.load(bench_engine).executor, torch.tensor([0])
    anchors = torch.tensor([5, 9])
    short = engine.executor.draft(anchors, one.repeat(2), torch.tensor([0, 1]))
    assert torch.equal(full.draft(anchors, one.repeat(2), torch.tensor([0, 1]), width=4), short)


def test_system_prompt_and_multi_turn(bench_engine, tmp_path, capsys):
    """--system-prompt: every request begins with the same tokens (the chat's system message); --multi-turn: each
    conversation's second turn is sent after its first, carrying the engine's own answer, so its prompt begins with the
    first turn's prompt; on a paged cache the shared blocks are found (prefix hits) and the tokens are the same as
    without the cache; run's tokens for the first turn."""
    from trtllm_dflash.bench.datasets import Conversations, read_system_prompt
    from trtllm_dflash.bench.runner import closed_loop

    dataset_path = write_jsonl(tmp_path / "speed.jsonl", SPEED_BENCH)
    system_path = tmp_path / "system.txt"
    system_path.write_text("You are a careful assistant. " * 12)
    engine = Engine.load(bench_engine)
    system = read_system_prompt(system_path)
    dataset = load_dataset(dataset_path)
    reqs = to_requests(dataset, engine.tokenizer, 16, 512, system=system)
    plain = to_requests(dataset, engine.tokenizer, 16, 512)
    added = [len(r.prompt_token_ids) - len(p.prompt_token_ids) for r, p in zip(reqs, plain)]
    shared = added[0]
    assert added == [shared, shared] and shared > 48
    assert reqs[0].prompt_token_ids[:shared] == reqs[1].prompt_token_ids[:shared]

    conversations = Conversations(dataset, engine.tokenizer, 16, 512, system)
    run = closed_loop(engine.decoder("ar"), reqs, 2, conversations.follow_up)
    by_id = {r.request.id: r for r in run.results}
    assert sorted(by_id, key=str) == ["q-code", "q-code#2", "q-math"]  # q-math has one turn
    first, second = by_id["q-code"], by_id["q-code#2"]
    assert second.request.prompt_token_ids[:len(first.request.prompt_token_ids)] == first.request.prompt_token_ids
    answer = engine.tokenizer.decode(first.output_token_ids, skip_special_tokens=True)
    assert "Now make it faster." in engine.tokenizer.decode(second.request.prompt_token_ids) and answer.strip() in \
        engine.tokenizer.decode(second.request.prompt_token_ids)
    assert conversations.categories["q-code#2"] == "coding"

    report_path = tmp_path / "report.json"
    args = ["bench", str(bench_engine), "--dataset", str(dataset_path), "--concurrency", "2", "--modes", "ar,dflash",
            "--max-new-tokens", "16", "--warmup", "0", "--repeats", "1", "--system-prompt", str(system_path),
            "--multi-turn", "--report-json", str(report_path)]
    assert main(args + ["--kv-cache-memory", "8MiB"]) == 0, capsys.readouterr().err
    report = json.loads(report_path.read_text())
    assert report["workload"] == {"system_prompt": str(system_path), "system_prompt_tokens": shared,
                                  "multi_turn": True, "conversations_cut_per_run": 0}
    assert report["kv_cache"]["prefix_hit_rate"] > 0.3
    points = {p["mode"]: p for p in report["points"]}
    assert points["ar"]["request_info"]["num_requests"] == 3 and points["dflash"]["outputs_identical_to_ar"]
    assert set(points["ar"]["per_category"]) == {"coding", "math"}


@pytest.mark.parametrize("args, words", [
    (["--system-prompt", "{missing}"], "--system-prompt {missing}: No such file or directory."),
    (["--system-prompt", "{empty}"], "--system-prompt {empty}: the file is empty."),
    (["--system-prompt", "{binary}"], "--system-prompt {binary}: not UTF-8 text (byte 1)."),
    (["--multi-turn"], "--multi-turn: needs SPEED-Bench records (with 'turns'), and {dataset} has prompt records."),
], ids=["missing", "empty", "binary", "multi-turn-prompts"])
def test_workload_option_errors(bench_engine, tmp_path, capsys, args, words):
    files = {"missing": tmp_path / "nope.txt", "empty": tmp_path / "empty.txt", "binary": tmp_path / "bin.txt",
             "dataset": write_jsonl(tmp_path / "p.jsonl", [{"id": "a", "prompt": "def f():"}])}
    files["empty"].write_text("  \n")
    files["binary"].write_bytes(b"a\xff\xfe")
    args = [a.format(**files) for a in args]
    code = main(["bench", str(bench_engine), "--dataset", str(files["dataset"]), *args])
    err = capsys.readouterr().err
    assert code == EXIT_USER_ERROR and err.strip() == "error: " + words.format(**files), err
