"""`trtllm-dflash train-drafter`: train a DFlash drafter for a frozen target
(docs/algorithm.md §Training a drafter).

Recipe (SpecForge / the paper):
  * data: the target's own greedy responses to the prompts of DATA (generated once, cached);
  * each step samples `anchors` random anchor positions p per sequence among response positions with
    a response token after them; block n is [x_p, MASK x (B-1)] at positions p..p+B-1;
  * all blocks of a batch go through the drafter in one pass: a block's queries see the context
    features of positions < p (strictly) and every key of their own block, nothing else;
  * same-position labels: slot k (1 <= k < B) predicts x_{p+k}; slot 0 is not trained;
  * loss: cross-entropy weighted by exp(-(k-1)/gamma), normalised by the weights of valid labels;
  * `--arch dflash2`: the convolutions start as the identity (a DFlash drafter) and the loss adds the candidate
    selector's (`selector_loss`), as speculators' DFlash2 trainer does;
  * AdamW, cosine schedule with warm-up, gradient clipping 1.0. The target, its embedding and its
    lm_head stay frozen.

Everything the run needs to continue is checkpointed (safetensors + JSON, no pickles) every
`save_every` steps into OUTPUT/checkpoint/, so an interrupted run resumes where it stopped. The final
drafter is written in the z-lab format that `build` reads.
"""

from __future__ import annotations

import json
import math
import shutil
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.utils.rnn import pad_sequence
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn
from safetensors.torch import load_file

from trtllm_dflash.checkpoint.formats import (
    LAST_LAYER_READERS,
    load_drafter,
    load_target,
    save_drafter,
    target_tensor_shapes,
)
from trtllm_dflash.checkpoint.tensors import check_tensors, save_safetensors
from trtllm_dflash.checkpoint.tokenizer import load_tokenizer
from trtllm_dflash.errors import UserError
from trtllm_dflash.inputs import require_file
from trtllm_dflash.models.drafter import CandidateSelector, DFlashDrafter
from trtllm_dflash.models.spec import DecoderSpec, DFlash2Params, DFlashParams, build_target_layer_ids
from trtllm_dflash.models.target import TargetModel
from trtllm_dflash.outputs import check_output_dir, marker_kind, write_marker
from trtllm_dflash.runtime.decoding import Decoder, Request
from trtllm_dflash.runtime.executor import TorchExecutor
from trtllm_dflash.runtime.jsonl import Defaults, read_requests
from trtllm_dflash.stats import all_steps, mean_acceptance_length
from trtllm_dflash.train.config import TrainConfig

CHECKPOINT = "checkpoint"
DATA_FILE = "train_data.jsonl"


@dataclass
class TrainState:
    step: int = 0
    losses: list[float] = field(default_factory=list)
    evals: list[dict] = field(default_factory=list)  # {"step", "acceptance_length"}
    seconds: float = 0.0


def load_frozen_target(target_dir: Path, device: str = "cpu") -> tuple[TargetModel, object, tuple[int, ...]]:
    ckpt = load_target(target_dir)
    check_tensors(ckpt.tensors, target_tensor_shapes(ckpt.spec), "target")
    state = {name: ckpt.tensors.get(name).float() for name in target_tensor_shapes(ckpt.spec)}
    return TargetModel.from_state_dict(ckpt.spec, state), load_tokenizer(target_dir), ckpt.eos_token_ids


def default_target_layer_ids(num_target_layers: int, num_layers: int) -> tuple[int, ...]:
    """The reference's spacing (z-lab build_target_layer_ids: one feature per draft layer, evenly from layer 1 to
    L-3; a single one at L // 2), which never reads the target's last layer: engines read that one differently
    (checkpoint/formats.py LAST_LAYER_READERS). Example: 36 layers, 5 -> (1, 9, 17, 25, 33); 16 layers, 4 ->
    (1, 5, 9, 13). A target too shallow for that spacing is refused with a sentence asking for explicit ids."""
    ids = tuple(build_target_layer_ids(num_target_layers, num_layers))
    if not all(0 <= i < num_target_layers - 1 for i in ids):
        raise UserError(f"the default target layer ids for a {num_target_layers}-layer target and {num_layers} draft "
                        f"layers would be {list(ids)}, outside layers 0 .. {num_target_layers - 2} (the last layer "
                        "is not portable between engines); pass --target-layer-ids.")
    return ids


def drafter_spec(target: DecoderSpec, num_layers: int) -> DecoderSpec:
    """The drafter's layers: Qwen3 layers with the target's width and attention shape."""
    return DecoderSpec(
        model_type="qwen3", vocab_size=target.vocab_size, hidden_size=target.hidden_size,
        intermediate_size=target.intermediate_size, num_layers=num_layers, num_heads=target.num_heads,
        num_kv_heads=target.num_kv_heads, head_dim=target.head_dim, rms_norm_eps=target.rms_norm_eps,
        qk_norm=True, attention_bias=False, mlp_bias=False, tie_word_embeddings=False, hidden_act="silu",
        rope_parameters=target.rope_parameters, max_position_embeddings=target.max_position_embeddings,
    )


def generate_responses(target: TargetModel, eos: tuple[int, ...], requests: list[Request],
                       max_seq_len: int, progress: Progress) -> list[dict]:
    """The target's own greedy continuations (batched, our AR decoder)."""
    executor = TorchExecutor(target, None, num_slots=min(64, len(requests)), max_seq_len=max_seq_len)
    task = progress.add_task("target responses", total=len(requests), loss=float("nan"), al=float("nan"))
    rows = []
    for result in Decoder.for_mode(executor, "ar", eos).generate(requests):
        rows.append({"id": result.request.id, "prompt_token_ids": result.request.prompt_token_ids,
                     "response_token_ids": result.output_token_ids})
        progress.advance(task)
    progress.remove_task(task)
    return sorted(rows, key=lambda r: str(r["id"]))


def sample_blocks(seqs: list[torch.Tensor], loss_masks: list[torch.Tensor], anchors: int, block: int,
                  mask_id: int, gen: torch.Generator):
    """Random anchors and their blocks, labels and attention mask for a batch of sequences.

    Returns input_ids [B, S], block_ids [B, Q], block_pos [B, Q], labels [B, Q] (-100: no label) and
    mask [B, Q, S + Q] with Q = anchors * block.
    """
    B, S, Q = len(seqs), max(len(s) for s in seqs), anchors * block
    input_ids = torch.zeros(B, S, dtype=torch.long)
    block_ids = torch.full((B, Q), mask_id, dtype=torch.long)
    block_pos = torch.zeros(B, Q, dtype=torch.long)
    labels = torch.full((B, Q), -100, dtype=torch.long)
    mask = torch.zeros(B, Q, S + Q, dtype=torch.bool)
    for b, (seq, lm) in enumerate(zip(seqs, loss_masks)):
        n = len(seq)
        input_ids[b, :n] = seq
        valid = torch.nonzero(lm[1:n - 1] & lm[2:n]).flatten() + 1  # p and p+1 are response tokens
        if len(valid) == 0:
            continue
        chosen = valid[torch.randperm(len(valid), generator=gen)[:anchors]].sort().values
        for j, p in enumerate(chosen.tolist()):
            rows = slice(j * block, (j + 1) * block)
            block_ids[b, rows.start] = seq[p]
            block_pos[b, rows] = torch.arange(p, p + block)
            targets = torch.arange(p + 1, p + block)
            ok = targets < n
            lab = torch.full((block - 1,), -100, dtype=torch.long)
            lab[ok] = torch.where(lm[targets[ok]], seq[targets[ok]], torch.tensor(-100))
            labels[b, rows.start + 1 : rows.stop] = lab
            mask[b, rows, :p] = True  # context strictly before the anchor
            mask[b, rows, S + rows.start : S + rows.stop] = True  # its own block, bidirectional
        unused = slice(len(chosen) * block, Q)
        mask[b, unused, S + unused.start : S + Q] = True  # padding blocks see themselves only (no labels)
    return input_ids, block_ids, block_pos, labels, mask


def batch_features(target: TargetModel, input_ids: torch.Tensor, layer_ids: tuple[int, ...]) -> torch.Tensor:
    """The target's features [B, S, len(layer_ids) * hidden] of a batch of sequences (padded with token 0)."""
    B, S = input_ids.shape
    return target(input_ids, torch.arange(S).expand(B, S), torch.arange(B), target.new_cache(B, S), layer_ids).hidden


@torch.inference_mode()
def target_features(target: TargetModel, seqs: list[torch.Tensor], layer_ids: tuple[int, ...], bar: Progress,
                    batch_tokens: int = 8192) -> list[torch.Tensor]:
    """Every training sequence's features [len, len(layer_ids) * hidden], computed once (`--cache-features`).

    Sequences of similar length share a pass, so little is padded. The training step then costs the drafter's
    pass only; what it reads is what the step would have computed, up to float rounding of other batch shapes."""
    order = sorted(range(len(seqs)), key=lambda i: len(seqs[i]))
    width = len(layer_ids) * target.spec.hidden_size
    total = sum(len(s) for s in seqs)
    bar.console.print(f"computing the target's features of {len(seqs)} sequences once ({total} tokens, "
                      f"{total * width * 4 / 2**30:.2f} GiB in memory)")
    task = bar.add_task("target features", total=len(seqs), loss=float("nan"), al=float("nan"))
    out: list[torch.Tensor | None] = [None] * len(seqs)
    start = 0
    while start < len(order):
        longest = len(seqs[order[start]])
        stop = start + 1
        while stop < len(order) and (stop - start + 1) * len(seqs[order[stop]]) <= max(batch_tokens, longest):
            longest = len(seqs[order[stop]])
            stop += 1
        group = order[start:stop]
        feats = batch_features(target, pad_sequence([seqs[i] for i in group], batch_first=True), layer_ids)
        for row, i in enumerate(group):
            out[i] = feats[row, : len(seqs[i])].clone()
        bar.advance(task, len(group))
        start = stop
    bar.remove_task(task)
    return out


def block_loss(logits: torch.Tensor, labels: torch.Tensor, block: int, gamma: float) -> torch.Tensor:
    """Cross-entropy with weight exp(-(k-1)/gamma) at block slot k, normalised by the valid weights."""
    k = torch.arange(labels.shape[1]) % block
    weights = torch.exp(-(k - 1).clamp_min(0) / gamma) * (labels != -100)
    ce = F.cross_entropy(logits.flatten(0, 1), labels.flatten().clamp_min(0), reduction="none").view_as(labels)
    return (ce * weights).sum() / weights.sum().clamp_min(1e-9)


def start_from(drafter: DFlashDrafter, source: Path, cfg: TrainConfig) -> None:
    """--init-from: copy a drafter's weights into `drafter` (made for the same target and settings); the modules it
    lacks (DFlash2's, when it is a DFlash drafter) keep their initial values. One sentence where it does not fit."""
    ckpt = load_drafter(source)
    where = f"--init-from {source}"
    p, q = ckpt.params, drafter.params
    for what, theirs, ours, option in (("block_size", p.block_size, q.block_size, "--block-size"),
                                       ("target_layer_ids", list(p.target_layer_ids), list(q.target_layer_ids),
                                        "--target-layer-ids"),
                                       ("num_hidden_layers", ckpt.spec.num_layers, drafter.spec.num_layers,
                                        "--num-layers")):
        if theirs != ours:
            raise UserError(f"{where}: its {what} is {theirs}, and this run's {option} gives {ours}; pass "
                            f"{option} to match it.")
    if p.mask_token_id != q.mask_token_id:
        raise UserError(f"{where}: its mask_token_id is {p.mask_token_id}, not this target's <|MASK|> token "
                        f"{q.mask_token_id}; it was trained for another target.")
    if p.dflash2 is not None and cfg.arch != "dflash2":
        raise UserError(f"{where}: it is a DFlash2 drafter; pass --arch dflash2 to continue training it.")
    if ckpt.draft_vocab_size is not None:
        raise UserError(f"{where}: it has its own lm_head over {ckpt.draft_vocab_size} tokens, which train-drafter "
                        "does not train; start from a drafter that uses the target's.")
    ours = drafter.state_dict()
    for name in ckpt.tensors.names():
        tensor = ckpt.tensors.get(name)
        if name not in ours or ours[name].shape != tensor.shape:
            raise UserError(f"{where}: tensor {name!r} {list(tensor.shape)} does not fit this run's drafter (its "
                            f"layers are the target's width and attention shape: "
                            f"{list(ours[name].shape) if name in ours else 'no such tensor'}).")
        ours[name] = tensor.float()
    drafter.load_state_dict(ours)


def selector_loss(selector: CandidateSelector, logits: torch.Tensor, hidden: torch.Tensor, block_ids: torch.Tensor,
                  labels: torch.Tensor, block: int, gamma: float) -> torch.Tensor:
    """DFlash2's selector objective, as the reference trains it (speculators dflash2/metrics.py): at every labelled
    slot, cross-entropy over the selector's scores of the top_k candidates of the drafter's logits, the label put in
    place of the last candidate where it is not among them, each slot's predecessor the token before it (the anchor
    for slot 1: teacher forcing); weighted over the slots as `block_loss`."""
    candidates = logits.detach().topk(selector.top_k, dim=-1).indices  # [B, Q, k]
    target = labels.clamp_min(0)
    hit = candidates.eq(target[..., None])
    found = hit.any(-1)
    index = torch.where(found, hit.long().argmax(-1), selector.top_k - 1)
    candidates[..., -1] = torch.where(found, candidates[..., -1], target)
    slot = torch.arange(labels.shape[1]) % block
    before_label = torch.cat([target[:, :1], target[:, :-1]], dim=1)
    before_block = torch.cat([block_ids[:, :1], block_ids[:, :-1]], dim=1)  # (the anchor, at slot 1)
    predecessors = torch.where(slot == 1, before_block, before_label)
    scores = selector.scores(logits.gather(-1, candidates), hidden, predecessors, candidates)
    weights = torch.exp(-(slot - 1).clamp_min(0) / gamma) * (labels != -100)
    ce = F.cross_entropy(scores.flatten(0, 1), index.flatten(), reduction="none").view_as(labels)
    return (ce * weights).sum() / weights.sum().clamp_min(1e-9)


@torch.no_grad()
def acceptance_estimate(target: TargetModel, drafter: DFlashDrafter, eos, prompts: list[Request],
                        max_seq_len: int) -> float:
    """Mean acceptance length of greedy DFlash with the current drafter on held-out prompts."""
    drafter.eval()
    executor = TorchExecutor(target, drafter, num_slots=len(prompts), max_seq_len=max_seq_len)
    steps = all_steps(Decoder.for_mode(executor, "dflash", eos).generate(prompts))
    drafter.train()
    return mean_acceptance_length(steps)


def _save_checkpoint(out: Path, drafter, opt, state: TrainState, cfg: TrainConfig, rng: torch.Generator) -> None:
    tmp = out / f".{CHECKPOINT}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    save_safetensors({k: v.contiguous() for k, v in drafter.state_dict().items()}, tmp / "drafter.safetensors")
    names = {id(p): n for n, p in drafter.named_parameters()}
    opt_tensors, opt_steps = {}, {}
    for group in opt.param_groups:
        for p in group["params"]:
            st = opt.state.get(p)
            if st:
                n = names[id(p)]
                opt_tensors[f"exp_avg.{n}"], opt_tensors[f"exp_avg_sq.{n}"] = st["exp_avg"], st["exp_avg_sq"]
                opt_steps[n] = float(st["step"])
    opt_tensors["rng_state"] = rng.get_state()
    save_safetensors(opt_tensors, tmp / "optimizer.safetensors")
    (tmp / "state.json").write_text(json.dumps({"config": asdict(cfg), "state": asdict(state),
                                                "optimizer_steps": opt_steps}, indent=1))
    final = out / CHECKPOINT
    shutil.rmtree(final, ignore_errors=True)
    tmp.rename(final)


def _load_checkpoint(out: Path, drafter, opt, cfg: TrainConfig, rng: torch.Generator) -> TrainState:
    ck = out / CHECKPOINT
    meta = json.loads((ck / "state.json").read_text())
    # a setting the checkpoint's version did not have yet had its default then
    saved = asdict(TrainConfig()) | {k: tuple(v) if isinstance(v, list) else v for k, v in meta["config"].items()}
    wanted = asdict(cfg)
    if saved != wanted:
        diff = sorted(k for k in saved if saved[k] != wanted[k])
        raise UserError(f"{ck}: the checkpoint was made with different settings ({', '.join(diff)}); "
                        "use the same arguments to resume, or another --output.")
    drafter.load_state_dict(load_file(str(ck / "drafter.safetensors")))
    tensors = load_file(str(ck / "optimizer.safetensors"))
    for n, p in drafter.named_parameters():
        if n in meta["optimizer_steps"]:
            opt.state[p] = {"step": torch.tensor(meta["optimizer_steps"][n]),
                            "exp_avg": tensors[f"exp_avg.{n}"], "exp_avg_sq": tensors[f"exp_avg_sq.{n}"]}
    rng.set_state(tensors["rng_state"])
    return TrainState(**meta["state"])


def train_drafter(target_dir: Path, data: Path, output: Path, cfg: TrainConfig, progress: bool = True) -> TrainState:
    """Train (or resume) and write OUTPUT/config.json + OUTPUT/model.safetensors (z-lab format).

    OUTPUT is checked before any work: it must be new, empty, or a drafter directory of an earlier run
    (which is resumed). A run whose loss stops being finite raises and writes no drafter."""
    require_file(data, "--data file")
    output = check_output_dir(output, "drafter", "--output", reuse=True,
                              inputs=(target_dir, data, *(() if cfg.init_from is None else (Path(cfg.init_from),))))
    target, tokenizer, eos = load_frozen_target(Path(target_dir))
    tspec = target.spec
    mask_id = tokenizer.convert_tokens_to_ids("<|MASK|>") if "<|MASK|>" in tokenizer.get_vocab() else None
    if mask_id is None or not 0 <= mask_id < tspec.vocab_size:
        raise UserError(f"{target_dir}: the tokenizer has no '<|MASK|>' token inside the embedding "
                        f"(vocab_size {tspec.vocab_size}); add one to train a DFlash drafter.")
    if cfg.num_layers > tspec.num_layers:
        raise UserError(f"--num-layers {cfg.num_layers}: a drafter deeper than its {tspec.num_layers}-layer target "
                        "would cost more per draft than the target's own step.")
    layer_ids = cfg.target_layer_ids or default_target_layer_ids(tspec.num_layers, cfg.num_layers)
    if len(set(layer_ids)) != len(layer_ids):
        raise UserError(f"target_layer_ids {list(layer_ids)} repeat a layer (the default spacing for a "
                        f"{tspec.num_layers}-layer target and {cfg.num_layers} draft layers); pass --target-layer-ids.")
    bad = [i for i in layer_ids if not 0 <= i < tspec.num_layers]
    if bad:
        raise UserError(f"--target-layer-ids {list(layer_ids)}: {bad} outside the target's layers 0..{tspec.num_layers - 1}.")
    dflash2 = DFlash2Params() if cfg.arch == "dflash2" else None
    if dflash2 is not None and tspec.hidden_size % dflash2.conv_group_size:
        raise UserError(f"--arch dflash2: the target's hidden_size {tspec.hidden_size} is not a multiple of the "
                        f"convolution's groups of {dflash2.conv_group_size} channels.")
    params = DFlashParams(cfg.block_size, mask_id, tuple(layer_ids), dflash2)
    if tspec.num_layers - 1 in layer_ids:
        Console(stderr=True).print(
            f"warning: --target-layer-ids {list(layer_ids)} include the target's last layer ({tspec.num_layers - 1}), "
            f"read here after the final norm; {LAST_LAYER_READERS}. The default spacing avoids it.",
            markup=False, highlight=False, soft_wrap=True)
    prompts = None if (output / DATA_FILE).exists() else _training_prompts(target, tokenizer, Path(data), cfg)
    output.mkdir(parents=True, exist_ok=True)
    if marker_kind(output) is None:
        write_marker(output, "drafter")

    columns = [TextColumn("{task.description}"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
               TextColumn("loss {task.fields[loss]:.3f}  AL {task.fields[al]:.2f}"), TimeRemainingColumn()]
    log = Console(stderr=True)
    with Progress(*columns, disable=not progress, console=log) as bar:
        rows = _training_data(target, eos, prompts, output, cfg, bar)
        held, train_rows = rows[: cfg.held_out], rows[cfg.held_out:]
        if not train_rows:
            raise UserError(f"{data}: needs more than {cfg.held_out} usable prompts (held out for evaluation).")
        max_len = max(len(r["prompt_token_ids"]) + len(r["response_token_ids"]) for r in rows) + cfg.block_size
        eval_prompts = [Request(id=r["id"], prompt_token_ids=r["prompt_token_ids"], max_new_tokens=cfg.response_tokens)
                        for r in held]

        torch.manual_seed(cfg.seed)
        drafter = DFlashDrafter(drafter_spec(tspec, cfg.num_layers), params)
        with torch.no_grad():  # HF-style init: N(0, 0.02) linears, unit norms; DFlash2's convolutions the identity
            for name, p in drafter.named_parameters():
                if p.ndim == 2 and "_conv." not in name:
                    p.normal_(0.0, 0.02)
        if cfg.init_from is not None:
            start_from(drafter, Path(cfg.init_from), cfg)
        drafter.train()
        opt = torch.optim.AdamW(drafter.parameters(), lr=cfg.lr, betas=(0.9, 0.95), weight_decay=0.0)
        warmup = max(1, int(cfg.steps * cfg.warmup_ratio))
        schedule = lambda s: min(1.0, (s + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * min(1.0, s / cfg.steps)))  # noqa: E731
        gen = torch.Generator().manual_seed(cfg.seed)
        state = _load_checkpoint(output, drafter, opt, cfg, gen) if (output / CHECKPOINT).exists() else TrainState()

        seqs = [torch.tensor(r["prompt_token_ids"] + r["response_token_ids"]) for r in train_rows]
        masks = [torch.tensor([False] * len(r["prompt_token_ids"]) + [True] * len(r["response_token_ids"]))
                 for r in train_rows]
        cached = target_features(target, seqs, params.target_layer_ids, bar) if cfg.cache_features else None
        lm_head = target.lm_head.weight
        task = bar.add_task("training drafter", total=cfg.steps, completed=state.step,
                            loss=state.losses[-1] if state.losses else float("nan"),
                            al=state.evals[-1]["acceptance_length"] if state.evals else float("nan"))
        while state.step < cfg.steps:
            t0 = time.perf_counter()
            for g in opt.param_groups:
                g["lr"] = cfg.lr * schedule(state.step)
            pick = torch.randint(0, len(seqs), (cfg.batch_size,), generator=gen).tolist()
            input_ids, block_ids, block_pos, labels, mask = sample_blocks(
                [seqs[i] for i in pick], [masks[i] for i in pick], cfg.anchors, cfg.block_size, mask_id, gen)
            with torch.inference_mode():
                computed = None if cached is not None else batch_features(target, input_ids, params.target_layer_ids)
                embeds = target.embed(block_ids)
            # cached: zeros past each sequence's end, never attended (a block sees only the context before its anchor)
            feats = (pad_sequence([cached[i] for i in pick], batch_first=True) if cached is not None
                     else computed.clone())
            hidden = drafter.forward_blocks(feats, embeds.clone(), block_pos, mask)
            logits = F.linear(hidden, lm_head)
            loss = block_loss(logits, labels, cfg.block_size, cfg.decay)
            if drafter.candidate_selector is not None:
                loss = loss + selector_loss(drafter.candidate_selector, logits, hidden, block_ids, labels,
                                            cfg.block_size, cfg.decay)
            if not torch.isfinite(loss):
                raise UserError(f"training diverged at step {state.step + 1} of {cfg.steps} (loss {loss.item()}); "
                                f"no drafter was written. Lower --lr (it is {cfg.lr}) and use a new --output.")
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(drafter.parameters(), 1.0)
            opt.step()
            state.step += 1
            state.losses.append(round(loss.item(), 5))
            state.seconds += time.perf_counter() - t0
            if state.step % cfg.eval_every == 0 or state.step == cfg.steps:
                al = acceptance_estimate(target, drafter, eos, eval_prompts, max_len)
                state.evals.append({"step": state.step, "acceptance_length": round(al, 4)})
                bar.update(task, al=al)
                log.print(f"step {state.step}/{cfg.steps}: loss {loss.item():.4f}, held-out acceptance length {al:.3f}")
            bar.update(task, advance=1, loss=loss.item())
            if state.step % cfg.save_every == 0 or state.step == cfg.steps:
                _save_checkpoint(output, drafter, opt, state, cfg, gen)

    save_drafter(output, drafter.spec, params, tspec.num_layers, drafter.state_dict(), cfg.dtype)
    (output / "training.json").write_text(json.dumps({"config": asdict(cfg), "state": asdict(state)}, indent=1) + "\n")
    return state


def _training_prompts(target: TargetModel, tokenizer, data: Path, cfg: TrainConfig) -> list[Request]:
    """DATA's prompts, every line checked (before the output directory is made)."""
    limit = target.spec.max_position_embeddings
    defaults = Defaults(cfg.response_tokens, 0.0, cfg.seed, limit, target.spec.vocab_size)
    requests, errors = read_requests(data, tokenizer, defaults)
    if errors:
        raise UserError(f"{data}:{errors[0].line}: {errors[0].message}.")
    requests = [Request(id=r.id, prompt_token_ids=r.prompt_token_ids, max_new_tokens=cfg.response_tokens)
                for r in requests]
    if not requests:
        raise UserError(f"{data}: no prompts.")
    return requests


def _training_data(target, eos, requests: list[Request] | None, output: Path, cfg: TrainConfig,
                   bar: Progress) -> list[dict]:
    """The prompts with the target's own responses; cached in OUTPUT so a resumed run reuses them (then
    `requests` is None)."""
    cached = output / DATA_FILE
    if requests is None:
        return [json.loads(line) for line in cached.read_text().splitlines()]
    max_len = max(len(r.prompt_token_ids) for r in requests) + cfg.response_tokens
    bar.console.print(f"generating the target's responses to {len(requests)} prompts ({cfg.response_tokens} tokens each)")
    rows = generate_responses(target, eos, requests, max_len, bar)
    rows = [r for r in rows if len(r["response_token_ids"]) >= 2]
    tmp = cached.with_suffix(".tmp")
    tmp.write_text("".join(json.dumps(r) + "\n" for r in rows))
    tmp.rename(cached)
    return rows
