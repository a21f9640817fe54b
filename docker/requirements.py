"""Print the requirements of trtllm-dflash (pyproject.toml's dependencies plus the named extras), one per line,
for `pip install -r`, leaving out torch when the interpreter running this script can already import it.

    python docker/requirements.py pyproject.toml mpi onnx quantize > requirements.txt

Why: NGC images that ship a CUDA torch (nvcr.io/nvidia/pytorch, -trtllm-python-py3) keep their own build;
`pip install .` would replace it with PyPI's torch==2.13.0. The project itself is then installed with
`pip install --no-deps`. Run it with the interpreter of the environment being filled (a venv made with
--system-site-packages sees the image's torch).
"""

from __future__ import annotations

import importlib.util
import re
import sys
import tomllib
from pathlib import Path


def requirements(pyproject: Path, extras: list[str], have_torch: bool) -> list[str]:
    project = tomllib.loads(pyproject.read_text(encoding="utf-8"))["project"]
    optional = project.get("optional-dependencies", {})
    unknown = [e for e in extras if e not in optional]
    if unknown:
        raise SystemExit(f"error: {pyproject} has no extra {unknown[0]!r} (extras: {', '.join(sorted(optional))}).")
    reqs = list(project["dependencies"]) + [r for e in extras for r in optional[e]]
    name = lambda r: re.split(r"[\s\[<>=!~;]", r, maxsplit=1)[0].lower()  # noqa: E731
    out: list[str] = []
    for r in reqs:
        if have_torch and name(r) == "torch":
            continue
        if r not in out:
            out.append(r)
    return out


if __name__ == "__main__":
    if len(sys.argv) < 2:
        raise SystemExit("usage: python requirements.py PYPROJECT [EXTRA ...]")
    have_torch = importlib.util.find_spec("torch") is not None
    print("\n".join(requirements(Path(sys.argv[1]), sys.argv[2:], have_torch)))
