"""What runs under Ray Train. `launch` is the driver and `recipe` what each worker does; the rest lives in three
rooms: `data/` (rows to token batches), `model/` (what the model is) and `run/` (how a run is driven).
`data/` and `model/` never import `run/`; none of the rooms imports the CLI."""
