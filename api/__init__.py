"""tierserve: a Ray-based distributed LLM serving runtime."""
from tierserve.scheduler.params import SamplingParams

__all__ = ["SamplingParams"]
__version__ = "0.1.0"
