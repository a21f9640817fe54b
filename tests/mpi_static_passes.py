"""Run under `mpiexec -n N` by tests/test_tensor_parallel.py: a tensor-parallel engine decoded by the torch executor's
static passes (what `--cuda-graphs` captures on GPUs; on the CPU the same padded passes run eagerly), every rank in
lockstep as `run` drives them. Rank 0 writes {request id: output token ids} as JSON.

    mpiexec -n 2 python tests/mpi_static_passes.py ENGINE_DIR PROMPTS.jsonl OUT.json MODE
"""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

from trtllm_dflash.parallel.world import init_world
from trtllm_dflash.runtime.executor import TorchExecutor
from trtllm_dflash.runtime.jsonl import Defaults, read_requests
from trtllm_dflash.runtime.lockstep import LockstepDriver, follow
from trtllm_dflash.runtime.runner import Engine


def main(engine_dir: Path, prompts: Path, out: Path, mode: str) -> None:
    world = init_world("gloo")
    engine = Engine.load(engine_dir, world=world)
    static = TorchExecutor.from_engine(engine_dir, engine.config, world.rank, world.tp, "cpu", None, cuda_graphs=True)
    decoder = dataclasses.replace(engine, executor=static).decoder(mode)
    if world.rank != 0:
        follow(decoder)
    else:
        defaults = Defaults(24, 0.0, 0, engine.config.max_seq_len, static.vocab_size)
        requests, errors = read_requests(prompts, engine.tokenizer, defaults)
        assert not errors, errors
        driver = LockstepDriver(decoder)
        tokens = {r.request.id: r.output_token_ids for r in driver.generate(requests)}
        driver.close()
        kinds = sorted({(k.kind, k.batch) for k in static.graphs.passes})
        out.write_text(json.dumps({"tokens": tokens, "passes": kinds}))
    world.close()


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3]), sys.argv[4])
