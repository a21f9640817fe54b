"""One rank's ONNX graphs in a process of its own:
`python -m trtllm_dflash.engine.export_rank ENGINE_DIR RANK THREADS [PART]`.

`build` runs the ranks of a tensor-parallel engine, and the graphs of a rank, in parallel processes
(engine/builder.py `export_graphs`): the export is single-threaded Python for the most part (torch.export's tracing,
the ONNX conversion and optimizer), so one process per core divides the time by up to the number of cores.
ENGINE_DIR is the build's temporary directory with its config.json and rank files already written. With PART, this
process exports the graphs it claims in PART's parent's `claims` folder, into PART (merged by the parent).
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from trtllm_dflash.engine.builder import export_rank_graphs
from trtllm_dflash.engine_dir import read_engine_config


def main(argv: list[str] | None = None) -> None:
    root, rank, threads, *part = (argv if argv is not None else sys.argv[1:])
    torch.set_num_threads(int(threads))
    export_rank_graphs(Path(root), read_engine_config(Path(root)), int(rank), Path(part[0]) if part else None)


if __name__ == "__main__":
    main()
