"""Rolling a Gated DeltaNet layer back to the accepted prefix: replaying the prefix against keeping a snapshot per
token (issue 30 item 1), side by side.

    python benchmarks/recurrent_rollback.py --rounds 30

A verify pass runs a block of T tokens through the layer's gated delta rule; the next step must start from the state
after the anchor and the accepted drafts only. Two ways, both exact:

- replay (what models/linear_attention.py's RecurrentStates does; this runs its read / write): the pass keeps the
  state before it and the block's k, v, g, beta ([T, H, dk + dv + 2] per request and layer); the next pass first
  re-runs the accepted prefix from that state (a fixed T-step loop, the rejected positions' g and beta zeroed, so a
  batch needs no per-row lengths on the host);
- snapshots: the pass keeps the state before it and after every token
  ([T + 1, H, dk, dv]); the next pass gathers the one its start selects.

Per step and layer, the recurrence alone (the projections and the conv are the same either way), at one rank's
share of Qwen3.5-27B under tp 2 (24 value heads of dk = dv = 128), T = 16, batches 1 and 8, 6 drafts accepted per
row; torch on this machine's CPU, the two forms alternating, medians. Also the bytes each form keeps per request and
layer. Results: benchmarks/results/recurrent_rollback.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import torch

from trtllm_dflash.models.linear_attention import RecurrentStates, token_by_token

ROOT = Path(__file__).resolve().parents[1]


def every_state(q, k, v, g, beta, state):
    """The gated delta rule keeping the state before and after every token [B, T + 1, H, dk, dv] (the snapshot
    form); outputs as `token_by_token`'s."""
    q, k, v, g, beta = (x.float() for x in (q, k, v, g, beta))
    q = q * q.shape[-1] ** -0.5
    outs, kept = [], [state]
    for i in range(q.shape[1]):
        state = state * g[:, i].exp()[..., None, None]
        delta = (v[:, i] - (state * k[:, i, :, :, None]).sum(dim=-2)) * beta[:, i, :, None]
        state = state + k[:, i, :, :, None] * delta[:, :, None, :]
        outs.append((state * q[:, i, :, :, None]).sum(dim=-2))
        kept.append(state)
    return torch.stack(outs, dim=1), torch.stack(kept, dim=1)


def inputs(batch: int, tokens: int, heads: int, dk: int, dv: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    q = torch.nn.functional.normalize(torch.randn(batch, tokens, heads, dk, generator=g), dim=-1)
    k = torch.nn.functional.normalize(torch.randn(batch, tokens, heads, dk, generator=g), dim=-1)
    v = torch.randn(batch, tokens, heads, dv, generator=g)
    decay = -torch.rand(batch, tokens, heads, generator=g)
    beta = torch.rand(batch, tokens, heads, generator=g)
    return q, k, v, decay, beta


def snapshot_step(store, slots, index, q, k, v, decay, beta):
    """Gather the state the start selects, run the block keeping every state, write them back."""
    out, kept = every_state(q, k, v, decay, beta, store[slots, index])
    store[slots, : kept.shape[1]] = kept
    return out


def replay_step(states: RecurrentStates, slots, starts, q, k, v, decay, beta):
    """RecurrentStates' own: replay what the last block kept, run this block, keep its pre-state and inputs."""
    step = states.begin(slots, starts, q.shape[1], torch.full_like(slots, q.shape[1]))
    conv, state = states.read(0, step)
    out, _ = token_by_token(q, k, v, decay, beta, state)
    states.write(0, step, torch.zeros(len(slots), conv.shape[1] + q.shape[1], conv.shape[2]), state, k, v, decay, beta)
    states.end(step)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--heads", type=int, default=24)
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--accepted", type=int, default=6)
    ap.add_argument("--output", type=Path, default=ROOT / "benchmarks" / "results" / "recurrent_rollback.json")
    args = ap.parse_args()
    h, dk, dv, t = args.heads, 128, 128, args.tokens
    # both forms agree: replaying the anchor + accepted drafts gives the snapshot after them
    q, k, v, decay, beta = inputs(2, t, h, dk, dv, 0)
    pre = torch.randn(2, h, dk, dv) * 0.1
    _, kept = every_state(q, k, v, decay, beta, pre)
    states = RecurrentStates(1, 2, t, 1, 4, h, dk, dv, torch.float32)
    slots = torch.arange(2)
    states.state[0][:] = pre
    step = states.begin(slots, torch.full((2,), 100), t, torch.full((2,), t))
    states.write(0, step, torch.zeros(2, 3 + t, 1), pre, k, v, decay, beta)
    states.end(step)
    _, replayed = states.read(0, states.begin(slots, torch.full((2,), 100 + args.accepted + 1), t, slots))
    torch.testing.assert_close(replayed, kept[:, args.accepted + 1], atol=1e-5, rtol=1e-5)

    results = []
    for batch in (1, 8):
        slots = torch.arange(batch)
        store = torch.zeros(batch, t + 1, h, dk, dv)
        states = RecurrentStates(1, batch, t, 1, 4, h, dk, dv, torch.float32)
        index = torch.full((batch,), args.accepted + 1)
        block = inputs(batch, t, h, dk, dv, 1)
        position = 64
        times = {"snapshots": [], "replay": []}
        for _ in range(args.rounds):
            for name in times:
                began = time.perf_counter()
                if name == "snapshots":
                    snapshot_step(store, slots, index, *block)
                else:
                    replay_step(states, slots, torch.full((batch,), position), *block)
                times[name].append(time.perf_counter() - began)
            position += args.accepted + 1
        med = {name: statistics.median(v) * 1e3 for name, v in times.items()}
        kept_bytes = {"snapshots": (t + 1) * h * dk * dv * 4, "replay": h * dk * dv * 4 + t * h * (dk + dv + 2) * 4}
        results.append({"batch": batch, "ms_per_step_per_layer": med, "replay_over_snapshots": med["replay"] /
                        med["snapshots"], "kept_bytes_per_request_per_layer": kept_bytes})
        print(f"batch {batch}: replay {med['replay']:.2f} ms, snapshots {med['snapshots']:.2f} ms per step and layer "
              f"({med['replay'] / med['snapshots']:.2f}x); kept per request and layer: "
              f"{kept_bytes['replay'] / 2**20:.2f} MiB vs {kept_bytes['snapshots'] / 2**20:.1f} MiB")
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps({
        "what": __doc__.splitlines()[0], "heads": h, "key_dim": dk, "value_dim": dv, "tokens": t,
        "accepted": args.accepted, "rounds": args.rounds, "torch_threads": torch.get_num_threads(),
        "load_average": os.getloadavg(), "results": results}, indent=2) + "\n")


if __name__ == "__main__":
    main()
