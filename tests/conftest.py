"""Shared fixtures: tiny random pairs in the real formats, built into engines.

"Biased" pairs shift the target's lm_head row of one token along the mean direction of the models'
final hidden states, so the target emits that token often (but not always) and a random drafter
agrees with it often: verify steps then accept varied numbers of drafts (0 .. K), which exercises
every branch of acceptance and commit. Unbiased random pairs accept almost nothing.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from trtllm_dflash.checkpoint.synthetic import write_random_pair
from trtllm_dflash.config import BuildConfig
from trtllm_dflash.engine.builder import build_engine
from trtllm_dflash.runtime.runner import Engine

BIAS_TOKEN = 100


def bias_target(target_dir: Path, token: int = BIAS_TOKEN, alpha: float = 0.16) -> None:
    """Make `token` likely under the target (in place), keeping the HF checkpoint format."""
    path = target_dir / "model.safetensors"
    sd = load_file(str(path))
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(target_dir), dtype=torch.float32)
    with torch.no_grad():
        ids = torch.arange(10, 210).reshape(4, 50)
        final = hf(ids, output_hidden_states=True).hidden_states[-1].reshape(-1, hf.config.hidden_size)
    direction = final.mean(0) / final.mean(0).norm()
    name = "model.embed_tokens.weight" if hf.config.tie_word_embeddings else "lm_head.weight"
    sd[name][token] += alpha * final.norm(dim=1).mean() * direction / 8
    save_file(sd, str(path), metadata={"format": "pt"})


def build(pair_dir: Path, out: Path, dtype: str = "float32", max_batch_size: int = 8,
          max_seq_len: int = 512) -> Path:
    cfg = BuildConfig(target=pair_dir / "target", drafter=pair_dir / "drafter", output=out, dtype=dtype,
                      max_batch_size=max_batch_size, max_seq_len=max_seq_len)
    return build_engine(cfg, force=True, progress=False)


@pytest.fixture(scope="session")
def qwen3_pair(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("qwen3_pair")
    write_random_pair(root, "qwen3", block_size=8)
    return root


@pytest.fixture(scope="session")
def llama_pair(tmp_path_factory) -> Path:
    """Llama-3 family with llama3 RoPE scaling, tied embeddings and a sharded, indexed checkpoint."""
    root = tmp_path_factory.mktemp("llama_pair")
    write_random_pair(root, "llama", block_size=8, tie_word_embeddings=True, shard=True, seed=1)
    return root


@pytest.fixture(scope="session")
def biased_pairs(tmp_path_factory) -> dict[int, Path]:
    """Biased qwen3 pairs for block sizes 2, 8 and 16 (same target weights, drafters per block size)."""
    pairs = {}
    for block in (2, 8, 16):
        root = tmp_path_factory.mktemp(f"biased_b{block}")
        write_random_pair(root, "qwen3", block_size=block, seed=2)
        bias_target(root / "target")
        pairs[block] = root
    return pairs


@pytest.fixture(scope="session")
def biased_engines(biased_pairs, tmp_path_factory) -> dict[int, Engine]:
    out = tmp_path_factory.mktemp("biased_engines")
    return {b: Engine.load(build(p, out / f"b{b}", max_batch_size=4)) for b, p in biased_pairs.items()}


@pytest.fixture(scope="session")
def qwen3_engine_dir(qwen3_pair, tmp_path_factory) -> Path:
    return build(qwen3_pair, tmp_path_factory.mktemp("qwen3_engine") / "engine")
