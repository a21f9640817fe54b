"""Temperature > 0: DFlash keeps the target's output distribution exactly.

Two checks. (1) Statistical: thousands of seeded DFlash samples of the first three tokens match the
target's own next-token distributions (chi-square against HF transformers' probabilities), also at
positions reached through accepted drafts. (2) Exact: with the same seeds, DFlash and AR sample the
very same tokens, because the sampler's randomness depends only on (seed, position).
"""

import pytest
import torch
from scipy.stats import chisquare
from transformers import AutoModelForCausalLM

from trtllm_dflash.runtime.decoding import Decoder, Request
from trtllm_dflash.speculative.core import request_seed

pytestmark = pytest.mark.slow

N = 3000
PROMPT = [17, 42, 99, 256, 7, 311]
ALPHA = 1e-3  # a correct sampler fails with this probability; the seeds are fixed, so the run is repeatable


def samples(engine, mode, n=N, max_new=3, temperature=1.0):
    reqs = [Request(id=i, prompt_token_ids=PROMPT, max_new_tokens=max_new, temperature=temperature,
                    seed=request_seed(0, str(i))) for i in range(n)]
    return {r.request.id: r for r in Decoder.for_mode(engine.executor, mode, ()).generate(reqs)}


def chi_square_pvalue(observed_tokens: list[int], probs: torch.Tensor) -> float:
    counts = torch.bincount(torch.tensor(observed_tokens), minlength=probs.numel()).double()
    expected = probs.double() * len(observed_tokens)
    big = expected >= 5  # pool the rare tokens into one bin
    obs = torch.cat([counts[big], counts[~big].sum()[None]])
    exp = torch.cat([expected[big], expected[~big].sum()[None]])
    return float(chisquare(obs.numpy(), exp.numpy() * obs.sum().item() / exp.sum().item()).pvalue)


def test_dflash_samples_follow_the_target_distribution(wide_engine, peaky_pair):
    hf = AutoModelForCausalLM.from_pretrained(str(peaky_pair / "target"), dtype=torch.float32).eval()
    results = samples(wide_engine, "dflash")
    outs = [r.output_token_ids for r in results.values()]
    steps = [n for r in results.values() for n in r.acceptance_lengths]
    # Enough verify steps accept drafts (about 4% here) that accepted tokens are part of the sample.
    assert sum(n > 1 for n in steps) >= 100, "too few accepted drafts to exercise acceptance"

    prefix: list[int] = []
    for position in range(3):
        group = [o[position] for o in outs if o[:position] == prefix]
        with torch.no_grad():
            probs = hf(torch.tensor([PROMPT + prefix])).logits[0, -1].softmax(-1)
        assert len(group) >= 300, (position, len(group))
        assert chi_square_pvalue(group, probs) > ALPHA, f"position {position} after {prefix}"
        prefix = prefix + [max(set(group), key=group.count)]  # condition on the most common token


def test_a_biased_sampler_is_detected(wide_engine, peaky_pair):
    """The statistical check has power: temperature 0.7 samples do not pass as temperature 1."""
    hf = AutoModelForCausalLM.from_pretrained(str(peaky_pair / "target"), dtype=torch.float32).eval()
    outs = [r.output_token_ids[0] for r in samples(wide_engine, "dflash", max_new=1, temperature=0.7).values()]
    with torch.no_grad():
        probs = hf(torch.tensor([PROMPT])).logits[0, -1].softmax(-1)
    assert chi_square_pvalue(outs, probs) < ALPHA


def test_dflash_and_ar_sample_identical_tokens_for_the_same_seeds(wide_engine):
    dflash = samples(wide_engine, "dflash", n=64, max_new=24)
    ar = samples(wide_engine, "ar", n=64, max_new=24)
    assert all(dflash[i].output_token_ids == ar[i].output_token_ids for i in range(64))
    assert len({tuple(r.output_token_ids) for r in dflash.values()}) > 32  # really sampled
