"""`run --resume` after kills at random moments, and `run --stream`."""

import io
import json
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from trtllm_dflash.cli import EXIT_USER_ERROR, main

ROOT = Path(__file__).resolve().parents[1]


def write_requests(path: Path, n: int) -> Path:
    lines = [{"id": f"r{i}", "prompt_token_ids": list(range(10 + i, 14 + 2 * i)), "max_new_tokens": 6 + 3 * (i % 4)}
             for i in range(n)]
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    return path


def records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def written_ids(path: Path) -> tuple[set[str], bool]:
    """Ids of the complete result lines of `path`, and whether it ends in a line cut short."""
    if not path.exists():
        return set(), False
    data = path.read_bytes()
    *lines, tail = data.split(b"\n")
    return {json.loads(line)["id"] for line in lines}, tail != b""


@pytest.mark.slow
def test_resume_after_kills_at_random_moments(qwen3_engine_dir, tmp_path):
    """SIGKILL `run --resume` at random moments (a target of 0 new lines kills it while it loads), then resume to
    the end: every request exactly once, with the uninterrupted run's tokens. At least one kill must land mid-write,
    after that process wrote a result line and before the last one was written: kills that all land before the
    writing starts or after it ends would prove nothing."""
    prompts = write_requests(tmp_path / "in.jsonl", 16)
    ref = tmp_path / "ref.jsonl"
    assert main(["run", str(qwen3_engine_dir), "--input", str(prompts), "--output", str(ref)]) == 0
    expected = {r["id"]: r["output_token_ids"] for r in records(ref)}

    out = tmp_path / "out.jsonl"
    cmd = [sys.executable, "-m", "trtllm_dflash.cli", "run", str(qwen3_engine_dir), "--input", str(prompts),
           "--output", str(out), "--resume", "--max-new-tokens", "256"]
    rng = random.Random(0)
    # (result lines when the process started, when it was killed, whether it was killed inside a line); a kill
    # landed mid-write when that process had added a line and not all were written
    kills = []
    for attempt in range(12):
        mid_write = [k for k in kills if k[0] < k[1] < len(expected)]
        if attempt >= 4 and mid_write:
            break
        before, _ = written_ids(out)
        if len(before) == len(expected):  # a process finished the whole run: start again from nothing
            out.unlink()
            before = set()
        proc = subprocess.Popen(cmd, cwd=ROOT, stderr=subprocess.DEVNULL)
        # First at random moments (0: while it loads, before it writes); then, while no kill landed mid-write, as
        # soon as the process wrote its first line.
        target = len(before) + (rng.randint(0, 4) if attempt < 4 else 1)
        deadline = time.monotonic() + 60
        while proc.poll() is None and time.monotonic() < deadline:
            if out.exists() and out.read_bytes().count(b"\n") >= target:
                if attempt < 4:
                    time.sleep(rng.uniform(0, 0.05))
                break
            time.sleep(0.001)
        if proc.poll() is None:
            proc.send_signal(signal.SIGKILL)
            proc.wait()
            ids, cut = written_ids(out)
            kills.append((len(before), len(ids), cut))
        proc.wait()
    mid_write = [k for k in kills if k[0] < k[1] < len(expected)]
    assert len(kills) >= 2 and mid_write, f"no kill landed while results were being written: {kills}"
    # A crash can cut the last line short: --resume drops it and runs that request again.
    with out.open("a") as f:
        f.write('{"id": "r15", "text": "cut sh')
    assert subprocess.run(cmd, cwd=ROOT, capture_output=True).returncode == 0
    got = records(out)
    assert sorted(r["id"] for r in got) == sorted(expected)  # each id exactly once
    assert {r["id"]: r["output_token_ids"] for r in got} == expected


def test_resume_rejects_a_foreign_output_file(qwen3_engine_dir, tmp_path, capsys):
    prompts = write_requests(tmp_path / "in.jsonl", 2)
    out = tmp_path / "out.jsonl"
    out.write_text("this is not a result line\n")
    code = main(["run", str(qwen3_engine_dir), "--input", str(prompts), "--output", str(out), "--resume"])
    assert code == EXIT_USER_ERROR
    assert f"{out}:1: not a result line of `run`; cannot --resume" in capsys.readouterr().err
    assert out.read_text() == "this is not a result line\n"


def test_stream_prints_the_same_text_as_run(qwen3_engine_dir, tmp_path, capsys, monkeypatch):
    prompts = ["def parse(line):", "import os\nclass Config:"]
    path = tmp_path / "in.jsonl"
    path.write_text("".join(json.dumps({"id": i, "prompt": p}) + "\n" for i, p in enumerate(prompts)))
    assert main(["run", str(qwen3_engine_dir), "--input", str(path), "--output", str(tmp_path / "o.jsonl"),
                 "--max-new-tokens", "40"]) == 0
    texts = {r["id"]: r["text"] for r in records(tmp_path / "o.jsonl")}
    capsys.readouterr()

    assert main(["run", str(qwen3_engine_dir), "--stream", prompts[0], "--max-new-tokens", "40"]) == 0
    captured = capsys.readouterr()
    assert captured.out == texts[0] + "\n"
    assert "mean acceptance length" in captured.err

    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(b"def parse(line):\n\n")))  # '-': prompts from stdin
    assert main(["run", str(qwen3_engine_dir), "--stream", "-", "--max-new-tokens", "40"]) == 0
    assert capsys.readouterr().out == texts[0] + "\n"


def test_stream_pieces_arrive_in_order(qwen3_engine_dir):
    """The pieces written while decoding concatenate to the final text, and arrive over several steps."""
    from trtllm_dflash.runtime.runner import RunOptions, stream

    pieces = []

    class Sink(io.StringIO):
        def write(self, s):
            pieces.append(s)
            return len(s)

    assert stream(qwen3_engine_dir, "def parse(line):", RunOptions(max_new_tokens=40), out=Sink()) == 0
    assert sum(1 for p in pieces if p) > 3
    text = "".join(pieces)
    assert text.endswith("\n") and len(text) > 10


def test_run_argument_errors(qwen3_engine_dir, tmp_path, capsys):
    assert main(["run", str(qwen3_engine_dir), "--input", str(tmp_path / "x.jsonl")]) == EXIT_USER_ERROR
    assert "run needs --input and --output" in capsys.readouterr().err
    assert main(["run", str(qwen3_engine_dir), "--stream", "hi", "--output", "o.jsonl"]) == EXIT_USER_ERROR
    assert "--stream prints to the terminal" in capsys.readouterr().err
    too_long = ["run", str(qwen3_engine_dir), "--stream", "hi", "--max-new-tokens", "100000"]
    assert main(too_long) == EXIT_USER_ERROR
    assert "exceeds the engine's max_seq_len 512" in capsys.readouterr().err


def test_forced_progress_display_leaves_the_results_unchanged(qwen3_engine_dir, tmp_path):
    """`--progress` drives the live display (rich) on every finished request; the results are the same."""
    prompts = write_requests(tmp_path / "in.jsonl", 6)
    plain, shown = tmp_path / "plain.jsonl", tmp_path / "shown.jsonl"
    assert main(["run", str(qwen3_engine_dir), "--input", str(prompts), "--output", str(plain), "--no-progress"]) == 0
    assert main(["run", str(qwen3_engine_dir), "--input", str(prompts), "--output", str(shown), "--progress"]) == 0
    by_id = lambda path: {r["id"]: r["output_token_ids"] for r in records(path)}  # noqa: E731
    assert by_id(shown) == by_id(plain) and len(by_id(plain)) == 6
