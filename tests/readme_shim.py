"""Run a Python file as ``__main__`` with hub model ids mapped to tiny random-weight models.

    python tests/readme_shim.py SNIPPET.py

Used by tests/test_readme.py to run the README's Python blocks as written without a download:
``AutoModelForCausalLM.from_pretrained("<hub id>", **kwargs)`` (any transformers Auto class)
with an id in HUB_IDS builds a random-weight model of that id's architecture at the tiny CPU
shape the tests use (forge.__main__.SHAPES["cpu"]), saves it to a temporary folder and loads it
from there with the caller's own arguments (dtype etc.), so the real loading path runs. Any other
argument goes to transformers unchanged; HF_HUB_OFFLINE=1 (set by the test) makes an id missing
from HUB_IDS fail instead of downloading.
"""
from __future__ import annotations

import atexit
import functools
import runpy
import shutil
import sys
import tempfile

# hub id -> model_type; add an entry when the README names another model
HUB_IDS = {
    "Qwen/Qwen2.5-0.5B": "qwen2",
}


def install():
    from transformers.models.auto import auto_factory

    original = auto_factory._BaseAutoModelClass.from_pretrained.__func__
    folders = {}

    @functools.wraps(original)
    def from_pretrained(cls, name, *args, **kwargs):
        if isinstance(name, str) and name in HUB_IDS:
            if name not in folders:
                import torch
                from transformers import AutoModelForCausalLM

                from forge.__main__ import model_config

                folders[name] = tempfile.mkdtemp(prefix="readme-tiny-")
                atexit.register(shutil.rmtree, folders[name], ignore_errors=True)
                with torch.random.fork_rng():
                    torch.manual_seed(0)
                    AutoModelForCausalLM.from_config(model_config(HUB_IDS[name])).save_pretrained(folders[name])
            name = folders[name]
        return original(cls, name, *args, **kwargs)

    auto_factory._BaseAutoModelClass.from_pretrained = classmethod(from_pretrained)


if __name__ == "__main__":
    path = sys.argv[1]
    install()
    sys.argv = sys.argv[1:]
    runpy.run_path(path, run_name="__main__")
