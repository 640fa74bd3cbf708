"""Megatron -> vLLM weight resharding after every actor update."""
