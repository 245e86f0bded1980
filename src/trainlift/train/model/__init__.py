"""What the model is: built on the meta device, sharded with `fully_shard`, weights filled from the files, LoRA
adapters, the loss, the Hugging Face export. May import `data/` (the label mask value); never `run/`."""
