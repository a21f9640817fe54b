"""The serving loop: one background thread owns the Decoder; requests from any thread join its batch.

    client threads --submit()--> inbox --> [decoder thread: submit to Decoder -> step() -> route Updates]
                                                                   |
                                         callback(Event) per request, in commit order

The Decoder is not thread-safe, so only the loop's thread calls `submit` and `step` on it. Requests
arriving while others decode join at the next step (continuous batching): this is where requests
of many Triton clients are batched together. The loop knows nothing about Triton; tensor-parallel
serving replaces only the Decoder it drives.
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
from trtllm_dflash.runtime.textstream import TextStream


class Stepper(Protocol):
    """What the loop needs of a decoder: `runtime.decoding.Decoder`, or a tensor-parallel rank 0 driving its
    followers in lockstep. `submit` raises ValueError for a request it cannot take."""

    def submit(self, request: Request) -> None: ...

    def step(self) -> list[Update]: ...

    @property
    def has_work(self) -> bool: ...


@dataclass(frozen=True)
class Event:
    """What a request's callback gets: a text delta per step when streaming, and always a last event.

    The last event has `result` (success) or `error` (the request failed; nothing else follows).
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


@dataclass
class _Live:
    callback: Callback
    stream: TextStream | None  # None: not streaming, only the last event carries text
    num_tokens: int = 0
    batch_size_max: int = 0


@dataclass
class StepStats:
    """Batch sizes seen by the loop: `batch_sizes[b]` = number of decoder steps that decoded b requests."""

    batch_sizes: Counter = field(default_factory=Counter)

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
                 on_step: Callable[[int], None] | None = None):
        self.decoder, self.tokenizer, self.max_batch_size = decoder, tokenizer, max_batch_size
        self.on_step = on_step  # called with each step's batch size (metrics, logs)
        self.stats = StepStats()
        self._inbox: queue.SimpleQueue[tuple[Request, Callback, bool] | None] = queue.SimpleQueue()
        self._waiting: deque[tuple[Request, Callback, bool]] = deque()
        self._live: dict[str | int, _Live] = {}
        self._failure: str | None = None
        self._thread = threading.Thread(target=self._run, name="trtllm-dflash-decoder", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def submit(self, request: Request, callback: Callback, streaming: bool) -> None:
        """Queue a request (any thread). `request.id` must be unique among requests in flight."""
        self._inbox.put((request, callback, streaming))

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
        for _, callback, _ in self._waiting:
            _deliver(callback, Event("", 0, 0, error=reason))
        self._waiting.clear()

    def _accept(self, item: tuple[Request, Callback, bool]) -> None:
        if self._failure is not None:
            _deliver(item[1], Event("", 0, 0, error=self._failure))
        else:
            self._waiting.append(item)

    def _admit(self) -> None:
        # `_live` holds running requests and those submitted but not yet prefilled; every request
        # submitted here is prefilled by the next step (max_batch_size <= the engine's KV slots).
        while self._waiting and len(self._live) < self.max_batch_size:
            request, callback, streaming = self._waiting.popleft()
            try:
                self.decoder.submit(request)
            except ValueError as exc:
                _deliver(callback, Event("", 0, 0, error=str(exc)))
                continue
            self._live[request.id] = _Live(callback, TextStream(self.tokenizer) if streaming else None)

    def _step(self) -> None:
        updates = self.decoder.step()
        # Every running request commits at least one token per step, so each has an Update.
        batch = len(updates)
        self.stats.batch_sizes[batch] += 1
        if self.on_step is not None:
            self.on_step(batch)
        for update in updates:
            live = self._live[update.request.id]
            live.num_tokens += len(update.new_token_ids)
            live.batch_size_max = max(live.batch_size_max, batch)
            if update.result is not None:
                del self._live[update.request.id]
                _deliver(live.callback, self._last_event(live, update.result))
            elif live.stream is not None:
                delta = live.stream.push(update.new_token_ids)
                if delta:
                    _deliver(live.callback, Event(delta, live.num_tokens, live.batch_size_max))

    def _last_event(self, live: _Live, result: Result) -> Event:
        full = self.tokenizer.decode(result.output_token_ids, skip_special_tokens=True)
        if live.stream is None:
            return Event(full, live.num_tokens, live.batch_size_max, result=result, full_text=full)
        live.stream.token_ids = list(result.output_token_ids)
        try:
            rest = live.stream.finish()
        except RuntimeError as exc:
            return Event("", live.num_tokens, live.batch_size_max, error=str(exc))
        return Event(rest, live.num_tokens, live.batch_size_max, result=result, full_text=full)


def _deliver(callback: Callback, event: Event) -> None:
    """Run a callback; one failing client (e.g. gone) must not stop the loop for the others."""
    try:
        callback(event)
    except Exception:  # noqa: BLE001 - logged; the request is over either way
        traceback.print_exc()
