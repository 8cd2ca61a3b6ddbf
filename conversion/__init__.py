"""HF <-> Megatron parameter maps, HF/GGUF model sources and SafeTensors export."""

from conversion.registry import ConversionError, hf_to_megatron, megatron_to_hf

__all__ = ["ConversionError", "hf_to_megatron", "megatron_to_hf"]
