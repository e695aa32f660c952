"""Pipeline stages: each `run_<stage>(inputs..., params, out_uri) -> Manifest`, shared by the CLI and KFP."""
