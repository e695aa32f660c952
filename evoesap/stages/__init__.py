"""The stages: `run_<stage>(inputs..., params, out_uri) -> Manifest` and its parameter dataclass, one module each. The
list of stages is `evoesap.registry`."""
