"""One DFlash drafter step, three implementations, one context: do they draft the same? (docs/interop.md)

    python -m trtllm_dflash.interop.drafter_step --target DIR --drafter DIR [--prompts FILE] [--prompt-index I]
                                                 [--vllm] [--json OUT]

For one prompt, the context of the first draft after the prefill (the features of positions 0 .. P-1, the
anchor = the target's greedy token after the prompt at position P, the block [anchor, MASK x (B-1)] at
P .. P+B-1) goes into:

  ours       trtllm_dflash.models: TargetModel's captured features, DFlashDrafter (its cache filled by
             append_context, then one forward), in float32, as `run` computes it
  reference  trtllm_dflash.interop.reference: transformers' own target model and z-lab's equations in float64,
             with the features of both conventions ("transformers": what z-lab and we read; "residual": what
             vLLM captures; they differ only for a target_layer_id that is the target's last layer)
  vllm       (--vllm, where vLLM is installed) vLLM's own engine (vllm_engine.VllmPair.first_step): the raw
             auxiliary features its target captured, its anchor, and the drafts of its DFlashQwen3ForCausalLM.
             Its features then also go through ours and the reference, so the drafter step is compared on
             identical inputs and the feature convention separately.

The report: each implementation's 15 drafts, which agree exactly, and per target layer id the largest difference
between the conventions' features. Exit status 0 when ours equals the reference exactly (tokens) on the same
features, 1 otherwise.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from trtllm_dflash.errors import UserError
from trtllm_dflash.inputs import loads, require_dir, strict_lines
from trtllm_dflash.interop.reference import ReferenceDrafter, ReferenceTarget, draft_step

ROOT = Path(__file__).resolve().parents[2]
HELD_OUT = ROOT / "benchmarks" / "prompts" / "heldout_code.jsonl"


class OurPair:
    """Our target and drafter, built from the checkpoint directories as `build` would, in `dtype`."""

    def __init__(self, target_dir: Path, drafter_dir: Path, dtype: torch.dtype = torch.float32):
        from trtllm_dflash.checkpoint.formats import drafter_tensor_shapes, load_pair, target_tensor_shapes
        from trtllm_dflash.models.drafter import DFlashDrafter
        from trtllm_dflash.models.target import TargetModel

        target, drafter = load_pair(Path(target_dir), Path(drafter_dir))
        if drafter.draft_vocab_size is not None:
            raise UserError(f"{drafter_dir}: a drafter with its own lm_head (pruned vocabulary); the z-lab reference "
                             "drafts with the target's lm_head only.")
        t_state = {n: target.tensors.get(n).to(dtype) for n in target_tensor_shapes(target.spec)}
        d_state = {n: drafter.tensors.get(n).to(dtype) for n in drafter_tensor_shapes(drafter.spec, drafter.params)}
        self.target = TargetModel.from_state_dict(target.spec, t_state)
        self.drafter = DFlashDrafter.from_state_dict(drafter.spec, drafter.params, d_state)
        self.params, self.dtype = drafter.params, dtype

    @torch.inference_mode()
    def features(self, prompt: list[int]) -> tuple[torch.Tensor, int]:
        """(captured features [P, n_feat * H], the greedy anchor) of a prompt."""
        ids = torch.tensor([prompt])
        cache = self.target.new_cache(1, len(prompt) + 1)
        out = self.target(ids, torch.arange(len(prompt))[None], torch.tensor([0]), cache,
                          capture_layers=self.params.target_layer_ids)
        return out.hidden[0].float(), int(out.logits[0, -1].argmax())

    @torch.inference_mode()
    def drafts(self, features: torch.Tensor, anchor: int) -> list[int]:
        """The drafts of one step: context = features of positions 0 .. P-1, block at P."""
        P, B = features.shape[0], self.params.block_size
        cache = self.drafter.new_cache(1, P + B)
        slots = torch.tensor([0])
        self.drafter.append_context(features[None].to(self.dtype), torch.arange(P)[None], slots, cache)
        block = torch.tensor([[anchor] + [self.params.mask_token_id] * (B - 1)])
        hidden = self.drafter(self.target.embed(block), (P + torch.arange(B))[None], torch.tensor([P]), slots, cache)
        return self.drafter.greedy_tokens(hidden[:, 1:], self.target.logits, block[:, 0])[0].tolist()


def prompt_ids(target_dir: Path, prompts: Path, index: int) -> list[int]:
    from trtllm_dflash.checkpoint.tokenizer import load_tokenizer

    require_dir(target_dir, "target directory")
    lines = []
    for n, text in strict_lines(prompts, "prompt file"):
        try:
            lines.append((n, loads(text)))
        except ValueError as exc:
            raise UserError(f"{prompts}:{n}: not a JSON line ({exc}).") from None
    if not 0 <= index < len(lines):
        raise UserError(f"--prompt-index {index}: {prompts} has {len(lines)} prompts.")
    n, line = lines[index]
    if not (isinstance(line, dict) and isinstance(line.get("prompt"), str) and line["prompt"]):
        raise UserError(f"{prompts}:{n}: needs a non-empty string 'prompt'.")
    return load_tokenizer(target_dir)(line["prompt"])["input_ids"]


def compare(target_dir: Path, drafter_dir: Path, prompt: list[int], with_vllm: bool = False) -> dict:
    """Every implementation's drafts for the first step after `prompt`, and the feature conventions' differences."""
    ours = OurPair(target_dir, drafter_dir)
    ref_target, ref_drafter = ReferenceTarget(target_dir), ReferenceDrafter.load(drafter_dir)
    layer_ids = list(ours.params.target_layer_ids)
    H = ref_target.model.config.hidden_size
    our_features, our_anchor = ours.features(prompt)
    ref = {c: draft_step(ref_target, ref_drafter, prompt, c) for c in ("transformers", "residual")}
    report: dict = {"prompt_tokens": len(prompt), "target_layer_ids": layer_ids,
                    "last_target_layer": ref_target.num_layers - 1, "anchor": {"ours": our_anchor,
                                                                               "reference": ref["transformers"]["anchor"]}}

    def per_layer(a: torch.Tensor, b: torch.Tensor) -> dict[int, float]:
        return {i: float((a[:, j * H:(j + 1) * H].double() - b[:, j * H:(j + 1) * H].double()).abs().max())
                for j, i in enumerate(layer_ids)}

    conv = ref["transformers"]["features"]
    report["feature_difference"] = {
        "ours - reference(transformers)": per_layer(our_features, conv["transformers"]),
        "reference: transformers - residual": per_layer(conv["transformers"], conv["residual"]),
    }
    drafts = {"ours": ours.drafts(our_features, our_anchor),
              "reference (transformers features)": ref["transformers"]["drafts"],
              "reference (residual features)": ref["residual"]["drafts"],
              "ours on residual features": ours.drafts(conv["residual"].float(), our_anchor)}
    if with_vllm:
        from trtllm_dflash.interop.vllm_engine import VllmPair

        pair = VllmPair(target_dir, drafter_dir, ours.params.block_size - 1, max_num_seqs=1)
        step = pair.first_step(prompt)
        report["anchor"]["vllm"] = step["anchor"]
        report["vllm_positions"] = [int(step["positions"][0]), int(step["positions"][-1])]
        report["feature_difference"]["vllm - reference(residual)"] = per_layer(step["features"], conv["residual"])
        report["feature_difference"]["vllm - reference(transformers)"] = per_layer(step["features"],
                                                                                 conv["transformers"])
        drafts["vllm"] = step["drafts"]
        drafts["ours on vllm's features"] = ours.drafts(step["features"], step["anchor"])
        drafts["reference on vllm's features"] = ref_drafter_drafts(ref_target, ref_drafter, step["features"],
                                                                    step["anchor"])
        drafts["reference on vllm's features, layer 0's context k_norm"] = ref_drafter_drafts(
            ref_target, ref_drafter, step["features"], step["anchor"], context_k_norm_of_layer=0)
    report["drafts"] = drafts
    report["ours_equals_reference"] = drafts["ours"] == drafts["reference (transformers features)"]
    report["ours_equals_reference_on_residual_features"] = (drafts["ours on residual features"]
                                                           == drafts["reference (residual features)"])
    if with_vllm:
        report["vllm_equals_ours_on_its_features"] = drafts["vllm"] == drafts["ours on vllm's features"]
        report["vllm_equals_reference_on_its_features"] = drafts["vllm"] == drafts["reference on vllm's features"]
        report["vllm_equals_reference_with_layer0_context_k_norm"] = (
            drafts["vllm"] == drafts["reference on vllm's features, layer 0's context k_norm"])
    return report


def ref_drafter_drafts(target: ReferenceTarget, drafter: ReferenceDrafter, features: torch.Tensor, anchor: int,
                       context_k_norm_of_layer: int | None = None) -> list[int]:
    block = torch.tensor([anchor] + [drafter.mask_token_id] * (drafter.block_size - 1))
    with torch.no_grad():
        hidden = drafter.hidden(features.double(), target.embed(block), features.shape[0], context_k_norm_of_layer)
        return target.lm_head(hidden[1:]).argmax(-1).tolist()


def format_report(r: dict) -> str:
    lines = [f"prompt: {r['prompt_tokens']} tokens; target_layer_ids {r['target_layer_ids']} "
             f"(the target's last layer: {r['last_target_layer']}); anchor {r['anchor']}", "",
             "largest |difference| of the features, per target layer id:"]
    for name, diff in r["feature_difference"].items():
        lines.append(f"  {name:36s} " + "  ".join(f"{i}: {d:.3g}" for i, d in diff.items()))
    lines += ["", "drafts of the first step (block slots 1..B-1):"]
    first = r["drafts"]["ours"]
    for name, d in r["drafts"].items():
        same = sum(a == b for a, b in zip(d, first))
        lines.append(f"  {name:56s} {d}  ({same}/{len(first)} equal to ours)")
    lines.append("")
    for key in ("ours_equals_reference", "ours_equals_reference_on_residual_features",
                "vllm_equals_ours_on_its_features", "vllm_equals_reference_on_its_features",
                "vllm_equals_reference_with_layer0_context_k_norm"):
        if key in r:
            lines.append(f"{key}: {'yes' if r[key] else 'NO'}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m trtllm_dflash.interop.drafter_step", description=__doc__.split("\n")[0])
    ap.add_argument("--target", type=Path, default=ROOT / "trtllm_dflash" / "assets" / "demo" / "target")
    ap.add_argument("--drafter", type=Path, default=ROOT / "trtllm_dflash" / "assets" / "demo" / "drafter")
    ap.add_argument("--prompts", type=Path, default=HELD_OUT, help="JSONL with a 'prompt' per line")
    ap.add_argument("--prompt-index", type=int, default=0)
    ap.add_argument("--vllm", action="store_true", help="also run vLLM's own engine (needs vllm installed)")
    ap.add_argument("--json", type=Path, help="write the report as JSON here too")
    args = ap.parse_args(argv)
    try:
        prompt = prompt_ids(args.target, args.prompts, args.prompt_index)
        report = compare(args.target, args.drafter, prompt, args.vllm)
    except UserError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(format_report(report))
    if args.json:
        args.json.write_text(json.dumps(report, indent=1) + "\n")
    return 0 if report["ours_equals_reference"] else 1


if __name__ == "__main__":
    sys.exit(main())
