"""`trtllm-dflash build`: a good build, and every bad input ending in one sentence and exit code 2."""

import json
import random
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch
from safetensors.torch import load_file, save_file

from trtllm_dflash.cli import EXIT_USER_ERROR, main
from trtllm_dflash.engine_dir import open_engine


@pytest.fixture
def pair(qwen3_pair, tmp_path):
    """A private copy of the random pair, safe to damage."""
    shutil.copytree(qwen3_pair / "target", tmp_path / "target")
    shutil.copytree(qwen3_pair / "drafter", tmp_path / "drafter")
    return tmp_path


def write_config(pair, **fields):
    cfg = {"target": "target", "drafter": "drafter", "output": "engine", "dtype": "float32",
           "max_batch_size": 2, "max_seq_len": 256} | fields
    path = pair / "build.yaml"
    path.write_text("\n".join(f"{k}: {json.dumps(v)}" for k, v in cfg.items() if v is not None) + "\n")
    return path


def edit_json(path, **changes):
    data = json.loads(path.read_text())
    for key, value in changes.items():
        *parents, leaf = key.split(".")
        node = data
        for p in parents:
            node = node[p]
        if value is None:
            del node[leaf]
        else:
            node[leaf] = value
    path.write_text(json.dumps(data))


def edit_tensor(path, name, fn):
    sd = load_file(str(path))
    sd[name] = fn(sd[name])
    save_file(sd, str(path))


def build_fails(pair, capsys, *words, config=None, extra=()):
    config = config or write_config(pair)
    code = main(["build", str(config), *extra])
    err = capsys.readouterr().err.strip()
    assert code == EXIT_USER_ERROR, err
    assert err.startswith("error: ") and "\n" not in err, err
    for word in words:
        assert word in err, (word, err)
    assert not (pair / "engine").exists() or extra  # nothing half-written
    assert not list(pair.glob(".engine.building-*"))
    return err


def test_build_writes_a_verified_engine_directory(pair, capsys):
    assert main(["build", str(write_config(pair))]) == 0
    engine = pair / "engine"
    assert sorted(p.name for p in engine.iterdir()) == [".trtllm-dflash", "config.json", "manifest.json",
                                                        "rank0.safetensors", "tokenizer"]
    cfg = json.loads((engine / "config.json").read_text())
    drafter = json.loads((pair / "drafter" / "config.json").read_text())
    assert cfg["dflash"] == {"block_size": drafter["block_size"],
                             "mask_token_id": drafter["dflash_config"]["mask_token_id"],
                             "target_layer_ids": drafter["dflash_config"]["target_layer_ids"]}
    assert cfg["mapping"] == {"world_size": 1, "tp_size": 1} and cfg["dtype"] == "float32"
    manifest = json.loads((engine / "manifest.json").read_text())["files"]
    assert set(manifest) == {".trtllm-dflash", "config.json", "rank0.safetensors", "tokenizer/tokenizer.json",
                             "tokenizer/tokenizer_config.json", "tokenizer/chat_template.jinja"}
    weights = load_file(str(engine / "rank0.safetensors"))
    assert all(k.startswith(("target.", "drafter.")) for k in weights)
    assert len([k for k in weights if k.startswith("drafter.")]) == 3 + 11 * drafter["num_hidden_layers"]


def test_bf16_build_casts_weights(pair):
    assert main(["build", str(write_config(pair, dtype="bfloat16"))]) == 0
    weights = load_file(str(pair / "engine" / "rank0.safetensors"))
    assert {t.dtype for t in weights.values()} == {torch.bfloat16}


def test_output_flag_and_force(pair, capsys):
    config = write_config(pair)
    out = pair / "elsewhere"
    assert main(["build", str(config), "--output", str(out)]) == 0
    assert (out / "manifest.json").exists()
    capsys.readouterr()
    build_fails(pair, capsys, str(out), "already holds an engine", "--force", extra=("--output", str(out)))
    assert main(["build", str(config), "--output", str(out), "--force"]) == 0


@pytest.mark.parametrize(
    "fields, words",
    [
        pytest.param({"flavour": "x"}, ["build.yaml", "unknown key 'flavour'"], id="unknown-key"),
        pytest.param({"dtype": "float64"}, ["build.yaml", "'dtype'", "float64"], id="bad-dtype"),
        pytest.param({"quantization": "int3"}, ["build.yaml", "'quantization'", "int3"], id="unknown-quantization"),
        pytest.param({"tp_size": 3}, ["build.yaml", "'tp_size'", "3"], id="tp3-invalid"),
        pytest.param({"max_batch_size": 0}, ["build.yaml", "'max_batch_size'", "0"], id="zero-batch"),
        pytest.param({"max_seq_len": 100000}, ["build.yaml", "max_seq_len 100000", "max_position_embeddings 4096"], id="too-long"),
        pytest.param({"target": None}, ["build.yaml", "required key 'target'"], id="missing-target-key"),
        pytest.param({"target": "nowhere"}, ["nowhere", "target checkpoint directory does not exist"], id="missing-target-dir"),
    ],
)
def test_bad_config_values(pair, capsys, fields, words):
    build_fails(pair, capsys, *words, config=write_config(pair, **fields))


def test_config_file_problems(pair, capsys):
    build_fails(pair, capsys, "nope.yaml", "does not exist", config=pair / "nope.yaml")
    bad = pair / "bad.yaml"
    bad.write_text("target: [unclosed\n")
    build_fails(pair, capsys, "bad.yaml", "not valid YAML", config=bad)
    bad.write_text("- a list\n")
    build_fails(pair, capsys, "bad.yaml", "mapping", config=bad)
    bad.write_text("target: target\ntp_size: 1\ndrafter: drafter\ntp_size: 2\n")
    build_fails(pair, capsys, "bad.yaml", "key 'tp_size' appears twice (line 4)", config=bad)


@pytest.mark.parametrize("value", ["0", "two", "-1", ""])
def test_bad_export_process_limit(pair, capsys, monkeypatch, value):
    """$TRTLLM_DFLASH_EXPORT_PROCESSES is checked before any work: one sentence, nothing written."""
    monkeypatch.setenv("TRTLLM_DFLASH_EXPORT_PROCESSES", value)
    build_fails(pair, capsys, f"TRTLLM_DFLASH_EXPORT_PROCESSES={value!r}: must be a whole number of processes",
                config=write_config(pair, backend="onnxruntime"))


def test_output_path_that_is_a_file(pair, capsys):
    (pair / "engine").write_text("not a directory")
    build_fails(pair, capsys, "engine", "not a directory", extra=("--force",))


@pytest.mark.parametrize(
    "file, changes, words",
    [
        pytest.param("target/config.json", {"hidden_size": None}, ["target/config.json", "'hidden_size' is missing"],
                     id="target-config-missing-field"),
        pytest.param("target/config.json", {"model_type": "gpt2"}, ["model_type 'gpt2'"], id="unsupported-family"),
        pytest.param("target/config.json", {"num_key_value_heads": 3},
                     ["num_attention_heads 4", "num_key_value_heads 3"], id="heads-not-divisible"),
        pytest.param("drafter/config.json", {"hidden_size": 96},
                     ["hidden_size is 96", "target's hidden_size is 64"], id="drafter-hidden-size"),
        pytest.param("drafter/config.json", {"vocab_size": 1000}, ["vocab_size is 1000", "512"], id="drafter-vocab"),
        pytest.param("drafter/config.json", {"dflash_config.mask_token_id": 600},
                     ["mask_token_id 600", "vocab_size 512"], id="mask-token-outside-embedding"),
        pytest.param("drafter/config.json", {"dflash_config.target_layer_ids": [0, 2, 4]},
                     ["target_layer_ids [0, 2, 4]", "[4]", "0..3"], id="layer-ids-out-of-range"),
        pytest.param("drafter/config.json", {"dflash_config.target_layer_ids": [0, -1, 3]},
                     ["[-1]"], id="negative-layer-id"),
        pytest.param("drafter/config.json", {"block_size": 1}, ["'block_size' is 1", "at least 2"], id="block-size-1"),
        pytest.param("drafter/config.json", {"architectures": ["Qwen3ForCausalLM"]},
                     ["'architectures'", "DFlashDraftModel"], id="not-a-drafter"),
        pytest.param("drafter/config.json", {"dflash_config.mask_token_id": None},
                     ["'dflash_config.mask_token_id'"], id="no-mask-token"),
        pytest.param("drafter/config.json", {"num_target_layers": 36},
                     ["num_target_layers is 36", "num_hidden_layers 4"], id="drafter-for-another-target"),
    ],
)
def test_bad_checkpoint_configs(pair, capsys, file, changes, words):
    edit_json(pair / file, **changes)
    build_fails(pair, capsys, *words)


def test_bad_checkpoint_tensors(pair, capsys):
    target = pair / "target" / "model.safetensors"
    original = target.read_bytes()
    target.write_bytes(original[: len(original) // 2])
    build_fails(pair, capsys, "target/model.safetensors", "safetensors")

    target.write_bytes(original)
    edit_tensor(target, "model.layers.1.mlp.up_proj.weight", lambda t: t[:, :32].contiguous())
    build_fails(pair, capsys, "model.layers.1.mlp.up_proj.weight", "shape [128, 32]", "expected [128, 64]")

    target.write_bytes(original)
    edit_tensor(target, "model.norm.weight", lambda t: t.to(torch.int32))
    build_fails(pair, capsys, "model.norm.weight", "dtype I32")

    target.write_bytes(original)
    drafter = pair / "drafter" / "model.safetensors"
    drafter_original = drafter.read_bytes()
    edit_tensor(drafter, "fc.weight", lambda t: t[:, :64].contiguous())
    build_fails(pair, capsys, "drafter tensor 'fc.weight'", "shape [64, 64]")

    drafter.write_bytes(drafter_original)
    sd = load_file(str(drafter))
    del sd["layers.1.self_attn.k_norm.weight"]
    save_file(sd, str(drafter))
    build_fails(pair, capsys, "drafter tensor 'layers.1.self_attn.k_norm.weight' is missing")

    drafter.unlink()
    build_fails(pair, capsys, "drafter", "no *.safetensors files")


def test_missing_tokenizer(pair, capsys):
    (pair / "target" / "tokenizer.json").unlink()
    build_fails(pair, capsys, "no tokenizer files")


def test_console_script_end_to_end(pair, tmp_path):
    """The installed `trtllm-dflash` entry point: build, then run one prompt."""
    exe = [sys.executable, "-m", "trtllm_dflash.cli"]
    subprocess.run([*exe, "build", str(write_config(pair))], check=True, capture_output=True)
    (tmp_path / "in.jsonl").write_text(json.dumps({"id": "x", "prompt": "import os"}) + "\n")
    run = subprocess.run([*exe, "run", str(pair / "engine"), "--input", str(tmp_path / "in.jsonl"),
                          "--output", str(tmp_path / "out.jsonl"), "--max-new-tokens", "5"],
                         capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    assert json.loads((tmp_path / "out.jsonl").read_text())["num_output_tokens"] == 5


@pytest.mark.slow
def test_killed_builds_never_leave_an_engine_that_loads(pair):
    """SIGKILL a build at many moments: the output either does not exist or is complete and verified."""
    config = write_config(pair)
    rng = random.Random(0)
    for _ in range(6):
        proc = subprocess.Popen([sys.executable, "-m", "trtllm_dflash.cli", "build", str(config), "--force"],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        time.sleep(rng.uniform(0.5, 6.0))
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        engine = pair / "engine"
        if engine.exists():
            open_engine(engine)  # raises if anything is missing or does not match the manifest
    assert main(["build", str(config), "--force"]) == 0
    assert not list(pair.glob(".engine.building-*")), "temporary directories of killed builds are cleaned up"
