#!/usr/bin/env bash
# Download, on a machine with a network, the wheels that benchmarks/gpu_check.py needs on a GPU machine without one:
# this project's dependencies from pyproject.toml except torch (the GPU machine has its own CUDA build), with every
# dependency of theirs, for CPython 3.12 on manylinux x86_64 (glibc 2.28 or newer), into DIR (default gpu_wheels/,
# which .gitignore keeps out of git), with DIR/requirements.txt naming what to install. gpu_check.py installs them
# offline into a temporary directory of its own (pip --no-index --target) when DIR is gpu_wheels/ or --wheels DIR.
#
#   benchmarks/gpu_wheels.sh [DIR]        PYTHON=python3.12 benchmarks/gpu_wheels.sh   (any Python with pip works)
#
# The GPU machine of our runs (one H200, torch 2.11 + CUDA 13, Python 3.12, no network) has no pydantic and a
# transformers newer than our pin; another Python or glibc: PYTHON_VERSION / GLIBC_MINOR.
# Wheels of the packages named in MACHINE_HAS (default: numpy, which that machine has) are deleted after the
# download: the device tool carries at most 64 MiB with the checkout (~30 MB), and numpy's wheel alone is 16 MB.
# gpu_check installs the wheels without dependency resolution, so the machine's own copy serves them.
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
dir="${1:-$root/gpu_wheels}"
python="${PYTHON:-python3}"
python_version="${PYTHON_VERSION:-3.12}"
glibc_minor="${GLIBC_MINOR:-28}"
machine_has="${MACHINE_HAS-numpy}"  # space-separated distribution names; MACHINE_HAS= keeps every wheel  # wheels for glibc 2.17 .. 2.$glibc_minor (every manylinux tag an older pip won't expand)
abi="cp${python_version/./}"
platforms=(--platform manylinux2014_x86_64 --platform manylinux2010_x86_64 --platform manylinux1_x86_64)
for minor in $(seq 17 "$glibc_minor"); do
    platforms+=(--platform "manylinux_2_${minor}_x86_64")
done

mkdir -p "$dir"
# The requirements: pyproject.toml's dependencies, torch left out (gpu_check uses the machine's own).
"$python" - "$root/pyproject.toml" > "$dir/requirements.txt" <<'EOF'
import re
import sys

text = open(sys.argv[1], encoding="utf-8").read()
block = re.search(r"^dependencies = \[(.*?)^\]", text, re.S | re.M).group(1)
for requirement in re.findall(r'"([^"]+)"', block):
    if not re.match(r"torch\b", requirement):
        print(requirement)
EOF
echo "gpu_wheels: requirements ($dir/requirements.txt): $(tr '\n' ' ' < "$dir/requirements.txt")" >&2
"$python" -m pip download --quiet --disable-pip-version-check --dest "$dir" --only-binary=:all: \
    "${platforms[@]}" --python-version "$python_version" --implementation cp --abi "$abi" --abi abi3 \
    --abi none -r "$dir/requirements.txt"
for name in $machine_has; do
    # a wheel's file name starts with its distribution name, lower-cased with - and . as _
    pattern="$(echo "$name" | tr '.-' '__')-*.whl"
    find "$dir" -maxdepth 1 -iname "$pattern" -print -delete | sed 's/^/gpu_wheels: MACHINE_HAS, deleted /' >&2
done
count=$(find "$dir" -maxdepth 1 -name '*.whl' | wc -l)
size=$(du -sh "$dir" | cut -f1)
echo "gpu_wheels: $count wheels, $size in $dir; on the GPU machine: python3 benchmarks/gpu_check.py --out gpu_check.json" >&2
