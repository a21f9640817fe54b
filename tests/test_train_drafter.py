"""`train-drafter` on a tiny random target: the loss falls, `build` accepts the result, resume is exact."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch
from safetensors.torch import load_file
from torch.nn.utils.rnn import pad_sequence

from tests.conftest import assert_dflash_equals_ar_greedy_and_sampled, build
from trtllm_dflash.cli import EXIT_USER_ERROR, main
from trtllm_dflash.runtime.runner import Engine
from trtllm_dflash.train.corpus import code_prompts, stdlib_modules
from trtllm_dflash.errors import UserError
from trtllm_dflash.train.drafter import (
    batch_features,
    block_loss,
    default_target_layer_ids,
    load_frozen_target,
    sample_blocks,
    selector_loss,
    target_features,
)
from trtllm_dflash.models.drafter import CandidateSelector

ARGS = ["--block-size", "8", "--num-layers", "2", "--target-layer-ids", "1", "3", "--batch-size", "4",
        "--anchors", "8", "--response-tokens", "24", "--held-out", "4", "--lr", "3e-3"]


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    path = tmp_path_factory.mktemp("data") / "prompts.jsonl"
    prompts = code_prompts(stdlib_modules(held_out=False, include_tests=False), 24, 160, seed=0)
    path.write_text("".join(json.dumps({"id": i, "prompt": p}) + "\n" for i, p in enumerate(prompts)))
    return path


def train(target, data, out, steps, *extra):
    return main(["train-drafter", "--target", str(target), "--data", str(data), "--output", str(out),
                 "--steps", str(steps), "--eval-every", str(steps), "--save-every", "5", *ARGS, *extra])


def zlab_build_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """z-lab/dflash dflash/model.py build_target_layer_ids, restated."""
    if num_draft_layers == 1:
        return [num_target_layers // 2]
    span = num_target_layers - 3 - 1
    return [int(round(1 + i * span / (num_draft_layers - 1))) for i in range(num_draft_layers)]


def test_default_layer_ids_are_the_references_and_never_the_last_layer():
    assert default_target_layer_ids(36, 5) == (1, 9, 17, 25, 33)  # Qwen3-8B's published drafter
    assert default_target_layer_ids(32, 5) == (1, 8, 15, 22, 29)  # Llama-3.1-8B's
    assert default_target_layer_ids(16, 4) == (1, 5, 9, 13)  # the demo drafter's (retrained, issue 26)
    for layers in range(4, 81):
        for n in range(1, 9):
            ids = zlab_build_target_layer_ids(layers, n)
            if all(0 <= i < layers - 1 for i in ids):
                assert default_target_layer_ids(layers, n) == tuple(ids)
                assert layers - 1 not in ids
    # Too shallow for the spacing: the reference's ids would include the last layer (2 layers, 1 feature: [1]).
    with pytest.raises(UserError, match="the last layer is not portable"):
        default_target_layer_ids(2, 1)


def test_sample_blocks_mask_and_labels():
    seq = torch.arange(10, 22)  # 12 tokens; the response starts at position 4
    lm = torch.tensor([False] * 4 + [True] * 8)
    ids, blk, pos, labels, mask = sample_blocks([seq], [lm], anchors=2, block=3, mask_id=99,
                                                gen=torch.Generator().manual_seed(0))
    S = 12
    for j in range(2):
        p = int(pos[0, 3 * j])
        assert 4 <= p <= 10 and pos[0, 3 * j:3 * j + 3].tolist() == [p, p + 1, p + 2]
        assert blk[0, 3 * j:3 * j + 3].tolist() == [int(seq[p]), 99, 99]
        want = [-100] + [int(seq[q]) if q < S else -100 for q in (p + 1, p + 2)]
        assert labels[0, 3 * j:3 * j + 3].tolist() == want  # same-position labels, slot 0 untrained
        for r in range(3 * j, 3 * j + 3):
            row = mask[0, r]
            assert row[:S].tolist() == [q < p for q in range(S)]  # context strictly before the anchor
            assert row[S:].tolist() == [3 * j <= c < 3 * j + 3 for c in range(6)]  # its own block only


def test_block_loss_weights_decay_with_slot():
    labels = torch.tensor([[-100, 1, 1, -100, 1, 1]])  # two blocks of 3
    logits = torch.zeros(1, 6, 4)
    logits[0, [1, 4], 1] = 10.0  # slot 1 right, slot 2 wrong (uniform)
    gamma = 2.0
    w1, w2 = 1.0, torch.exp(torch.tensor(-1 / gamma))
    ce_uniform = torch.log(torch.tensor(4.0))
    ce_right = torch.nn.functional.cross_entropy(logits[0, 1:2], torch.tensor([1]))
    want = (2 * w1 * ce_right + 2 * w2 * ce_uniform) / (2 * w1 + 2 * w2)
    torch.testing.assert_close(block_loss(logits, labels, block=3, gamma=gamma), want)


@pytest.mark.slow
def test_loss_falls_and_build_accepts_the_drafter(biased_pairs, data, tmp_path):
    qwen3_pair = biased_pairs[8]  # a target with predictable text, so 30 steps show learning
    out = tmp_path / "drafter"
    assert train(qwen3_pair / "target", data, out, 30, "--dtype", "bfloat16") == 0
    assert {t.dtype for t in load_file(str(out / "model.safetensors")).values()} == {torch.bfloat16}
    log = json.loads((out / "training.json").read_text())["state"]
    losses = log["losses"]
    assert sum(losses[-5:]) / 5 < sum(losses[:5]) / 5 - 0.3, losses
    assert len(log["evals"]) == 1 and log["evals"][0]["acceptance_length"] >= 1.0
    pair = tmp_path / "pair"
    pair.mkdir()
    (pair / "target").symlink_to(qwen3_pair / "target")
    (pair / "drafter").symlink_to(out)
    engine = Engine.load(build(pair, tmp_path / "engine"))
    assert engine.config.dflash.target_layer_ids == [1, 3] and engine.config.dflash.block_size == 8


def test_dflash2_training_learns_and_builds(biased_pairs, data, tmp_path):
    """--arch dflash2: the loss (block + selector) falls, the convolutions and the selector leave their initial
    values, and the written DFlash2 drafter builds and decodes losslessly."""
    pair = biased_pairs[8]
    out = tmp_path / "drafter"
    assert train(pair / "target", data, out, 30, "--arch", "dflash2") == 0
    assert json.loads((out / "config.json").read_text())["architectures"] == ["DFlash2DraftModel"]
    losses = json.loads((out / "training.json").read_text())["state"]["losses"]
    assert sum(losses[-5:]) / 5 < sum(losses[:5]) / 5 - 0.3, losses
    weights = load_file(str(out / "model.safetensors"))
    identity = torch.zeros_like(weights["layers.0.mlp_conv.base_kernel"])
    identity[:, 0] = 1.0
    assert not torch.equal(weights["layers.0.mlp_conv.base_kernel"], identity)
    assert weights["layers.1.attention_conv.kernel_projection.weight"].abs().max() > 0
    both = tmp_path / "pair"
    both.mkdir()
    (both / "target").symlink_to(pair / "target")
    (both / "drafter").symlink_to(out)
    engine = Engine.load(build(both, tmp_path / "engine", max_batch_size=4))
    assert engine.config.dflash.dflash2 is not None
    assert_dflash_equals_ar_greedy_and_sampled(engine)


def test_init_from_upgrades_a_dflash_drafter(biased_pairs, data, tmp_path, capsys):
    """--init-from a DFlash drafter with --arch dflash2: its weights carried over (one step at a negligible learning
    rate moves them by ~1e-9), the convolutions the identity; settings that do not match it are one sentence."""
    pair = biased_pairs[8]
    source = pair / "drafter"  # 2 layers reading target layers 0, 2, 3 (make-random-pair's)
    out = tmp_path / "upgraded"
    assert train(pair / "target", data, out, 1, "--arch", "dflash2", "--init-from", str(source),
                 "--target-layer-ids", "0", "2", "3", "--lr", "1e-9") == 0
    before, after = load_file(str(source / "model.safetensors")), load_file(str(out / "model.safetensors"))
    assert all(torch.allclose(after[k], before[k], atol=1e-6) for k in before)
    identity = torch.zeros_like(after["layers.1.attention_conv.base_kernel"])
    identity[:, 0] = 1.0
    torch.testing.assert_close(after["layers.1.attention_conv.base_kernel"], identity, atol=1e-6, rtol=0)
    capsys.readouterr()
    assert train(pair / "target", data, tmp_path / "bad", 1, "--init-from", str(source)) == EXIT_USER_ERROR
    assert (f"--init-from {source}: its target_layer_ids is [0, 2, 3], and this run's --target-layer-ids gives "
            "[1, 3]; pass --target-layer-ids to match it.") in capsys.readouterr().err
    assert train(pair / "target", data, tmp_path / "bad2", 1, "--init-from", str(out), "--target-layer-ids", "0", "2",
                 "3") == EXIT_USER_ERROR
    assert "it is a DFlash2 drafter; pass --arch dflash2 to continue training it." in capsys.readouterr().err


def test_selector_loss_is_cross_entropy_over_the_candidates():
    """With a selector that adds nothing (zero codebooks) the loss is the weighted cross-entropy of the candidates'
    logits; a label outside the top k replaces the last candidate; slot 1's predecessor is the anchor."""
    selector = CandidateSelector(hidden_size=4, vocab_size=6, rank=3, top_k=2)
    with torch.no_grad():
        selector.predecessor_codebook.zero_()
    logits = torch.tensor([[[0.0, 1, 2, 3, 4, 5], [5.0, 4, 3, 2, 1, 0], [0.0, 0, 9, 1, 0, 8]]])
    labels = torch.tensor([[-100, 1, 0]])  # slot 1: 1 is the 2nd candidate of (0, 1); slot 2: 0 is not in (2, 5)
    loss = selector_loss(selector, logits, torch.randn(1, 3, 4), torch.tensor([[3, 9, 9]]), labels, block=3,
                         gamma=1.0)
    ce1 = -torch.log_softmax(torch.tensor([5.0, 4.0]), 0)[1]
    ce2 = -torch.log_softmax(torch.tensor([9.0, 0.0]), 0)[1]  # (2, 0): the label in the last candidate's place
    w2 = torch.exp(torch.tensor(-1.0))
    torch.testing.assert_close(loss, (ce1 + w2 * ce2) / (1 + w2))
    with torch.no_grad():  # the edges: slot 1's predecessor must be the anchor (3), slot 2's the label before it (1)
        selector.predecessor_codebook.normal_()
    seen = []
    original = selector.scores
    selector.scores = lambda unary, hidden, prev, cands: seen.append(prev.tolist()) or original(unary, hidden, prev,
                                                                                                  cands)
    selector_loss(selector, logits, torch.randn(1, 3, 4), torch.tensor([[3, 9, 9]]), labels, block=3, gamma=1.0)
    assert seen[0][0][1:] == [3, 1]


@pytest.mark.slow
def test_resume_after_a_kill_gives_the_same_drafter(qwen3_pair, data, tmp_path):
    straight, killed = tmp_path / "straight", tmp_path / "killed"
    assert train(qwen3_pair / "target", data, straight, 40) == 0
    cmd = [sys.executable, "-m", "trtllm_dflash.cli", "train-drafter", "--target", str(qwen3_pair / "target"),
           "--data", str(data), "--output", str(killed), "--steps", "40", "--eval-every", "40", "--save-every", "5", *ARGS]
    proc = subprocess.Popen(cmd, stderr=subprocess.DEVNULL, env=os.environ | {"OMP_NUM_THREADS": "1"})
    state = killed / "checkpoint" / "state.json"
    deadline = time.time() + 120
    while not state.exists() and time.time() < deadline and proc.poll() is None:
        time.sleep(0.01)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert proc.returncode == -signal.SIGKILL, "training finished before it could be interrupted"
    assert not (killed / "model.safetensors").exists()
    assert train(qwen3_pair / "target", data, killed, 40) == 0
    a, b = load_file(str(straight / "model.safetensors")), load_file(str(killed / "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_cached_features_are_the_steps_own(qwen3_pair, tmp_path):
    """--cache-features: each sequence's features, computed once in length groups, are what the step computes
    on its padded batch (fails if a group's rows are mixed up or cut at the wrong length)."""
    from rich.progress import Progress

    target, _, _ = load_frozen_target(qwen3_pair / "target")
    gen = torch.Generator().manual_seed(0)
    seqs = [torch.randint(4, 512, (n,), generator=gen) for n in (5, 40, 17, 17, 3, 64, 29)]
    with Progress(disable=True) as bar:
        cached = target_features(target, seqs, (1, 3), bar, batch_tokens=64)  # several groups of 1-3
    pick = [5, 0, 2, 4]
    with torch.inference_mode():
        want = batch_features(target, pad_sequence([seqs[i] for i in pick], batch_first=True), (1, 3))
    got = pad_sequence([cached[i] for i in pick], batch_first=True)  # as the training step pads them
    assert got.shape == want.shape == (4, 64, 2 * target.spec.hidden_size)
    for row, i in enumerate(pick):
        n = len(seqs[i])
        torch.testing.assert_close(got[row, :n], want[row, :n], atol=1e-5, rtol=1e-5)
        assert not got[row, n:].any()


def test_training_on_cached_features_follows_the_uncached_run(qwen3_pair, data, tmp_path):
    """The same run with and without --cache-features: the same losses up to float rounding."""
    assert train(qwen3_pair / "target", data, tmp_path / "plain", 4) == 0
    assert train(qwen3_pair / "target", data, tmp_path / "cached", 4, "--cache-features") == 0
    plain, cached = (json.loads((tmp_path / d / "training.json").read_text()) for d in ("plain", "cached"))
    assert cached["config"]["cache_features"] and not plain["config"]["cache_features"]
    assert plain["state"]["losses"] == pytest.approx(cached["state"]["losses"], rel=1e-4)


def test_bad_arguments(qwen3_pair, data, tmp_path, capsys):
    assert train(qwen3_pair / "target", data, tmp_path / "a", 5, "--target-layer-ids", "1", "9") == EXIT_USER_ERROR
    assert "[9] outside the target's layers 0..3" in capsys.readouterr().err
    assert train(qwen3_pair / "target", data, tmp_path / "b", 5) == 0
    assert train(qwen3_pair / "target", data, tmp_path / "b", 5, "--anchors", "4") == EXIT_USER_ERROR
    assert "different settings (anchors)" in capsys.readouterr().err
