"""Where a model runs: loading it with a dtype and a device map (`runtime`), sizes as people write them (`sizes`), the
sizes refused before any work (`bounds`) and the side environments of vLLM and llm-compressor (`side_env`)."""
