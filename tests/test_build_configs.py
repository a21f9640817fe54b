"""Every file in build_configs/ is a valid build config (schema, types, known keys)."""

from pathlib import Path

import pytest

from trtllm_dflash.config import load_build_config

CONFIGS = sorted((Path(__file__).resolve().parents[1] / "build_configs").glob("*.yaml"))


@pytest.mark.parametrize("path", CONFIGS, ids=[p.name for p in CONFIGS])
def test_build_config_is_valid(path):
    cfg = load_build_config(path)
    assert cfg.output is not None and cfg.output.is_absolute()
    assert cfg.target.is_absolute() and cfg.drafter.is_absolute()
    assert cfg.target != cfg.drafter
    if cfg.quantization == "none":
        assert cfg.calibration is None
