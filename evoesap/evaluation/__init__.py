"""Benchmarks of a checkpoint through lm-eval (`lmeval`), on the `hf` backend or in vLLM's own environment
(`vllm_eval`)."""
