"""Checkpoint conversion and inspection: streaming sources (sources.py) and writers (convert.py) between Hugging
Face, the toolkit's Megatron and DeepSpeed layouts and Megatron-LM files, built on the format (toolkit/format/) and
the model families (toolkit/families/)."""
