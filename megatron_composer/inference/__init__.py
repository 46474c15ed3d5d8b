"""Inference: the rollout engine RL samples from, and its OpenAI-compatible server.

    params.py     SamplingParams, Completion, GenerationEvent
    engine.py     Engine: MLA latent KV cache, continuous batching, chunked prefill,
                  routed-expert capture, MTP speculative decoding, in-flight weight updates
    server.py     FastAPI app: /v1/completions, /v1/chat/completions, /v1/models, /v1/weights
    client.py     RolloutClient: the in-process Engine or any OpenAI-compatible server
"""
from .params import Completion, GenerationEvent, SamplingParams, SpeculativeStats

__all__ = ["Completion", "GenerationEvent", "SamplingParams", "SpeculativeStats"]
