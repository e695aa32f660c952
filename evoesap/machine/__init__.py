"""Where a model runs: loading it with a dtype and a device map (`runtime`), sizes as people write them (`sizes`), the
sizes refused before any work (`bounds`), the side environments of vLLM and llm-compressor (`side_env`) and the
switches set in the environment (`env`)."""
