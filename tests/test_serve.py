"""`serve`: the model repository, the CLI's refusals, and the real tritonserver serving the demo engine.

Server tests start `trtllm-dflash serve --launch` from the Triton environment (`.venv-triton`, or
$TRTLLM_DFLASH_TRITON_VENV; nvidia-pytriton, which bundles tritonserver, needs numpy<2) with this
checkout on PYTHONPATH, and talk to it with tritonclient over HTTP and gRPC. Every text is compared
with what `trtllm-dflash run` writes for the same engine, prompts and options. Two servers run per
module: the default decoupled model (streaming; gRPC streams, HTTP generate endpoints) and a
`--no-streaming` model (Triton's plain infer over HTTP and gRPC).
"""

from __future__ import annotations

import json
import os
import queue
import shutil
import signal
import socket
import subprocess
import threading
import time
import urllib.error
import urllib.request
from contextlib import closing
from pathlib import Path

import numpy as np
import pytest

from trtllm_dflash.checkpoint.tokenizer import load_tokenizer
from trtllm_dflash.cli import EXIT_USER_ERROR, main
from trtllm_dflash.config import load_build_config
from trtllm_dflash.engine.builder import build_engine
from trtllm_dflash.engine_dir import CONFIG, TOKENIZER, write_manifest
from trtllm_dflash.runtime.decoding import Request
from trtllm_dflash.runtime.runner import Engine
from trtllm_dflash.runtime.textstream import TextStream
from trtllm_dflash.serve.repository import SERVE_CONFIG
from trtllm_dflash.serve.scheduler import Event, ServingLoop

ROOT = Path(__file__).resolve().parents[1]
HELD_OUT = ROOT / "benchmarks" / "prompts" / "heldout_code.jsonl"
TRITON_VENV = Path(os.environ.get("TRTLLM_DFLASH_TRITON_VENV", ROOT / ".venv-triton"))
MODEL = "trtllm_dflash"
MAX_TOKENS = 24
NUM_PROMPTS = 8
SAMPLED = {"id": "hot", "temperature": 0.8}  # with `run --seed SEED`, prompt 0
SEED = 3


# --- the repository and the CLI (no server) ---------------------------------------------------------

@pytest.fixture(scope="module")
def engine_dir(tmp_path_factory) -> Path:
    cfg = load_build_config(ROOT / "build_configs" / "demo.yaml", output=tmp_path_factory.mktemp("demo") / "engine")
    # the torch form; the demo's onnxruntime form is served in tests/test_serve_onnxruntime.py
    return build_engine(cfg.model_copy(update={"backend": "torch"}), progress=False)


def test_writes_a_triton_model_repository(engine_dir, tmp_path):
    repo = tmp_path / "repo"
    assert main(["serve", str(engine_dir), "--model-repo", str(repo), "--model-name", "code", "--mode", "ar",
                 "--block-size", "8", "--max-new-tokens", "64"]) == 0
    assert sorted(str(p.relative_to(repo)) for p in repo.rglob("*") if p.is_file()) == \
        [".trtllm-dflash", "code/1/model.py", f"code/1/{SERVE_CONFIG}", "code/config.pbtxt"]
    pbtxt = (repo / "code" / "config.pbtxt").read_text()
    for line in ('name: "code"', 'backend: "python"', "max_batch_size: 0", "decoupled: true", 'name: "text_input"',
                 'name: "sampling_param_max_tokens"', 'name: "acceptance_rate"', 'name: "batch_size_max"'):
        assert line in pbtxt, line
    cfg = json.loads((repo / "code" / "1" / SERVE_CONFIG).read_text())
    assert cfg["engine_dir"] == str(engine_dir) and cfg["mode"] == "ar" and cfg["block_size"] == 8
    assert cfg["max_new_tokens"] == 64
    assert "from trtllm_dflash.serve.triton_model import TritonPythonModel" in (repo / "code/1/model.py").read_text()

    # --force replaces the whole repository; --no-streaming writes a non-decoupled model.
    assert main(["serve", str(engine_dir), "--model-repo", str(repo), "--force", "--no-streaming"]) == 0
    assert sorted(p.name for p in repo.iterdir()) == [".trtllm-dflash", MODEL]
    assert "decoupled: false" in (repo / MODEL / "config.pbtxt").read_text()
    assert not list(tmp_path.glob(".repo*"))  # no temporary directories left behind


def _tp2_engine(engine_dir: Path, tmp_path: Path) -> Path:
    dst = tmp_path / "tp2"
    shutil.copytree(engine_dir, dst)
    cfg = json.loads((dst / CONFIG).read_text())
    cfg["mapping"] = {"world_size": 2, "tp_size": 2}
    (dst / CONFIG).write_text(json.dumps(cfg))
    write_manifest(dst)
    return dst


@pytest.mark.parametrize("case, words", [
    ("missing engine", ["engine directory does not exist"]),
    ("repo is a file", ["--model-repo", "is a file, not a directory"]),
    ("repo not empty", ["is not empty and was not written by trtllm-dflash"]),
    ("bad model name", ["--model-name", "letters, digits"]),
    ("tp engine", ["tp_size 2", "serve it with `mpirun -n 2 trtllm-dflash serve ... --launch`"]),
    ("block size", ["--block-size 17", "between 2 and the engine's trained block_size 16"]),
    ("max batch", ["--max-batch-size 9", "slots for 8 requests"]),
    ("max new tokens", ["--max-new-tokens 2048", "below the engine's max_seq_len 2048"]),
    ("kv cache memory", ["--kv-cache-memory lots: 'lots' is not a size"]),
    ("tree with ar", ["--tree-budget drafts a tree every step of --mode dflash (or, with --block-size auto, where it "
                      "pays); it does not take --mode ar"]),
    ("prefix states", ["--prefix-states 4: this engine's qwen3 target has no recurrent states to keep"]),
    ("tree on tensorrt", ["--tree-budget: the tensorrt executor does not verify draft trees yet"]),
    ("tree with auto", ["a tree budget of 16 (--tree-budget, bench's treeN) with --block-size auto: auto prices trees "
                        "of at most block_size - 1 = 15 nodes"]),
], ids=lambda x: x if isinstance(x, str) else "")
def test_bad_arguments_are_one_sentence_and_write_nothing(engine_dir, tmp_path, capsys, case, words):
    repo, engine, extra = tmp_path / "repo", str(engine_dir), []
    if case == "missing engine":
        engine = str(tmp_path / "nowhere")
    elif case == "repo is a file":
        repo.write_text("x")
    elif case == "repo not empty":
        repo.mkdir()
        (repo / "other").write_text("keep me")
    elif case == "bad model name":
        extra = ["--model-name", "../up"]
    elif case == "tp engine":
        engine = str(_tp2_engine(engine_dir, tmp_path))
    else:
        extra = {"block size": ["--block-size", "17"], "max batch": ["--max-batch-size", "9"],
                 "max new tokens": ["--max-new-tokens", "2048"],
                 "kv cache memory": ["--kv-cache-memory", "lots"],
                 "tree with ar": ["--tree-budget", "8", "--mode", "ar"],
                 "prefix states": ["--prefix-states", "4", "--kv-cache-memory", "64MiB"],
                 "tree on tensorrt": ["--tree-budget", "8", "--backend", "tensorrt"],
                 "tree with auto": ["--tree-budget", "16", "--block-size", "auto"]}[case]
    before = sorted(p.name for p in tmp_path.iterdir())
    assert main(["serve", engine, "--model-repo", str(repo), *extra]) == EXIT_USER_ERROR
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1, err
    for w in words:
        assert w in err, (w, err)
    assert sorted(p.name for p in tmp_path.iterdir()) == before
    if case == "repo not empty":
        assert (repo / "other").read_text() == "keep me"


@pytest.mark.parametrize("flag", ["--http-port", "--grpc-port", "--metrics-port"])
@pytest.mark.parametrize("value", ["0", "70000", "http"])
def test_bad_ports_are_refused(engine_dir, tmp_path, capsys, flag, value):
    with pytest.raises(SystemExit) as exc:
        main(["serve", str(engine_dir), "--model-repo", str(tmp_path / "repo"), "--launch", flag, value])
    assert exc.value.code == 2
    assert flag in capsys.readouterr().err
    assert not (tmp_path / "repo").exists()


def test_launch_without_tritonserver_names_what_to_install(engine_dir, tmp_path, capsys, monkeypatch):
    import importlib.util

    if importlib.util.find_spec("pytriton") is not None:
        pytest.skip("this environment has nvidia-pytriton (covered by the server tests)")
    monkeypatch.setenv("PATH", "/nonexistent")  # no tritonserver on PATH either
    assert main(["serve", str(engine_dir), "--model-repo", str(tmp_path / "repo"), "--launch"]) == EXIT_USER_ERROR
    err = capsys.readouterr().err
    assert "pip install nvidia-pytriton==0.7.0" in err and "nvcr.io/nvidia/tritonserver" in err
    assert not (tmp_path / "repo").exists()


def test_text_stream_holds_back_split_characters(engine_dir):
    tokenizer = load_tokenizer(engine_dir / TOKENIZER)
    text = "x = 'héllo 🙂'\n"
    ids = tokenizer(text)["input_ids"]
    stream, pieces = TextStream(tokenizer), []
    for tok in ids:
        pieces.append(stream.push([tok]))
        assert "\ufffd" not in pieces[-1]
    pieces.append(stream.finish())
    assert "".join(pieces) == tokenizer.decode(ids, skip_special_tokens=True) == text
    # The emoji's four bytes span several byte-level tokens: held back until whole.
    assert [p for p in pieces if "🙂" in p] == ["🙂"] and "" in pieces[:-1]


# --- the real tritonserver ---------------------------------------------------------------------------

def _triton_cli() -> Path:
    """The Triton environment's `trtllm-dflash`; skips (fails under CI) when the server tests cannot run."""
    import importlib.util

    cli = TRITON_VENV / "bin" / "trtllm-dflash"
    bundled = TRITON_VENV.glob("lib/python*/site-packages/pytriton/tritonserver/bin/tritonserver")
    if not (cli.is_file() and list(bundled)):
        reason = (f"no Triton environment at {TRITON_VENV} (nvidia-pytriton needs numpy<2, so it has its own venv: "
                  f"python3 -m venv .venv-triton && .venv-triton/bin/pip install -e '.[serve,mpi,onnx]')")
    elif importlib.util.find_spec("tritonclient") is None:
        reason = "tritonclient is not installed in the test environment (pip install -e '.[test]')"
    else:
        return cli
    if os.environ.get("CI"):
        pytest.fail(reason)  # .ci/run installs both: a missing one is a broken CI, not a skip
    pytest.skip(reason)


def _free_ports(n: int) -> list[int]:
    socks = [socket.create_server(("127.0.0.1", 0)) for _ in range(n)]
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


class Server:
    """`trtllm-dflash serve ENGINE --launch` in the Triton environment, on free local ports."""

    def __init__(self, cli: Path, engine_dir: Path, root: Path, *extra: str, launcher: tuple[str, ...] = ()):
        self.http, self.grpc, self.metrics = _free_ports(3)
        self.log = root / "server.log"
        env = dict(os.environ, PYTHONPATH=str(ROOT))  # this checkout, whatever .venv-triton was installed from
        cmd = [*launcher, str(cli), "serve", str(engine_dir), "--model-repo", str(root / "repo"), "--launch", *extra,
               "--http-port", str(self.http), "--grpc-port", str(self.grpc), "--metrics-port", str(self.metrics)]
        self.proc = subprocess.Popen(cmd, stdout=self.log.open("w"), stderr=subprocess.STDOUT, env=env,
                                     start_new_session=True)

    def wait_ready(self, timeout: float = 180) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                pytest.fail(f"tritonserver exited with {self.proc.returncode}:\n{self.log.read_text()[-3000:]}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.http}/v2/health/ready", timeout=2) as r:
                    if r.status == 200:
                        return
            except OSError:
                pass
            time.sleep(0.5)
        pytest.fail(f"tritonserver not ready after {timeout} s:\n{self.log.read_text()[-3000:]}")

    def stop(self) -> int | None:
        """SIGTERM to `serve`, which passes it on; tritonserver then shuts down gracefully."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        return self.proc.returncode

    def metric(self, name: str) -> float:
        text = urllib.request.urlopen(f"http://127.0.0.1:{self.metrics}/metrics", timeout=5).read().decode()
        return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(name + "{"))


@pytest.fixture(scope="module")
def servers(engine_dir, tmp_path_factory, request):
    """{"decoupled": Server, "plain": Server, "tree": Server} on the demo engine, started together."""
    cli = _triton_cli()
    started = {"decoupled": Server(cli, engine_dir, tmp_path_factory.mktemp("decoupled")),
               # the plain model on a paged KV cache (48 MiB: one max_seq_len request or many short ones)
               "plain": Server(cli, engine_dir, tmp_path_factory.mktemp("plain"), "--no-streaming",
                               "--kv-cache-memory", "48MiB"),
               # DDTree steps (serve --tree-budget)
               "tree": Server(cli, engine_dir, tmp_path_factory.mktemp("tree"), "--no-streaming", "--tree-budget",
                              "16")}
    try:
        request.getfixturevalue("expected")  # `run` in this process while the servers load
        for s in started.values():
            s.wait_ready()
        yield started
    finally:
        codes = {name: s.stop() for name, s in started.items()}
    assert codes == {"decoupled": 0, "plain": 0, "tree": 0}, codes  # a graceful shutdown


@pytest.fixture(scope="module")
def expected(engine_dir, tmp_path_factory) -> dict:
    """`trtllm-dflash run` records for the first prompts (greedy) and one sampled request, by id."""
    rows = [json.loads(line) for line in HELD_OUT.read_text().splitlines()[:NUM_PROMPTS]]
    lines = [{"id": f"p{i}", "prompt": r["prompt"]} for i, r in enumerate(rows)]
    lines.append({**SAMPLED, "prompt": rows[0]["prompt"]})
    tmp = tmp_path_factory.mktemp("run")
    (tmp / "in.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    assert main(["run", str(engine_dir), "--input", str(tmp / "in.jsonl"), "--output", str(tmp / "out.jsonl"),
                 "--max-new-tokens", str(MAX_TOKENS), "--seed", str(SEED)]) == 0
    records = {r["id"]: r for r in map(json.loads, (tmp / "out.jsonl").read_text().splitlines())}
    prompts = {x["id"]: x["prompt"] for x in lines}
    return {rid: {**r, "prompt": prompts[rid]} for rid, r in records.items()}


def _inputs(module, prompt: str | bytes | None, max_tokens: int | None = MAX_TOKENS, streaming: bool | None = None,
            temperature: float | None = None, seed: int | None = None, text_dtype: str = "BYTES") -> list:
    """tritonclient inputs; None leaves an input out."""
    values = [("text_input", text_dtype, prompt), ("sampling_param_max_tokens", "INT32", max_tokens),
              ("streaming", "BOOL", streaming), ("sampling_param_temperature", "FP32", temperature),
              ("sampling_param_seed", "UINT64", seed)]
    out = []
    for name, dtype, value in values:
        if value is None:
            continue
        if dtype == "BYTES":
            array = np.array([value.encode() if isinstance(value, str) else value], dtype=object)
        else:
            array = np.array([value], dtype=np.int32 if dtype == "INT32" else
                             {"BOOL": bool, "FP32": np.float32, "UINT64": np.uint64}[dtype])
        tensor = module.InferInput(name, [1], dtype)
        tensor.set_data_from_numpy(array)
        out.append(tensor)
    return out


class Stream:
    """One gRPC bidirectional stream to the decoupled model; `request` returns all responses of one request."""

    def __init__(self, port: int):
        import tritonclient.grpc as grpcclient

        self.module = grpcclient
        self.client = grpcclient.InferenceServerClient(f"127.0.0.1:{port}")
        self.responses: queue.Queue = queue.Queue()
        self.client.start_stream(callback=lambda result, error: self.responses.put((result, error)))

    def request(self, inputs: list, request_id: str = "") -> list:
        """Responses until the final one; raises the error of an error response."""
        self.client.async_stream_infer(MODEL, inputs, request_id=request_id)
        out = []
        while True:
            result, error = self.responses.get(timeout=120)
            if error is not None:
                raise error
            out.append(result)
            if result.get_response().parameters["triton_final_response"].bool_param:
                return out

    def close(self) -> None:
        self.client.stop_stream()
        self.client.close()


def _text(result) -> str:
    return result.as_numpy("text_output")[0].decode()


def _generate(port: int, body: dict, stream: bool = False) -> list[dict]:
    """HTTP generate / generate_stream (Server-Sent Events) of the decoupled model: the JSON responses."""
    url = f"http://127.0.0.1:{port}/v2/models/{MODEL}/generate{'_stream' if stream else ''}"
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        raw = r.read().decode()
    if not stream:
        return [json.loads(raw)]
    return [json.loads(line[len("data: "):]) for line in raw.splitlines() if line.startswith("data: ")]


def _check_final(outputs: dict, rec: dict, block_size: int = 16) -> None:
    """Final-response outputs (numpy or JSON values) against a `run` record."""
    steps = [int(x) for x in np.asarray(outputs["acceptance_lengths"]).reshape(-1)]
    assert steps == rec["acceptance_lengths"]
    assert int(np.asarray(outputs["num_output_tokens"]).reshape(-1)[0]) == rec["num_output_tokens"]
    finish = np.asarray(outputs["finish_reason"]).reshape(-1)[0]
    assert (finish.decode() if isinstance(finish, bytes) else finish) == rec["finish_reason"]
    accepted = sum(n - 1 for n in steps)
    assert int(np.asarray(outputs["total_accepted_draft_tokens"]).reshape(-1)[0]) == accepted
    assert int(np.asarray(outputs["total_draft_tokens"]).reshape(-1)[0]) == len(steps) * (block_size - 1)
    rate = float(np.asarray(outputs["acceptance_rate"]).reshape(-1)[0])
    assert rate == pytest.approx(accepted / (len(steps) * (block_size - 1)), rel=1e-6)
    assert float(np.asarray(outputs["mean_acceptance_length"]).reshape(-1)[0]) == \
        pytest.approx(sum(steps) / len(steps), rel=1e-6)


FINAL_OUTPUTS = ("acceptance_lengths", "num_output_tokens", "finish_reason", "total_accepted_draft_tokens",
                 "total_draft_tokens", "acceptance_rate", "mean_acceptance_length")


@pytest.mark.triton
def test_plain_infer_over_http_and_grpc_equals_run(servers, expected):
    import tritonclient.grpc as grpcclient
    import tritonclient.http as httpclient

    plain = servers["plain"]
    # this model runs on a paged KV cache (serve --kv-cache-memory): the same text as `run` on the static one
    assert json.loads((plain.log.parent / "repo" / MODEL / "1" / SERVE_CONFIG).read_text())["kv_cache_memory"] == "48MiB"
    with closing(httpclient.InferenceServerClient(f"127.0.0.1:{plain.http}")) as http, \
            closing(grpcclient.InferenceServerClient(f"127.0.0.1:{plain.grpc}")) as grpc:
        for rid, rec in expected.items():
            if rid == SAMPLED["id"]:
                continue
            for client, module in ((http, httpclient), (grpc, grpcclient)):
                result = client.infer(MODEL, _inputs(module, rec["prompt"]))
                assert _text(result) == rec["text"], (rid, module.__name__)
                _check_final({k: result.as_numpy(k) for k in FINAL_OUTPUTS}, rec)


@pytest.mark.mpi
@pytest.mark.triton
def test_tensor_parallel_engine_served_by_two_mpi_ranks(servers, expected, tmp_path_factory, monkeypatch):
    """`mpirun -n 2 trtllm-dflash serve ENGINE_TP2 --launch --block-size auto`: rank 0 serves, rank 1 follows, every
    step verifies the k rank 0 chooses (its pass costs measured at start-up, into a cache directory of the test's own);
    concurrent requests get `run`'s text (from the unsplit engine, fixed blocks); SIGTERM shuts every rank down
    cleanly."""
    import tritonclient.http as httpclient

    cli = _triton_cli()
    mpiexec = cli.parent / "mpiexec"
    if not mpiexec.is_file():
        pytest.fail(f"{mpiexec} is missing: install the Triton environment with '.[serve,mpi]'")
    root = tmp_path_factory.mktemp("tp2")
    cfg = load_build_config(ROOT / "build_configs" / "demo.yaml", output=root / "engine")
    engine = build_engine(cfg.model_copy(update={"tp_size": 2, "backend": "torch"}), progress=False)
    monkeypatch.setenv("TRTLLM_DFLASH_CACHE_DIR", str(root / "cache"))  # (Server passes this process's environment)
    server = Server(cli, engine, root, "--no-streaming", "--block-size", "auto", launcher=(str(mpiexec), "-n", "2"))
    try:
        server.wait_ready()
        texts = {}

        def ask(rid: str) -> None:
            with closing(httpclient.InferenceServerClient(f"127.0.0.1:{server.http}")) as client:
                texts[rid] = _text(client.infer(MODEL, _inputs(httpclient, expected[rid]["prompt"])))

        threads = [threading.Thread(target=ask, args=(rid,)) for rid in expected if rid != SAMPLED["id"]]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
        assert texts == {rid: rec["text"] for rid, rec in expected.items() if rid != SAMPLED["id"]}
    finally:
        code = server.stop()
    assert code == 0, server.log.read_text()[-3000:]
    assert list((root / "cache").rglob("*.json")), "no cost profile was measured"


@pytest.mark.triton
def test_sampling_matches_run_for_the_same_seed_and_id(servers, expected):
    import tritonclient.http as httpclient

    rec = expected[SAMPLED["id"]]
    assert rec["text"] != expected["p0"]["text"]  # it did sample
    with closing(httpclient.InferenceServerClient(f"127.0.0.1:{servers['plain'].http}")) as client:
        result = client.infer(MODEL, _inputs(httpclient, rec["prompt"], temperature=SAMPLED["temperature"],
                                             seed=SEED), request_id=SAMPLED["id"])
    assert _text(result) == rec["text"]


@pytest.mark.triton
def test_a_tree_budget_serves_the_text_of_run(servers, expected):
    """serve --tree-budget 16: the greedy and the sampled requests get `run`'s (chain) text and token count, in fewer
    steps than tokens."""
    import tritonclient.http as httpclient

    tree = servers["tree"]
    assert json.loads((tree.log.parent / "repo" / MODEL / "1" / SERVE_CONFIG).read_text())["tree_budget"] == 16
    steps = tokens = 0
    with closing(httpclient.InferenceServerClient(f"127.0.0.1:{tree.http}")) as client:
        for rid, rec in expected.items():
            sampled = {"temperature": SAMPLED["temperature"], "seed": SEED} if rid == SAMPLED["id"] else {}
            result = client.infer(MODEL, _inputs(httpclient, rec["prompt"], **sampled), request_id=rid)
            assert _text(result) == rec["text"], rid
            assert int(result.as_numpy("num_output_tokens").reshape(-1)[0]) == rec["num_output_tokens"], rid
            steps += len(result.as_numpy("acceptance_lengths").reshape(-1))
            tokens += rec["num_output_tokens"]
    assert steps < tokens


@pytest.mark.triton
def test_decoupled_model_over_grpc_stream_and_http_generate_equals_run(servers, expected):
    server = servers["decoupled"]
    stream = Stream(server.grpc)
    try:
        for rid in ("p0", "p1", "p2"):
            rec = expected[rid]
            (result,) = stream.request(_inputs(stream.module, rec["prompt"]))  # not streaming: one response
            assert _text(result) == rec["text"]
            _check_final({k: result.as_numpy(k) for k in FINAL_OUTPUTS}, rec)
            (body,) = _generate(server.http, {"text_input": rec["prompt"], "sampling_param_max_tokens": MAX_TOKENS})
            assert body["text_output"] == rec["text"]
            _check_final(body, rec)
    finally:
        stream.close()


@pytest.mark.triton
def test_streaming_sends_the_text_in_order(servers, expected):
    server = servers["decoupled"]
    stream = Stream(server.grpc)
    try:
        for rid in ("p3", "p4", "p5"):
            rec = expected[rid]
            responses = stream.request(_inputs(stream.module, rec["prompt"], streaming=True))
            counts = [int(r.as_numpy("num_output_tokens")[0]) for r in responses]
            assert len(responses) > 2 and counts == sorted(set(counts)) and counts[-1] == rec["num_output_tokens"]
            assert all(r.as_numpy("finish_reason") is None for r in responses[:-1])  # metrics come last
            assert "".join(_text(r) for r in responses) == rec["text"]
            _check_final({k: responses[-1].as_numpy(k) for k in FINAL_OUTPUTS}, rec)

            events = _generate(server.http, {"text_input": rec["prompt"], "sampling_param_max_tokens": MAX_TOKENS,
                                             "streaming": True}, stream=True)
            assert len(events) > 2 and "".join(e["text_output"] for e in events) == rec["text"]
            _check_final(events[-1], rec)
    finally:
        stream.close()


@pytest.mark.triton
def test_concurrent_clients_are_batched_and_get_the_offline_text(servers, expected):
    """8 clients x 25 requests (odd clients streaming), each on its own gRPC stream, all at once."""
    server = servers["decoupled"]
    steps_before = server.metric("trtllm_dflash_decoder_steps")
    request_steps_before = server.metric("trtllm_dflash_decoder_request_steps")
    ids = [f"p{i}" for i in range(NUM_PROMPTS)]
    failures, batch_sizes, done = [], [], []
    lock = threading.Lock()

    def client(c: int) -> None:
        stream = Stream(server.grpc)
        try:
            for i in range(25):
                rec = expected[ids[(c + i) % len(ids)]]
                try:
                    responses = stream.request(_inputs(stream.module, rec["prompt"], streaming=c % 2 == 1))
                    text = "".join(_text(r) for r in responses)
                    with lock:
                        batch_sizes.append(int(responses[-1].as_numpy("batch_size_max")[0]))
                        (done if text == rec["text"] else failures).append((c, i, text))
                except Exception as exc:  # noqa: BLE001 - counted and shown below
                    with lock:
                        failures.append((c, i, repr(exc)))
        finally:
            stream.close()

    start = time.monotonic()
    threads = [threading.Thread(target=client, args=(c,)) for c in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=600)
    elapsed = time.monotonic() - start
    assert not failures, failures[:3]
    assert len(done) == 200
    assert max(batch_sizes) > 1, batch_sizes
    steps = server.metric("trtllm_dflash_decoder_steps") - steps_before
    mean_batch = (server.metric("trtllm_dflash_decoder_request_steps") - request_steps_before) / steps
    assert mean_batch > 2, mean_batch  # 8 clients at once: most steps decode several requests
    print(f"200 requests in {elapsed:.1f} s, {steps:.0f} decoder steps, mean batch size {mean_batch:.2f}, "
          f"largest {max(batch_sizes)}")


BAD_REQUESTS = [  # (name, inputs arguments, words in the error)
    ("missing text_input", {"prompt": None}, ["text_input"]),
    ("text_input not BYTES", {"prompt": 7, "text_dtype": "INT32"}, ["text_input"]),
    ("empty prompt", {"prompt": ""}, ["'text_input' is empty"]),
    ("malformed UTF-8", {"prompt": b"def f(\xff\xfe):"}, ["not valid UTF-8"]),
    ("max_tokens too large", {"prompt": "def f():", "max_tokens": 4000}, ["exceeds the engine's max_seq_len 2048"]),
    ("max_tokens zero", {"prompt": "def f():", "max_tokens": 0}, ["positive integer, got 0"]),
    ("negative temperature", {"prompt": "def f():", "temperature": -1.0}, [">= 0, got -1"]),
]


def _bad_inputs(module, args: dict) -> list:
    args = dict(args)
    prompt = args.pop("prompt")
    if args.get("text_dtype") == "INT32":
        tensor = module.InferInput("text_input", [1], "INT32")
        tensor.set_data_from_numpy(np.array([prompt], dtype=np.int32))
        return [tensor] + _inputs(module, None, **{k: v for k, v in args.items() if k != "text_dtype"})
    return _inputs(module, prompt, **args)


@pytest.mark.triton
@pytest.mark.parametrize("name, args, words", BAD_REQUESTS, ids=[b[0] for b in BAD_REQUESTS])
def test_a_bad_request_gets_an_error_and_the_next_one_succeeds(servers, expected, name, args, words):
    import tritonclient.http as httpclient
    from tritonclient.utils import InferenceServerException

    good = expected["p6"]
    stream = Stream(servers["decoupled"].grpc)  # decoupled model, gRPC stream
    try:
        with pytest.raises(InferenceServerException) as exc:
            stream.request(_bad_inputs(stream.module, args))
        assert all(w in str(exc.value) for w in words), str(exc.value)
        assert _text(stream.request(_inputs(stream.module, good["prompt"]))[0]) == good["text"]
    finally:
        stream.close()
    with closing(httpclient.InferenceServerClient(f"127.0.0.1:{servers['plain'].http}")) as client:  # plain, HTTP
        with pytest.raises(InferenceServerException) as exc:
            client.infer(MODEL, _bad_inputs(httpclient, args))
        assert all(w in str(exc.value) for w in words), str(exc.value)
        assert exc.value.status() == "400"
        assert _text(client.infer(MODEL, _inputs(httpclient, good["prompt"]))) == good["text"]


@pytest.mark.triton
def test_streaming_needs_the_decoupled_model(servers, expected):
    import tritonclient.http as httpclient
    from tritonclient.utils import InferenceServerException

    with closing(httpclient.InferenceServerClient(f"127.0.0.1:{servers['plain'].http}")) as client:
        with pytest.raises(InferenceServerException, match="'streaming' needs a decoupled model"):
            client.infer(MODEL, _inputs(httpclient, "def f():", streaming=True))


@pytest.mark.triton
def test_http_generate_reports_a_bad_request(servers, expected):
    with pytest.raises(urllib.error.HTTPError) as exc:
        _generate(servers["decoupled"].http, {"text_input": "", "sampling_param_max_tokens": MAX_TOKENS})
    assert exc.value.code == 400 and "'text_input' is empty" in exc.value.read().decode()
    (body,) = _generate(servers["decoupled"].http, {"text_input": expected["p7"]["prompt"],
                                                     "sampling_param_max_tokens": MAX_TOKENS})
    assert body["text_output"] == expected["p7"]["text"]


@pytest.mark.triton
def test_launch_refuses_a_port_in_use(servers, engine_dir, tmp_path):
    cli = _triton_cli()
    busy = str(servers["plain"].http)
    out = subprocess.run([str(cli), "serve", str(engine_dir), "--model-repo", str(tmp_path / "repo"), "--launch",
                          "--http-port", busy], capture_output=True, text=True, timeout=120,
                         env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert out.returncode == EXIT_USER_ERROR, out.stderr
    assert f"--http-port {busy}: cannot listen on 127.0.0.1:{busy}" in out.stderr
    assert not (tmp_path / "repo").exists()


# --- the scheduler alone (after the server tests, so that `run` overlaps the servers' start) --------------

def test_serving_loop_batches_requests_from_many_threads(engine_dir, expected):
    """The scheduler alone (no Triton): threads submit at once; texts equal `run`'s, steps batch them."""
    engine = Engine.load(engine_dir)
    loop = ServingLoop(engine.decoder("dflash"), engine.tokenizer, max_batch_size=8)
    events: dict[int, list[Event]] = {}
    finished = threading.Semaphore(0)
    jobs = [(n, f"p{n % NUM_PROMPTS}", n % 2 == 1) for n in range(12)]  # (request id, prompt id, streaming)

    def callback(n: int):
        def on_event(event: Event) -> None:
            events.setdefault(n, []).append(event)
            if event.last:
                finished.release()
        return on_event

    def submit(part: list) -> None:
        for n, rid, streaming in part:
            ids = engine.tokenizer(expected[rid]["prompt"])["input_ids"]
            loop.submit(Request(n, ids, MAX_TOKENS), callback(n), streaming)

    loop.start()
    threads = [threading.Thread(target=submit, args=(jobs[i::4],)) for i in range(4)]
    for t in threads:
        t.start()
    too_long = Request("long", [5] * 10, engine.config.max_seq_len)  # the Decoder itself refuses it
    loop.submit(too_long, callback(-1), False)
    for _ in range(len(jobs) + 1):
        assert finished.acquire(timeout=120)
    loop.stop()
    assert "exceeds the engine's max_seq_len" in events[-1][0].error
    for n, rid, streaming in jobs:
        last = events[n][-1]
        assert last.result is not None and last.full_text == expected[rid]["text"]
        assert "".join(e.text for e in events[n]) == expected[rid]["text"]
        assert len(events[n]) > 1 if streaming else len(events[n]) == 1
    assert loop.stats.max_batch_size > 1, loop.stats.batch_sizes
