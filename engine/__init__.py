"""The built-in paged-attention engine: a Llama-family model over kvstore's GPU block pool.

``LLM(...).generate(prompts, SamplingParams(...))`` returns one
:class:`RequestOutput` per prompt.
"""

from engine.config import CheckpointError, ModelArch, RopeScaling
from engine.engine_config import EngineConfig
from engine.llm import LLM
from engine.outputs import RequestMetrics, RequestOutput
from engine.sampling_params import SamplingParams

__all__ = ["LLM", "CheckpointError", "EngineConfig", "ModelArch", "RequestMetrics", "RequestOutput",
           "RopeScaling", "SamplingParams"]
