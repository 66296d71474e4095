"""Layer-range execution over block buffers, KV caches, sampling, and a local serving engine."""

from .engine import AdmissionError, Engine, TokenOutput
from .model import SUPPORTED_MODEL_TYPES, LayerRange, hf_config
from .sampling import SamplingParams, make_generator, sample_token

__all__ = [
    "SUPPORTED_MODEL_TYPES",
    "AdmissionError",
    "Engine",
    "LayerRange",
    "SamplingParams",
    "TokenOutput",
    "hf_config",
    "make_generator",
    "sample_token",
]
