"""The language model: decoder-only Transformer with SparseK attention and a chunk cache."""

from longtrain.model.cache import FullKVCache, LayerCache, ModelCache
from longtrain.model.model import LM, STYLES, LMConfig, LMOutput, ThresholdOverflowWarning, warn_threshold_overflow

__all__ = ["LM", "STYLES", "FullKVCache", "LMConfig", "LMOutput", "LayerCache", "ModelCache", "ThresholdOverflowWarning",
    "warn_threshold_overflow"]
