"""Qwen3.5's Gated DeltaNet layers and the recurrent state a speculative step must roll back.

A Gated DeltaNet layer (transformers' `Qwen3_5GatedDeltaNet`, same parameter names) keeps, per request, no KV cache
but two states: the last kernel - 1 inputs of a causal depthwise conv over its q, k, v projections, and a recurrent
matrix S [value heads, key_head_dim, value_head_dim] updated by the gated delta rule at every token:

    S = S * exp(g);   S = S + k (beta * (v - S^T k))^T;   out = S^T q      (q, k l2-normed; q scaled by dk^-0.5)

A rejected draft cannot be "cropped" as KV entries are (masked by position, overwritten later): once a verify pass
has run the block through the layer, S holds every drafted token. So `RecurrentStates` keeps what resumes the layer at
any position of a slot's last pass: a pass of at most `depth` tokens (a verify block, a plain step, a short prompt)
keeps the state before it, its tokens' k, v, g and beta, and its conv inputs; the next pass of the request replays
the tokens before its own start (start - kept_from of them: the anchor and the accepted drafts) from that state, on
the device, without telling anyone what was accepted. A longer pass (a prompt) keeps the state after each row's last
real token (`valid`: padding columns of a batched prefill have g = 0 and beta = 0, which leave S exactly as it was).
A request's first pass (start 0) starts from zeros, so a slot needs no clearing when it is reused.
The onnxruntime graphs run the same scheme: the replay as a graph of its own before the pass, the recurrence in chunks
of 16 tokens, one ONNX Scan step per chunk (`chunk_scanned`; compile/onnx_export.py RecurrentTargetStep and
TargetReplay, onnx_ops.GraphRecurrentStates).

Replay, not per-token snapshots (the state after every token of the block kept, the next pass picking one):
benchmarks/recurrent_rollback.py measured both at Qwen3.5-27B's per-rank shape. A snapshot per token costs (block + 1)
states per request and layer (25.5 MiB at 24 heads of 128 x 128, block 16) and writing them every step; the replay
keeps one state and the block's inputs (1.9 MiB) and re-runs a block of state updates, which on the CPU cost less
than making and writing the snapshots (0.57x the time per step and layer at batch 1, 0.49x at batch 8). On a GPU a
fused recurrent kernel would keep the state on chip for the replay, while snapshots go to memory (not measured: no
GPU here).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from trtllm_dflash.models.spec import DecoderSpec
from trtllm_dflash.parallel.group import SINGLE, TPGroup

# What a Gated DeltaNet layer keeps per slot (RecurrentStates), in the order of its graphs' inputs and outputs
STATE_KINDS = ("conv", "state", "delta_k", "delta_v", "delta_g", "delta_beta")
READ_KINDS = STATE_KINDS[:2]  # what a pass reads (it writes all six)
REPLAY_KINDS = STATE_KINDS[1:]  # what the replay before a pass reads (it writes the state)
# Prompt passes run the gated delta rule in chunks of this many tokens (transformers' torch_chunk_gated_delta_rule).
CHUNK = 64
# The exported graphs run every pass in chunks of this many tokens (`chunk_scanned`): a verify block of up to 16 tokens
# is one chunk (chunks of 64, and token by token, measured slower in onnxruntime: docs/models.md §Recurrent state)
GRAPH_CHUNK = 16


def linear_heads(spec: DecoderSpec, tp_size: int) -> tuple[int, int]:
    """(key heads, value heads) of a Gated DeltaNet layer on one of tp_size ranks (each rank: a contiguous share)."""
    return spec.linear_num_key_heads // tp_size, spec.linear_num_value_heads // tp_size


def conv_channels(spec: DecoderSpec, tp_size: int) -> int:
    """Channels of one rank's causal conv: its q and k (key heads x key_head_dim each) and v."""
    nk, nv = linear_heads(spec, tp_size)
    return 2 * nk * spec.linear_key_head_dim + nv * spec.linear_value_head_dim


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """transformers' (and FLA's) l2norm over the last dimension."""
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


class GatedRMSNorm(nn.Module):
    """Qwen3_5RMSNormGated: RMSNorm over each value head (weight applied in the input dtype), times silu(gate) in
    fp32."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return ((self.weight * x32.to(dtype)) * F.silu(gate.float())).to(dtype)


@dataclass
class RecurrentPass:
    """One target pass's view of the recurrent states: for each row, how many of the slot's last pass's tokens it keeps
    (`kept`: replayed from the state before that pass) and whether it starts afresh (a request's first pass)."""

    slots: torch.Tensor  # [B]
    starts: torch.Tensor  # [B]
    kept: torch.Tensor  # [B] tokens of the slot's last pass before this pass's start (0 .. depth)
    fresh: torch.Tensor  # [B, 1] float: 0 for rows at position 0 (start from zeros), else 1
    valid: torch.Tensor  # [B] real tokens per row (the rest are a batched prefill's padding)
    tokens: int  # T
    keep_all: bool  # T <= depth: the pass's inputs are kept, to replay the part the next pass keeps
    # A draft tree's pass (TargetModel.forward with `tree`; set by tree_walk): each node's conv window [B, T, K] as
    # rows of the layer's inputs (the K - 1 conv inputs before the pass, then the nodes'), and its parent node [B, T]
    # (-1: the anchor, which follows the state before the pass)
    windows: torch.Tensor | None = None
    parents: torch.Tensor | None = None


class RecurrentStates:
    """Per slot and Gated DeltaNet layer, what resumes the layer at any position of the slot's last pass: the recurrent
    state before that pass [value heads, dk, dv] (fp32, as transformers keeps it) and the inputs of its tokens to the
    gated delta rule (k, v, g, beta: `depth` of each), and the conv inputs of its positions and the K - 1 before them
    [K - 1 + depth, channels]. `kept_from`: the position of the pass's first token. A pass longer than `depth` (a
    prompt) keeps the state after each row's last real token instead, as if that pass had no tokens; so does a pass of
    one token (a plain step, whose token no later pass drops: the next pass then replays nothing) where
    `one_token_advances` (False: the graphs of engines built before 2026-12-05 keep a one-token pass's inputs)."""

    def __init__(self, num_layers: int, num_slots: int, depth: int, channels: int, kernel: int, heads: int,
                 key_dim: int, value_dim: int, dtype: torch.dtype, device: torch.device | str = "cpu",
                 one_token_advances: bool = True):
        self.depth, self.kernel, self.one_token_advances = depth, kernel, one_token_advances

        def per_layer(*shape: int, dtype: torch.dtype = dtype) -> list[torch.Tensor]:
            return [torch.zeros(num_slots, *shape, dtype=dtype, device=device) for _ in range(num_layers)]

        self.conv = per_layer(kernel - 1 + depth, channels)
        self.state = per_layer(heads, key_dim, value_dim, dtype=torch.float32)
        self.k, self.v = per_layer(depth, heads, key_dim), per_layer(depth, heads, value_dim)
        self.g, self.beta = per_layer(depth, heads, dtype=torch.float32), per_layer(depth, heads)
        self.kept_from = torch.zeros(num_slots, dtype=torch.int64, device=device)
        # on the host, per row of the compiled executors (which tell `end` their rows): whether the row's last pass
        # kept its inputs, so that its next pass may replay some (`may_replay`)
        self.kept_inputs = [False] * num_slots

    @classmethod
    def of(cls, spec: DecoderSpec, tp_size: int, num_slots: int, depth: int, dtype: torch.dtype,
           device: torch.device | str = "cpu", one_token_advances: bool = True) -> "RecurrentStates | None":
        """The states of one rank's Gated DeltaNet layers of `spec`, resuming passes of up to `depth` tokens; None for a
        model without them."""
        if not spec.has_recurrent_state:
            return None
        return cls(len(spec.linear_layers), num_slots, depth, conv_channels(spec, tp_size), spec.linear_conv_kernel,
                   linear_heads(spec, tp_size)[1], spec.linear_key_head_dim, spec.linear_value_head_dim, dtype, device,
                   one_token_advances)

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.conv + self.state + self.k + self.v + self.g + self.beta) + \
            self.kept_from.nbytes

    def named(self, layer_ids: list[int], kinds: tuple[str, ...] = STATE_KINDS) -> list[tuple[str, torch.Tensor]]:
        """("conv_5", conv of the layer numbered 5 in the model), ("state_5", ...), ("delta_k_5", ...), ("delta_v_5",
        ...), ("delta_g_5", ...), ("delta_beta_5", ...), ...: the suffixes of the graphs' past_* / present_* names
        (`layer_ids`: the model's numbers of these layers, in order), of the buffers of `kinds` only."""
        buffers = dict(zip(STATE_KINDS, (self.conv, self.state, self.k, self.v, self.g, self.beta)))
        return [(f"{kind}_{i}", buffers[kind][n]) for n, i in enumerate(layer_ids) for kind in kinds]

    def move_row(self, src: int, dst: int) -> None:
        """Slot `src`'s states (and where its kept tokens begin) into slot `dst` (runtime/cache_rows.py)."""
        for buf in (*self.conv, *self.state, *self.k, *self.v, *self.g, *self.beta):
            buf[dst].copy_(buf[src])
        self.kept_from[dst] = self.kept_from[src]
        self.kept_inputs[dst] = self.kept_inputs[src]

    def begin(self, slots: torch.Tensor, starts: torch.Tensor, tokens: int, valid: torch.Tensor) -> RecurrentPass:
        kept = (starts - self.kept_from[slots]).clamp(0, self.depth)
        fresh = (starts > 0).to(torch.float32)[:, None]
        keep_all = tokens <= self.depth and not (tokens == 1 and self.one_token_advances)
        return RecurrentPass(slots, starts, kept, fresh, valid, tokens, keep_all)

    def end(self, step: RecurrentPass, rows: range | None = None) -> None:
        """After every layer has run the pass: where each slot's kept tokens now begin (a longer pass: at its end, so
        that no later pass replays any of it, even one that starts past a row's last real token, as the next part of
        a prompt cut into passes does for a shorter prompt beside it). `rows`: step.slots as the host knows them."""
        self.kept_from[step.slots] = step.starts if step.keep_all else step.starts + step.tokens
        for row in rows or ():
            self.kept_inputs[row] = step.keep_all

    def tree_walk(self, step: RecurrentPass, depths: torch.Tensor, tree: torch.Tensor) -> None:
        """Make `step` a draft tree's pass: depths [B, T] of its nodes (node 0 the anchor, every node after its parent)
        and their ancestor mask tree [B, T, T]. Node i's conv window is its K - 1 nearest ancestors (then, above the
        anchor, the conv inputs before the pass) and itself; its recurrent state follows its parent's."""
        t = depths.shape[1]
        assert step.keep_all, f"a tree of {t} nodes needs states that keep {t} tokens (depth {self.depth})"

        def ancestor(up: int) -> tuple[torch.Tensor, torch.Tensor]:
            """The node `up` levels above each node [B, T] (argmax over its one match), and that level [B, T]."""
            level = depths - up
            match = tree & (depths[:, None, :] == level[:, :, None])  # [B, T, T]
            return match.to(torch.int64).argmax(dim=-1), level

        columns = []
        for up in range(self.kernel - 1, -1, -1):  # the window's columns: the farthest ancestor first, itself last
            node, level = ancestor(up)
            columns.append(torch.where(level >= 0, node, level) + self.kernel - 1)
        step.windows = torch.stack(columns, dim=-1)
        # the column before the node's own: its parent, or (for the anchor) the row before it, which is -1 once shifted
        step.parents = step.windows[..., -2] - (self.kernel - 1)

    def keep_path(self, slots: torch.Tensor, nodes: torch.Tensor) -> None:
        """After a tree's pass (its nodes' inputs kept in node order): the accepted nodes [B, n] (node 0 first, rows
        padded with 0) become the pass's first n tokens, which the next pass replays as a chain's."""
        rows, n = slots[:, None], nodes.shape[1]
        order = torch.arange(n, device=nodes.device)
        for layer in range(len(self.state)):
            for buf in (self.k[layer], self.v[layer], self.g[layer], self.beta[layer]):
                buf[rows, order] = buf[rows, nodes]
            self.conv[layer][rows, self.kernel - 1 + order] = self.conv[layer][rows, self.kernel - 1 + nodes]

    def may_replay(self, rows: range) -> bool:
        """Whether the last pass of any of `rows` (ended with them) kept its inputs; if none did (prompts, plain steps),
        a replay before their next pass has nothing to do, which the host knows without reading the device."""
        return any(self.kept_inputs[row] for row in rows)

    def state_at(self, row: int, position: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per layer, the row's conv inputs [K - 1, C] and recurrent state [H, dk, dv] at `position` (the state after
        positions 0 .. position - 1), which the row's last pass must have reached: a position from that pass's first
        token to its last real one where the pass kept its inputs, else (a prompt, a plain step) the pass's last real
        one. What a later pass from that position resumes from (prefix reuse: runtime/prefix_states.py)."""
        rows = torch.tensor([row], device=self.kept_from.device)
        step = self.begin(rows, torch.full_like(rows, position), 0, rows)  # (its tokens and valid: unused by read)
        return [(conv[0], state[0]) for conv, state in (self.read(layer, step) for layer in range(len(self.state)))]

    def resume_at(self, row: int, position: int, layers: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Make `row` resume at `position` from `layers` (state_at's, of any row): its next pass starts at `position`
        and replays nothing."""
        for layer, (conv, state) in enumerate(layers):
            self.conv[layer][row, : self.kernel - 1] = conv
            self.state[layer][row] = state
        self.kept_from[row] = position
        self.kept_inputs[row] = False

    def read(self, layer: int, step: RecurrentPass) -> tuple[torch.Tensor, torch.Tensor]:
        """The rows' conv inputs [B, K - 1, C] and recurrent state [B, H, dk, dv] before the pass: the slot's kept state
        advanced over the `kept` tokens of its last pass (a fixed `depth`-step loop, the other steps' g and beta zero:
        exactly the state the last pass had after those tokens)."""
        slots = step.slots
        rows = step.kept[:, None] + torch.arange(self.kernel - 1, device=slots.device)  # [B, K - 1]
        conv = self.conv[layer][slots[:, None], rows]
        keep = (torch.arange(self.depth, device=slots.device)[None, :] < step.kept[:, None])[..., None]  # [B, depth, 1]
        _, state = token_by_token(None, self.k[layer][slots], self.v[layer][slots], self.g[layer][slots] * keep,
                                  self.beta[layer][slots] * keep, self.state[layer][slots])
        return conv * step.fresh[:, :, None].to(conv.dtype), state * step.fresh[:, :, None, None]

    def recur(self, step: RecurrentPass, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
              beta: torch.Tensor, state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The gated delta rule over the pass from `state`: its outputs [B, T, H, dv] fp32 and the state to keep, the
        one it started from (keep_all: the next pass replays what it keeps from there) or the one after it (a prompt,
        in chunks as transformers runs a prefill; a plain step's one token). A verify block runs token by token here:
        in eager torch the graphs' chunks (chunk_scanned) made a demo-width Qwen3.5 pair's decoding slower
        (docs/models.md)."""
        if step.parents is not None:  # a tree's nodes (their inputs kept, as a verify block's: keep_path orders them)
            return node_by_node(q, k, v, g, beta, state, step.parents), state
        if step.keep_all:
            return token_by_token(q, k, v, g, beta, state)[0], state
        if step.tokens == 1:
            return token_by_token(q, k, v, g, beta, state)
        return _chunked(q, k, v, g, beta, state)

    def write(self, layer: int, step: RecurrentPass, inputs: torch.Tensor, state: torch.Tensor,
              k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor) -> None:
        """After the layer ran the pass: inputs [B, K - 1 + T, C] (the conv inputs read, then the pass's); `state` the
        one it started from (keep_all: kept with the pass's k, v, g, beta [B, T, H, ...]) or the one after each row's
        valid tokens."""
        slots = step.slots
        self.state[layer][slots] = state
        if step.keep_all:
            t = k.shape[1]
            self.conv[layer][slots, : inputs.shape[1]] = inputs
            self.k[layer][slots, :t], self.v[layer][slots, :t] = k, v
            self.g[layer][slots, :t], self.beta[layer][slots, :t] = g, beta
            return
        rows = step.valid[:, None] + torch.arange(self.kernel - 1, device=inputs.device)  # the K - 1 before the end
        batch = torch.arange(inputs.shape[0], device=rows.device)[:, None]
        self.conv[layer][slots, : self.kernel - 1] = inputs[batch, rows]


class GatedDeltaNet(nn.Module):
    """One rank's Gated DeltaNet: its share of the key and value heads (in_proj_* and the conv column-parallel,
    out_proj row-parallel and all-reduced), HF parameter names."""

    def __init__(self, spec: DecoderSpec, tp: TPGroup = SINGLE):
        super().__init__()
        h, dk, dv = spec.hidden_size, spec.linear_key_head_dim, spec.linear_value_head_dim
        nk, nv = linear_heads(spec, tp.size)
        self.tp, self.num_k_heads, self.num_v_heads, self.key_dim, self.value_dim = tp, nk, nv, dk, dv
        channels = conv_channels(spec, tp.size)
        self.in_proj_qkv = nn.Linear(h, channels, bias=False)
        self.in_proj_z = nn.Linear(h, nv * dv, bias=False)
        self.in_proj_b = nn.Linear(h, nv, bias=False)
        self.in_proj_a = nn.Linear(h, nv, bias=False)
        self.conv1d = nn.Conv1d(channels, channels, spec.linear_conv_kernel, groups=channels, bias=False)
        self.dt_bias = nn.Parameter(torch.ones(nv))
        self.A_log = nn.Parameter(torch.zeros(nv))
        self.norm = GatedRMSNorm(dv, spec.rms_norm_eps)
        self.out_proj = nn.Linear(nv * dv, h, bias=False)

    def forward(self, x: torch.Tensor, states: RecurrentStates, layer: int, step: RecurrentPass) -> torch.Tensor:
        """x: [B, T, hidden] -> [B, T, hidden]; reads the rows' states and keeps the new ones (`RecurrentStates`)."""
        b, t, _ = x.shape
        conv_before, state = states.read(layer, step)
        inputs = torch.cat([conv_before, self.in_proj_qkv(x)], dim=1)  # [B, K - 1 + T, C]
        if step.windows is None:
            mixed = F.silu(F.conv1d(inputs.transpose(1, 2).to(self.conv1d.weight.dtype), self.conv1d.weight,
                                    groups=inputs.shape[-1])).transpose(1, 2).to(x.dtype)  # [B, T, C]
        else:  # a tree: each node's window along its own path (RecurrentStates.tree_walk)
            windows = inputs[torch.arange(b, device=x.device)[:, None, None], step.windows]  # [B, T, K, C]
            taps = self.conv1d.weight[:, 0].t()  # [K, C]
            mixed = F.silu((windows.to(taps.dtype) * taps).sum(dim=2)).to(x.dtype)
        key_width = self.num_k_heads * self.key_dim
        q, k, v = mixed.split([key_width, key_width, self.num_v_heads * self.value_dim], dim=-1)
        q, k = q.unflatten(-1, (self.num_k_heads, self.key_dim)), k.unflatten(-1, (self.num_k_heads, self.key_dim))
        v = v.unflatten(-1, (self.num_v_heads, self.value_dim))
        beta = self.in_proj_b(x).sigmoid()
        g = -self.A_log.float().exp() * F.softplus(self.in_proj_a(x).float() + self.dt_bias)
        real = (torch.arange(t, device=x.device)[None, :] < step.valid[:, None])[..., None]  # [B, T, 1]
        beta, g = beta * real, g * real  # padding: S * exp(0) + k 0^T = S
        if self.num_v_heads > self.num_k_heads:
            repeat = self.num_v_heads // self.num_k_heads
            q, k = q.repeat_interleave(repeat, dim=2), k.repeat_interleave(repeat, dim=2)
        q, k = l2norm(q), l2norm(k)
        out, kept = states.recur(step, q, k, v, g, beta, state)
        states.write(layer, step, inputs, kept, k, v, g, beta)
        z = self.in_proj_z(x).unflatten(-1, (self.num_v_heads, self.value_dim))
        out = self.norm(out.to(x.dtype), z).flatten(2)
        return self.tp.all_reduce(self.out_proj(out))


def delta_step(state, k, v, g, beta):
    """One token of the gated delta rule: state [B, H, dk, dv] fp32, k [B, H, dk], v [B, H, dv], g / beta [B, H] (fp32)
    -> the state after it."""
    state = state * g.exp()[..., None, None]
    remembered = (state * k[..., :, None]).sum(dim=-2)  # [B, H, dv]
    delta = (v - remembered) * beta[..., None]
    return state + k[..., :, None] * delta[..., None, :]


def token_by_token(q, k, v, g, beta, state):
    """The gated delta rule token by token (transformers' torch_recurrent_gated_delta_rule).
    q (None: no outputs), k: [B, T, H, dk]; v: [B, T, H, dv]; g, beta: [B, T, H]; state [B, H, dk, dv] fp32.
    Returns out [B, T, H, dv] fp32 (or None) and the state after the last token."""
    k, v, g, beta = (x.float() for x in (k, v, g, beta))
    q = None if q is None else q.float() * q.shape[-1] ** -0.5
    outs = []
    for i in range(k.shape[1]):
        state = delta_step(state, k[:, i], v[:, i], g[:, i], beta[:, i])
        if q is not None:
            outs.append((state * q[:, i, :, :, None]).sum(dim=-2))
    return (None if q is None else torch.stack(outs, dim=1)), state


def node_by_node(q, k, v, g, beta, state, parents):
    """The gated delta rule over a draft tree's nodes, each from its parent's state (token_by_token along every path
    at once): q, k [B, T, H, dk]; v [B, T, H, dv]; g, beta [B, T, H]; state [B, H, dk, dv] fp32, the anchor's parent's;
    parents [B, T] (-1 for the anchor; every node after its parent). Returns out [B, T, H, dv] fp32."""
    k, v, g, beta = (x.float() for x in (k, v, g, beta))
    q = q.float() * q.shape[-1] ** -0.5
    rows = torch.arange(k.shape[0], device=k.device)
    after = state.new_empty(k.shape[0], k.shape[1], *state.shape[1:])  # [B, T, H, dk, dv]: each node's state after it
    for i in range(k.shape[1]):
        before = state if i == 0 else after[rows, parents[:, i]]
        after[:, i] = delta_step(before, k[:, i], v[:, i], g[:, i], beta[:, i])
    return (after * q[..., None]).sum(dim=-2)


def chunk_scanned(q, k, v, g, beta, state, chunk: int = GRAPH_CHUNK):
    """The gated delta rule in chunks of `chunk` tokens (a power of 2) as the exported graphs run it: `token_by_token`'s
    values within float32 rounding (q None: the final state only). Within a chunk, what makes its tokens depend on
    each other is the unit lower triangular (I - L)^-1 that transformers' chunked form solves row by row in chunk - 1
    steps; here it is inverted by blocks (`_unit_lower_inverse`: log2(chunk) rounds of two matrix products over every
    chunk at once). Then one torch scan over the chunks carries the state (its exported graphs: one ONNX Scan of
    T / chunk steps, where `token_by_token`'s form is one of T steps).

    The number of chunks is read from the data (an unbacked size: the export assumes nothing about it, where
    ceil(T / chunk) on T's symbol made it guard on values it cannot prove). Tokens with g = beta = 0 (padding past a
    row's valid tokens, and the zeros padding T to whole chunks) leave the state and every other token's output
    exactly as they are, as in `token_by_token`. Why chunks of 16 (GRAPH_CHUNK), measured: docs/models.md §Recurrent
    state."""
    rounds = (chunk - 1).bit_length()  # (of _unit_lower_inverse: enough for a whole chunk)
    k, v, g, beta = (x.float().transpose(1, 2) for x in (k, v, g, beta))  # [B, H, T, ...]
    b, h, t, dk = k.shape
    tokens = k.new_ones(t, dtype=torch.long).sum()
    chunk = int(tokens.clamp(max=chunk).item())  # a pass shorter than a chunk is one chunk of its own length
    n = int(((tokens + (chunk - 1)) // chunk).item())
    torch._check(chunk > 0)
    torch._check(n > 0)
    torch._check(n * chunk >= t)

    def chunks(x: torch.Tensor) -> torch.Tensor:  # [B, H, T, ...] -> [B, H, n, chunk, ...], zeros past T
        x = F.pad(x, (0, 0) * (x.dim() - 3) + (0, n * chunk - t))
        return x.reshape(b, h, n, chunk, *x.shape[3:])

    k, v, g, beta = chunks(k), chunks(v), chunks(g).cumsum(dim=-1), chunks(beta)  # g: decay from the chunk's start
    k_beta = k * beta[..., None]
    i = torch.arange(chunk, device=k.device)
    decay = torch.where(i[:, None] >= i[None, :], g[..., :, None] - g[..., None, :], float("-inf")).exp()
    strict = torch.where(i[:, None] > i[None, :], -(k_beta @ k.transpose(-1, -2)) * decay, 0.0)  # L
    solve = _unit_lower_inverse(strict, rounds)
    v = solve @ (v * beta[..., None])  # each token's write, the chunk's earlier writes removed
    k_cumdecay = solve @ (k_beta * g.exp()[..., None])  # what of the state at the chunk's start each write removes
    k_decayed = k * (g[..., -1:] - g).exp()[..., None]  # each key's decay to the chunk's end
    chunk_decay = g[..., -1].exp()
    readers, xs = k_cumdecay, [v, k_decayed, chunk_decay]
    if q is not None:
        q = chunks(q.float().transpose(1, 2)) * dk**-0.5
        # what each query reads of the state at the chunk's start, beside what each write removes: one product
        readers = torch.cat([k_cumdecay, q * g.exp()[..., None]], dim=-2)  # [B, H, n, 2 chunk, dk]
        xs.append(q @ k.transpose(-1, -2) * decay)

    def step(s, xs):
        readers_i, v_i, k_decayed_i, decay_i, *inner = xs
        read = readers_i @ s  # (the state read once)
        if not inner:
            written = v_i - read
            return s * decay_i[..., None, None] + k_decayed_i.transpose(-1, -2) @ written, []
        read = read.unflatten(-2, (2, -1))  # (no slice by the chunk's length: a size the scan's body cannot take)
        written = v_i - read[..., 0, :, :]
        new = s * decay_i[..., None, None] + k_decayed_i.transpose(-1, -2) @ written
        return new, read[..., 1, :, :] + inner[0] @ written

    from torch._higher_order_ops.scan import scan

    final, outs = scan(step, state, [readers, *xs], dim=2)
    if q is None:
        return None, final
    out = outs.reshape(b, h, n * chunk, outs.shape[-1])[:, :, :t]
    return out.transpose(1, 2), final


def _unit_lower_inverse(lower: torch.Tensor, rounds: int) -> torch.Tensor:
    """(I - L)^-1 for L [..., C, C] strictly lower triangular, C <= 2^rounds, by blocks: the inverse of each diagonal
    block of size s known (1 x 1 blocks: 1), a block of 2s [[A, 0], [-L21, D]] has the inverse [[A^-1, 0],
    [D^-1 L21 A^-1, D^-1]]: with X the block-diagonal of the known inverses, X + X (L21's entries only) X, for every
    block of every chunk at once. Stable as the substitution transformers runs (errors of float32 rounding where the
    Neumann product (I + L)(I + L^2)(I + L^4)... reached 1e+8 at 64 tokens of nearly parallel keys)."""
    c = lower.shape[-1]
    i = torch.arange(c, device=lower.device)
    inverse = torch.eye(c, device=lower.device, dtype=lower.dtype)
    for size in (2**r for r in range(rounds)):
        same_pair = i[:, None] // (2 * size) == i[None, :] // (2 * size)  # (row, column) in the same block of 2s
        second, first = i[:, None] // size % 2 == 1, i[None, :] // size % 2 == 0  # its lower-left quarter
        inverse = inverse + inverse @ torch.where(same_pair & second & first, lower, 0.0) @ inverse
    return inverse


def _chunked(q, k, v, g, beta, state, chunk: int = CHUNK):
    """The gated delta rule over chunks of `chunk` tokens (transformers' torch_chunk_gated_delta_rule, the same
    operations in the same order), from `state`. Returns out [B, T, H, dv] fp32 and the final state [B, H, dk, dv]."""
    q, k, v, beta, g = (x.transpose(1, 2).contiguous().float() for x in (q, k, v, beta, g))  # [B, H, T, ...]
    b, h, t, dk = k.shape
    pad = (chunk - t % chunk) % chunk
    q, k, v = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
    beta, g = F.pad(beta, (0, pad)), F.pad(g, (0, pad))
    q = q * dk**-0.5
    v_beta, k_beta = v * beta[..., None], k * beta[..., None]
    q, k, v, k_beta, v_beta = (x.reshape(b, h, -1, chunk, x.shape[-1]) for x in (q, k, v, k_beta, v_beta))
    g = g.reshape(b, h, -1, chunk).cumsum(dim=-1)
    upper = torch.triu(torch.ones(chunk, chunk, dtype=torch.bool, device=q.device), diagonal=0)
    decay = (g[..., :, None] - g[..., None, :]).tril().exp().float().tril()
    attn = -((k_beta @ k.transpose(-1, -2)) * decay).masked_fill(upper, 0)
    for i in range(1, chunk):
        row, sub = attn[..., i, :i].clone(), attn[..., :i, :i].clone()
        attn[..., i, :i] = row + (row[..., None] * sub).sum(-2)
    attn = attn + torch.eye(chunk, dtype=attn.dtype, device=attn.device)
    v = attn @ v_beta
    k_cumdecay = attn @ (k_beta * g.exp()[..., None])
    out = torch.zeros_like(v)
    for i in range(v.shape[2]):
        q_i, k_i = q[:, :, i], k[:, :, i]
        inner = q_i @ k_i.transpose(-1, -2) * decay[:, :, i]  # (decay is lower triangular: causal)
        v_new = v[:, :, i] - k_cumdecay[:, :, i] @ state
        out[:, :, i] = (q_i * g[:, :, i, :, None].exp()) @ state + inner @ v_new
        state = state * g[:, :, i, -1, None, None].exp() + (
            k_i * (g[:, :, i, -1, None] - g[:, :, i]).exp()[..., None]).transpose(-1, -2) @ v_new
    out = out.reshape(b, h, -1, out.shape[-1])[:, :, :t]
    return out.transpose(1, 2), state
