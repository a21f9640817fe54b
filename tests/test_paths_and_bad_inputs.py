"""Never destroy a user's files, never a traceback: outputs that overlap inputs, file-system errors,
text encodings and non-finite numbers, through the real CLI.

Every refusal is checked the same way (`refused`): the exact exit code, one `error:` line on stderr
(argparse's own errors: its usage line and one error line), no traceback, and the watched files
byte-identical afterwards. File-system errors use real file systems: small tmpfs mounts, one
read-only and one full (root only; CI runs as root).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file

from trtllm_dflash.cli import EXIT_BAD_LINES, EXIT_USER_ERROR, main
from trtllm_dflash.outputs import MARKER

PROMPTS = [{"id": i, "prompt": f"def f{i}(x):\n    return"} for i in range(6)]


def snapshot(*roots: Path) -> dict[str, bytes]:
    """Every file under `roots` (or the file itself) with its bytes."""
    files = {}
    for root in roots:
        paths = [root] if root.is_file() else sorted(p for p in root.rglob("*") if p.is_file())
        files |= {str(p): p.read_bytes() for p in paths}
    return files


def refused(capsys, argv: list[str], *words: str, watch: tuple[Path, ...] = (), code: int = EXIT_USER_ERROR) -> str:
    """Run the CLI; assert the exit code, a single error line (the last) containing `words`, no traceback,
    and that every file under `watch` is unchanged. Lines before it may only be progress of finished
    stages. Returns the error line."""
    before = snapshot(*watch)
    try:
        rc = main(argv)
    except SystemExit as exc:  # argparse's own errors
        rc = exc.code
    err = capsys.readouterr().err.strip()
    assert rc == code, err
    assert "Traceback" not in err
    lines = err.splitlines()
    errors = [line for line in lines if "error: " in line]
    assert len(errors) == 1 and errors[0] == lines[-1], err
    for w in words:
        assert w in errors[0], (w, errors[0])
    assert snapshot(*watch) == before, "a watched file was changed"
    return errors[0]


def write_jsonl(path: Path, records=PROMPTS) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def write_config(root: Path, pair: Path, **fields) -> Path:
    cfg = {"target": str(pair / "target"), "drafter": str(pair / "drafter"), "output": str(root / "built"),
           "dtype": "float32", "max_batch_size": 2, "max_seq_len": 256} | fields
    path = root / "build.yaml"
    path.write_text("".join(f"{k}: {json.dumps(v)}\n" for k, v in cfg.items()))
    return path


@pytest.fixture
def pair(qwen3_pair, tmp_path) -> Path:
    """A private copy of the random pair: its files are the inputs whose safety is checked."""
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
# 1. Outputs never overlap inputs; --force replaces only what trtllm-dflash wrote
# ----------------------------------------------------------------------------------------------------

def test_build_output_onto_its_own_inputs(pair, tmp_path, capsys, monkeypatch):
    config = write_config(tmp_path, pair)
    watch = (pair, config)
    refused(capsys, ["build", str(config), "--output", str(pair / "target"), "--force"],
            "is the input directory", watch=watch)
    refused(capsys, ["build", str(config), "--output", str(pair / "target" / "engine"), "--force"],
            "lies inside the input directory", watch=watch)
    refused(capsys, ["build", str(config), "--output", str(pair), "--force"], "contains the input directory",
            watch=watch)
    refused(capsys, ["build", str(config), "--output", str(config), "--force"], "is the input file", watch=watch)
    # The current directory, and any directory above it, is never an output.
    work = tmp_path / "work"
    work.mkdir()
    (work / "notes.txt").write_text("mine")
    monkeypatch.chdir(work)
    refused(capsys, ["build", str(config), "--output", ".", "--force"], "contains the current directory",
            watch=(work, pair))
    deeper = work / "deeper"
    deeper.mkdir()
    monkeypatch.chdir(deeper)
    refused(capsys, ["build", str(config), "--output", "..", "--force"], "contains the current directory",
            watch=(work, pair))


def test_build_force_replaces_only_an_engine(pair, tmp_path, capsys):
    config = write_config(tmp_path, pair)
    mine = tmp_path / "built"
    mine.mkdir()
    (mine / "thesis.tex").write_text("years of work")
    refused(capsys, ["build", str(config), "--force"], "was not written by trtllm-dflash",
            "--force only replaces a directory that trtllm-dflash wrote", watch=(mine,))
    refused(capsys, ["build", str(config)], "was not written by trtllm-dflash", watch=(mine,))
    # An engine is replaced with --force (and only with it); a model repository is not an engine.
    shutil.rmtree(mine)
    assert main(["build", str(config)]) == 0
    assert json.loads((mine / MARKER).read_text())["kind"] == "engine"
    capsys.readouterr()
    refused(capsys, ["build", str(config)], "already holds an engine (use --force", watch=(mine,))
    assert main(["build", str(config), "--force"]) == 0
    repo = tmp_path / "repo"
    assert main(["serve", str(mine), "--model-repo", str(repo), "--max-new-tokens", "16"]) == 0
    capsys.readouterr()
    refused(capsys, ["build", str(config), "--output", str(repo), "--force"],
            "holds a trtllm-dflash model repository, not an engine", watch=(repo,))
    # An empty directory is fine without --force.
    empty = tmp_path / "empty"
    empty.mkdir()
    assert main(["build", str(config), "--output", str(empty)]) == 0


def test_run_outputs_never_overwrite_inputs(engine, tmp_path, capsys):
    prompts = write_jsonl(tmp_path / "prompts.jsonl")
    watch = (engine, prompts)
    base = ["run", str(engine), "--input", str(prompts), "--max-new-tokens", "4"]
    refused(capsys, [*base, "--output", str(prompts)], "--output", "is the input file", watch=watch)
    refused(capsys, [*base, "--output", str(engine / "out.jsonl")], "lies inside the input directory", watch=watch)
    refused(capsys, [*base, "--output", str(tmp_path / "o.jsonl"), "--summary", str(engine / "config.json")],
            "--summary", "lies inside the input directory", watch=watch)
    refused(capsys, [*base, "--output", str(tmp_path / "o.jsonl"), "--summary", str(tmp_path / "o.jsonl")],
            "--summary and --output are the same file", watch=watch)
    assert not (tmp_path / "o.jsonl").exists()


def test_run_replaces_an_existing_output_only_when_it_completes(engine, tmp_path, capsys):
    prompts = write_jsonl(tmp_path / "prompts.jsonl")
    out = tmp_path / "out.jsonl"
    out.write_text("previous results\n")
    # A run that fails (a bad --stop-token-ids is found after the engine loads) leaves the old file.
    refused(capsys, ["run", str(engine), "--input", str(prompts), "--output", str(out), "--stop-token-ids", "99999"],
            "--stop-token-ids", watch=(out,))
    assert main(["run", str(engine), "--input", str(prompts), "--output", str(out), "--max-new-tokens", "4"]) == 0
    assert [json.loads(line)["id"] for line in out.read_text().splitlines()] == [r["id"] for r in PROMPTS]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".out.jsonl")]  # no temporaries left


def test_train_drafter_never_writes_into_an_engine_or_the_target(pair, engine, tmp_path, capsys):
    data = write_jsonl(tmp_path / "data.jsonl")
    base = ["train-drafter", "--target", str(pair / "target"), "--data", str(data), "--steps", "1"]
    refused(capsys, [*base, "--output", str(engine)], "holds a trtllm-dflash engine, not a drafter",
            watch=(engine,))
    refused(capsys, [*base, "--output", str(pair / "target")], "is the input directory", watch=(pair,))
    refused(capsys, [*base, "--output", str(pair / "target" / "drafter")], "lies inside the input directory",
            watch=(pair,))
    refused(capsys, [*base, "--output", str(data)], "is the input file", watch=(data,))
    other = tmp_path / "other"
    other.mkdir()
    (other / "keep.txt").write_text("x")
    refused(capsys, [*base, "--output", str(other)], "was not written by trtllm-dflash", watch=(other,))


def test_serve_bench_and_random_pair_outputs(engine, tmp_path, capsys, monkeypatch):
    refused(capsys, ["serve", str(engine), "--model-repo", str(engine)], "--model-repo", "is the input directory",
            watch=(engine,))
    refused(capsys, ["serve", str(engine), "--model-repo", str(engine / "repo")], "lies inside", watch=(engine,))
    mine = tmp_path / "models"
    mine.mkdir()
    (mine / "model.onnx").write_bytes(b"\x00mine")
    refused(capsys, ["serve", str(engine), "--model-repo", str(mine), "--force"],
            "was not written by trtllm-dflash", watch=(mine,))
    dataset = write_jsonl(tmp_path / "dataset.jsonl")
    bench = ["bench", str(engine), "--dataset", str(dataset), "--num-requests", "1", "--max-new-tokens", "2"]
    refused(capsys, [*bench, "--report-json", str(dataset)], "--report-json", "is the input file",
            watch=(dataset, engine))
    refused(capsys, [*bench, "--plot", str(engine / "plot.png")], "--plot", "lies inside", watch=(engine,))
    refused(capsys, [*bench, "--plot", str(tmp_path / "r"), "--report-json", str(tmp_path / "r")],
            "are the same file", watch=(tmp_path,))
    refused(capsys, ["make-random-pair", str(mine), "--force"], "was not written by trtllm-dflash", watch=(mine,))
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    refused(capsys, ["make-random-pair", ".", "--force"], "contains the current directory")


# ----------------------------------------------------------------------------------------------------
# 2. File-system errors: read-only, full, file where a directory is expected (and the reverse), long names
# ----------------------------------------------------------------------------------------------------

def _mount_tmpfs(path: Path, size: str) -> None:
    path.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], capture_output=True)
    if done.returncode != 0:
        pytest.skip(f"mounting a tmpfs needs root: {done.stderr.decode().strip()}")


@pytest.fixture(scope="module")
def filesystems(tmp_path_factory):
    """`ro`: a read-only file system; `full`: one with no space left; `small`: 1 MiB, too small for an engine;
    `nearly`: one page (4 KiB) left, enough for the space check and a few result lines."""
    if os.geteuid() != 0:
        pytest.skip("mounting file systems needs root (CI runs as root)")
    root = tmp_path_factory.mktemp("filesystems")
    fs = {name: root / name for name in ("ro", "full", "small", "nearly")}
    try:
        _mount_tmpfs(fs["ro"], "1m")
        subprocess.run(["mount", "-o", "remount,ro", str(fs["ro"])], check=True)
        for name in ("full", "nearly"):
            _mount_tmpfs(fs[name], "256k")
            with open(fs[name] / "filler", "wb", buffering=0) as f:
                try:
                    while True:
                        f.write(b"\0" * 4096)
                except OSError:
                    pass
        filler = fs["nearly"] / "filler"
        os.truncate(filler, filler.stat().st_size - 4096)
        _mount_tmpfs(fs["small"], "1m")
        yield fs
    finally:
        for path in fs.values():
            if path.is_mount():
                subprocess.run(["umount", str(path)], check=False)


def writing_commands(engine: Path, pair: Path, tmp_path: Path) -> dict[str, callable]:
    """Each writing command, given the output path to try."""
    prompts = write_jsonl(tmp_path / "prompts.jsonl")
    config = write_config(tmp_path, pair)
    run = ["run", str(engine), "--input", str(prompts), "--max-new-tokens", "4"]
    bench = ["bench", str(engine), "--dataset", str(prompts), "--num-requests", "1", "--max-new-tokens", "2"]
    return {
        "build": lambda out: ["build", str(config), "--output", str(out)],
        "run --output": lambda out: [*run, "--output", str(out)],
        "run --summary": lambda out: [*run, "--output", str(tmp_path / "o.jsonl"), "--summary", str(out)],
        "bench --report-json": lambda out: [*bench, "--report-json", str(out)],
        "bench --plot": lambda out: [*bench, "--plot", str(out)],
        "serve": lambda out: ["serve", str(engine), "--model-repo", str(out)],
        "train-drafter": lambda out: ["train-drafter", "--target", str(pair / "target"), "--data", str(prompts),
                                      "--output", str(out), "--steps", "1"],
        "make-random-pair": lambda out: ["make-random-pair", str(out)],
    }


COMMANDS = ["build", "run --output", "run --summary", "bench --report-json", "bench --plot", "serve",
            "train-drafter", "make-random-pair"]
DIRECTORY_OUTPUTS = {"build", "serve", "train-drafter", "make-random-pair"}


@pytest.mark.parametrize("command", COMMANDS)
def test_file_system_errors_are_one_sentence(command, filesystems, engine, pair, tmp_path, capsys):
    argv = writing_commands(engine, pair, tmp_path)[command]
    watch = (engine, pair, filesystems["full"])
    refused(capsys, argv(filesystems["ro"] / "out"), f"cannot write in {filesystems['ro']} (read-only file system)",
            watch=watch)
    refused(capsys, argv(filesystems["full"] / "out"), "(no space left on device)", watch=watch)
    refused(capsys, argv(filesystems["ro"] / "deep" / "er" / "out"), "(read-only file system)", watch=watch)
    a_file = tmp_path / "a-file"
    a_file.write_text("x")
    refused(capsys, argv(a_file / "out"), f"{a_file} is a file, not a directory", watch=(*watch, a_file))
    refused(capsys, argv(tmp_path / ("n" * 300)), "is too long for the file system", watch=watch)
    if command in DIRECTORY_OUTPUTS:
        refused(capsys, argv(a_file), "is a file, not a directory", watch=(a_file,))
    else:
        a_dir = tmp_path / "a-dir"
        a_dir.mkdir()
        refused(capsys, argv(a_dir), "is a directory, not a file", watch=watch)
        refused(capsys, argv(Path("/dev/full")), "is not a regular file", watch=watch)
    assert sorted(p.name for p in filesystems["full"].iterdir()) == ["filler"]


def test_disk_full_during_a_build_leaves_nothing(pair, tmp_path, filesystems, capsys):
    """The space check passes (the disk is not full yet), the engine does not fit: one sentence, and
    neither the engine nor its temporary directory is left."""
    config = write_config(tmp_path, pair)
    code = main(["build", str(config), "--output", str(filesystems["small"] / "engine")])
    err = capsys.readouterr().err.strip()
    assert code == EXIT_USER_ERROR and "Traceback" not in err
    assert err.splitlines()[-1] == (f"error: {filesystems['small'] / 'engine'}: no space left on device while "
                                    "writing it; nothing there was changed."), err
    assert list(filesystems["small"].iterdir()) == []


def test_disk_full_during_a_run_keeps_the_finished_lines(engine, tmp_path, filesystems, capsys):
    """Results fill the last page of the disk: one sentence; the lines already written stay, and once
    there is space again `--resume` finishes the job with every id exactly once."""
    prompts = write_jsonl(tmp_path / "prompts.jsonl", [{"id": i, "prompt": f"def g{i}(y):"} for i in range(16)])
    out = filesystems["nearly"] / "out.jsonl"
    argv = ["run", str(engine), "--input", str(prompts), "--output", str(out), "--max-new-tokens", "48"]
    code = main(argv)
    err = capsys.readouterr().err.strip()
    assert code == EXIT_USER_ERROR and "Traceback" not in err
    assert err.splitlines()[-1] == (f"error: {out}: no space left on device while writing results; the lines written "
                                    "so far are kept (fix it, then run again with --resume).")
    kept = out.read_bytes()
    assert 0 < kept.count(b"\n") < 16
    (filesystems["nearly"] / "filler").unlink()
    assert main([*argv, "--resume"]) == 0
    ids = [json.loads(line)["id"] for line in out.read_text().splitlines()]
    assert sorted(ids) == list(range(16))
    out.unlink()


# ----------------------------------------------------------------------------------------------------
# 3. Text is decoded on purpose
# ----------------------------------------------------------------------------------------------------

LATIN1 = b'{"id": "x", "prompt": "caf\xe9"}\n'
TRAIN_SHAPE = ["--steps", "1", "--held-out", "1", "--num-layers", "1", "--target-layer-ids", "1"]


def test_invalid_utf8_in_every_input(pair, engine, tmp_path, capsys, monkeypatch):
    bad = tmp_path / "bad.jsonl"
    bad.write_bytes(json.dumps(PROMPTS[0]).encode() + b"\n" + LATIN1)
    where = f"{bad}:2: not valid UTF-8 (byte 0xe9 at byte offset"
    refused(capsys, ["compare", str(engine), "--input", str(bad), "--num-prompts", "1"], where)
    refused(capsys, ["bench", str(engine), "--dataset", str(bad)], where)
    refused(capsys, ["train-drafter", "--target", str(pair / "target"), "--data", str(bad), "--output",
                     str(tmp_path / "d"), *TRAIN_SHAPE], where)
    config = write_config(tmp_path, pair, calibration=str(bad), quantization="fp8")
    pytest.importorskip("modelopt")
    refused(capsys, ["build", str(config)], where)
    yaml_path = tmp_path / "latin1.yaml"
    yaml_path.write_bytes(b"target: t\ndrafter: d # caf\xe9\n")
    refused(capsys, ["build", str(yaml_path)], f"{yaml_path}:2: not valid UTF-8")
    (pair / "target" / "config.json").write_bytes(b'{"model_type": "caf\xe9"}')
    refused(capsys, ["build", str(write_config(tmp_path, pair))], "config.json:1: not valid UTF-8")
    assert not (tmp_path / "built").exists() and not (tmp_path / "d").exists()


def test_invalid_utf8_lines_are_skipped_per_line(engine, tmp_path, capsys, monkeypatch):
    inp = tmp_path / "in.jsonl"
    inp.write_bytes(json.dumps(PROMPTS[0]).encode() + b"\n" + LATIN1 + json.dumps(PROMPTS[1]).encode() + b"\n")
    out = tmp_path / "out.jsonl"
    code = main(["run", str(engine), "--input", str(inp), "--output", str(out), "--max-new-tokens", "4"])
    assert code == EXIT_BAD_LINES
    assert f"{inp}:2: not valid UTF-8 (byte 0xe9 at byte offset " in capsys.readouterr().err
    assert [json.loads(line)["id"] for line in out.read_text().splitlines()] == [0, 1]
    # --stream -: a bad line on stdin is reported and skipped, the others stream.
    import io

    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(b"def a():\n\xff\xfe\ndef b():\n")))
    assert main(["run", str(engine), "--stream", "-", "--max-new-tokens", "3"]) == EXIT_BAD_LINES
    captured = capsys.readouterr()
    assert "<stdin>:2: not valid UTF-8 (byte 0xff at byte offset 0); line skipped." in captured.err
    assert captured.err.count("tokens, ") == 2 and "Traceback" not in captured.err


def test_empty_prompt_files_are_errors(pair, engine, tmp_path, capsys):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n  \n")
    refused(capsys, ["run", str(engine), "--input", str(empty), "--output", str(tmp_path / "o")],
            "the input file has no requests")
    refused(capsys, ["compare", str(engine), "--input", str(empty)], "the input file has no requests")
    refused(capsys, ["bench", str(engine), "--dataset", str(empty)], "the dataset has no records")
    refused(capsys, ["train-drafter", "--target", str(pair / "target"), "--data", str(empty), "--output",
                     str(tmp_path / "d"), *TRAIN_SHAPE], "the input file has no requests")
    sampled = write_jsonl(tmp_path / "sampled.jsonl", [{"prompt": "a", "temperature": 0.5}])
    refused(capsys, ["compare", str(engine), "--input", str(sampled)], "no greedy prompts")
    assert not (tmp_path / "o").exists()


# ----------------------------------------------------------------------------------------------------
# 4. Numbers are checked everywhere they enter
# ----------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("field, value, words", [
    ("max_batch_size", ".nan", ["'max_batch_size'"]),
    ("max_batch_size", "1e30", ["'max_batch_size'"]),
    ("max_batch_size", "100000", ["'max_batch_size' input should be less than or equal to 4096"]),
    ("max_seq_len", ".inf", ["'max_seq_len'", "finite number"]),
    ("max_seq_len", "-.inf", ["'max_seq_len'"]),
    ("calibration_samples", "1e999", ["'calibration_samples'"]),
], ids=["nan", "1e30", "batch-too-large", "inf", "-inf", "1e999"])
def test_non_finite_and_huge_yaml_values(pair, tmp_path, capsys, field, value, words):
    config = write_config(tmp_path, pair)
    kept = [line for line in config.read_text().splitlines() if not line.startswith(f"{field}:")]
    config.write_text("\n".join([*kept, f"{field}: {value}"]) + "\n")
    refused(capsys, ["build", str(config)], str(config), *words)
    assert not (tmp_path / "built").exists()


@pytest.mark.parametrize("argv, words", [
    (["run", "E", "--input", "i", "--output", "o", "--temperature", "nan"], ["--temperature", "got nan"]),
    (["run", "E", "--input", "i", "--output", "o", "--temperature", "inf"], ["--temperature", "got inf"]),
    (["run", "E", "--input", "i", "--output", "o", "--threads", "100000000"],
     ["--threads", "must be an integer from 1"]),
    (["run", "E", "--input", "i", "--output", "o", "--seed", str(2**64)], ["--seed"]),
    (["run", "E", "--input", "i", "--output", "o", "--max-new-tokens", "0"], ["--max-new-tokens"]),
    (["compare", "E", "--input", "i", "--show", "-1"], ["--show", "must be an integer >= 0, got -1"]),
    (["compare", "E", "--input", "i", "--threads", "0"], ["--threads"]),
    (["bench", "E", "--dataset", "d", "--threads", "99999"], ["--threads"]),
    (["serve", "E", "--model-repo", "r", "--http-port", "70000"], ["--http-port", "from 1 to 65535"]),
    (["serve", "E", "--model-repo", "r", "--threads", "-3"], ["--threads"]),
    (["train-drafter", "--target", "t", "--data", "d", "--output", "o", "--seed", "-1"], ["--seed"]),
    (["make-random-pair", "o", "--block-size", "100000"], ["--block-size", "from 2 to 64"]),
])
def test_cli_numbers_are_bounded(capsys, argv, words):
    refused(capsys, argv, *words)


@pytest.mark.parametrize("option, value, words", [
    ("--lr", "0", ["--lr 0.0: the learning rate must be a number in (0, 1]"]),
    ("--lr", "-1e-3", ["--lr"]),
    ("--lr", "nan", ["--lr nan"]),
    ("--lr", "inf", ["--lr inf"]),
    ("--gamma", "0", ["--gamma 0.0: the loss decay must be a finite number > 0"]),
    ("--gamma", "nan", ["--gamma nan"]),
    ("--warmup-ratio", "1.5", ["--warmup-ratio 1.5: must be a number from 0 to 1"]),
    ("--warmup-ratio", "-0.1", ["--warmup-ratio"]),
    ("--block-size", "1", ["--block-size 1: a DFlash block has 2 to 64 tokens"]),
    ("--anchors", "1000000000", ["--anchors 1000000000: more blocks per sequence than --response-tokens 128"]),
    ("--num-layers", "100000", ["--num-layers 100000: a drafter deeper than its 4-layer target"]),
])
def test_training_options_that_cannot_train(pair, tmp_path, capsys, option, value, words):
    """Refused before any work (the target's shape is read, no response is generated): the output
    directory is never created."""
    data = write_jsonl(tmp_path / "data.jsonl")
    out = tmp_path / "drafter"
    refused(capsys, ["train-drafter", "--target", str(pair / "target"), "--data", str(data), "--output", str(out),
                     option, value], *words)
    assert not out.exists()


def test_training_that_diverges_writes_no_drafter(pair, tmp_path, capsys):
    """A target whose lm_head holds an infinity (the drafter's loss goes through it) makes the loss
    non-finite: the run stops at once with one sentence, and no drafter is written."""
    weights = pair / "target" / "model.safetensors"
    tensors = load_file(str(weights))
    tensors["lm_head.weight"][300, 0] = float("inf")
    save_file(tensors, str(weights), metadata={"format": "pt"})
    data = write_jsonl(tmp_path / "data.jsonl", [{"id": i, "prompt": f"x = {i}"} for i in range(8)])
    out = tmp_path / "drafter"
    refused(capsys, ["train-drafter", "--target", str(pair / "target"), "--data", str(data), "--output", str(out),
                     "--steps", "3", "--held-out", "2", "--response-tokens", "8", "--anchors", "4", "--block-size", "4",
                     "--num-layers", "1", "--target-layer-ids", "1"],
            "training diverged at step 1 of 3 (loss ", "no drafter was written")
    assert not (out / "config.json").exists() and not (out / "model.safetensors").exists()


# ----------------------------------------------------------------------------------------------------
# 5. --resume stays honest
# ----------------------------------------------------------------------------------------------------

def test_resume_refuses_lines_of_another_run(engine, tmp_path, capsys):
    prompts = write_jsonl(tmp_path / "prompts.jsonl")
    out = tmp_path / "out.jsonl"
    base = ["run", str(engine), "--input", str(prompts), "--output", str(out), "--resume"]
    assert main([*base, "--max-new-tokens", "4"]) == 0
    lines = out.read_text().splitlines()
    capsys.readouterr()
    # Other options: every line was made with max_new_tokens 4.
    refused(capsys, [*base, "--max-new-tokens", "5"], f"{out}:1: written with another max_new_tokens (4, this "
            "run: 5)", watch=(out,))
    refused(capsys, [*base, "--max-new-tokens", "4", "--mode", "ar"], "written with another mode", watch=(out,))
    refused(capsys, [*base, "--max-new-tokens", "4", "--seed", "9"], "written with another seed", watch=(out,))
    # Other ids: the file belongs to another input.
    other = write_jsonl(tmp_path / "other.jsonl", [{"id": "z", "prompt": "a"}])
    refused(capsys, ["run", str(engine), "--input", str(other), "--output", str(out), "--resume",
                     "--max-new-tokens", "4"], "id 0 is not a request of this input", watch=(out,))
    # Garbage bytes, a duplicate line, a line cut short in the middle of the file.
    for damaged, words in [(b"\xff\xfe garbage\n", "not valid UTF-8"), (lines[0].encode() + b"\n", "appears twice"),
                           (lines[0][:10].encode() + b"\n", "not a result line of `run`")]:
        out.write_bytes("".join(x + "\n" for x in lines).encode() + damaged + b"tail")
        refused(capsys, [*base, "--max-new-tokens", "4"], words, "cannot --resume", watch=(out,))
    # A last line cut short by a crash is dropped and its request runs again.
    out.write_text("".join(x + "\n" for x in lines[:3]) + lines[3][:20])
    assert main([*base, "--max-new-tokens", "4"]) == 0

    def tokens(text):
        return sorted((r["id"], r["output_token_ids"]) for r in map(json.loads, text.splitlines()))

    assert tokens(out.read_text()) == tokens("\n".join(lines))


# ----------------------------------------------------------------------------------------------------
# 6. Messages that name the real problem
# ----------------------------------------------------------------------------------------------------

def test_messages_name_the_real_problem(engine, pair, tmp_path, capsys, qwen3_pair):
    prompts = write_jsonl(tmp_path / "prompts.jsonl")
    config_file = engine / "config.json"
    refused(capsys, ["run", str(config_file), "--input", str(prompts), "--output", str(tmp_path / "o")],
            f"{config_file}: engine directory is a file, not a directory")
    refused(capsys, ["inspect", str(config_file)], "is a file, not a directory")
    refused(capsys, ["run", str(engine), "--input", str(tmp_path), "--output", str(tmp_path / "o")],
            f"{tmp_path}: input file is a directory, not a file")
    refused(capsys, ["bench", str(engine), "--dataset", str(tmp_path)], "dataset file is a directory, not a file")
    refused(capsys, ["build", str(tmp_path)], "build config file is a directory, not a file")
    config = write_config(tmp_path, pair, target=str(prompts))
    refused(capsys, ["build", str(config)], "target checkpoint directory is a file, not a directory")
    refused(capsys, ["serve", str(engine), "--model-repo", str(tmp_path / "r"), "--launch", "--host", "999.1.1.1"],
            "--host '999.1.1.1': not a known address")
    refused(capsys, ["serve", str(engine), "--model-repo", str(tmp_path / "r"), "--launch", "--host", "8.8.8.8"],
            "--host 8.8.8.8: not an address of this machine")
    assert not (tmp_path / "r").exists()
    # Commands without tensor parallelism say so (instead of pointing to mpirun ... run for themselves).
    tp2 = tmp_path / "tp2"
    assert main(["build", str(write_config(tmp_path, pair, tp_size=2, output=str(tp2)))]) == 0
    capsys.readouterr()
    refused(capsys, ["compare", str(tp2), "--input", str(prompts)], "`compare` runs in one process",
            "split for tp_size 2")
    refused(capsys, ["bench", str(tp2), "--dataset", str(prompts)], "`bench` runs in one process")


# ----------------------------------------------------------------------------------------------------
# 7. The CLI starts fast, and every option shows its default
# ----------------------------------------------------------------------------------------------------

SUBCOMMANDS = ["build", "compile", "run", "inspect", "compare", "serve", "bench", "train-drafter", "make-random-pair"]


def test_help_and_version_do_not_import_torch():
    code = ("import sys\nfrom trtllm_dflash.cli import main\n"
            f"for argv in [['--help'], ['--version']] + [[c, '--help'] for c in {SUBCOMMANDS!r}]:\n"
            "    try:\n        main(argv)\n    except SystemExit as exc:\n        assert exc.code == 0, argv\n"
            "heavy = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'transformers', 'numpy'))\n"
            "print('HEAVY', heavy, file=sys.stderr)\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert "HEAVY []" in done.stderr, done.stderr.splitlines()[-1]


def test_every_option_shows_its_default_in_one_format(capsys):
    import argparse

    from trtllm_dflash.cli import parser

    sub = next(a for a in parser()._actions if isinstance(a, argparse._SubParsersAction))
    for name, p in sub.choices.items():
        formatter = p._get_formatter()
        for action in p._actions:
            if (not action.option_strings or action.required
                    or isinstance(action, (argparse._HelpAction, argparse._StoreTrueAction))):
                continue
            text = formatter._expand_help(action) if action.help else ""
            assert text.count("(default: ") == 1, (name, action.option_strings, text)
