"""
Sample from a trained model, printing the tokens as they are generated. Decoding is recurrent: the
prompt is read once, then every new token costs O(1) work from the carried state.

$ python sample.py --out_dir=out --start="ROMEO:" --num_samples=3 --max_new_tokens=300
$ python sample.py --start=FILE:prompt.txt
"""
import os

# see train.py: spinning OpenMP threads are very slow on a CPU shared with other processes
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import math
import sys
import time
from contextlib import nullcontext

import torch

from engine import Engine
from model import GPT
from run_safety import read_checkpoint
from prepare_data import get_tokenizer

# -----------------------------------------------------------------------------
out_dir = "out"  # the checkpoint is out_dir/ckpt.pt
start = "\n"  # the prompt, or "FILE:prompt.txt" to read it from a file
num_samples = 2
max_new_tokens = 500
temperature = 0.8  # 1.0 samples the model's distribution, lower is more conservative, 0 is greedy
top_k = 200  # keep only the top_k most likely tokens; 0 keeps all
seed = 1337
device = "cuda" if torch.cuda.is_available() else "mps" if torch.backends.mps.is_available() else "cpu"
dtype = "bfloat16" if torch.cuda.is_available() and torch.cuda.is_bf16_supported() else "float32"
compile = False
cuda_graph = True  # KLA / GDN on CUDA: replay each decoding step from a CUDA graph (7x faster on the H200)
exec(open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "configurator.py")).read())
# -----------------------------------------------------------------------------


def fail(msg):
    print(f"error: {msg}", file=sys.stderr)
    sys.exit(1)


# every setting checked before any work: one line naming the value and what it may be (configurator.py)
device_type = check_device(device, dtype)
check("num_samples", num_samples >= 1, ">= 1")
check("max_new_tokens", max_new_tokens >= 1, ">= 1")
# logits are divided by it in float32: at 1e-4 logits up to 1e4 stay below 1e8, far from float32's 3.4e38, and
# sampling below it is greedy in effect (a logit 0.01 below the top one is e^-100 times as likely)
check("temperature", temperature == 0 or 1e-4 <= temperature < math.inf,
      "a finite number >= 0 and, other than 0 (greedy), >= 1e-4 (below that sampling is greedy in effect)")
check("top_k", top_k >= 0, ">= 0 (0: all tokens)")
check("seed", 0 <= seed < 2**63, ">= 0 and < 2**63")
check_run_folder()
quit_on_ctrl_c()
torch.manual_seed(seed)
ptdtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[dtype]
ctx = nullcontext() if dtype == "float32" else torch.autocast(device_type=device_type, dtype=ptdtype)

ckpt_path = os.path.join(out_dir, "ckpt.pt")
try:
    checkpoint = read_checkpoint(ckpt_path, device, needs=("model", "model_args", "meta"))
    model = GPT.from_checkpoint(checkpoint, backend="auto")  # the fastest path here, whatever it was trained with
except ValueError as err:
    fail(f"{ckpt_path}: {err}" if ckpt_path not in str(err) else str(err))
model.eval()
model.to(device)
use_graph = cuda_graph and device_type == "cuda" and "attn" not in model.config.mixers
if use_graph and dtype != "float32":  # weights in the compute dtype instead of autocast inside the graph,
    model.to(ptdtype)                 # the configuration bench.py measures (the state stays float32)
    ctx = nullcontext()
try:
    model.set_backend(device_type)
except (ValueError, RuntimeError) as err:
    fail(str(err))
engine = Engine(model)
if compile:
    engine.compile()  # the engine's forward, with the model's inside it
encode, decode = get_tokenizer(checkpoint["meta"])  # the meta.json of the data it was trained on

if start.startswith("FILE:"):
    try:
        with open(start[5:], encoding="utf-8") as f:
            start = f.read()
    except OSError as err:
        fail(f"cannot read the prompt file {start[5:]}: {err.strerror}")
    except UnicodeDecodeError:
        fail(f"cannot read the prompt file {start[5:]}: not UTF-8 text")
try:
    start_ids = encode(start)
except ValueError as err:
    fail(f"cannot encode the prompt ({err})")
if not start_ids:
    fail("the prompt is empty; give at least one token with --start=...")
vocab_size = model.config.vocab_size
bad = [i for i in start_ids if not 0 <= i < vocab_size]  # token ids given as such (the datasets without a tokenizer)
if bad:
    fail(f"the prompt holds token id {bad[0]}; this model's token ids are 0..{vocab_size - 1}")
x = torch.tensor(start_ids, dtype=torch.long, device=device)[None, ...]
sep = " " if checkpoint["meta"]["tokenizer"] == "none" else ""  # token ids: the new ones apart from the prompt's

t_prefill, t_decode = 0.0, 0.0
with ctx:
    for _ in range(num_samples):
        ids, printed = [], ""
        print(start + sep, end="", flush=True)
        t0 = time.time()
        tokens = engine.stream(x, max_new_tokens, temperature=temperature, top_k=top_k or None, cuda_graph=use_graph)
        for i, tok in enumerate(tokens):
            if i == 0:  # the first token comes right after reading the prompt (prefill)
                t1 = time.time()
                t_prefill += t1 - t0
            ids.append(tok.item())
            text = decode(ids)
            if not text.endswith("\ufffd"):  # hold back a partial UTF-8 character of a BPE token
                print(text[len(printed):], end="", flush=True)
                printed = text
        print(text[len(printed):] + "\n---------------")
        t_decode += time.time() - t1
n_decoded = num_samples * (max_new_tokens - 1)
print(f"prompt of {len(start_ids)} tokens read in {1000 * t_prefill / num_samples:.1f} ms; "
      f"{n_decoded} tokens decoded at {n_decoded / max(t_decode, 1e-9):.1f} tokens/s")
