"""batchgen: offline batch LLM inference that never loses a finished result."""

__version__ = "0.1.0"
