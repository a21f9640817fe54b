"""Our target decoder equals transformers' Qwen3ForCausalLM / LlamaForCausalLM on tiny random checkpoints."""

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from trtllm_dflash.checkpoint.formats import load_target
from trtllm_dflash.models.target import TargetModel

PROMPT_LENGTHS = (7, 19, 12)


def ours_and_hf(pair_dir):
    ckpt = load_target(pair_dir / "target")
    state = {name: ckpt.tensors.get(name) for name in ckpt.tensors.names()}
    ours = TargetModel.from_state_dict(ckpt.spec, state)
    hf = AutoModelForCausalLM.from_pretrained(str(pair_dir / "target"), dtype=torch.float32).eval()
    return ckpt, ours, hf


@pytest.fixture(params=["qwen3", "llama"])
def family_pair(request):
    return request.getfixturevalue(f"{request.param}_pair")


def test_batched_prefill_logits_and_hidden_states_equal_hf(family_pair):
    ckpt, ours, hf = ours_and_hf(family_pair)
    torch.manual_seed(0)
    prompts = [torch.randint(4, ckpt.spec.vocab_size, (n,)) for n in PROMPT_LENGTHS]
    layers = tuple(range(ckpt.spec.num_layers))  # every layer, the last one included
    # One right-padded batch, rows in slots 2, 0, 1 of a 3-slot cache.
    T = max(PROMPT_LENGTHS)
    tokens = torch.zeros(len(prompts), T, dtype=torch.long)
    for row, p in enumerate(prompts):
        tokens[row, : len(p)] = p
    cache = ours.new_cache(num_slots=3, capacity=64)
    out = ours(tokens, torch.arange(T).expand(len(prompts), T), torch.tensor([2, 0, 1]), cache, layers)
    for row, p in enumerate(prompts):
        with torch.no_grad():
            ref = hf(p[None], output_hidden_states=True)
        n = len(p)
        torch.testing.assert_close(out.logits[row, :n], ref.logits[0], atol=2e-5, rtol=1e-4)
        H = ckpt.spec.hidden_size
        for k, layer_id in enumerate(layers):
            torch.testing.assert_close(out.hidden[row, :n, k * H:(k + 1) * H], ref.hidden_states[layer_id + 1][0],
                                       atol=2e-5, rtol=1e-4)


def test_incremental_decoding_with_cache_equals_full_forward(family_pair):
    """Prefill, then blocks of 3 and single tokens at per-request positions, against one HF pass."""
    ckpt, ours, hf = ours_and_hf(family_pair)
    torch.manual_seed(1)
    seqs = [torch.randint(4, ckpt.spec.vocab_size, (n + 7,)) for n in PROMPT_LENGTHS]
    cache = ours.new_cache(num_slots=3, capacity=64)
    slots = torch.tensor([1, 2, 0])
    T = max(PROMPT_LENGTHS)
    tokens = torch.zeros(3, T, dtype=torch.long)
    for row, n in enumerate(PROMPT_LENGTHS):
        tokens[row, :n] = seqs[row][:n]
    ours(tokens, torch.arange(T).expand(3, T), slots, cache)
    starts = torch.tensor(PROMPT_LENGTHS)
    got = [[] for _ in seqs]
    for width in (3, 1, 3):
        pos = starts[:, None] + torch.arange(width)
        step = torch.stack([seqs[row][pos[row]] for row in range(3)])
        logits = ours(step, pos, slots, cache).logits
        for row in range(3):
            got[row].append(logits[row])
        starts = starts + width
    for row, s in enumerate(seqs):
        with torch.no_grad():
            ref = hf(s[None]).logits[0]
        n = PROMPT_LENGTHS[row]
        torch.testing.assert_close(torch.cat(got[row]), ref[n:n + 7], atol=2e-5, rtol=1e-4)


def test_tied_embeddings_share_one_tensor(llama_pair):
    ckpt, ours, _ = ours_and_hf(llama_pair)
    assert ckpt.spec.tie_word_embeddings
    assert ours.lm_head.weight is ours.model.embed_tokens.weight
    assert "lm_head.weight" not in ckpt.tensors


def test_sharded_checkpoint_is_read_through_its_index(llama_pair):
    files = {p.name for p in (llama_pair / "target").iterdir()}
    assert "model.safetensors.index.json" in files and len([f for f in files if f.endswith(".safetensors")]) > 1
    ckpt = load_target(llama_pair / "target")
    merged = {}
    for f in sorted((llama_pair / "target").glob("*.safetensors")):
        merged |= load_file(str(f))
    assert sorted(merged) == ckpt.tensors.names()
