"""examples/finetune_lora_fsdp2.py as a new user meets it (issue 44): ``--help`` answers without
importing torch and names torchrun; started without torchrun it runs as one process and says so;
on a CPU its speed-up line says the kernels ran in their interpreters. (tests/test_fsdp.py runs
it under torchrun with two ranks.)
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "finetune_lora_fsdp2.py"


def _env():
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR",
                                                               "MASTER_PORT", "TRITON_INTERPRET")}
    return env


def test_help_names_torchrun_before_importing_torch():
    code = ("import runpy, sys\n"
            f"sys.argv = [{str(EXAMPLE)!r}, '--help']\n"
            "try:\n"
            f"    runpy.run_path({str(EXAMPLE)!r}, run_name='__main__')\n"
            "except SystemExit:\n"
            "    pass\n"
            "print('IMPORTED', sorted(m for m in ('torch', 'transformers', 'forge', 'jax') if m in sys.modules))\n")
    r = subprocess.run([sys.executable, "-c", code], env=_env(), capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "torchrun --nproc-per-node" in r.stdout and "one process" in r.stdout, r.stdout
    assert "IMPORTED []" in r.stdout, r.stdout  # argparse answered before any heavy import


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU run's wording (interpreters)")
def test_without_torchrun_it_runs_as_one_process(tmp_path):
    out = tmp_path / "ft"
    cmd = [sys.executable, str(EXAMPLE), "--quick", "--steps", "1", "--kernels", "rmsnorm",
           "--max-text-mb", "0.05", "--out", str(out)]
    r = subprocess.run(cmd, env=_env(), capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert r.returncode == 0, (r.stdout[-2000:], r.stderr[-4000:])
    assert "not started by torchrun: running as one process" in r.stdout and "torchrun --nproc-per-node N" in r.stdout
    assert "speed-up" in r.stdout and "ran in their interpreters on the CPU" in r.stdout, r.stdout
    summary = json.loads((out / "summary.json").read_text())
    assert summary["world_size"] == 1 and summary["command"].startswith("python ")
    assert "interpreters" in summary["speedup_note"]
    assert (out / "loss.csv").exists() and (out / "adapter-forge" / "adapter_model.safetensors").exists()
