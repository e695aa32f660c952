"""The EvoESAP pipeline: configuration, DAG, local run and cluster submission."""
