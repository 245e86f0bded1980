"""metrics.jsonl on object storage goes through a local copy: a resumed run reads the step-0 eval loss an earlier
start wrote, and the temporary copy is gone once the sink closes. A SubTreeFileSystem over a local directory is a
real pyarrow filesystem that is not the local one, so the sink takes its object-storage path."""

from __future__ import annotations

import json
import os

import pyarrow.fs as pafs

from trainlift.train.run import metrics


def test_a_resumed_sink_reads_the_initial_eval_and_leaves_no_temporary_copy(tmp_path):
    (tmp_path / "store" / "run").mkdir(parents=True)
    remote = pafs.SubTreeFileSystem(str(tmp_path / "store"), pafs.LocalFileSystem())
    first = metrics.JsonlSink(remote, "run/metrics.jsonl")
    first.write({"event": "start", "step": 0})
    first.write({"step": 0, "eval_loss": 2.5})
    first.write({"step": 1, "loss": 2.4})
    first.write({"step": 2, "eval_loss": 2.1})
    temporary = first.mirror.directory
    first.close()
    assert not os.path.exists(temporary)

    resumed = metrics.JsonlSink(remote, "run/metrics.jsonl")
    assert resumed.recorded_initial_eval() == 2.5
    resumed.write({"step": 3, "loss": 2.0})
    resumed.close()
    rows = [json.loads(line) for line in (tmp_path / "store" / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 0, 1, 2, 3]
    assert metrics.JsonlSink(pafs.LocalFileSystem(), str(tmp_path / "new.jsonl")).recorded_initial_eval() is None
