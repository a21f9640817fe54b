"""Bad inputs, round three (issue 25), through the real CLI: outputs inside inputs for every writing command, a
full disk under safetensors' own writer, lone surrogates, JSON nested 100,000 deep, numbers past int32, prompts
too long to tokenize, values too long to quote, two writers on one output, Ctrl-C, and an auto cache that cannot be
written; the request-line cases also on an onnxruntime engine and a gpt-oss engine.

Refusals are checked as in tests/test_paths_and_bad_inputs.py (`refused`: exit code, one `error:` line, no
traceback, watched files byte-identical). Concurrency and Ctrl-C use real processes: the first command is paused
with SIGSTOP once it holds its output's lock (taken when the output is checked, before any work), so the second
always meets it mid-work.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.test_paths_and_bad_inputs import PROMPTS, filesystems, refused, snapshot, write_config, write_jsonl  # noqa: F401
from trtllm_dflash.cli import EXIT_BAD_LINES, EXIT_INTERRUPTED, EXIT_USER_ERROR, main
from trtllm_dflash.outputs import MARKER, lock_file

CLI = [sys.executable, "-m", "trtllm_dflash.cli"]


@pytest.fixture
def pair(qwen3_pair, tmp_path) -> Path:
    root = tmp_path / "pair"
    for part in ("target", "drafter"):
        shutil.copytree(qwen3_pair / part, root / part)
    return root


@pytest.fixture
def engine(qwen3_engine_dir, tmp_path) -> Path:
    dst = tmp_path / "engine"
    shutil.copytree(qwen3_engine_dir, dst)
    return dst


# ----------------------------------------------------------------------------------------------------
# 1. Every writing command applies the output-path rule (convert-drafter, export, compile included)
# ----------------------------------------------------------------------------------------------------

def test_convert_drafter_never_writes_inside_an_input(pair, engine, tmp_path, capsys):
    base = ["convert-drafter", str(pair / "drafter")]
    watch = (pair,)
    refused(capsys, [*base, str(pair / "target" / "spec"), "--target", str(pair / "target")],
            "OUTPUT", "lies inside the input directory", watch=watch)
    refused(capsys, [*base, str(pair / "drafter" / "sub"), "--target", str(pair / "target"), "--force"],
            "lies inside the input directory", watch=watch)
    refused(capsys, [*base, str(pair / "drafter"), "--target", str(pair / "target"), "--force"],
            "is the input directory", watch=watch)
    refused(capsys, [*base, str(engine), "--target", str(pair / "target"), "--force"],
            "holds a trtllm-dflash engine, not a drafter", watch=(*watch, engine))
    text = write_jsonl(tmp_path / "vocab.txt")
    refused(capsys, [*base, str(text), "--target", str(pair / "target"), "--prune-vocab", "8", "--vocab-text",
                     str(text)], "is the input file", watch=(*watch, text))
    # The rule does not forbid what it should allow: a new directory beside the inputs.
    assert main([*base, str(tmp_path / "spec"), "--target", str(pair / "target")]) == 0
    assert json.loads((tmp_path / "spec" / MARKER).read_text())["kind"] == "drafter"


def test_export_and_compile_never_write_inside_an_input(engine, tmp_path, capsys, monkeypatch):
    refused(capsys, ["export", "trtllm", str(engine), "--output", str(engine / "trtllm")], "lies inside the input",
            watch=(engine,))
    refused(capsys, ["export", "trtllm", str(engine), "--output", str(engine), "--force"], "is the input directory",
            watch=(engine,))
    # compile rewrites the engine directory: a plugin library inside it would be lost, the cwd would vanish.
    library = engine / "libtrtllm_dflash_plugins.so"
    library.write_bytes(b"\x7fELF")
    refused(capsys, ["compile", str(engine), "--plugin-library", str(library)],
            "ENGINE_DIR", "contains the input file", watch=(engine,))
    monkeypatch.chdir(engine)
    refused(capsys, ["compile", "."], "contains the current directory", watch=(engine,))


# ----------------------------------------------------------------------------------------------------
# 2. A full disk under safetensors' own writer
# ----------------------------------------------------------------------------------------------------

@pytest.fixture
def tiny_fs(tmp_path):
    """A 160 KiB tmpfs: room for the probe, the output's marker and train-drafter's responses, not for weights."""
    if os.geteuid() != 0:
        pytest.skip("mounting a file system needs root (CI runs as root)")
    path = tmp_path / "tiny"
    path.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=160k", "tmpfs", str(path)], capture_output=True)
    if done.returncode != 0:
        pytest.skip(f"mounting a tmpfs needs root: {done.stderr.decode().strip()}")
    yield path
    subprocess.run(["umount", str(path)], check=False)


def test_a_full_disk_under_safetensors_is_one_sentence(pair, tiny_fs, tmp_path, capsys):
    out = tiny_fs / "spec"
    refused(capsys, ["convert-drafter", str(pair / "drafter"), str(out), "--target", str(pair / "target")],
            f"{out}: no space left on device while writing it; nothing there was changed", watch=(pair,))
    assert list(tiny_fs.iterdir()) == []
    data = write_jsonl(tmp_path / "data.jsonl")
    td = tiny_fs / "td"
    line = refused(capsys, ["train-drafter", "--target", str(pair / "target"), "--data", str(data), "--output",
                            str(td), "--steps", "2", "--held-out", "1", "--num-layers", "1", "--target-layer-ids", "1",
                            "--response-tokens", "16", "--anchors", "2", "--block-size", "4", "--save-every", "1"],
                   f"--output {td}: no space left on device while writing", "the same command resumes",
                   watch=(pair, data))
    assert "safetensors" in line  # names the file it could not write
    assert (td / "train_data.jsonl").is_file()  # the generated responses are kept for the resumed run


# ----------------------------------------------------------------------------------------------------
# 3-5, 10. Request lines: numbers past int32, lone surrogates, deep nesting, long values, huge prompts
# ----------------------------------------------------------------------------------------------------

HOSTILE_LINES = [
    ('{"id": "k", "prompt": "a", "top_k": 100000000000000000000}',
     "'top_k' must be an integer from 0 to 2147483647 (0: no limit), got 100000000000000000000"),
    ('{"id": "s", "prompt": "def f(\\ud800):"}', "'prompt' holds a lone surrogate '\\ud800' at character 6"),
    ('{"id": "m", "messages": [{"role": "user", "content": "x\\udfff"}]}',
     "'messages[0].content' holds a lone surrogate '\\udfff' at character 1"),
    ('{"id": "\\ud800", "prompt": "a"}', "'id' holds a lone surrogate"),
    ("[" * 100_000 + "]" * 100_000, "arrays and objects nested more than 64 deep"),
    (json.dumps({"id": "stop", "prompt": "a", "stop": [["x" * 10_000]]}), "'stop' must be a list of strings, got"),
    (json.dumps({"id": "key", "prompt": "a", "y" * 10_000: 1}), "unknown key 'yyyy"),
    (json.dumps({"id": "big", "prompt": "a" * 2_000_000}), "'prompt' has 2,000,000 characters, more than the "
                                                           "engine's max_seq_len of"),
]


def run_hostile_lines(engine: Path, tmp_path: Path, capsys) -> tuple[str, list[dict]]:
    good = json.dumps({"id": "good", "prompt": "def f(x):"})
    inp = tmp_path / "hostile.jsonl"
    inp.write_text("\n".join([good, *(line for line, _ in HOSTILE_LINES)]) + "\n")
    out = tmp_path / "out.jsonl"
    start = time.perf_counter()
    assert main(["run", str(engine), "--input", str(inp), "--output", str(out), "--max-new-tokens", "4"]) == \
        EXIT_BAD_LINES
    took = time.perf_counter() - start
    err = capsys.readouterr().err
    assert "Traceback" not in err
    for number, (_, words) in enumerate(HOSTILE_LINES, start=2):
        line = next(x for x in err.splitlines() if x.startswith(f"{inp}:{number}: "))
        assert words in line and line.endswith("; line skipped."), line
        assert len(line) < 400, line  # a 10,000-character value is named, not repeated
    # The 2 MB prompt is refused before its tokenization (BPE on one huge word takes minutes): far under that.
    assert took < 120, took
    return err, [json.loads(x) for x in out.read_text().splitlines()]


def test_hostile_request_lines_are_each_one_line_and_the_others_run(engine, tmp_path, capsys):
    _, results = run_hostile_lines(engine, tmp_path, capsys)
    assert [r["id"] for r in results] == ["good"]


def test_hostile_request_lines_on_an_onnxruntime_engine(ort_engine_dir, tmp_path, capsys):
    _, results = run_hostile_lines(ort_engine_dir("qwen3"), tmp_path, capsys)
    assert [r["id"] for r in results] == ["good"]


@pytest.fixture(scope="module")
def gpt_oss_engine(gpt_oss_pair, tmp_path_factory) -> Path:
    from tests.conftest import build

    return build(gpt_oss_pair, tmp_path_factory.mktemp("gpt_oss_hostile") / "engine", max_batch_size=2,
                 max_seq_len=256)


def test_hostile_request_lines_on_a_gpt_oss_engine(gpt_oss_engine, tmp_path, capsys):
    _, results = run_hostile_lines(gpt_oss_engine, tmp_path, capsys)
    assert [r["id"] for r in results] == ["good"]


def test_stream_prompts_that_are_not_text(engine, capsys):
    refused(capsys, ["run", str(engine), "--stream", ""], "--stream: the prompt is empty")
    refused(capsys, ["run", str(engine), "--stream", "   "], "--stream: the prompt is empty")
    # argv bytes ED A0 80 (a UTF-16 surrogate encoded as UTF-8): Python hands them over as lone surrogates.
    argv_prompt = os.fsdecode(b"def f(\xed\xa0\x80):")
    refused(capsys, ["run", str(engine), "--stream", argv_prompt],
            "--stream: not valid UTF-8 (byte 0xed at byte offset 6)")
    refused(capsys, ["run", str(engine), "--stream", "a" * 2_000_000], "--stream: the prompt has 2,000,000 characters")


def test_bench_and_build_configs_refuse_the_same_values(engine, pair, tmp_path, capsys):
    dataset = tmp_path / "dataset.jsonl"
    dataset.write_text('{"prompt": "def f(\\ud800):"}\n')
    refused(capsys, ["bench", str(engine), "--dataset", str(dataset)], f"{dataset}:1: 'prompt' holds a lone surrogate")
    dataset.write_text("[" * 100_000 + "]" * 100_000 + "\n")
    refused(capsys, ["bench", str(engine), "--dataset", str(dataset)], "nested more than 64 deep")
    dataset.write_text(json.dumps({"prompt": "b" * 3_000_000}) + "\n")
    refused(capsys, ["bench", str(engine), "--dataset", str(dataset), "--num-requests", "1"],
            f"{dataset}:1: the prompt has 3,000,000 characters")
    config = write_config(tmp_path, pair)
    config.write_text(config.read_text() + 'extra: "\\ud800"\n')
    refused(capsys, ["build", str(config)], "'extra' holds a lone surrogate")
    config = write_config(tmp_path, pair)
    config.write_text(config.read_text() + "deep: " + "[" * 100_000 + "]" * 100_000 + "\n")
    refused(capsys, ["build", str(config)], "nested thousands deep")
    config = write_config(tmp_path, pair, max_batch_size="z" * 10_000)
    line = refused(capsys, ["build", str(config)], "'max_batch_size'", "(a string of 10,000 characters)")
    assert len(line) < 400
    assert not (tmp_path / "built").exists()


# ----------------------------------------------------------------------------------------------------
# 7. Two writers on one output
# ----------------------------------------------------------------------------------------------------

def start(argv: list[str], cwd: Path) -> subprocess.Popen:
    return subprocess.Popen([*CLI, *argv], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=cwd)


def wait_for_lock(proc: subprocess.Popen, output: Path, timeout: float = 180) -> None:
    """Until `proc` holds the lock of `output` (it has checked its output, and its work is still to come)."""
    lock = lock_file(Path(os.path.realpath(output)))
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if lock.is_file() and lock.read_text().split()[:1] == [str(proc.pid)]:
            return
        assert proc.poll() is None, proc.communicate()
        time.sleep(0.01)
    raise AssertionError(f"{proc.args} never locked {output}")


def test_two_runs_on_one_output(engine, tmp_path, capsys):
    prompts = write_jsonl(tmp_path / "prompts.jsonl")
    out = tmp_path / "out.jsonl"
    first = start(["run", str(engine), "--input", str(prompts), "--output", str(out), "--max-new-tokens", "8"],
                  tmp_path)
    wait_for_lock(first, out)
    first.send_signal(signal.SIGSTOP)
    try:
        refused(capsys, ["run", str(engine), "--input", str(prompts), "--output", str(out), "--max-new-tokens", "4"],
                f"--output {out} is being written by another trtllm-dflash process (pid {first.pid})")
    finally:
        first.send_signal(signal.SIGCONT)
    _, err = first.communicate(timeout=300)
    assert first.returncode == 0, err
    lines = [json.loads(x) for x in out.read_text().splitlines()]
    assert sorted(r["id"] for r in lines) == [r["id"] for r in PROMPTS]
    assert {r["max_new_tokens"] for r in lines} == {8}  # all of them the first run's
    assert not lock_file(Path(os.path.realpath(out))).exists()


@pytest.mark.parametrize("command", ["build", "export"])
def test_two_builds_or_exports_on_one_new_output(command, pair, engine, tmp_path, capsys):
    out = tmp_path / "out"
    if command == "build":
        argv = ["build", str(write_config(tmp_path, pair)), "--output", str(out)]
    else:
        argv = ["export", "trtllm", str(engine), "--output", str(out)]
    first = start(argv, tmp_path)
    wait_for_lock(first, out)
    first.send_signal(signal.SIGSTOP)
    try:
        refused(capsys, argv, f"{out} is being written by another trtllm-dflash process (pid {first.pid})")
        # With --force the second waits for the first, then replaces its output.
        second = start([*argv, "--force"], tmp_path)
        deadline = time.monotonic() + 180
        while "waiting for it to finish" not in (line := second.stderr.readline()):
            assert line and time.monotonic() < deadline, second.communicate()
    finally:
        first.send_signal(signal.SIGCONT)
    for proc in (first, second):
        _, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, err
    kind = "engine" if command == "build" else "trtllm export"
    assert json.loads((out / MARKER).read_text())["kind"] == kind
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".out.")]  # no temporaries left


# ----------------------------------------------------------------------------------------------------
# 8. Ctrl-C: one line, exit 130, nothing half-written
# ----------------------------------------------------------------------------------------------------

def interrupted(proc: subprocess.Popen, output: Path, ready=None) -> str:
    """SIGINT to `proc` once it holds `output`'s lock (and `ready()` holds); its one error line."""
    wait_for_lock(proc, output)
    deadline = time.monotonic() + 300
    while ready is not None and not ready():
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.01)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == EXIT_INTERRUPTED, err
    assert "Traceback" not in err and err.strip().splitlines()[-1].startswith("error: interrupted (Ctrl-C); "), err
    assert sum("error: " in line for line in err.splitlines()) == 1, err
    return err.strip().splitlines()[-1]


def test_ctrl_c_during_build_export_and_convert_leaves_nothing(pair, engine, tmp_path):
    config = write_config(tmp_path, pair)
    data = write_jsonl(tmp_path / "vocab.txt", [{"text": "def f(x): return x"}] * 20_000)  # slows the pruning
    commands = {
        "build": ["build", str(config), "--output", str(tmp_path / "built")],
        "export": ["export", "trtllm", str(engine), "--output", str(tmp_path / "exported")],
        "convert-drafter": ["convert-drafter", str(pair / "drafter"), str(tmp_path / "converted"), "--target",
                            str(pair / "target"), "--prune-vocab", "64", "--vocab-text", str(data)],
    }
    inputs = snapshot(pair, engine, config, data)
    for name, argv in commands.items():
        output = Path(argv[argv.index("--output") + 1]) if "--output" in argv else tmp_path / "converted"
        line = interrupted(start(argv, tmp_path), output)
        assert line == "error: interrupted (Ctrl-C); nothing was written.", (name, line)
        assert not output.exists(), name
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["pair", "engine", "build.yaml", "vocab.txt"])
    assert snapshot(pair, engine, config, data) == inputs


def test_an_interrupt_right_after_the_temporary_directory_is_made_removes_it(tmp_path, monkeypatch):
    """The window the test above hit once under load: Ctrl-C raised as soon as mkdir of the temporary sibling returns."""
    from trtllm_dflash.outputs import atomic_directory

    real_mkdir = Path.mkdir

    def mkdir_then_interrupt(self, *args, **kwargs):
        real_mkdir(self, *args, **kwargs)
        if ".building-" in self.name:
            raise KeyboardInterrupt

    monkeypatch.setattr(Path, "mkdir", mkdir_then_interrupt)
    with pytest.raises(KeyboardInterrupt), atomic_directory(tmp_path / "out", "engine"):
        pass
    assert not [p.name for p in tmp_path.iterdir() if ".building-" in p.name or p.name == "out"]


def test_ctrl_c_during_a_run_keeps_finished_lines_or_the_old_file(engine, tmp_path):
    # One short request, so that a line is written at once, then long ones to interrupt.
    prompts = write_jsonl(tmp_path / "prompts.jsonl", [{"id": i, "prompt": f"def g{i}(y):",
                                                        "max_new_tokens": 2 if i == 0 else 200} for i in range(64)])
    out = tmp_path / "out.jsonl"
    argv = ["run", str(engine), "--input", str(prompts), "--output", str(out)]
    line = interrupted(start(argv, tmp_path), out, ready=lambda: out.is_file() and out.stat().st_size > 0)
    assert line == (f"error: interrupted (Ctrl-C); the results finished so far are in {out} (run again with "
                    "--resume to finish).")
    finished = [json.loads(text) for text in out.read_text().splitlines()]  # only complete lines
    assert 0 < len(finished) < 64
    # An existing file is replaced only by a run that completes: interrupted while its replacement is written.
    out.write_text("previous results\n")
    line = interrupted(start(argv, tmp_path), out,
                       ready=lambda: any(p.stat().st_size for p in tmp_path.glob(".out.jsonl.writing-*")))
    assert line.endswith(f"{out} is left as it was (results are replaced only when a run completes).")
    assert out.read_text() == "previous results\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["engine", "out.jsonl", "prompts.jsonl"]


# ----------------------------------------------------------------------------------------------------
# 9. --block-size auto with a cache that cannot be written costs the cache, not the run
# ----------------------------------------------------------------------------------------------------

def test_an_unwritable_auto_cache_keeps_the_run(engine, tmp_path, capsys, monkeypatch, filesystems):
    prompts = write_jsonl(tmp_path / "prompts.jsonl")
    a_file = tmp_path / "cache-is-a-file"
    a_file.write_text("x")
    for cache, words in ((a_file, "(not a directory)"), (filesystems["ro"] / "cache", "(read-only file system)")):
        monkeypatch.setenv("TRTLLM_DFLASH_CACHE_DIR", str(cache))
        out = tmp_path / f"{cache.name}.jsonl"
        code = main(["run", str(engine), "--input", str(prompts), "--output", str(out), "--max-new-tokens", "4",
                     "--block-size", "auto"])
        err = capsys.readouterr().err
        assert code == 0, err
        assert "warning: the pass-cost cache cannot write in " in err and words in err, err
        assert "for this run only" in err
        assert len(out.read_text().splitlines()) == len(PROMPTS)
    assert a_file.read_text() == "x"


def test_make_random_pair_offers_the_families_the_docs_use(tmp_path, capsys):
    """docs and tests build gpt-oss pairs; make-random-pair writes them too, and they build."""
    assert main(["make-random-pair", str(tmp_path / "pair"), "--family", "gpt_oss"]) == 0
    config = write_config(tmp_path, tmp_path / "pair")
    assert main(["build", str(config)]) == 0
    assert json.loads((tmp_path / "built" / "config.json").read_text())["target"]["model_type"] == "gpt_oss"
    refused(capsys, ["make-random-pair", str(tmp_path / "other"), "--family", "mistral"], "invalid choice: 'mistral'")


def test_a_ctrl_c_that_a_library_turns_into_another_error_is_still_an_interrupt(monkeypatch, capsys, tmp_path):
    """SIGINT inside a native library's call back into Python can surface as another exception (safetensors'
    get_tensor under export: a ValueError about an UntypedStorage; seen once in CI under load): still one line and
    exit 130. The same exception without a Ctrl-C is a bug, and is raised."""
    from trtllm_dflash import cli

    def interrupted_inside_a_library(args):
        try:
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(5)
        except KeyboardInterrupt:
            raise ValueError("could not determine the shape of object type 'torch.storage.UntypedStorage'") from None

    monkeypatch.setattr(cli, "cmd_inspect", interrupted_inside_a_library)
    assert cli.main(["inspect", str(tmp_path)]) == cli.EXIT_INTERRUPTED
    assert capsys.readouterr().err == "error: interrupted (Ctrl-C); nothing was written.\n"
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # restored

    def a_bug(args):
        raise ValueError("a bug")

    monkeypatch.setattr(cli, "cmd_inspect", a_bug)
    with pytest.raises(ValueError, match="a bug"):
        cli.main(["inspect", str(tmp_path)])
