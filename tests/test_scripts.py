"""The Slurm script is valid bash and passes `mpiparallel train` only options it has."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

SLURM = Path(__file__).resolve().parent.parent / "scripts" / "slurm_train.sh"


def test_the_slurm_script_parses_and_uses_only_real_train_options():
    subprocess.run(["bash", "-n", str(SLURM)], check=True, timeout=30)
    command = SLURM.read_text().split("\nsrun ", 1)[1]
    used = set(re.findall(r"(--[a-z][a-z-]+)", command)) - {"--cpu-bind"}  # srun's own option
    help_text = subprocess.run([sys.executable, "-m", "mpiparallel", "train", "--help"], capture_output=True,
                               text=True, timeout=60, check=True).stdout
    offered = set(re.findall(r"(--[a-z][a-z-]+)", help_text))
    assert used and used <= offered, sorted(used - offered)
