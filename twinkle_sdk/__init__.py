"""twinkle_sdk: the native Twinkle API. One training script, written as a visible loop,
runs in this process (`initialize(mode="local")`) or on a `twinkled` daemon
(`init_twinkle_client(base_url, api_key)`).

The seed documents' imports map onto this package:
  twinkle.initialize / DeviceMesh / get_logger      -> twinkle_sdk.initialize / ...
  twinkle.model.TransformersModel                   -> twinkle_sdk.TransformersModel
  twinkle_client.model.MultiLoraTransformersModel   -> twinkle_sdk.MultiLoraTransformersModel
  twinkle.dataset / dataloader / preprocessor       -> twinkle_sdk.Dataset, DataLoader, ...
  twinkle.sampler.vLLMSampler                       -> twinkle_sdk.Sampler (the engine's own)
  twinkle.advantage / reward / metric               -> twinkle_sdk.GRPOAdvantage, ...
"""

from . import rl
from .client import init_tinker_compat_client, init_twinkle_client
from .dataloader import DataLoader
from .dataset import Dataset, DatasetMeta
from .datum import input_feature_to_datum
from .images import ImageChunk
from .model import MultiLoraTransformersModel, TransformersModel, TwinkleModel
from .preprocessor import (
    AlpacaProcessor,
    GSM8KProcessor,
    MessagesProcessor,
    Preprocessor,
    SelfCognitionProcessor,
)
from .rl import (
    CompletionRewardMetric,
    GRPOAdvantage,
    GSM8KAccuracyReward,
    GSM8KFormatReward,
    RLOOAdvantage,
)
from .runtime import DeviceMesh, get_device_placement, get_logger, initialize
from .sampler import SampledSequence, Sampler, SampleResponse, SamplingParams
from .template import Template
from .tracking import MetricsLogger

__all__ = [
    "AlpacaProcessor", "CompletionRewardMetric", "DataLoader", "Dataset", "DatasetMeta",
    "DeviceMesh", "GRPOAdvantage", "ImageChunk", "MetricsLogger", "GSM8KAccuracyReward", "GSM8KFormatReward",
    "GSM8KProcessor", "MessagesProcessor", "MultiLoraTransformersModel", "Preprocessor",
    "RLOOAdvantage", "SampleResponse", "SampledSequence", "Sampler", "SamplingParams",
    "SelfCognitionProcessor", "Template", "TransformersModel", "TwinkleModel",
    "get_device_placement", "get_logger", "init_tinker_compat_client", "init_twinkle_client",
    "initialize", "input_feature_to_datum", "rl",
]
