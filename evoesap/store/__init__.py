"""Where artifacts live: fsspec I/O, manifests and atomic publishing (`artifacts`), the content identity of an input
(`identity`), and the lineage walk over manifests (`lineage`)."""
