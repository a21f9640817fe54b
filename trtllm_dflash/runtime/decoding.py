"""The DFlash decoding loop (and plain autoregressive decoding), batched over requests.

Per request: prefill -> [draft a block in one drafter pass -> verify it in one target pass ->
accept -> commit accepted drafts + bonus token -> add the committed positions' target features to
the drafter's context] until EOS / a stop token / a stop string / max_new_tokens, or until it is cancelled.

Requests join and leave the batch at every step (continuous batching): each holds one KV-cache
slot in the target's and the drafter's cache, its own positions and its own acceptance history.

Invariant per active request: the target KV cache holds positions [0, start) where
start = prompt length + committed output tokens - 1; the last committed token (the anchor) is
not yet in it. The drafter's context cache holds the same positions.
"""

from __future__ import annotations

import bisect
import math
import struct
import time
from collections import deque
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Literal

import torch
from torch.nn.utils.rnn import pad_sequence
from transformers import PreTrainedTokenizerBase

from trtllm_dflash.inputs import shown
from trtllm_dflash.runtime.executor import DraftContext, Executor, HostRows, StepOutput
from trtllm_dflash.runtime.stop_strings import first_stop
from trtllm_dflash.runtime.options import Mode
from trtllm_dflash.runtime.verify import StepShape, TreeDrafting, VerifyPolicy, verify_policy
from trtllm_dflash.speculative.core import Sampling, sample_tokens
from trtllm_dflash.speculative.tree import accepted_paths, ancestor_mask, build_trees, chain_outcomes
from trtllm_dflash.speculative.schedule import AcceptanceEstimate, AutoBlockSize


# --block-size auto: the prompt and plain AR steps hold back at most this many positions' features from the
# drafter per request (memory: slots x this x len(target_layer_ids) x hidden_size values; 400 MB in bfloat16
# for 32 slots of a Qwen3-8B pair), then add them in one call. A request that never has a speculative step
# before it ends never costs the drafter anything.
MAX_PENDING_CONTEXT = 512

# A target pass's fixed cost in prompt tokens, on the CPU (the demo target on 1 thread: 5.5 ms for 1 token,
# ~0.18 ms per further token): admitted prompts are prefilled in groups of similar lengths when padding them
# to one length would cost more than another pass. On a GPU a pass costs about the same for any prompt
# length that fits, so on devices not listed here the admitted prompts prefill together, padded.
PREFILL_PASS_TOKENS = {"cpu": 32}


@dataclass(frozen=True)
class Request:
    id: str | int
    prompt_token_ids: list[int]
    max_new_tokens: int
    temperature: float = 0.0
    seed: int = 0  # per-request sampling seed (see speculative.core.request_seed)
    top_k: int = 0  # sample among the k most likely tokens only; 0: no limit (ignored when greedy)
    top_p: float = 1.0  # ... and among the most likely ones whose probability reaches top_p; 1: no limit
    stop: tuple[str, ...] = ()  # stop strings: the text ends right before the first one (runtime/stop_strings.py)


# top_k larger than any vocabulary means no limit; this bound keeps it an int32 (Triton's tensor, the kernels').
MAX_TOP_K = 2**31 - 1


def check_top_k(value, name: str) -> int:
    """A request's top_k; ValueError (naming the field `name`) unless an integer from 0 to MAX_TOP_K."""
    if type(value) is not int or not 0 <= value <= MAX_TOP_K:
        raise ValueError(f"'{name}' must be an integer from 0 to {MAX_TOP_K} (0: no limit), got {shown(value)}")
    return value


def check_top_p(value, name: str) -> float:
    """A request's top_p; ValueError unless a number in (0, 1]."""
    if type(value) not in (int, float) or not (math.isfinite(value) and 0 < value <= 1):
        raise ValueError(f"'{name}' must be a number in (0, 1] (1: no limit), got {shown(value)}")
    return float(value)


def check_stop(value, name: str) -> tuple[str, ...]:
    """A request's stop strings; ValueError unless a list of non-empty strings."""
    if not (isinstance(value, (list, tuple)) and all(isinstance(s, str) for s in value)):
        raise ValueError(f"'{name}' must be a list of strings, got {shown(value)}")
    if "" in value:
        raise ValueError(f"'{name}' has an empty string, which would stop every request at once")
    return tuple(value)


FinishReason = Literal["stop", "length", "cancelled"]


@dataclass(frozen=True)
class Result:
    request: Request
    output_token_ids: list[int]
    finish_reason: FinishReason  # stop: EOS, a stop token or a stop string
    acceptance_lengths: list[int]  # tokens committed per verify step (accepted drafts + 1)
    ttft_s: float = 0.0  # submission -> first output token (includes queueing for a free slot)
    e2e_s: float = 0.0  # submission -> last output token
    # dflash mode: tokens per request of each step's target pass after the prefill (block_size with a fixed
    # block; with --block-size auto the chosen k, 1 for a plain AR step, which has no acceptance length)
    verify_lengths: list[int] = field(default_factory=list)
    stop_reason: str | None = None  # the stop string that ended the request, if one did

    @property
    def tpot_s(self) -> float | None:
        """Time per output token after the first (trtllm-bench's TPOT); None for one-token outputs."""
        n = len(self.output_token_ids)
        return (self.e2e_s - self.ttft_s) / (n - 1) if n > 1 else None


@dataclass(frozen=True)
class Update:
    """What one scheduler step produced for one request: newly committed tokens, and its result once done."""

    request: Request
    new_token_ids: list[int]
    result: Result | None = None


@dataclass
class _Active:
    request: Request
    slot: int
    submitted: float
    output: list[int] = field(default_factory=list)  # committed tokens; the last one is the anchor
    acceptance_lengths: list[int] = field(default_factory=list)
    verify_lengths: list[int] = field(default_factory=list)
    # Target features [n, F] of the positions just before `start` that the drafter's context does not hold yet,
    # oldest first: those the last verify step committed, which the next draft pass adds; with --block-size auto also
    # the prompt's and those plain AR steps committed (held back: a request that never drafts again never pays for
    # them), added in a pass of their own first when they are more than a block's worth
    pending_context: list[torch.Tensor] = field(default_factory=list)
    num_pending: int = 0  # positions in pending_context (kept, not summed: a step checks every request's)
    acceptance: AcceptanceEstimate | None = None  # --block-size auto: this request's own acceptance estimate
    finish_reason: FinishReason | None = None
    stop_reason: str | None = None
    first_token_at: float | None = None
    cached: int = 0  # prompt positions already in the caches at admission (a shared prefix): the prefill skips them
    # its prompt blocks are to be shared once the drafter holds their context (--block-size auto holds it back)
    unpublished: bool = False
    shared_end: int = 0  # the end of the prompt blocks it shares by prefix (full blocks of `known` but its last token)
    # positions where its prefill passes end, for the executor to keep the target's recurrent states there
    # (Executor.checkpoints; a hybrid target's prefix reuse)
    checkpoints: list[int] = field(default_factory=list)
    preempted: int = 0  # times its caches were taken back for others (it was recomputed after each)
    reported: int = 0  # output tokens already in an Update
    arrival: int = 0  # submission order (the same on every tensor-parallel rank, unlike `submitted`)

    def hold_context(self, features: torch.Tensor) -> None:
        """Keep target features [n, F] of the next n positions for the drafter's next context update."""
        self.pending_context.append(features)
        self.num_pending += features.shape[0]

    def take_context(self) -> torch.Tensor:
        """The held features [num_pending, F], oldest first; none are held afterwards."""
        chunks = self.pending_context
        features = chunks[0] if len(chunks) == 1 else torch.cat(chunks)
        self.pending_context, self.num_pending = [], 0
        return features

    @property
    def start(self) -> int:
        """Position of the anchor = number of positions in the KV caches."""
        return len(self.request.prompt_token_ids) + len(self.output) - 1

    @property
    def known(self) -> list[int]:
        """What a prefill puts in the caches: the prompt; for a preempted request, the prompt and its committed tokens
        but the anchor (positions 0 .. start - 1), the prefill of its recompute."""
        prompt = self.request.prompt_token_ids
        return prompt + self.output[:-1] if self.output else prompt

    def commit(self, tokens: list[int], stop_ids: frozenset[int]) -> list[int]:
        """Append tokens up to the first stop token / the length limit; returns those appended."""
        done = []
        for tok in tokens:
            self.output.append(tok)
            done.append(tok)
            if tok in stop_ids:
                self.finish_reason = "stop"
            elif len(self.output) >= self.request.max_new_tokens:
                self.finish_reason = "length"
            if self.finish_reason:
                break
        if self.first_token_at is None:
            self.first_token_at = time.perf_counter()
        return done

    def result(self) -> Result:
        now = time.perf_counter()
        first = now if self.first_token_at is None else self.first_token_at  # cancelled before its first token
        return Result(self.request, self.output, self.finish_reason, self.acceptance_lengths,
                      ttft_s=first - self.submitted, e2e_s=now - self.submitted,
                      verify_lengths=self.verify_lengths, stop_reason=self.stop_reason)


class Decoder:
    """Continuous-batching scheduler over one executor's KV-cache slots; `policy` says how many tokens each step
    verifies (runtime/verify.py: plain decoding, a fixed DFlash block, or --block-size auto).

    `submit` queues requests; every `step` admits queued requests into free slots (one batched
    prefill; on the CPU, one per group of similar prompt lengths), runs one decoding step (a draft +
    verify pass, or one plain token) for every running request and returns what each request committed.
    Finished requests free their slot in the same step, so the next step admits new ones. `generate` is the batch-job
    loop over it. Where prompt blocks are shared by prefix, a request whose prompt starts with blocks that another
    request admitted in the same step is computing is admitted after that one's prefill (a second wave of the step),
    and finds them cached; requests behind it that need nothing from that wave are not held back with it.

    KV memory (a paged cache, runtime/kv_blocks.py): requests are admitted in arrival order while the executor can
    hold their prompts (`reserve`), leaving a block per running request for it to grow into; before every step each
    running request takes the blocks the step can write (`extend`). When one cannot, the running request that arrived
    last is preempted: its blocks are returned and it waits at the head of the queue; admitted again, it is recomputed
    (one prefill of its prompt and committed tokens, the prompt's blocks often found cached) and goes on with the
    tokens it had, the same as had it never stopped (the sampling noise is a function of the seed and the position).

    `cancel` ends a request at the next step: before anything is admitted, it leaves with what it has
    committed (finish_reason "cancelled") and its slot is released exactly as a finished request's.
    Requests with stop strings need the `tokenizer` (the engine's, which decodes `run`'s text).

    A step verifies the same k tokens for every request (one k per step, not per request: an executor's target
    pass takes one [B, T] block, and ragged lengths would pad to the longest and cost as much).

    Host and device: what the host already knows (slots, starts, anchors, sampling settings) goes to the device in
    one copy per step (`_stage`), the executors are told it as HostRows, and a step's results (accepted drafts,
    bonus tokens, drafts) come back in one read (`_read`): one host synchronization per decoding step. Running
    requests are kept in slot order and take the lowest free slot, so a batch's slots are usually one run that
    the caches read as views.
    """

    def __init__(self, executor: Executor, policy: VerifyPolicy, stop_token_ids: Iterable[int],
                 tokenizer: PreTrainedTokenizerBase | None = None):
        if policy.longest > executor.block_size:
            raise ValueError(f"the policy verifies up to {policy.longest} tokens a step, more than the executor's "
                             f"block of {executor.block_size}")
        self.executor, self.policy, self.tokenizer = executor, policy, tokenizer
        self.stop_ids = frozenset(stop_token_ids)
        self._pending: deque[_Active] = deque()  # waiting, in arrival order (slot -1): new requests and preempted ones
        self._free = list(range(executor.num_slots))  # kept sorted: a new request takes the lowest
        self._active: list[_Active] = []  # in slot order
        self._cancelled: set[str | int] = set()  # ids to end at the next step
        # What a request's prompt blocks hold once shared by prefix with later requests of the same kind
        # (executor.reserve): the target's K/V; with a drafter, its context too, which a policy that defers the
        # prompt's features to the drafter (--block-size auto) writes later: the blocks are published then.
        self._share = "target+drafter" if policy.drafts else "target"
        self.preemptions = 0  # over the decoder's life
        self._arrivals = 0

    @classmethod
    def for_mode(cls, executor: Executor, mode: Mode, stop_token_ids: Iterable[int] = (),
                 auto: AutoBlockSize | None = None, tokenizer: PreTrainedTokenizerBase | None = None) -> "Decoder":
        """The decoder of `run --mode`: plain decoding for "ar"; for "dflash", `auto`'s choice (--block-size auto)
        when given, else blocks of the executor's block_size."""
        return cls(executor, verify_policy(mode, executor.block_size, auto), stop_token_ids, tokenizer)

    def check(self, request: Request) -> None:
        """Raise ValueError if the request can never fit in a slot (prompt + max_new_tokens > max_seq_len) or
        has stop strings without a tokenizer to find them."""
        limit = self.executor.max_seq_len
        if len(request.prompt_token_ids) + request.max_new_tokens > limit:
            raise ValueError(f"request {shown(request.id)}: prompt ({len(request.prompt_token_ids)} tokens) + "
                             f"max_new_tokens ({request.max_new_tokens}) exceeds the engine's max_seq_len {limit}")
        if request.stop and self.tokenizer is None:
            raise ValueError(f"request {shown(request.id)}: stop strings need a decoder with a tokenizer")

    def submit(self, request: Request) -> None:
        self.check(request)
        self._arrivals += 1
        self._pending.append(_Active(request, -1, time.perf_counter(), arrival=self._arrivals))

    def cancel(self, request_id: str | int) -> None:
        """End the request at the next step (waiting or running); an id that is not in flight is ignored."""
        self._cancelled.add(request_id)

    @property
    def has_work(self) -> bool:
        return bool(self._pending or self._active or self._cancelled)

    @property
    def num_active(self) -> int:
        return len(self._active)

    def step(self) -> list[Update]:
        updates = self._drop_cancelled()
        admitted = []
        while wave := self._admit(admitted):  # each wave's prefill publishes blocks the next one's prompts start with
            self._prefill(wave)
            admitted += wave
        if admitted:
            self._active = sorted(self._active + admitted, key=lambda a: a.slot)
        running = self._make_room([a for a in self._active if a.finish_reason is None])
        if running:
            self._decode(running)
        for a in list(self._active):
            new, a.reported = a.output[a.reported:], len(a.output)
            result = self._finish(a) if a.finish_reason is not None else None
            if new or result:
                updates.append(Update(a.request, new, result))
        return updates

    def _admit(self, earlier: list[_Active]) -> list[_Active]:
        """Take waiting requests into free slots in arrival order (one waiting for KV memory holds back those after
        it). One whose prompt starts with blocks that a request of this wave is about to compute is held for the next
        wave, after this one's prefill has published them, so that a burst of requests with one system prompt prefills
        it once. Later requests are let by while they leave each one held a free slot and the blocks of what it will not
        find cached (`earlier`: this step's earlier waves, already prefilled and published)."""
        wave: list[_Active] = []
        held: list[int] = []  # of each request held for the next wave, the positions it will not find cached
        for a in list(self._pending):
            if len(self._free) <= len(held):
                break
            found, source = self._found_in(a, wave)
            if found:
                held.append(len(a.known) - found)
                if self.executor.resumes_states:  # it resumes the target's states where its prefix ends
                    source.checkpoints.append(found)
                continue
            # a block left free per running request (and per one held): its next step may need one
            cached = self.executor.reserve(self._free[0], a.known, self._share, waiting=held,
                                           headroom=len(self._active) + len(earlier) + len(wave) + len(held))
            if cached is None:
                if not self._active and not earlier and not wave:  # nothing will ever free memory for it
                    raise RuntimeError(f"request {shown(a.request.id)} does not fit in the KV cache even alone")
                break
            self._pending.remove(a)
            a.slot, a.cached = self._free.pop(0), cached
            a.checkpoints = list(self.executor.checkpoints(a.slot))
            if a.acceptance is None:  # a preempted request keeps its own
                a.acceptance = self.policy.new_request()
            wave.append(a)
        return wave

    def _found_in(self, a: _Active, wave: list[_Active]) -> tuple[int, _Active | None]:
        """How many positions of `a`'s prompt it would find cached once `wave`'s prefill has published its blocks,
        where a request of `wave` computes a full block `a`'s prompt starts with (past what it found cached), and the
        first such request that computes them all; else (0, None). The blocks are those reserve shares, of every token
        but the last. (Where the policy holds a prompt's features back from the drafter, a prompt publishes with its
        prefill only when it is longer than the features held back.)"""
        block = self.executor.prefix_block_tokens
        if block is None:
            return 0, None
        tokens, found, source = a.known[:-1], 0, None
        for b in wave:
            if self.policy.defers_context and len(b.known) - b.cached <= MAX_PENDING_CONTEXT:
                continue
            theirs, shared = b.known[:-1], 0
            while shared + block <= min(len(tokens), len(theirs)) and \
                    tokens[shared:shared + block] == theirs[shared:shared + block]:
                shared += block
            if shared > max(b.cached, found):
                found, source = shared, b
        return found, source

    def _make_room(self, running: list[_Active]) -> list[_Active]:
        """Give every running request the cache positions its next step can write, oldest first; where none are free,
        preempt the requests that arrived last (at worst the one asking) until they are. Returns those still running."""
        by_arrival = sorted(running, key=lambda a: a.arrival)
        i = 0
        while i < len(by_arrival):
            a = by_arrival[i]
            if self.executor.extend(a.slot, a.start):
                i += 1
            elif len(by_arrival) == 1:  # alone, and a request of max_seq_len fits alone (plan_blocks): a bug
                raise RuntimeError(f"request {shown(a.request.id)} does not fit in the KV cache even alone")
            else:
                self._preempt(by_arrival.pop())
        return [a for a in running if a.slot >= 0]

    def _preempt(self, a: _Active) -> None:
        """Take a running request's caches back: it waits at the head of the queue, to be recomputed (`known`)."""
        self._active.remove(a)
        self.executor.release(a.slot)
        bisect.insort(self._free, a.slot)
        a.slot, a.cached, a.pending_context, a.num_pending, a.unpublished, a.checkpoints = -1, 0, [], 0, False, []
        a.preempted += 1
        self.preemptions += 1
        self._pending.appendleft(a)

    def _finish(self, a: _Active) -> Result:
        """Take a finished request out of the batch and free its slot (its prompt blocks published first, if they
        were not: `_publish_at_the_end`)."""
        if a.unpublished:
            self._publish_at_the_end(a)
        self._active.remove(a)
        self.executor.release(a.slot)
        bisect.insort(self._free, a.slot)
        return a.result()

    def _drop_cancelled(self) -> list[Update]:
        """End the cancelled requests: running ones free their slot for this step's admissions."""
        if not self._cancelled:
            return []
        ids, self._cancelled = self._cancelled, set()
        updates = []
        for a in [a for a in self._active if a.request.id in ids]:
            a.finish_reason = "cancelled"
            updates.append(Update(a.request, a.output[a.reported:], self._finish(a)))
        for a in [a for a in self._pending if a.request.id in ids]:  # a preempted one leaves with what it committed
            self._pending.remove(a)
            a.finish_reason = "cancelled"
            updates.append(Update(a.request, a.output[a.reported:], a.result()))
        return updates

    def generate(self, requests: Iterable[Request]) -> Iterator[Result]:
        """Yield each request's result as soon as it finishes (not in input order)."""
        return run_to_completion(self, requests)

    def save(self) -> None:
        """Keep what the policy learnt for the next run (--block-size auto's acceptance prior), if anything."""
        save = getattr(self.policy, "save", None)
        if save is not None:
            save()

    def _stage(self, active: list[_Active], spans: list[tuple[int, int]] | None = None) -> _Staged:
        """The batch's host values on the executor's device, in one copy: slots, starts (a prefill pass: the first of
        each request's `spans` of positions of `known`, whose ids it stages padded to the longest), anchors, sampling
        settings and, where requests hold features for the drafter, where those begin."""
        reqs = [a.request for a in active]
        temperature = [r.temperature for r in reqs]
        starts = [first for first, _ in spans] if spans is not None else [a.start for a in active]
        rows = [[a.slot for a in active], starts, [a.output[-1] if a.output else 0 for a in active],
                [a.start - a.num_pending for a in active], [r.top_k for r in reqs],
                float_bits(temperature), float_bits([r.top_p for r in reqs]), [r.seed for r in reqs]]
        if spans is not None:
            longest = max(end - first for first, end in spans)
            rows += [[end - first - 1 for first, end in spans],
                     [t for a, (first, end) in zip(active, spans)
                      for t in a.known[first:end] + [0] * (longest - (end - first))]]
        slots, starts_d, anchors, context_starts, top_k, temperature_bits, top_p_bits, seeds, *prefill = to_device(
            rows, self.executor.device)
        truncated = any(r.temperature > 0 and (r.top_k > 0 or r.top_p < 1) for r in reqs)
        sampling = Sampling(bits_float(temperature_bits), top_k, bits_float(top_p_bits), seeds,
                            sampled=any(t > 0 for t in temperature), truncated=truncated)
        last, prompt_ids = (prefill[0], prefill[1].view(len(active), -1)) if prefill else (None, None)
        return _Staged(HostRows(tuple(rows[0]), tuple(starts)), slots, starts_d, anchors, context_starts, sampling,
                       any(t > 0 for t in temperature), last, prompt_ids)

    def _commit(self, a: _Active, tokens: list[int]) -> None:
        """Commit a step's tokens: up to a stop token or the length limit, then up to the token that completes
        a stop string (the tokens after it are dropped, as after a stop token)."""
        checked = len(a.output)
        a.commit(tokens, self.stop_ids)
        match = first_stop(self.tokenizer, a.output, checked, a.request.stop) if a.request.stop else None
        if match is not None:
            del a.output[match.num_tokens:]
            a.finish_reason, a.stop_reason = "stop", match.stop

    def _prefill(self, admitted: list[_Active]) -> None:
        """One target pass per group of similar prompt lengths (prefill_groups): a batch is padded to its longest
        prompt, and on a CPU one pass over 32 prompts of 20 to 250 tokens would cost three times the prompts'
        own tokens."""
        lengths = [len(a.known) - a.cached for a in admitted]
        pass_tokens = PREFILL_PASS_TOKENS.get(self.executor.device.type)
        for group in prefill_groups(lengths, pass_tokens) if pass_tokens is not None else [range(len(admitted))]:
            self._prefill_group([admitted[i] for i in group])

    def _prefill_group(self, admitted: list[_Active]) -> None:
        """Target passes over the admitted requests' uncached positions (each from its `cached` position on, padded to
        the longest): one, after one ending at each of their checkpoints, if any (the executor keeps the target's
        recurrent states there); the drafter's context of them, each new request's first token (a preempted one has
        its tokens); then their blocks may be shared."""
        hold = self.policy.drafts and self.policy.defers_context and \
            max(len(a.known) - a.cached for a in admitted) <= MAX_PENDING_CONTEXT
        done = [a.cached for a in admitted]  # each one's positions in the caches so far
        while cuts := [(i, c) for i, a in enumerate(admitted)
                       if (c := min((p for p in a.checkpoints if done[i] < p < len(a.known)), default=None))]:
            part = [admitted[i] for i, _ in cuts]
            self._prefill_pass(part, [(done[i], c) for i, c in cuts], hold)
            for a, (i, c) in zip(part, cuts):
                self.executor.checkpoint(a.slot, c)
                done[i] = c
        batch, out = self._prefill_pass(admitted, [(d, len(a.known)) for a, d in zip(admitted, done)], hold)
        first = sample_tokens(out.logits, batch.sampling, (batch.starts + batch.last + 1)[:, None])[:, 0]
        block = self.executor.prefix_block_tokens or 1
        for a, tok in zip(admitted, first.tolist()):  # the prefill's one read
            a.unpublished, a.shared_end = True, (len(a.known) - 1) // block * block
            if not a.output:
                self._commit(a, [tok])
        self._publish(admitted)

    def _prefill_pass(self, requests: list[_Active], spans: list[tuple[int, int]], hold: bool
                      ) -> tuple[_Staged, StepOutput]:
        """One target pass over each request's span (first, end) of `known`, padded to the longest, and the drafter's
        context of it: held back (`hold`) or added now."""
        batch = self._stage(requests, spans)
        out = self.executor.target_forward(batch.prompts, batch.starts, batch.slots, capture=self.policy.drafts,
                                           last_index=batch.last, rows=batch.rows)
        if hold:
            for row, (a, (first, end)) in enumerate(zip(requests, spans)):  # until a speculative step needs them
                a.hold_context(out.hidden[row, : end - first])
        elif self.policy.drafts:
            # Padding columns of shorter prompts land past their `start` and stay masked.
            self.executor.append_context(out.hidden, batch.starts, batch.slots, rows=batch.rows)
        return batch, out

    def _publish(self, requests: list[_Active]) -> None:
        """Share the prompt blocks of those requests whose drafter holds their prompt's context (all, at the prefill,
        unless the policy holds the features back; then once a draft pass or a pass of their own has added them)."""
        for a in requests:
            if a.unpublished and not a.num_pending:
                self.executor.publish(a.slot)
                a.unpublished = False

    def _publish_at_the_end(self, a: _Active) -> None:
        """A request ends with its prompt blocks unpublished: the policy held the prompt's features back from the
        drafter, and no speculative step (nor a flush) since has given them to it, as where --block-size auto runs
        plain steps only. Give the drafter the features of those blocks in a pass of their own and publish them, so
        that later requests with the same prompt find them: a drafter pass over at most the prompt, where each later
        hit saves a target pass over it."""
        if self.executor.prefix_block_tokens is None:
            return
        first = a.start - a.num_pending  # the first position the drafter's context lacks
        if a.shared_end > first:
            hidden = a.take_context()[: a.shared_end - first]
            slots, starts = to_device([[a.slot], [first]], self.executor.device)
            self.executor.append_context(hidden[None], starts, slots, rows=HostRows((a.slot,), (first,)))
        self.executor.publish(a.slot)
        a.unpublished = False

    def _decode(self, active: list[_Active]) -> None:
        """One decoding step for every running request: the policy's k, then a plain step (k = 1) or a draft pass and
        a verify pass; one read of the results; commit."""
        began = time.perf_counter()
        shape = self._shape(active)
        if isinstance(self.policy, TreeDrafting):
            self._tree_step(active, shape, began)
            return
        k = self.policy.choose(shape)
        if self.policy.drafts:  # features held back that need a pass of their own first
            self._flush_context([a for a in active if a.num_pending >= MAX_PENDING_CONTEXT or
                                 (k > 1 and a.num_pending > self.executor.block_size)])
        if getattr(self.policy, "tree_step", False):  # (--block-size auto chose the tree)
            self._tree_step(active, shape, began)
            return
        batch = self._stage(active)
        if k == 1:  # plain: the anchor alone (with a drafter, its features are kept for later steps)
            out = self.executor.target_forward(batch.anchors[:, None], batch.starts, batch.slots,
                                               capture=self.policy.drafts, rows=batch.rows)
            bonus = sample_tokens(out.logits, batch.sampling, (batch.starts + 1)[:, None])[:, 0]
            results = bonus[:, None]
        else:  # one drafter pass (the features the last step committed join its context), one verify pass
            draft = self.executor.draft(batch.anchors, batch.starts, batch.slots, k - 1,
                                        self._draft_context(active, batch), rows=batch.rows,
                                        width=self.policy.width)  # [B, k-1] greedy
            self._publish(active)
            block = torch.cat([batch.anchors[:, None], draft], dim=1)  # [B, k]
            out = self.executor.target_forward(block, batch.starts, batch.slots, capture=True, rows=batch.rows)
            accepted, bonus = self.executor.accept(draft, out.logits, batch.sampling, batch.starts)  # [B], [B]
            results = torch.cat([bonus[:, None], accepted[:, None], draft], dim=1)
        # The step's one read: on a GPU it waits for the step's work, so the time below is real.
        accepted_list = []
        for row, (a, (bonus_token, *rest)) in enumerate(zip(active, results.tolist())):
            n, drafts = (rest[0], rest[1:]) if rest else (0, [])
            accepted_list.append(n)
            if self.policy.drafts:
                a.verify_lengths.append(k)
                # The anchor and the accepted drafts are now in the target's KV cache; the drafter gets their
                # features with its next draft pass (after plain steps, in a pass of its own once they are many).
                a.hold_context(out.hidden[row, : n + 1])
            if k > 1:
                a.acceptance_lengths.append(n + 1)
            self._commit(a, drafts[:n] + [bonus_token])
        self.policy.observe(k, accepted_list, shape, time.perf_counter() - began)

    def _tree_step(self, active: list[_Active], shape: StepShape, began: float) -> None:
        """One DDTree step (speculative/tree.py): the drafter's best candidates per position, a tree of the policy's
        budget built from them on the host, one verify pass over every tree, the accepted paths' cache entries moved
        into place, commit. Two reads: the candidates, then the target's tokens."""
        ex, policy = self.executor, self.policy
        batch = self._stage(active)
        ids, logprobs = ex.draft_candidates(batch.anchors, batch.starts, batch.slots, policy.candidates,
                                            self._draft_context(active, batch), rows=batch.rows)
        self._publish(active)
        candidates = ids.tolist()
        trees = build_trees([a.output[-1] for a in active], candidates, logprobs.tolist(), policy.budget)
        parents, tokens, depths = (torch.tensor(x, device=ex.device) for x in (trees.parents, trees.tokens,
                                                                              trees.depths))
        out = ex.verify_tree(tokens, depths, ancestor_mask(parents), batch.starts, batch.slots, capture=True,
                             rows=batch.rows)
        target = sample_tokens(out.logits, batch.sampling, batch.starts[:, None] + depths + 1).tolist()
        paths = accepted_paths(trees, target)
        width = max(len(p) for p in paths)
        ex.keep_path(batch.slots, batch.starts, torch.tensor([p + [0] * (width - len(p)) for p in paths],
                                                             device=ex.device))
        for row, (a, path) in enumerate(zip(active, paths)):
            a.verify_lengths.append(trees.nodes)
            a.acceptance_lengths.append(len(path))
            a.hold_context(out.hidden[row, torch.tensor(path, device=ex.device)])  # the anchor and accepted nodes
            self._commit(a, [trees.tokens[row][n] for n in path[1:]] + [target[row][path[-1]]])
        seconds = time.perf_counter() - began
        # (with what the chain of the best drafts would have done: auto's chains learn from tree steps too)
        chains = chain_outcomes(trees, paths, target, [[c[0] for c in row] for row in candidates])
        policy.observe(trees.nodes, [len(p) - 1 for p in paths], shape, seconds, chains)

    def _shape(self, active: list[_Active]) -> StepShape:
        """What the policy chooses from; `pending`: held-back positions per request beyond what a draft pass takes
        (what a speculative step must hand over first)."""
        block = self.executor.block_size
        return StepShape(batch=len(active), context=max(a.start for a in active),
                         estimates=[a.acceptance for a in active],
                         pending=sum(a.num_pending for a in active if a.num_pending > block) / len(active),
                         remaining=sum(a.request.max_new_tokens - len(a.output) for a in active) / len(active))

    def _draft_context(self, active: list[_Active], batch: _Staged) -> DraftContext | None:
        """The features each request holds for the drafter (at most block_size positions each, once the flush has
        run), as one DraftContext padded to the most any request holds; None if none holds any."""
        held = [a.take_context() if a.num_pending else None for a in active]
        some = next((h for h in held if h is not None), None)
        if some is None:
            return None
        empty = some.new_zeros(0, some.shape[-1])
        return DraftContext(pad_sequence([empty if h is None else h for h in held], batch_first=True),
                            batch.context_starts)

    def _flush_context(self, requests: list[_Active]) -> None:
        """Give the drafter, in passes of their own, the features these requests hold (a prompt's, or those plain
        steps held back): request r's are positions start_r - n_r .. start_r - 1. One call per distinct n_r (usually
        one or two: the plain steps' rows, which every running request has alike, and a new request's prompt), so
        nothing is padded and no write can run past a slot's last position."""
        groups: dict[int, list[_Active]] = {}
        for a in requests:
            groups.setdefault(a.num_pending, []).append(a)
        for n, group in groups.items():
            slots, starts = [a.slot for a in group], [a.start - n for a in group]
            staged = to_device([slots, starts], self.executor.device)
            hidden = torch.stack([a.take_context() for a in group])  # [len(group), n, F]
            self.executor.append_context(hidden, staged[1], staged[0], rows=HostRows(tuple(slots), tuple(starts)))
        self._publish(requests)


@dataclass(frozen=True)
class _Staged:
    """A batch's host values on the device (`Decoder._stage`)."""

    rows: HostRows
    slots: torch.Tensor  # [B] int64
    starts: torch.Tensor  # [B] int64: each request's anchor position (0 in a prefill)
    anchors: torch.Tensor  # [B] int64: each request's last committed token
    context_starts: torch.Tensor  # [B] int64: the first position of the features a request holds for the drafter
    sampling: Sampling
    sampled: bool  # some request samples (temperature > 0)
    last: torch.Tensor | None = None  # prefill: [B] each prompt's last column
    prompts: torch.Tensor | None = None  # prefill: [B, longest] prompt ids, padded with 0


def float_bits(values: list[float]) -> list[int]:
    """float32 values as their int32 bit patterns (to travel in an int64 staging buffer; bits_float undoes it)."""
    return list(struct.unpack(f"{len(values)}i", struct.pack(f"{len(values)}f", *values)))


def bits_float(bits: torch.Tensor) -> torch.Tensor:
    """[B] int64 holding int32 bit patterns -> the float32 values (float_bits' inverse), on bits' device."""
    return bits.to(torch.int32).view(torch.float32)


def to_device(rows: list[list[int]], device: torch.device) -> list[torch.Tensor]:
    """Host integer lists -> one int64 tensor per list on `device`, in one copy (on a GPU from pinned memory and
    without waiting: the copy is queued ahead of the passes that read it)."""
    host = torch.tensor([v for row in rows for v in row], dtype=torch.int64)
    if device.type != "cpu":
        host = host.pin_memory().to(device, non_blocking=True)
    return list(host.split([len(row) for row in rows]))


def prefill_groups(lengths: list[int], pass_tokens: int) -> list[list[int]]:
    """Indices into `lengths` grouped for batched prefill passes, each padded to its longest member, where a pass
    costs `pass_tokens` plus its padded tokens. By increasing length, the next prompt joins the current group
    when padding the group's n members up to it costs at most what a pass of its own would
    (n x (its length - the group's longest) <= pass_tokens)."""
    groups: list[list[int]] = []
    longest = 0
    for i in sorted(range(len(lengths)), key=lengths.__getitem__):
        if groups and len(groups[-1]) * (lengths[i] - longest) <= pass_tokens:
            groups[-1].append(i)
        else:
            groups.append([i])
        longest = lengths[i]
    return groups


def run_to_completion(scheduler, requests: Iterable[Request]) -> Iterator[Result]:
    """Submit every request to `scheduler` (a Decoder or a tensor-parallel driver) and step it until all
    are done, yielding each result as its request finishes."""
    for request in requests:
        scheduler.submit(request)
    while scheduler.has_work:
        for update in scheduler.step():
            if update.result is not None:
                yield update.result
    save = getattr(scheduler, "save", None)
    if save is not None:  # what the policy learnt (--block-size auto's acceptance), as the next run's prior
        save()
