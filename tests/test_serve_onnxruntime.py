"""`serve` with the onnxruntime executor: the real tritonserver serving the demo engine built with
`backend: onnxruntime` returns what `run` writes with that executor (and with the torch executor: the same
float32 tokens), streamed and not. The Triton environment needs the onnx extra (.ci/run installs it)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.test_serve import HELD_OUT, MAX_TOKENS, Server, _generate, _triton_cli
from trtllm_dflash.cli import main
from trtllm_dflash.serve.repository import SERVE_CONFIG

pytest.importorskip("onnxruntime")
NUM_PROMPTS = 4


@pytest.fixture(scope="module")
def ort_demo_engine(demo_ort_engine) -> Path:
    return demo_ort_engine  # tests/conftest.py


def run_records(engine: Path, tmp: Path, backend: str) -> dict[str, dict]:
    rows = [json.loads(line) for line in HELD_OUT.read_text().splitlines()[:NUM_PROMPTS]]
    (tmp / "in.jsonl").write_text("".join(json.dumps({"id": f"p{i}", "prompt": r["prompt"]}) + "\n"
                                          for i, r in enumerate(rows)))
    out = tmp / f"out_{backend}.jsonl"
    assert main(["run", str(engine), "--input", str(tmp / "in.jsonl"), "--output", str(out), "--backend", backend,
                 "--max-new-tokens", str(MAX_TOKENS)]) == 0
    records = {r["id"]: r for r in map(json.loads, out.read_text().splitlines())}
    return {rid: {**rec, "prompt": rows[int(rid[1:])]["prompt"]} for rid, rec in records.items()}


@pytest.mark.triton
def test_onnxruntime_engine_served_by_tritonserver_equals_run(ort_demo_engine, tmp_path):
    cli = _triton_cli()
    server = Server(cli, ort_demo_engine, tmp_path, "--backend", "onnxruntime")
    try:
        expected = run_records(ort_demo_engine, tmp_path, "onnxruntime")
        assert {r: x["text"] for r, x in run_records(ort_demo_engine, tmp_path, "torch").items()} == \
            {r: x["text"] for r, x in expected.items()}
        server.wait_ready()
        for rid, rec in expected.items():
            body = {"text_input": rec["prompt"], "sampling_param_max_tokens": MAX_TOKENS}
            (final,) = _generate(server.http, body)
            assert final["text_output"] == rec["text"], rid
            streamed = _generate(server.http, {**body, "streaming": True}, stream=True)
            assert len(streamed) > 2 and "".join(r["text_output"] for r in streamed) == rec["text"], rid
        (config,) = (tmp_path / "repo").glob(f"*/1/{SERVE_CONFIG}")
        assert json.loads(config.read_text())["backend"] == "onnxruntime"
    finally:
        assert server.stop() == 0
