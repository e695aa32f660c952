"""The smallest configuration of a cluster run: object-store storage and paths that exist only on the cluster, so
compiling and submitting read nothing local."""

REMOTE_CONFIG = dict(
    model="/models/full",
    calibration_data="/data/code.jsonl",
    search_data="/data/math.jsonl",
    storage_root="s3://bucket/runs",
    criteria=["reap"],
    sparsities=[0.5],
)
