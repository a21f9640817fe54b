"""DFlash2 drafters (docs/algorithm.md §DFlash2 drafters) on the torch and onnxruntime executors and under tensor
parallelism: lossless decoding with drafts that are the candidate selector's, the training pass equal to the inference
pass, the speculators format both ways, and every configuration or option they cannot run with refused in one
sentence. The drafter's equations against a
float64 restatement: tests/test_drafter_reference.py."""

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.conftest import (
    MPIEXEC,
    assert_dflash_equals_ar_greedy_and_sampled,
    assert_mpiexec_run_equals_one_process,
    build,
    family_requests,
    write_family_config,
)
from trtllm_dflash.checkpoint.formats import load_drafter, load_pair
from trtllm_dflash.checkpoint.speculators import convert_to_speculators
from trtllm_dflash.cli import EXIT_USER_ERROR, main
from trtllm_dflash.engine_dir import rank_file
from trtllm_dflash.errors import UserError
from trtllm_dflash.models.drafter import DFlashDrafter
from trtllm_dflash.runtime.runner import Engine
from trtllm_dflash.stats import all_steps


@pytest.fixture(scope="module")
def engine_dir(dflash2_pair, tmp_path_factory) -> Path:
    return build(dflash2_pair, tmp_path_factory.mktemp("dflash2") / "engine", max_batch_size=4)


@pytest.fixture(scope="module")
def engine(engine_dir) -> Engine:
    return Engine.load(engine_dir)


def test_decoding_is_lossless_and_accepts_the_selectors_drafts(engine):
    assert engine.executor.drafter.candidate_selector is not None
    assert_dflash_equals_ar_greedy_and_sampled(engine)
    reqs = family_requests(engine.executor.vocab_size)
    kept = [n - 1 for n in all_steps(engine.decoder("dflash").generate(reqs))]  # drafts kept per step
    assert max(kept) >= 2 and min(kept) == 0  # drafts accepted and drafts rejected


def test_a_shorter_block_is_lossless(engine):
    """--block-size 4 of a block-8 drafter: the convolutions run over the shorter block."""
    reqs = family_requests(engine.executor.vocab_size)
    tokens = {mode: {r.request.id: r.output_token_ids for r in engine.decoder(mode, block_size=4 if mode == "dflash"
                                                                               else None).generate(reqs)}
              for mode in ("dflash", "ar")}
    assert tokens["dflash"] == tokens["ar"]


def test_the_training_pass_equals_the_inference_pass(dflash2_pair):
    """forward_blocks (many blocks in one pass, the convolutions cut at block boundaries) gives each block what
    forward gives it alone."""
    ckpt = load_drafter(dflash2_pair / "drafter")
    drafter = DFlashDrafter.from_state_dict(ckpt.spec, ckpt.params, {n: ckpt.tensors.get(n)
                                                                     for n in ckpt.tensors.names()})
    block, H = ckpt.params.block_size, ckpt.spec.hidden_size
    F = len(ckpt.params.target_layer_ids) * H
    torch.manual_seed(0)
    S, anchors = 20, [3, 9, 14]
    features, embeds = torch.randn(1, S, F), torch.randn(1, len(anchors) * block, H)
    positions = torch.cat([torch.arange(p, p + block) for p in anchors])[None]
    mask = torch.zeros(1, len(anchors) * block, S + len(anchors) * block, dtype=torch.bool)
    for j, p in enumerate(anchors):
        rows = slice(j * block, (j + 1) * block)
        mask[0, rows, :p] = True
        mask[0, rows, S + rows.start: S + rows.stop] = True
    together = drafter.forward_blocks(features, embeds, positions, mask)
    for j, p in enumerate(anchors):
        cache, slot = drafter.new_cache(1, 32), torch.tensor([0])
        drafter.append_context(features[:, :p], torch.arange(p)[None], slot, cache)
        alone = drafter(embeds[:, j * block:(j + 1) * block], positions[:, j * block:(j + 1) * block],
                        torch.tensor([p]), slot, cache)
        torch.testing.assert_close(together[:, j * block:(j + 1) * block], alone, atol=2e-5, rtol=2e-5)


def test_speculators_format_both_ways(dflash2_pair, engine, tmp_path):
    """convert-drafter --to speculators writes a DFlash2SpeculatorConfig drafter that loads as the same drafter and
    builds into an engine with the same tokens."""
    out = tmp_path / "speculators"
    assert convert_to_speculators(dflash2_pair / "drafter", dflash2_pair / "target", out) == 512
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["speculators_model_type"] == "dflash2" and cfg["architectures"] == ["DFlash2DraftModel"]
    assert (cfg["conv_kernel_size"], cfg["conv_group_size"], cfg["selector_rank"], cfg["selector_top_k"]) == (2, 16, 32, 8)
    _, ours = load_pair(dflash2_pair / "target", dflash2_pair / "drafter")
    _, theirs = load_pair(dflash2_pair / "target", out)
    assert theirs.params == ours.params and theirs.draft_vocab_size is None
    assert all(torch.equal(theirs.tensors.get(n), ours.tensors.get(n)) for n in ours.tensors.names())
    pair = tmp_path / "pair"
    pair.mkdir()
    (pair / "target").symlink_to(dflash2_pair / "target")
    (pair / "drafter").symlink_to(out)
    converted = Engine.load(build(pair, tmp_path / "engine", max_batch_size=4))
    reqs = family_requests(engine.executor.vocab_size)
    steps = [all_steps(e.decoder("dflash").generate(reqs)) for e in (engine, converted)]
    assert steps[0] == steps[1]


@pytest.mark.slow
def test_onnxruntime_walks_the_selector_as_the_torch_executor(dflash2_pair, engine, tmp_path):
    """backend onnxruntime: the drafter graph convolves and walks the selector over the trained block (static); the
    same drafts as the torch executor (acceptance lengths step for step), tokens == ar, and a shorter verify length
    reads the first drafts of the whole block."""
    pytest.importorskip("onnxruntime")
    config = write_family_config(tmp_path / "ort.yaml", dflash2_pair, backend="onnxruntime",
                                 output=str(tmp_path / "ort"))
    assert main(["build", str(config)]) == 0
    ort = Engine.load(tmp_path / "ort")
    assert type(ort.executor).__name__ == "OnnxRuntimeExecutor"
    reqs = family_requests(ort.executor.vocab_size)
    runs = [{r.request.id: (r.output_token_ids, r.acceptance_lengths) for r in e.decoder("dflash").generate(reqs)}
            for e in (ort, engine)]
    assert runs[0] == runs[1]
    assert {i: tokens for i, (tokens, _) in runs[0].items()} == \
        {r.request.id: r.output_token_ids for r in engine.decoder("ar").generate(reqs)}
    assert_dflash_equals_ar_greedy_and_sampled(ort)
    short = {r.request.id: r.output_token_ids for r in ort.decoder("dflash", block_size=4).generate(reqs)}
    assert short == {i: tokens for i, (tokens, _) in runs[0].items()}


@pytest.mark.mpi
@pytest.mark.skipif(not MPIEXEC.exists(), reason="MPICH's mpiexec is not installed: pip install -e '.[mpi]'")
def test_tp_under_mpiexec_drafts_as_one_process(dflash2_pair, tmp_path):
    """tp 2: the convolutions and the selector replicated on both ranks (the rank files hold them whole), around the
    split attention and MLP: the same tokens and the same acceptance lengths (the same drafts) as one process."""
    one, two = tmp_path / "tp1", tmp_path / "tp2"
    assert main(["build", str(write_family_config(tmp_path / "1.yaml", dflash2_pair)), "--output", str(one)]) == 0
    assert main(["build", str(write_family_config(tmp_path / "2.yaml", dflash2_pair, tp_size=2)), "--output",
                 str(two)]) == 0
    full, rank = load_file(str(one / rank_file(0))), load_file(str(two / rank_file(1)))
    for name in ("drafter.layers.1.mlp_conv.kernel_projection.weight", "drafter.candidate_selector.successor_codebook"):
        assert torch.equal(rank[name], full[name]), name
    assert_mpiexec_run_equals_one_process(one, two, tmp_path, fields=("output_token_ids", "acceptance_lengths"))


def _edited_drafter(pair, tmp_path, **dflash_config):
    """A copy of the pair whose drafter config.json has these dflash_config values."""
    root = tmp_path / "edited"
    shutil.copytree(pair / "drafter", root / "drafter")
    (root / "target").symlink_to(pair / "target")
    path = root / "drafter" / "config.json"
    cfg = json.loads(path.read_text())
    cfg["dflash_config"] |= dflash_config
    path.write_text(json.dumps(cfg))
    return root


@pytest.mark.parametrize("field, value, says", [
    ("conv_group_size", 24, "field 'dflash_config.conv_group_size' 24 does not divide hidden_size 64"),
    ("conv_kernel_size", 9, "conv_kernel_size' 9 is more taps than the block has tokens (block_size 8)"),
    ("selector_top_k", 513, "selector_top_k' 513 is more candidates than the vocabulary has tokens (vocab_size 512)"),
    ("selector_rank", 0, "field 'dflash_config.selector_rank' must be a positive integer, got 0"),
    ("selector_rank", True, "field 'dflash_config.selector_rank' must be a positive integer, got True"),
    ("output_multiplier", -1, "field 'dflash_config.output_multiplier' must be a positive number, got -1"),
    ("final_logit_softcapping", "20", "field 'dflash_config.final_logit_softcapping' must be a positive number"),
])
def test_bad_dflash2_configs_are_one_sentence(dflash2_pair, tmp_path, field, value, says):
    root = _edited_drafter(dflash2_pair, tmp_path, **{field: value})
    with pytest.raises(UserError, match="^" + str(root / "drafter" / "config.json")) as err:
        load_pair(root / "target", root / "drafter")
    assert says in str(err.value)


def test_a_speculators_dflash2_drafter_needs_the_whole_vocabulary(dflash2_pair, tmp_path):
    out = tmp_path / "speculators"
    convert_to_speculators(dflash2_pair / "drafter", dflash2_pair / "target", out)
    cfg = json.loads((out / "config.json").read_text())
    path = out / "config.json"
    path.write_text(json.dumps(cfg | {"draft_vocab_size": 100}))
    with pytest.raises(UserError, match="field 'draft_vocab_size' is 100; a DFlash2 drafter's candidate selector "
                                        "needs the verifier's whole vocabulary"):
        load_pair(dflash2_pair / "target", out)
    with pytest.raises(UserError, match="a DFlash2 drafter's candidate selector needs the whole vocabulary; convert it "
                                        "without --prune-vocab"):
        convert_to_speculators(dflash2_pair / "drafter", dflash2_pair / "target", tmp_path / "pruned", 100)


def test_what_dflash2_does_not_run_with_is_refused(dflash2_pair, engine_dir, tmp_path, capsys):
    for fields, says in (({"backend": "tensorrt"}, "is a DFlash2 drafter, which backend tensorrt does not support "
                                                   "yet"),
                         ({"quantization": "fp8", "quantize_drafter": True}, "is a DFlash2 drafter, which "
                                                                            "quantize_drafter does not support yet")):
        config = write_family_config(tmp_path / "build.yaml", dflash2_pair, output=str(tmp_path / "out"), **fields)
        assert main(["build", str(config)]) == EXIT_USER_ERROR
        assert says in capsys.readouterr().err
        assert not (tmp_path / "out").exists()
    prompts = tmp_path / "in.jsonl"
    prompts.write_text(json.dumps({"id": 0, "prompt_token_ids": [5, 6, 7], "max_new_tokens": 4}) + "\n")
    assert main(["run", str(engine_dir), "--input", str(prompts), "--output", str(tmp_path / "o.jsonl"),
                 "--tree-budget", "8"]) == EXIT_USER_ERROR
    assert "this engine's drafter is DFlash2, whose candidate selector walks one chain" in capsys.readouterr().err
    assert main(["export", "trtllm", str(engine_dir), "--output", str(tmp_path / "trtllm")]) == EXIT_USER_ERROR
    assert "the drafter is DFlash2 (convolutions and a candidate selector)" in capsys.readouterr().err


def test_make_random_pair_writes_a_dflash2_drafter(tmp_path):
    assert main(["make-random-pair", str(tmp_path / "pair"), "--drafter-arch", "dflash2"]) == 0
    ckpt = load_drafter(tmp_path / "pair" / "drafter")
    assert ckpt.params.dflash2 is not None and ckpt.hf_config["architectures"] == ["DFlash2DraftModel"]
