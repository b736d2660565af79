"""Models: the decoder-only LM (`Transformer`) and Hugging Face checkpoint import/export (`hf`)."""

from jspec.models.cache import KVCache
from jspec.models.transformer import Transformer, create, param_shardings

__all__ = ["KVCache", "Transformer", "create", "param_shardings"]
