"""Interoperability with other model formats: Hugging Face folders in and out (Llama, GPT-NeoX)."""

from longtrain.interop.hf_families import HFFormatError

__all__ = ["HFFormatError"]
