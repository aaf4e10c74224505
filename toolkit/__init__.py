"""Train Llama-class models on DeepSpeed or Megatron-Core from one recipe."""
__version__ = "0.1.0"
