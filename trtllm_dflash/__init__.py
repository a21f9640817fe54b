"""trtllm-dflash: DFlash block-diffusion speculative decoding, built and run as one engine."""

__version__ = "0.1.0"
