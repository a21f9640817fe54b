"""The embedded demo pair: shipped in the package, loadable by transformers, lossless and accepting drafts."""

import json
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from trtllm_dflash.config import load_build_config
from trtllm_dflash.engine.builder import build_engine
from trtllm_dflash.runtime.compare import side_by_side
from trtllm_dflash.runtime.jsonl import Defaults, read_requests
from trtllm_dflash.runtime.runner import Engine
from trtllm_dflash.train.corpus import is_held_out

ROOT = Path(__file__).resolve().parents[1]
ASSETS = ROOT / "trtllm_dflash" / "assets" / "demo"
HELD_OUT = ROOT / "benchmarks" / "prompts" / "heldout_code.jsonl"


@pytest.fixture(scope="module")
def demo_engine(tmp_path_factory):
    cfg = load_build_config(ROOT / "build_configs" / "demo.yaml", output=tmp_path_factory.mktemp("demo") / "engine")
    return Engine.load(build_engine(cfg, progress=False))


def test_assets_fit_the_size_budget():
    total = sum(p.stat().st_size for p in ASSETS.rglob("*") if p.is_file())
    assert total <= 25 * 2**20, total


def test_target_loads_with_transformers():
    model = AutoModelForCausalLM.from_pretrained(str(ASSETS / "target"))
    assert type(model).__name__ == "Qwen3ForCausalLM"
    with torch.no_grad():
        assert model(torch.tensor([[5, 6, 7]])).logits.shape == (1, 3, model.config.vocab_size)


def test_held_out_prompts_come_from_held_out_modules():
    rows = [json.loads(line) for line in HELD_OUT.read_text().splitlines()]
    assert len(rows) >= 50
    assert all(is_held_out(r["id"].split(":")[0]) for r in rows)


def test_greedy_dflash_equals_ar_on_held_out_prompts_and_accepts_drafts(demo_engine):
    defaults = Defaults(64, 0.0, 0, demo_engine.config.max_seq_len, demo_engine.executor.vocab_size)
    requests, errors = read_requests(HELD_OUT, demo_engine.tokenizer, defaults)
    assert not errors
    cmp = side_by_side(demo_engine, requests[:6])
    assert cmp.identical
    # The trained drafter accepts several drafts per step (benchmarks/ measures it on all prompts).
    assert cmp.mean_acceptance_length >= 2.5, cmp.mean_acceptance_length
