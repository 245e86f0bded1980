"""The sitecustomize trainlift puts first on its Ray processes' PYTHONPATH (ops/ray_site/) keeps running the one it
hides: the environment's own, or a profiler's (bench/phasetrace), as Python would have without it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from trainlift.ops import localray


def test_the_sitecustomize_further_down_the_path_still_runs_once(tmp_path):
    other = tmp_path / "other"
    other.mkdir()
    (other / "sitecustomize.py").write_text("import os\nwith open(os.environ['MARK'], 'a') as f:\n    f.write('ran\\n')\n")
    env = {**os.environ, "MARK": str(tmp_path / "mark"),
           "PYTHONPATH": os.pathsep.join([str(localray.RAY_SITE), str(other)])}
    out = subprocess.run([sys.executable, "-c", "import sys; print(sys.modules['sitecustomize'].__file__)"],
                         env=env, capture_output=True, text=True, check=True)
    assert Path(out.stdout.strip()).parent == localray.RAY_SITE
    assert (tmp_path / "mark").read_text() == "ran\n"
