"""Loom: a paged-KV LLM inference engine in PyTorch."""
from loom.llm import LLM, InvalidRequestsError
from loom.outputs import CompletionOutput, RequestOutput
from loom.sampling_params import SamplingParams

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "InvalidRequestsError"]
