"""Loading policy and reference models; the tiny built-in model of the demo."""

from grpokit.models.loading import load_model_and_tokenizer, resolve_device
from grpokit.models.precision import resolve_dtype
from grpokit.models.tiny import build_char_tokenizer, build_tiny_model

__all__ = [
    "build_char_tokenizer",
    "build_tiny_model",
    "load_model_and_tokenizer",
    "resolve_device",
    "resolve_dtype",
]
