"""Layer-range execution over block buffers, KV caches, sampling, and a local serving engine."""

from .grammar import Constraint, grammar_tokenizer
from .engine import AdmissionError, Engine, StepShape, TokenOutput, budgeted_stage, checkpoint_eos_ids, local_stages
from .model import SUPPORTED_MODEL_TYPES, LayerRange, hf_config, kv_slot_bytes_of, warm_up
from .sampling import SamplingSpec, apply_penalties, make_generator, sample_token, token_logprobs
from .stages import LocalStage, RemoteStage, StageServer

__all__ = [
    "SUPPORTED_MODEL_TYPES",
    "AdmissionError",
    "Constraint",
    "grammar_tokenizer",
    "Engine",
    "LocalStage",
    "RemoteStage",
    "StageServer",
    "budgeted_stage",
    "checkpoint_eos_ids",
    "local_stages",
    "LayerRange",
    "SamplingSpec",
    "StepShape",
    "TokenOutput",
    "hf_config",
    "kv_slot_bytes_of",
    "make_generator",
    "sample_token",
    "apply_penalties",
    "token_logprobs",
    "warm_up",
]
