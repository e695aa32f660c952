"""The memory model (`footprint`: each stage's peak memory, disk and temporary space) and its use on a configuration
or a stage about to run (`plan`)."""
