"""Conformance with the engines users run DFlash drafters in (docs/interop.md): the z-lab reference equations
(`reference`), one drafter step compared across implementations (`drafter_step`), and vLLM driven on CPU
(`vllm_engine`, importable only where vLLM is installed)."""
