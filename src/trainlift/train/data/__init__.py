"""Where rows come from and how they become token batches: sources (local, s3://), formats, chat templates,
masking, packing, and the tokenize-once cache. Imports nothing from `model/` or `run/`."""
