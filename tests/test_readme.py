"""The README's two fresh-machine commands are the ones CI and the build configs rely on."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def readme_commands() -> list[str]:
    blocks = re.findall(r"```bash\n(.*?)```", (ROOT / "README.md").read_text(), re.S)
    return [next(line for line in b.splitlines() if not line.startswith("#")) for b in blocks[:2]]


def test_ci_runs_the_readme_test_command():
    ci = [line for line in (ROOT / ".ci" / "run").read_text().splitlines() if line and not line.startswith(("#", "set ", "cd "))]
    assert ci == [readme_commands()[1]]


def test_main_job_uses_files_in_the_repository():
    main_job = readme_commands()[0]
    paths = re.findall(r"(build_configs/\S+|benchmarks/\S+)", main_job)
    assert paths, f"the README's main command names no build config or benchmark file: {main_job}"
    for path in paths:
        assert (ROOT / path).is_file(), path
