"""After the search: quantization in llm-compressor's own environment (`quantize_env`, `quantize_worker`) and the push
to a Hub repository (`hub`)."""
