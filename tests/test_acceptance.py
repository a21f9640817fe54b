"""The acceptance step alone, with hand-made target tokens and logits."""

import pytest
import torch

from trtllm_dflash.speculative.core import (
    Sampling,
    accepted_lengths,
    block_input,
    bonus_tokens,
    gumbel_noise,
    request_seed,
    sample_tokens,
)

K = 4  # drafts per block (block_size 5)


def logits_choosing(tokens, vocab=10):
    """[B, T] tokens -> [B, T, vocab] logits whose argmax are those tokens."""
    logits = torch.randn(*tokens.shape, vocab)
    return logits.scatter(-1, tokens[..., None], 100.0)


def greedy(draft, target_tokens):
    logits = logits_choosing(torch.tensor(target_tokens))
    t = sample_tokens(logits, Sampling.greedy(len(draft)), torch.zeros(logits.shape[:2], dtype=torch.long))
    d = torch.tensor(draft)
    a = accepted_lengths(d, t)
    return a.tolist(), bonus_tokens(t, a).tolist()


@pytest.mark.parametrize(
    "draft, target, accepted, bonus",
    [
        pytest.param([[1, 2, 3, 4]], [[1, 2, 3, 4, 5]], [4], [5], id="perfect-match-bonus-after-all"),
        pytest.param([[9, 2, 3, 4]], [[1, 2, 3, 4, 5]], [0], [1], id="first-position-mismatch"),
        pytest.param([[1, 2, 9, 4]], [[1, 2, 3, 4, 5]], [2], [3], id="mismatch-in-the-middle"),
        pytest.param([[1, 2, 3, 9]], [[1, 2, 3, 4, 5]], [3], [4], id="mismatch-at-last-draft"),
        pytest.param([[1, 9, 3, 4]], [[1, 2, 3, 4, 5]], [1], [2], id="later-matches-do-not-count"),
        pytest.param([[1, 2, 3, 4], [7, 2, 3, 4], [1, 2, 8, 4]], [[1, 2, 3, 4, 5], [1, 2, 3, 4, 5], [1, 2, 3, 4, 5]],
                     [4, 0, 2], [5, 1, 3], id="batch-rows-independent"),
    ],
)
def test_greedy_acceptance(draft, target, accepted, bonus):
    assert greedy(draft, target) == (accepted, bonus)


def test_block_input_is_anchor_then_masks():
    assert block_input(torch.tensor([7, 8]), mask_token_id=99, block_size=4).tolist() == [[7, 99, 99, 99], [8, 99, 99, 99]]


def test_sampling_is_a_function_of_seed_and_position_only():
    logits = torch.randn(1, 6, 50)
    temp = torch.tensor([1.0])
    seed = request_seed(0, "req-1")
    pos = torch.arange(10, 16)[None]
    whole = sample_tokens(logits, Sampling.plain(temp, [seed]), pos)
    pieces = torch.cat([sample_tokens(logits[:, i:i + 1], Sampling.plain(temp, [seed]), pos[:, i:i + 1]) for i in range(6)], 1)
    assert torch.equal(whole, pieces)
    assert request_seed(0, "req-1") == seed != request_seed(1, "req-1") != request_seed(0, "req-2")
    assert not torch.equal(gumbel_noise(seed, 10, 50), gumbel_noise(seed, 11, 50))


def test_greedy_rows_ignore_noise_and_hot_rows_sample():
    logits = logits_choosing(torch.tensor([[3], [3]]), vocab=10) * 0.0
    logits[:, :, 3] = 0.5  # nearly flat: a sampled row should not always pick 3
    pos = torch.arange(200)[:, None]
    greedy_row = [int(sample_tokens(logits[:1], Sampling.plain(torch.tensor([0.0]), [5]), pos[i:i + 1])) for i in range(200)]
    sampled_row = [int(sample_tokens(logits[:1], Sampling.plain(torch.tensor([1.0]), [5]), pos[i:i + 1])) for i in range(200)]
    assert set(greedy_row) == {3}
    assert len(set(sampled_row)) > 5
