"""Exports of an engine directory into other runtimes' formats (`trtllm-dflash export ...`)."""
