"""The TensorRT executor's decode-step plan calls as CUDA graphs (issue 28, item 4).

A CUDA graph replays fixed kernels on fixed addresses, and a TensorRT execution context's enqueue is captured with the
input shapes and tensor addresses it had at capture. So each distinct call (`PlanKey`: the plan, the shape and dtype
of every input and output, the cache rows bound) gets, the first time it occurs:
- an execution context of its own (a graph fixes the context it was captured from; the plans share one scratch
  buffer, as the executor's own contexts do: they run one at a time on one stream);
- static input and output buffers (shared between keys of the same plan, tensor name, shape and dtype: each call
  copies its inputs in and its outputs out on the stream, so no two calls' values overlap), bound once;
- one eager enqueue (the call's own result: TensorRT asks for one enqueue after a shape change before a capture),
  then a capture of the same enqueue (nothing runs while capturing: a plan that writes the caches or advances a
  recurrent state is not applied twice), replayed from the next call of that key on.
The state copies that follow a Qwen3.5 target pass (rows <- the plan's own state buffers) are captured with it.

A plan TensorRT cannot enqueue under capture (its enqueue returns False) runs eagerly over the same static buffers,
and the executor's `report` says so once per plan.

On a CPU (the tests' onnxruntime stand-ins) `capture` is False: every call of a key runs its context over the static
buffers bound when the key was made, which is what a replay does (no address or shape is set again). The capture
itself (`_capture`) has never run on a GPU.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch

# Binds a new context's inputs, outputs (and caches) to the given static buffers and sets their shapes.
Bind = Callable[[object, dict[str, torch.Tensor], dict[str, torch.Tensor]], None]
# (cache rows view, output name): after the plan, the rows take that output's values (a recurrent state's).
StateCopies = list[tuple[torch.Tensor, str]]


@dataclass(frozen=True)
class PlanKey:
    """What a captured enqueue fixes: the plan, its tensors' shapes and dtypes, and the cache rows bound."""

    plan: str
    tensors: tuple[tuple[str, tuple[int, ...], torch.dtype], ...]  # every input and output (name, shape, dtype)
    rows: tuple[int, int] | None  # (first cache row, rows) bound, or None (a plan without caches)

    @classmethod
    def of(cls, plan: str, inputs: Mapping[str, torch.Tensor], outputs: Mapping[str, torch.Tensor],
           rows: range | None) -> "PlanKey":
        tensors = tuple((name, tuple(t.shape), t.dtype) for name, t in (*inputs.items(), *outputs.items()))
        return cls(plan, tensors, None if rows is None else (rows.start, len(rows)))


class _Call:
    """One key's context over its static buffers, and its graph once captured."""

    def __init__(self, plan: str, context, stream: int, inputs: dict[str, torch.Tensor],
                 outputs: dict[str, torch.Tensor], copies: StateCopies):
        self.plan, self.context, self.stream = plan, context, stream
        self.inputs, self.outputs, self.copies = inputs, outputs, copies
        self.graph: torch.cuda.CUDAGraph | None = None

    def enqueue(self) -> None:
        if not self.context.execute_async_v3(self.stream):
            raise RuntimeError(f"TensorRT refused to run {self.plan} (its log says why)")
        for rows, name in self.copies:
            rows.copy_(self.outputs[name])

    def replay(self) -> None:
        if self.graph is not None:
            self.graph.replay()
        else:
            self.enqueue()


class PlanGraphs:
    """The executor's decode-step plan calls over static buffers: CUDA graphs (`capture`), or on a CPU the same
    calls run eagerly over the buffers bound when each key was made."""

    def __init__(self, new_context: Callable[[str], object], stream: torch.cuda.Stream | None, capture: bool,
                 report: Callable[[str], None] = lambda line: None):
        """`new_context(plan)`: a fresh execution context of that plan; `stream`: the executor's stream (None: the
        CPU stand-ins', stream 0)."""
        self._new_context, self._stream, self.capture, self._report = new_context, stream, capture, report
        self.calls: dict[PlanKey, _Call] = {}
        self._buffers: dict[tuple, torch.Tensor] = {}
        self._pool = torch.cuda.graph_pool_handle() if capture else None
        self.eager: set[str] = set()  # plans whose enqueue could not be captured

    def run(self, key: PlanKey, inputs: Mapping[str, torch.Tensor], outputs: Mapping[str, torch.Tensor],
            bind: Bind, copies: StateCopies) -> None:
        """The call `key` with these inputs, writing `outputs` (and, through the bound caches, the rows)."""
        call = self.calls.get(key)
        if call is None:
            self.calls[key] = self._first(key, inputs, outputs, bind, copies)
        else:
            for name, value in inputs.items():
                call.inputs[name].copy_(value)
            call.replay()
            self._copy_out(call, outputs)

    def _first(self, key: PlanKey, inputs: Mapping[str, torch.Tensor], outputs: Mapping[str, torch.Tensor],
               bind: Bind, copies: StateCopies) -> _Call:
        """Make the key's call, run it eagerly (this call's result), then capture it (not run) for the next ones."""
        static_in = {name: self._buffer(key.plan, name, t) for name, t in inputs.items()}
        static_out = {name: self._buffer(key.plan, name, t) for name, t in outputs.items()}
        context = self._new_context(key.plan)
        bind(context, static_in, static_out)
        call = _Call(key.plan, context, self._stream.cuda_stream if self._stream is not None else 0, static_in,
                     static_out, copies)
        for name, value in inputs.items():
            static_in[name].copy_(value)
        call.enqueue()
        self._copy_out(call, outputs)
        if self.capture and key.plan not in self.eager:
            call.graph = self._capture(key.plan, call)
        return call

    @staticmethod
    def _copy_out(call: _Call, outputs: Mapping[str, torch.Tensor]) -> None:
        """The call's outputs into the caller's tensors, but the states the call copied into their rows itself."""
        copied = {name for _, name in call.copies}
        for name, out in outputs.items():
            if name not in copied:
                out.copy_(call.outputs[name])

    def _buffer(self, plan: str, name: str, like: torch.Tensor) -> torch.Tensor:
        """A static buffer for tensor `name` of `plan` at like's shape and dtype, shared by every key that has one."""
        index = (plan, name, tuple(like.shape), like.dtype)
        if index not in self._buffers:
            self._buffers[index] = torch.empty_like(like, memory_format=torch.contiguous_format)
        return self._buffers[index]

    def _capture(self, plan: str, call: _Call) -> torch.cuda.CUDAGraph | None:
        """The call's enqueue (and state copies) captured on the executor's stream, or None where TensorRT cannot
        enqueue this plan under capture (then it runs eagerly, said once). Never run on a GPU."""
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph, pool=self._pool, stream=self._stream):
                call.enqueue()
        except RuntimeError as e:
            self.eager.add(plan)
            self._report(f"CUDA graphs: TensorRT could not enqueue {plan} under capture ({e}); {plan} runs without a "
                         "CUDA graph.")
            return None
        return graph
