"""
Shared setup and fixtures of tests/. The kernel tests run kernel.py in Triton's interpreter on CPU tensors (set here,
before triton is imported); the GPU checks are in test_gpu.py. Run: python -m pytest (the fast default),
python -m pytest -m slow (the rest).
"""

import os

os.environ["TRITON_INTERPRET"] = "1"  # kernel.py runs in Triton's interpreter on CPU tensors; set before triton loads

import signal

import numpy as np
import pytest
import torch

import prepare_data

from helpers import TINY, run, tiny_corpus

torch.set_num_threads(2)
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:  # started in the background by a shell, which ignores Ctrl-C
    signal.signal(signal.SIGINT, signal.default_int_handler)  # there: the Ctrl-C tests need Python's, as do their
    # children (an ignored signal stays ignored across exec; a handled one is reset to the default)


@pytest.fixture(scope="session")
def tiny_data(tmp_path_factory):
    """data_dir holding shakespeare_char prepared from 120 copies of PLAY (20 'plays' of 6 in one folder: 18 train,
    1 val, 1 test)."""
    return tiny_corpus(tmp_path_factory.mktemp("tiny"), 20)


@pytest.fixture(scope="session")
def trained(tiny_data, tmp_path_factory):
    """out_dir of a tiny model trained for 8 iterations, checkpointed at 4 and 8."""
    out = str(tmp_path_factory.mktemp("out") / "full")
    p = run("train.py", *TINY, f"--data_dir={tiny_data}", f"--out_dir={out}", "--max_iters=8",
            "--eval_interval=4", "--lr_decay_iters=8", "--always_save_checkpoint=True")
    assert p.returncode == 0, p.stderr
    return out


@pytest.fixture(scope="session")
def tiny_documents(tmp_path_factory):
    """data_dir holding 'docs': documents of 1 to 40 token ids in [0, 63), each ended by the end-of-text token
    63, written by prepare_data.write_dataset as it writes the BPE datasets (meta.json names it)."""
    d = tmp_path_factory.mktemp("documents") / "docs"
    rng = np.random.default_rng(0)
    docs = [np.append(rng.integers(0, 63, rng.integers(1, 41)), 63) for _ in range(300)]
    prepare_data.write_dataset(str(d), docs, {"vocab_size": 64, "tokenizer": "none", "eot": 63})
    return str(d.parent)
