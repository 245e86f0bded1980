"""How a run is driven: Ray Train glue, preflight checks, failure explanations, checkpoints, metrics and trackers.
May import `data/` and `model/`; never the CLI."""
