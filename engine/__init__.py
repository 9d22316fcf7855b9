"""Token-in/token-out inference engine: the public protocol the gateway imports."""

from engine.config import EngineConfig, ModelConfig
from engine.llm_engine import Engine, RequestOutput
from engine.loader import UnsupportedModelError, default_model_path, load_model
from engine.observer import OutputObserver, RequestStats, StepStats
from engine.request import IllegalTransition, Request, RequestState
from engine.sampling_params import SamplingParams

__version__ = "0.1.0"

__all__ = [
    "Engine", "EngineConfig", "IllegalTransition", "ModelConfig", "OutputObserver", "Request",
    "RequestOutput", "RequestState", "RequestStats", "SamplingParams", "StepStats",
    "UnsupportedModelError", "default_model_path", "load_model",
]
