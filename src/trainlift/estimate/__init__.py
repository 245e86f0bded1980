"""Before launching: memory per GPU, step time and cost of a job on a cluster, from the job spec, the model's
config and the hardware catalog. Pure: no torch, no weights read, no AWS calls."""
