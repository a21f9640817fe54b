"""The serving loop: one background thread owns the Decoder; requests from any thread join its batch.

    client threads --submit()--> inbox --> [decoder thread: submit to Decoder -> step() -> route Updates]
                                                                   |
                                         callback(Event) per request, in commit order

The Decoder is not thread-safe, so only the loop's thread calls `submit`, `cancel` and `step` on it.
Requests arriving while others decode join at the next step (continuous batching): this is where
requests of many Triton clients are batched together. Before every step the loop asks each request
whether its client cancelled it (Triton: the client went away or cancelled the call); a cancelled
request leaves at that step and its slot takes a waiting request in the same step. The loop knows
nothing about Triton; tensor-parallel serving replaces only the Decoder it drives.
"""

from __future__ import annotations

import queue
import threading
import traceback
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from transformers import PreTrainedTokenizerBase

from trtllm_dflash.runtime.decoding import Request, Result, Update
from trtllm_dflash.runtime.stop_strings import output_text
from trtllm_dflash.runtime.textstream import TextStream


class Stepper(Protocol):
    """What the loop needs of a decoder: `runtime.decoding.Decoder`, or a tensor-parallel rank 0 driving its
    followers in lockstep. `submit` raises ValueError for a request it cannot take."""

    def submit(self, request: Request) -> None: ...

    def cancel(self, request_id: str | int) -> None: ...

    def step(self) -> list[Update]: ...

    @property
    def has_work(self) -> bool: ...


@dataclass(frozen=True)
class Event:
    """What a request's callback gets: a text delta per step when streaming, and always a last event.

    The last event has `result` (success, or finish_reason "cancelled") or `error` (the request failed;
    nothing else follows).
    """

    text: str  # streaming: text committed since the previous event; last event: the rest of the text
    num_output_tokens: int  # tokens committed so far
    batch_size_max: int  # most requests decoded together in one step while this request ran
    result: Result | None = None
    full_text: str | None = None  # the whole output text, on the last event of a successful request
    error: str | None = None

    @property
    def last(self) -> bool:
        return self.result is not None or self.error is not None


Callback = Callable[[Event], None]
IsCancelled = Callable[[], bool]  # asked before every step; True: the client cancelled the request


@dataclass(frozen=True)
class _Submitted:
    request: Request
    callback: Callback
    streaming: bool
    is_cancelled: IsCancelled | None


@dataclass
class _Live:
    callback: Callback
    stream: TextStream | None  # None: not streaming, only the last event carries text
    is_cancelled: IsCancelled | None
    num_tokens: int = 0
    batch_size_max: int = 0
    cancelling: bool = False  # the Decoder was told; it ends the request at the next step


@dataclass
class StepStats:
    """Batch sizes seen by the loop: `batch_sizes[b]` = number of decoder steps that decoded b requests."""

    batch_sizes: Counter = field(default_factory=Counter)
    cancelled: int = 0  # requests ended because their client cancelled them

    @property
    def steps(self) -> int:
        return sum(self.batch_sizes.values())

    @property
    def max_batch_size(self) -> int:
        return max(self.batch_sizes, default=0)


class ServingLoop:
    """Drives one Decoder on a background thread for requests submitted from any thread.

    Each iteration hands waiting requests to the Decoder (keeping at most `max_batch_size` running),
    runs one `decoder.step()` and routes each request's Update to its callback as an Event. A request
    the Decoder rejects gets an error event; an exception while stepping fails every request in
    flight and stops the loop (later submissions get an error event at once), since the decoder's
    state is then unknown. Callbacks run on the loop's thread and must not block; one that raises
    is logged and does not affect the others.
    """

    def __init__(self, decoder: Stepper, tokenizer: PreTrainedTokenizerBase, max_batch_size: int,
                 on_step: Callable[[int], None] | None = None, on_cancel: Callable[[], None] | None = None):
        self.decoder, self.tokenizer, self.max_batch_size = decoder, tokenizer, max_batch_size
        self.on_step = on_step  # called with each step's batch size (metrics, logs)
        self.on_cancel = on_cancel  # called for each request its client cancelled (metrics)
        self.stats = StepStats()
        self._inbox: queue.SimpleQueue[_Submitted | None] = queue.SimpleQueue()
        self._waiting: deque[_Submitted] = deque()
        self._live: dict[str | int, _Live] = {}
        self._failure: str | None = None
        self._thread = threading.Thread(target=self._run, name="trtllm-dflash-decoder", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def submit(self, request: Request, callback: Callback, streaming: bool,
               is_cancelled: IsCancelled | None = None) -> None:
        """Queue a request (any thread). `request.id` must be unique among requests in flight. `is_cancelled` is
        asked (on the loop's thread) before every step until the request ends."""
        self._inbox.put(_Submitted(request, callback, streaming, is_cancelled))

    def stop(self, reason: str = "the server is shutting down") -> None:
        """Fail what is still in flight with `reason` and end the thread."""
        self._inbox.put(None)
        self._thread.join()
        self._fail(reason)

    def _run(self) -> None:
        while True:
            idle = not self._live and not self._waiting
            try:
                item = self._inbox.get(block=idle)
                while True:
                    if item is None:
                        return
                    self._accept(item)
                    item = self._inbox.get_nowait()
            except queue.Empty:
                pass
            if self._failure is not None:
                continue  # nothing runs after a failure; _accept answers new requests
            try:
                self._cancel()
                self._admit()
                if self.decoder.has_work:
                    self._step()
            except Exception as exc:  # noqa: BLE001 - reported to every request in flight, then the loop stops
                traceback.print_exc()
                self._fail(f"the decoder failed ({type(exc).__name__}: {exc}); the model must be reloaded")

    def _fail(self, reason: str) -> None:
        self._failure = reason
        for live in self._live.values():
            _deliver(live.callback, Event("", live.num_tokens, live.batch_size_max, error=reason))
        self._live.clear()
        for item in self._waiting:
            _deliver(item.callback, Event("", 0, 0, error=reason))
        self._waiting.clear()

    def _accept(self, item: _Submitted) -> None:
        if self._failure is not None:
            _deliver(item.callback, Event("", 0, 0, error=self._failure))
        else:
            self._waiting.append(item)

    def _cancel(self) -> None:
        """Ask every request whether its client cancelled it: a waiting one ends now, a live one at the next step
        (the Decoder frees its slot before it admits anything)."""
        for item in [w for w in self._waiting if _asks_to_cancel(w.is_cancelled)]:
            self._waiting.remove(item)
            self._count_cancel()
            _deliver(item.callback, Event("", 0, 0, result=Result(item.request, [], "cancelled", [])))
        for request_id, live in self._live.items():
            if not live.cancelling and _asks_to_cancel(live.is_cancelled):
                live.cancelling = True
                self.decoder.cancel(request_id)

    def _count_cancel(self) -> None:
        self.stats.cancelled += 1
        if self.on_cancel is not None:
            self.on_cancel()

    def _admit(self) -> None:
        # `_live` holds running requests and those submitted but not yet prefilled; every request
        # submitted here is prefilled by the next step (max_batch_size <= the engine's KV slots). A request
        # being cancelled leaves at the next step, before admissions: its slot already counts as free.
        running = sum(not live.cancelling for live in self._live.values())
        while self._waiting and running < self.max_batch_size:
            item = self._waiting.popleft()
            try:
                self.decoder.submit(item.request)
            except ValueError as exc:
                _deliver(item.callback, Event("", 0, 0, error=str(exc)))
                continue
            stream = TextStream(self.tokenizer, item.request.stop) if item.streaming else None
            self._live[item.request.id] = _Live(item.callback, stream, item.is_cancelled)
            running += 1

    def _step(self) -> None:
        updates = self.decoder.step()
        # Every running request commits at least one token per step, so each has an Update; a cancelled
        # request's last Update commits nothing and was not decoded in this step.
        batch = sum(1 for u in updates if u.new_token_ids)
        if batch:  # not a step that only ended cancelled requests
            self.stats.batch_sizes[batch] += 1
            if self.on_step is not None:
                self.on_step(batch)
        for update in updates:
            live = self._live[update.request.id]
            live.num_tokens += len(update.new_token_ids)
            live.batch_size_max = max(live.batch_size_max, batch)
            if update.result is not None:
                del self._live[update.request.id]
                if update.result.finish_reason == "cancelled":
                    self._count_cancel()
                _deliver(live.callback, self._last_event(live, update.result))
            elif live.stream is not None:
                delta = live.stream.push(update.new_token_ids)
                if delta:
                    _deliver(live.callback, Event(delta, live.num_tokens, live.batch_size_max))

    def _last_event(self, live: _Live, result: Result) -> Event:
        full = output_text(self.tokenizer, result.output_token_ids, result.request.stop)
        if live.stream is None:
            return Event(full, live.num_tokens, live.batch_size_max, result=result, full_text=full)
        live.stream.token_ids = list(result.output_token_ids)
        try:
            rest = live.stream.finish()
        except RuntimeError as exc:
            return Event("", live.num_tokens, live.batch_size_max, error=str(exc))
        return Event(rest, live.num_tokens, live.batch_size_max, result=result, full_text=full)


def _asks_to_cancel(is_cancelled: IsCancelled | None) -> bool:
    """The client's answer; a client whose question fails (e.g. gone) is taken as cancelled."""
    if is_cancelled is None:
        return False
    try:
        return bool(is_cancelled())
    except Exception:  # noqa: BLE001 - logged; the request cannot be answered anyway
        traceback.print_exc()
        return True


def _deliver(callback: Callback, event: Event) -> None:
    """Run a callback; one failing client (e.g. gone) must not stop the loop for the others."""
    try:
        callback(event)
    except Exception:  # noqa: BLE001 - logged; the request is over either way
        traceback.print_exc()
