"""One rank of the resume-reads test (tests/integration/test_resume_reads.py), run as its own process:

    python resume_reads_job.py RANK WORLD PORT MODEL_DIR S3_PATH LOAD_ENDPOINT OUT

Trains one step of the tiny model under FSDP2 (gloo), saves a checkpoint, uploads this rank's files to S3 (through
AWS_ENDPOINT_URL), then loads it into a fresh model with `checkpoint.load` reading from S3 through LOAD_ENDPOINT.
Not a test module."""

from __future__ import annotations

import json
import sys
import tempfile

import pyarrow.fs as pafs
import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM

from trainlift.train.run import checkpoint
from trainlift.train.model.build import apply_fsdp


def fresh(model_dir: str):
    model = apply_fsdp(AutoModelForCausalLM.from_pretrained(model_dir), torch.device("cpu"), bf16=False,
                       activation_checkpointing=False)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return model, optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)


def full(model) -> dict[str, torch.Tensor]:
    return {name: p.full_tensor().clone() for name, p in model.named_parameters()}


def main(rank: int, world: int, port: int, model_dir: str, s3_path: str, load_endpoint: str, out: str) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    model, optimizer, scheduler = fresh(model_dir)
    ids = torch.randint(0, model.config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(rank))
    model(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()
    scheduler.step()
    trained = full(model)

    save_fs, bucket_path = pafs.FileSystem.from_uri(s3_path)
    with tempfile.TemporaryDirectory() as local_dir:
        checkpoint.write_shard(local_dir, model, optimizer, scheduler, step=1, cursor=8, rank=rank, world=world)
        pafs.copy_files(local_dir, bucket_path, destination_filesystem=save_fs)
    dist.barrier()

    load_fs = pafs.S3FileSystem(endpoint_override=load_endpoint, scheme="http", region="us-east-1",
                                access_key="testing", secret_key="testing")
    model, optimizer, scheduler = fresh(model_dir)
    step, cursor = checkpoint.load(load_fs, bucket_path, model, optimizer, scheduler, rank)
    loaded = full(model)
    same = all(torch.equal(trained[name], loaded[name]) for name in trained)
    if rank == 0:
        files = save_fs.get_file_info(pafs.FileSelector(bucket_path))
        sizes = {info.base_name: info.size for info in files}
        with open(out, "w") as fh:
            json.dump({"step": step, "cursor": cursor, "weights_restored": same, "sizes": sizes,
                       "optimizer_steps": scheduler.last_epoch}, fh)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    rank, world, port = map(int, sys.argv[1:4])
    main(rank, world, port, *sys.argv[4:8])
