"""`trtllm-dflash run`: output and summary contracts, bad input lines, bad engines."""

import json
import shutil

import pytest

from trtllm_dflash.checkpoint.tokenizer import load_tokenizer
from trtllm_dflash.cli import EXIT_BAD_LINES, EXIT_USER_ERROR, main

GOOD = [
    {"id": "plain", "prompt": "def fibonacci(n):"},
    {"id": 7, "messages": [{"role": "user", "content": "Write a sort function."}], "max_new_tokens": 4},
    {"id": "ids", "prompt_token_ids": [5, 6, 7, 8, 9], "temperature": 0.8},
]
BAD = [  # (line, words expected in its report)
    ("not json", ["not valid JSON"]),
    ('{"id": "e", "prompt": ""}', ["'prompt' must be a non-empty string"]),
    ('{"id": "n"}', ["needs exactly one of prompt, messages, prompt_token_ids"]),
    ('{"id": "two", "prompt": "a", "prompt_token_ids": [1]}', ["needs exactly one of"]),
    ('{"id": "k", "prompt": "a", "frequency_penalty": 0.9}', ["unknown key 'frequency_penalty'"]),
    ('{"id": "m", "prompt": "a", "max_new_tokens": 0}', ["'max_new_tokens' must be a positive integer, got 0"]),
    ('{"id": "t", "prompt": "a", "temperature": -1}', ["'temperature' must be a number from 0 to 1e+06, got -1"]),
    ('{"id": "nan", "prompt": "a", "temperature": NaN}', ["NaN is not a number (JSON has no NaN or Infinity)"]),
    ('{"id": "inf", "prompt": "a", "temperature": -Infinity}', ["-Infinity is not a number"]),
    ('{"id": "big", "prompt": "a", "temperature": 1e999}', ["the number 1e999 is too large"]),
    ('{"id": "huge", "prompt": "a", "temperature": ' + "9" * 400 + "}", ["'temperature' must be a number from 0"]),
    ('{"id": "many", "prompt": "a", "max_new_tokens": ' + "9" * 400 + "}", ["exceeds the engine's max_seq_len"]),
    (b'{"id": "latin1", "prompt": "caf\xe9"}', ["not valid UTF-8 (byte 0xe9 at byte offset"]),
    ('{"id": "v", "prompt_token_ids": [1, 99999]}', ["99999", "outside the vocabulary 0..511"]),
    ('{"id": "long", "prompt_token_ids": [5], "max_new_tokens": 600}', ["exceeds the engine's max_seq_len 512"]),
    ('{"id": "msg", "messages": [{"role": "user"}]}', ["'messages' must be a non-empty list"]),
    ('{"id": "plain", "prompt": "again"}', ["duplicate id 'plain'"]),
    ("[1, 2]", ["must be a JSON object"]),
]


@pytest.fixture
def engine_dir(qwen3_engine_dir, tmp_path):
    dst = tmp_path / "engine"
    shutil.copytree(qwen3_engine_dir, dst)
    return dst


def run(engine_dir, tmp_path, lines, *extra):
    inp, out, summary = tmp_path / "in.jsonl", tmp_path / "out.jsonl", tmp_path / "summary.json"
    inp.write_bytes(b"\n".join(x if isinstance(x, bytes) else x.encode() for x in lines) + b"\n")
    code = main(["run", str(engine_dir), "--input", str(inp), "--output", str(out), "--summary", str(summary),
                 "--max-new-tokens", "12", *extra])
    records = [json.loads(x) for x in out.read_text().splitlines()] if out.exists() else []
    return code, records, json.loads(summary.read_text()) if summary.exists() else None


@pytest.mark.parametrize("mode", ["dflash", "ar"])
def test_outputs_and_summary(engine_dir, tmp_path, capsys, mode):
    code, records, summary = run(engine_dir, tmp_path, [json.dumps(x) for x in GOOD], "--mode", mode)
    assert code == 0, capsys.readouterr().err
    by_id = {r["id"]: r for r in records}
    assert set(by_id) == {"plain", 7, "ids"}
    tok = load_tokenizer(engine_dir / "tokenizer")
    for r in records:
        assert set(r) == {"id", "mode", "max_new_tokens", "temperature", "seed", "top_k", "top_p", "stop", "text",
                          "output_token_ids", "finish_reason", "stop_reason", "num_prompt_tokens",
                          "num_output_tokens", "acceptance_lengths", "ttft_ms", "tpot_ms", "e2e_latency_ms"}
        assert 0 < r["ttft_ms"] <= r["e2e_latency_ms"]
        if r["num_output_tokens"] > 1:
            assert r["tpot_ms"] == pytest.approx((r["e2e_latency_ms"] - r["ttft_ms"]) / (r["num_output_tokens"] - 1),
                                                 rel=1e-3, abs=1e-3)
        assert r["num_output_tokens"] == len(r["output_token_ids"])
        assert r["text"] == tok.decode(r["output_token_ids"], skip_special_tokens=True)
        assert r["finish_reason"] in ("stop", "length")
        if mode == "dflash":
            assert len(r["acceptance_lengths"]) >= 1 and all(1 <= n <= 8 for n in r["acceptance_lengths"])
        else:
            assert r["acceptance_lengths"] == []
    assert by_id[7]["num_output_tokens"] <= 4  # per-line max_new_tokens
    chat = tok.apply_chat_template(GOOD[1]["messages"], add_generation_prompt=True, tokenize=True, return_dict=False)
    assert by_id[7]["num_prompt_tokens"] == len(chat)
    assert by_id["plain"]["num_prompt_tokens"] == len(tok("def fibonacci(n):")["input_ids"])
    assert set(summary) == {"mode", "num_requests", "num_output_tokens", "wall_time_s", "output_tokens_per_s",
                            "mean_acceptance_length", "acceptance_rate_per_position", "num_failed",
                            "ttft_ms", "tpot_ms", "request_latency_ms", "num_skipped_resumed", "num_preemptions"}
    for key in ("ttft_ms", "request_latency_ms"):
        block = summary[key]
        assert block["minimum"] <= block["p50"] <= block["p90"] <= block["p99"] <= block["maximum"]
        assert block["maximum"] == max(r[key if key == "ttft_ms" else "e2e_latency_ms"] for r in records)
    assert summary["mode"] == mode and summary["num_requests"] == 3 and summary["num_failed"] == 0
    assert summary["num_output_tokens"] == sum(r["num_output_tokens"] for r in records)
    steps = [n for r in records for n in r["acceptance_lengths"]]
    if mode == "dflash":
        assert summary["mean_acceptance_length"] == pytest.approx(sum(steps) / len(steps), abs=1e-4)
        assert len(summary["acceptance_rate_per_position"]) == 7  # block_size 8
    else:
        assert summary["mean_acceptance_length"] == 1.0 and summary["acceptance_rate_per_position"] == []


def test_bad_lines_are_reported_and_the_rest_still_runs(engine_dir, tmp_path, capsys):
    lines = [json.dumps(x) for x in GOOD] + [line for line, _ in BAD]
    code, records, summary = run(engine_dir, tmp_path, lines)
    err = capsys.readouterr().err
    assert code == EXIT_BAD_LINES
    assert {r["id"] for r in records} == {"plain", 7, "ids"}
    assert summary["num_failed"] == len(BAD)
    for offset, (_, words) in enumerate(BAD):
        lineno = len(GOOD) + offset + 1
        report = [x for x in err.splitlines() if x.startswith(f"{tmp_path / 'in.jsonl'}:{lineno}: ")]
        assert len(report) == 1, (lineno, err)
        for w in words:
            assert w in report[0], (w, report[0])


def test_an_input_of_only_bad_lines_leaves_earlier_results_alone(engine_dir, tmp_path, capsys):
    out, summary = tmp_path / "out.jsonl", tmp_path / "summary.json"
    out.write_text('{"id": "earlier", "text": "kept"}\n')
    code, records, written = run(engine_dir, tmp_path, [line for line, _ in BAD[:3]])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == EXIT_USER_ERROR
    assert [line.split(":")[1] for line in err[:3]] == ["1", "2", "3"] and len(err) == 4
    assert err[-1] == (f"error: {tmp_path / 'in.jsonl'}: none of its 3 lines is a valid request (reported above); "
                       f"{out} is left as it was.")
    assert records == [{"id": "earlier", "text": "kept"}] and written is None and not summary.exists()


def test_tampered_engine_is_refused(engine_dir, tmp_path, capsys):
    weights = engine_dir / "rank0.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0xFF
    weights.write_bytes(bytes(data))
    code, records, _ = run(engine_dir, tmp_path, [json.dumps(GOOD[0])])
    err = capsys.readouterr().err.strip()
    assert code == EXIT_USER_ERROR and records == []
    assert err == f"error: {weights}: engine file does not match manifest.json (modified or corrupted)."


def test_engine_problems(engine_dir, tmp_path, capsys):
    (engine_dir / "stray.bin").write_bytes(b"x")
    assert run(engine_dir, tmp_path, [json.dumps(GOOD[0])])[0] == EXIT_USER_ERROR
    assert "stray.bin: file is not listed in manifest.json" in capsys.readouterr().err
    (engine_dir / "stray.bin").unlink()
    (engine_dir / "manifest.json").unlink()
    assert run(engine_dir, tmp_path, [json.dumps(GOOD[0])])[0] == EXIT_USER_ERROR
    assert "not an engine directory (manifest.json is missing" in capsys.readouterr().err
    assert run(tmp_path / "nope", tmp_path, [json.dumps(GOOD[0])])[0] == EXIT_USER_ERROR
    assert "engine directory does not exist" in capsys.readouterr().err


def test_bad_flags_and_missing_input(engine_dir, tmp_path, capsys):
    with pytest.raises(SystemExit) as exc:
        main(["run", str(engine_dir), "--input", "x", "--output", "y", "--temperature", "-1"])
    assert exc.value.code == 2 and "must be a number from 0 to 1e+06, got -1" in capsys.readouterr().err
    code = main(["run", str(engine_dir), "--input", str(tmp_path / "missing.jsonl"), "--output", str(tmp_path / "o")])
    assert code == EXIT_USER_ERROR and "missing.jsonl: input file does not exist" in capsys.readouterr().err


def test_stop_token_ids(engine_dir, tmp_path, capsys):
    _, records, _ = run(engine_dir, tmp_path, [json.dumps(GOOD[0])])
    full = records[0]["output_token_ids"]
    stop = full[3]
    code, records, _ = run(engine_dir, tmp_path, [json.dumps(GOOD[0])], "--stop-token-ids", str(stop))
    assert code == 0
    assert records[0]["output_token_ids"] == full[: full.index(stop) + 1]
    assert records[0]["finish_reason"] == "stop"
    code, _, _ = run(engine_dir, tmp_path, [json.dumps(GOOD[0])], "--stop-token-ids", "99999")
    assert code == EXIT_USER_ERROR
    assert "--stop-token-ids: 99999 is outside the vocabulary 0..511." in capsys.readouterr().err


def test_inspect_summarises_and_verifies(engine_dir, capsys):
    assert main(["inspect", str(engine_dir)]) == 0
    out = capsys.readouterr().out
    assert "block_size 8" in out and "quantization none" in out and "integrity: all 6 files match manifest.json" in out
    tok = engine_dir / "tokenizer" / "tokenizer.json"
    tok.write_text(tok.read_text() + " ")
    assert main(["inspect", str(engine_dir)]) == EXIT_USER_ERROR
    assert f"{tok}: engine file does not match manifest.json" in capsys.readouterr().err


def test_block_size_flag(engine_dir, tmp_path, capsys):
    code, records, summary = run(engine_dir, tmp_path, [json.dumps(GOOD[0])], "--block-size", "4")
    assert code == 0 and len(summary["acceptance_rate_per_position"]) == 3
    assert all(n <= 4 for n in records[0]["acceptance_lengths"])
    code, _, _ = run(engine_dir, tmp_path, [json.dumps(GOOD[0])], "--block-size", "9")
    assert code == EXIT_USER_ERROR
    assert "--block-size 9: must be between 2 and the engine's trained block_size 8." in capsys.readouterr().err


def test_cuda_graphs_flag(engine_dir, gpt_oss_ort_engine, tmp_path, capsys):
    """--cuda-graphs where they cannot run is one sentence before anything is loaded or written; --no-cuda-graphs is
    the CPU's own default (same outputs)."""
    from trtllm_dflash.engine_dir import Mapping, read_engine_config
    from trtllm_dflash.errors import UserError
    from trtllm_dflash.runtime.runner import _check_cuda_graphs

    line = [json.dumps(GOOD[0])]
    cases = [((), "error: --cuda-graphs needs --device cuda (CUDA graphs are a GPU feature; on the CPU the passes run "
                  "eagerly)."),
             (("--backend", "onnxruntime"), "error: --cuda-graphs: the onnxruntime executor does not capture CUDA "
              "graphs; drop --cuda-graphs or use --backend torch or tensorrt.")]
    for extra, message in cases:
        code, records, summary = run(engine_dir, tmp_path, line, "--cuda-graphs", *extra)
        assert (code, records, summary) == (EXIT_USER_ERROR, [], None)
        assert capsys.readouterr().err.strip() == message
    # a target with experts is refused for the device alone (grouped experts: tests/test_grouped_experts.py)
    code, records, _ = run(gpt_oss_ort_engine, tmp_path, line, "--cuda-graphs", "--backend", "torch")
    assert (code, records) == (EXIT_USER_ERROR, [])
    assert capsys.readouterr().err.strip() == cases[0][1]
    # tensor parallelism (reached only under mpirun, after the rank checks): the torch executor's static passes, not
    # the tensorrt executor's plans
    tp2 = read_engine_config(engine_dir).model_copy(update={"mapping": Mapping(tp_size=2)})
    _check_cuda_graphs(tp2, "torch", "cuda:0")
    with pytest.raises(UserError, match="--cuda-graphs: the tensorrt executor does not capture its plans under tensor "
                                        "parallelism yet .* tp_size 2"):
        _check_cuda_graphs(tp2, "tensorrt", "cuda:0")
    # the tensorrt executor's plans (experts in their dense form: no data-dependent shapes) always run on a GPU
    _check_cuda_graphs(read_engine_config(gpt_oss_ort_engine), "tensorrt", "cpu")
    default = [r["output_token_ids"] for r in run(engine_dir, tmp_path, line)[1]]
    assert [r["output_token_ids"] for r in run(engine_dir, tmp_path, line, "--no-cuda-graphs")[1]] == default != []
