"""HF <-> Megatron parameter maps, HF/GGUF model sources and SafeTensors export."""
