"""
The paper's claims at small scale (RESULTS.md): every (task, mixer, seed) run of train.py + evaluate.py,
several at once on one GPU, and their results gathered into results/<task>/.

$ python experiments.py --tasks=mqar,sniah,lm --mixers=kla,gdn,attn --seeds=1,2,3    # run, then collect + plot
$ python experiments.py --collect=True       # only gather out-exp/*/eval.json into results/<task>/ and plot
$ python experiments.py --tasks=lm,mqar --mixers=kla --step_rules=kaczmarz,unit,raw,scalar,longhorn,deltanet \
      --seeds=1,2,3 --results_dir=results/step_rules    # the step-size ablation: one mixer, one run per rule

Tasks (their config file holds every hyper-parameter; flags after --train_args override them for all runs):
  mqar   config/mqar.py: MQAR, 256 tokens, 32 pairs, vocab 8192; accuracy at 1x, 2x, 4x, 8x
  sniah  config/sniah.py: MQAR with one pair, trained at 1024; accuracy at 1024 .. 8192
  stack  config/stack.py: PUSH id val / POP id ? over 64 stacks, vocab 128, trained at 1024; accuracy at the
         popped values at 256 .. 2048
  palindrome  config/palindrome.py: src SEP reverse(src), vocab 128, trained at 1024; accuracy on the reversed
         half at 256 .. 2048
  lm     config/python_stdlib.py: GPT-2 BPE over the Python standard library, split by file; test loss (and
         val loss, which chose the rates) at 1x .. 16x
  lm_large  config/python_code.py: GPT-2 small's size on every installed package's Python sources and the
         standard library's (GPT-2 BPE, split by file), one pass at most; test loss at 1x .. 16x
  mqar_small, stack_small, palindrome_small  config/<task>.py: CPU-sized versions, to check the pipeline
--step_rules: the layer of the one mixer in --mixers with each step-size rule in turn (train.py --step_rule, model.py's
STEP_RULES; 'deltanet' is the rule 'unit' with --decay=False), a run each named <task>-<rule>-<seed>.
Each run writes out-exp/<task>-<mixer>-<seed>/ (checkpoint, log.jsonl, eval.json, stdout.txt). A run that is done
is skipped, so seeds can be added later. A run is done when it ended (the last record of its log.jsonl is an end
record: train.py's at max_iters or an early stop, or the one this script adds for a run it stopped, below) and its
eval.json evaluated the checkpoint it ended with (the same iteration). Any other run with a checkpoint is resumed
from it: one stopped or killed, one whose eval.json cannot be read (a write cut short), was written while it still
trained (evaluate.py run by hand mid-run) or is of an earlier checkpoint. If train.py had ended it, train.py says
there is nothing left to train and the run is evaluated. A run whose train.py fails otherwise (e.g. a resume
refused: other model flags than its checkpoint's), or whose evaluate.py fails, is reported with its error line,
neither evaluated nor collected, and experiments.py exits non-zero at the end. --deadline=S stops the training runs
still going after S seconds: their best checkpoint so far is evaluated, and their log.jsonl ends with
{"iter": <the iteration reached>, "end": "deadline"}, which makes them done; with --eval_stopped=False they are
left for the next call to resume, e.g. on a machine that keeps --root between calls. A SIGTERM (a scheduler's time
limit, `kill`) does the same at once ("end": "SIGTERM"). Ctrl-C stops the runs as well, leaves them unevaluated
for the next call to resume and exits with status 130.
--data_dir=DIR --n_train=N: the datasets in DIR, prepared there with N training examples if missing.
--tasks: by default mqar,sniah,lm; with --collect=True, every task that has a run under --root. Only the tasks of
--tasks are collected, checked for clashes (below) and have their tables written: the others' are left as they are.
results/<task>/<task>.csv (or --results_dir=DIR: DIR/<task>.csv) has one row per run (merged with the rows
already there), its mixer and step_rule (empty: the mixer's own); <task>.png beside it plots the mean and spread
over seeds per mixer (or rule) against the evaluation length. Both are written whole to a temporary file that is
then renamed over the old one: a write that fails (a full disk) leaves the old table as it was. A task with no done
run under --root keeps its table and plot as they are; --collect=True with no done run of its tasks under --root
is an error. A row is never replaced by another run's silently: a call that would (a run of the same
task, mixer or rule and seed under another --root, with other settings, or trained again) stops before any work,
naming the row, and writes nothing; collect such runs into another --results_dir, or replace the rows with
--overwrite=True. The same run collected again gives the same row, which is no replacement.
--root (unless --collect=True, where it must exist) and the tables' folders must be folders this user can make and
write: checked with the other settings, before any work. So are --train_args and --eval_args: train.py (for each task
and mixer or rule) and evaluate.py are run up to the end of their own checks of their settings, and a flag they refuse
is one line here; flags that this script sets for each run (--out_dir, --seed, --mixer, ...) are refused there, as is
a task, mixer, step rule or seed given twice.
"""
import csv
import io
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from ast import literal_eval

from prepare_data import write_file
from run_safety import IN_USE, NOTHING_LEFT, open_output, read_log

TASKS = {"mqar": ("config/mqar.py", "mqar", "accuracy"),
         "sniah": ("config/sniah.py", "sniah", "accuracy"),
         "stack": ("config/stack.py", "stack", "accuracy"),
         "palindrome": ("config/palindrome.py", "palindrome", "accuracy"),
         "lm": ("config/python_stdlib.py", "python_stdlib", "test_loss"),  # val_loss@<length> beside it
         "lm_large": ("config/python_code.py", "python_code", "test_loss"),
         "mqar_small": ("config/mqar_small.py", "mqar_small", "accuracy"),
         "stack_small": ("config/stack_small.py", "stack_small", "accuracy"),
         "palindrome_small": ("config/palindrome_small.py", "palindrome_small", "accuracy")}
# the paper's MQAR / S-NIAH accuracies (%), KLA.md, for the plots and tables
PAPER = {"mqar": {"kla": [98.35, 98.16, 95.64, 73.84], "gdn": [98.74, 98.36, 94.31, 66.81]},
         "sniah": {"kla": [100.0, 100.0, 100.0, 100.0]}}
# the step-size ablation (--step_rules): each rule's train.py flags
STEP_RULE_FLAGS = {**{rule: [f"--step_rule={rule}"] for rule in ("kaczmarz", "unit", "raw", "scalar", "longhorn")},
                   "deltanet": ["--step_rule=unit", "--decay=False"]}

# -----------------------------------------------------------------------------
tasks = ""  # from TASKS, separated by commas; "": mqar,sniah,lm, and with --collect=True every task run under --root
mixers = "kla,gdn,attn"
step_rules = ""  # e.g. "kaczmarz,unit,deltanet": a run per rule (STEP_RULE_FLAGS) of the one mixer in --mixers; "": none
seeds = "1,2,3"
jobs = 9  # training processes at once (in all)
gpus = ""  # GPUs to spread the runs over, e.g. "0,1" (a run sees one, through CUDA_VISIBLE_DEVICES); "": all
deadline = 0  # seconds; 0: let every run finish
root = "out-exp"
results_dir = ""  # where <task>.csv and <task>.png go; "": results/<task>/
data_dir = "data"  # where the datasets are (prepared there first if missing)
n_train = 0  # the synthetic tasks: training examples when the data is prepared here (0: the authors' 20,000)
train_args = ""  # extra train.py flags for every run, e.g. "--max_iters=500"
eval_stopped = True  # evaluate the runs --deadline stopped (their best checkpoint so far); False: leave them
#                      unevaluated, so that the next call with the same --root resumes them
eval_args = ""  # extra evaluate.py flags, e.g. "--max_examples=100"
collect = False  # only collect and plot
overwrite = False  # replace the rows of the results tables that other runs made (otherwise refused, see above)
exec(open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "configurator.py")).read())
# -----------------------------------------------------------------------------
here = os.path.dirname(os.path.abspath(__file__))
MIXERS = ("kla", "gdn", "attn")  # train.py --mixer

# every setting checked before any work: one line naming the value and what it may be (configurator.py)
check("tasks", not tasks or all(t in TASKS for t in tasks.split(",")),
      f"tasks separated by commas, from {', '.join(TASKS)}")
check("mixers", all(m in MIXERS for m in mixers.split(",")), f"mixers separated by commas, from {', '.join(MIXERS)}")
check("step_rules", not step_rules or all(r in STEP_RULE_FLAGS for r in step_rules.split(",")),
      f"step rules separated by commas, from {', '.join(STEP_RULE_FLAGS)} ('': none)")
check("mixers", not step_rules or mixers in ("kla", "gdn"),
      "one mixer, 'kla' or 'gdn', with --step_rules (which vary the layer of that mixer)")
check("seeds", all(s.isdecimal() for s in seeds.split(",")), "integers >= 0 separated by commas, e.g. 1,2,3")
for key in ("tasks", "mixers", "step_rules", "seeds"):  # a run named twice would be trained twice at once
    items = [int(v) if key == "seeds" else v for v in globals()[key].split(",")] if globals()[key] else []
    check(key, len(set(items)) == len(items),
          "given once each" + (" (01 and 1 are one seed)" if key == "seeds" else ""))
# the flags that this script gives each run itself: the same in --train_args or --eval_args would override them, and a
# run would train another seed, mixer or dataset than its name and row say, or into another run's folder
PER_RUN = {"train_args": (["out_dir", "seed", "mixer", "dataset", "data_dir", "init_from"]
                          + ["step_rule", "decay"] * bool(step_rules),
                          "--root, --seeds, --mixers, --step_rules, --tasks or --data_dir"),
           "eval_args": (["out_dir"], "--root")}
for key, (names, instead) in PER_RUN.items():
    given = [a.partition("=")[0] for a in globals()[key].split() if a.partition("=")[0][2:] in names]
    check(key, not given, f"other flags than {', '.join('--' + n for n in names)}, which experiments.py sets for each "
                          f"run (given: {', '.join(given)}; use {instead})")
check("jobs", jobs >= 1, ">= 1")
check("gpus", not gpus or all(g.isdecimal() for g in gpus.split(",")), "GPU indices separated by commas, e.g. 0,1 ('': all)")
check("deadline", deadline >= 0, ">= 0 seconds (0: none)")
check("n_train", n_train >= 0, ">= 0 (0: the authors' 20,000)")
for key in ("root", "data_dir", "results_dir"):
    check(key, not os.path.isfile(globals()[key]), "a folder (made if missing), not a file")
check("root", not collect or os.path.isdir(root), "an existing folder of runs with --collect=True")
if not tasks:  # the default
    tasks = ",".join(t for t in TASKS if os.path.isdir(root) and any(n.startswith(t + "-") for n in os.listdir(root))) \
        if collect else "mqar,sniah,lm"
selected = tasks.split(",") if tasks else []  # the tasks run, collected and checked for clashes


def fail(msg):
    print(f"error: {msg}", file=sys.stderr)
    sys.exit(1)


def runs():
    """(task, train.py flags of the model, seed, out_dir) of every run: a mixer each, or a step rule each."""
    rules = step_rules.split(",") if step_rules else []
    models = {rule: [f"--mixer={mixers}"] + STEP_RULE_FLAGS[rule] for rule in rules} \
        or {mixer: [f"--mixer={mixer}"] for mixer in mixers.split(",")}
    for task in selected:
        for name, flags in models.items():
            for seed in seeds.split(","):
                yield task, flags, int(seed), os.path.join(root, f"{task}-{name}-{seed}")


def train_cmd(task, flags, seed, out_dir):
    """The train.py command of a run (a resume adds --init_from=resume)."""
    return ["train.py", TASKS[task][0], *flags, f"--seed={seed}", f"--out_dir={out_dir}", f"--data_dir={data_dir}",
            "--sample_tokens=0"] + train_args.split()


def check_flags():
    """--train_args and --eval_args as train.py and evaluate.py take them, before any work: a typo found once the data
    is prepared, or once every run has trained, would cost all of that. train.py's command of each task and mixer or
    rule (the seed changes nothing there), and evaluate.py's, are run up to the end of their checks of their settings
    (KLA_CHECK_SETTINGS=1: configurator.settings_checked), at once; the first refusal is one line here."""
    cmds = {}
    if train_args:
        for task, flags, seed, out_dir in runs():
            model = " ".join([TASKS[task][0], *flags])
            cmds.setdefault(("train_args", "train.py", model), train_cmd(task, flags, seed, out_dir))
    if eval_args:
        cmds[("eval_args", "evaluate.py", "")] = ["evaluate.py", f"--out_dir={root}"] + eval_args.split()
    env = dict(os.environ, KLA_CHECK_SETTINGS="1")
    procs = {k: subprocess.Popen([sys.executable] + cmd, cwd=here, env=env, stdout=subprocess.DEVNULL,
                                 stderr=subprocess.PIPE, text=True) for k, cmd in cmds.items()}
    for (key, script, after), p in procs.items():
        err = p.communicate()[1]
        if p.returncode:
            said = (err.strip().splitlines() or [f"exit status {p.returncode}"])[-1]
            said = said.removeprefix("config error: ").removeprefix("error: ")
            check(key, False, f"flags that {script} takes{' after ' + after if after else ''} (it says: {said})")


def writable(folder):
    """Why folder cannot be made and written into ('' if it can): a file on its path, or its nearest existing
    folder refuses a new folder (tried: an empty one made and removed again)."""
    parent = os.path.abspath(folder)
    while not os.path.lexists(parent):
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent):
        return f"{parent} is a file"
    try:
        os.rmdir(tempfile.mkdtemp(dir=parent, prefix=".experiments-"))
    except OSError as err:
        return f"cannot make a folder in {parent}: {err.strerror or err}"
    return ""


def check_folders():
    """--root (where runs are trained) and the folders of the results tables can be made and written, before any
    work: an impossible folder found only after hours of training would lose the tables."""
    folders = [] if collect else [("root", root)]
    folders += [("results_dir", os.path.dirname(results_path(task))) for task in selected]
    for key, folder in folders:
        why = writable(folder)
        check(key, not why, f"a folder that can be made and written ({why})")
    for *_, out_dir in [] if collect else runs():
        if os.path.lexists(out_dir) and not os.path.isdir(out_dir):
            fail(f"{out_dir} is a file where the folder of a run should be: move it away, or use another --root")


def checkpoint_iter(out_dir, entry="iter_num"):
    """(the entry of the run's ckpt.pt, its iteration by default, ''): (None, '') without one, (None, why) if it
    cannot be read. The file is mapped, not read: only the entry is looked at."""
    path = os.path.join(out_dir, "ckpt.pt")
    if not os.path.exists(path):
        return None, ""
    import torch
    try:
        value = torch.load(path, map_location="cpu", weights_only=True, mmap=True)[entry]
        return (int(value) if entry == "iter_num" else value), ""
    except Exception as err:  # a damaged or foreign file: the resume reports it
        return None, f"its ckpt.pt cannot be read ({type(err).__name__}: {str(err)[:200]})"


def trained_otherwise(done):
    """The first run of done (runs() that are done, and skipped) whose checkpoint was trained with another value of a
    flag of --train_args: one line saying so and what to do, or ''. (Its result would be collected as if of these
    flags; only the flags given are compared, with the config saved in its checkpoint, but for those that change how
    a run is computed, not what it computes.)"""
    how = ("compile", "backend", "recompute_elementwise", "fused_loss", "device", "log_interval", "sample_tokens")
    flags = dict(a[2:].partition("=")[::2] for a in train_args.split() if a.startswith("--") and a[2:].partition("=")[0]
                 not in how)
    for *_, out_dir in done:
        config, _ = checkpoint_iter(out_dir, "config")
        for key, given in flags.items() if isinstance(config, dict) else ():
            had = config.get(key)
            if had is None or isinstance(had, str) and given == had:
                continue
            try:
                value = given if isinstance(had, str) else literal_eval(given)
            except (SyntaxError, ValueError):
                value = given
            if value != had:
                return (f"{out_dir} is done, trained with {key} = {had!r}, and --train_args gives {key} = {given}: its "
                        "result would be collected as if of these flags; give the flags it was trained with, use "
                        "another --root, or delete its eval.json to resume it with these")
    return ""


def read_eval(out_dir):
    """(the run's eval.json, '') if the run is done, else (None, why not), why '' when there is no eval.json. Done:
    the run ended (the last record of its log.jsonl is an end record) and its eval.json can be read and evaluated the
    checkpoint there (the same iteration; a run whose checkpoint was deleted after its evaluation stays done)."""
    path = os.path.join(out_dir, "eval.json")
    if not os.path.exists(path):
        return None, ""
    try:
        with open(path) as f:
            ev = json.load(f)
        ev["mixer"], ev["seed"], ev["iter_num"], [r["length"] for r in ev["results"]]  # what collected() reads
    except (OSError, ValueError, KeyError, TypeError) as err:
        return None, f"its eval.json is unreadable ({type(err).__name__}: {err})"
    log = read_log(os.path.join(out_dir, "log.jsonl"))
    if not log or "end" not in log[-1]:
        reached = f" and reaches iteration {log[-1].get('iter')}" if log else ""
        return None, (f"its eval.json (of iteration {ev['iter_num']}) was written before the run ended (its log.jsonl "
                      f"has no end record{reached})")
    it, why = checkpoint_iter(out_dir)
    if why:
        return None, why
    if it is not None and it != ev["iter_num"]:
        return None, f"its eval.json is of iteration {ev['iter_num']}, its ckpt.pt of iteration {it}"
    return ev, ""


def results_path(task):
    return os.path.join(results_dir or os.path.join("results", task), f"{task}.csv")


def read_table(path):
    """The rows of a results table, by (mixer, step_rule, seed); {} if there is none. One line, before any work, for a
    table that is not one this script writes (damaged, or edited by hand: a row without a mixer or an integer seed,
    a cell too many or too few, a value that is not a number)."""
    if not os.path.exists(path):
        return {}
    try:
        with open(path, newline="") as f:
            rows = list(csv.DictReader(f))
        for n, r in enumerate(rows, start=2):  # line n of the file
            if None in r or None in r.values():
                raise ValueError(f"line {n} has {'more' if None in r else 'fewer'} cells than the header")
            if not r.get("mixer") or not r.get("seed", "").isdecimal():
                raise ValueError(f"line {n} has no mixer or no integer seed")
            for k, v in r.items():
                if "@" in k and v:
                    float(v)  # a ValueError names the cell
    except (OSError, UnicodeDecodeError, csv.Error, ValueError) as err:
        fail(f"{path} is not a results table that experiments.py writes ({type(err).__name__}: {err}): restore it, "
             "or collect into another --results_dir")
    return {(r["mixer"], r.get("step_rule") or "", r["seed"]): {"mixer": r["mixer"], "step_rule": "", **r}
            for r in rows}


def replaced(fresh=()):
    """The rows of the results tables that this call would replace by those of other runs: a row for a run
    collected from --root whose values differ from the table's, or a table's row for a run of fresh (runs about to
    be trained from nothing, without a checkpoint). One line saying which and what to do, or ''."""
    clashes = clashed(fresh)
    if not clashes:
        return ""
    task, name, seed, out_dir = clashes[0]
    more = f" (and {len(clashes) - 1} more)" if len(clashes) > 1 else ""
    return (f"{results_path(task)} already holds {name} seed {seed}{more}, from another run than {out_dir}: "
            "collect into another --results_dir, or replace those rows with --overwrite=True")


def mixed(clashes):
    """With --overwrite=True, a warning line for each group of a table (a mixer, or a rule) whose rows clashes replace
    while it keeps other rows of the group from other runs: its mean and spread would mix runs of other settings."""
    lines = []
    for task in selected:
        replacing = {(name, seed) for t, name, seed, _ in clashes if t == task}
        ours = {(r["step_rule"] or r["mixer"], r["seed"]) for r in collected(task, TASKS[task][2], quiet=True).values()}
        for name in sorted({name for name, _ in replacing}):
            kept = sorted((seed for m, rule, seed in read_table(results_path(task)) if (rule or m) == name
                           and (name, seed) not in ours), key=int)
            if kept:
                lines.append(f"warning: --overwrite=True replaces {name} seed(s) "
                             f"{', '.join(sorted((s for n, s in replacing if n == name), key=int))} of "
                             f"{results_path(task)} with runs under {root}, and keeps its {name} seed(s) "
                             f"{', '.join(kept)} of other runs: their mean and spread mix runs that may differ in "
                             "their settings")
    return lines


def clashed(fresh=()):
    """(task, mixer or rule, seed, out_dir) of each row that replaced() tells of."""
    clashes = []
    for task in selected:
        column, table = TASKS[task][2], read_table(results_path(task))
        if not table:
            continue
        for name, row in collected(task, column, quiet=True).items():
            old = table.get((row["mixer"], row["step_rule"], row["seed"]))
            if old and any(str(row[k]) != old[k] for k in row.keys() & old.keys()):
                clashes.append((task, row["step_rule"] or row["mixer"], row["seed"], os.path.join(root, name)))
        for t, _, seed, out_dir in fresh:
            name = os.path.basename(out_dir)[len(t) + 1:].rpartition("-")[0]  # <task>-<mixer or rule>-<seed>
            key = (mixers, name, str(seed)) if step_rules else (name, "", str(seed))
            if t == task and key in table and not os.path.exists(os.path.join(out_dir, "ckpt.pt")):
                clashes.append((task, name, str(seed), out_dir))
    return clashes


def gpu_ids():
    """The GPUs to spread the runs over: --gpus, else every GPU nvidia-smi lists; [None] on a machine without."""
    if gpus:
        return gpus.split(",")
    try:
        listing = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True).stdout
    except OSError:
        return [None]
    return [str(i) for i in range(listing.count("GPU "))] or [None]


children = []  # every train.py and evaluate.py started, to stop those still running at a Ctrl-C


def launch(cmd, out_dir, log_name, gpu=None, append=False):
    """Start python cmd with its output to out_dir/log_name; None, starting nothing, while another experiments.py's
    process writes there (open_output: that run is in use, and its output is left as it is)."""
    os.makedirs(out_dir, exist_ok=True)
    log = open_output(os.path.join(out_dir, log_name), append)
    if log is None:
        return None
    env = dict(os.environ, **({"CUDA_VISIBLE_DEVICES": gpu} if gpu is not None else {}))
    children.append(subprocess.Popen([sys.executable] + cmd, cwd=here, stdout=log, stderr=subprocess.STDOUT, env=env))
    return children[-1]


def record_stop(out_dir, why):
    """End the log.jsonl of a run stopped here (why: 'deadline' or 'SIGTERM') as train.py ends its own runs, with
    {"iter": the iteration reached, "end": why}: its best checkpoint so far is its result, evaluated next, and the
    run is done. A resume (e.g. with a higher --max_iters) goes on from the checkpoint, and train.py drops this
    record as it drops every record from the checkpoint's iteration on."""
    path = os.path.join(out_dir, "log.jsonl")
    last = max((r.get("iter", 0) for r in read_log(os.path.join(out_dir, "log.jsonl"))), default=0)
    try:
        with open(path, "rb") as f:
            text = f.read()
        cut = text and not text.endswith(b"\n")  # a last line cut short by the kill: the record on a line of its own
        with open(path, "a") as f:
            f.write(("\n" if cut else "") + json.dumps({"iter": last, "end": why}) + "\n")
    except OSError as err:  # the run is then evaluated but not done: the next call resumes it
        print(f"cannot write {path}: {err.strerror or err}; the next call resumes the run", flush=True)


def least_busy(devices, gpu_of, running):
    """The GPU with the fewest of the running processes."""
    return min(devices, key=lambda g: sum(gpu_of[d] == g for d in running))


stop_signal = []  # SIGTERM (a scheduler's time limit, `kill`) received: stop as at the deadline


def run_all(todo):
    """Train and evaluate the runs of todo; the out_dirs of those that failed (train.py or evaluate.py exited
    with an error, shown here)."""
    signal.signal(signal.SIGTERM, lambda signum, frame: stop_signal.append("SIGTERM"))
    for task in selected:  # data first, once per dataset
        dataset = TASKS[task][1]
        if not os.path.exists(os.path.join(here, data_dir, dataset, "meta.json")):
            p = subprocess.run([sys.executable, "prepare_data.py", f"--dataset={dataset}", f"--data_dir={data_dir}"]
                               + ([f"--n_train={n_train}"] if n_train else []), cwd=here)
            if p.returncode:  # its error line is above
                sys.exit(p.returncode)
    t0, waiting, running, done, failed = time.time(), list(todo), {}, [], []
    devices, gpu_of = gpu_ids(), {}  # gpu_of: out_dir -> the GPU it runs on

    def stop():
        """Why the training runs stop now: 'SIGTERM', 'deadline', or '' (not yet)."""
        return stop_signal[0] if stop_signal else "deadline" if deadline and time.time() - t0 > deadline else ""

    while waiting or running:
        while waiting and len(running) < jobs and not stop():
            task, flags, seed, out_dir = waiting.pop(0)
            resume = os.path.exists(os.path.join(out_dir, "ckpt.pt"))  # stopped or killed before: go on from it
            cmd = train_cmd(task, flags, seed, out_dir) + ["--init_from=resume"] * resume
            gpu_of[out_dir] = least_busy(devices, gpu_of, running)
            p = launch(cmd, out_dir, "stdout.txt", gpu_of[out_dir], append=resume)
            if p is None:  # another experiments.py trains or evaluates it: neither done here nor counted
                print(f"[{time.time() - t0:6.0f}s] left alone {out_dir}: in use by another train.py", flush=True)
                continue
            running[out_dir] = p
            on = f" on GPU {gpu_of[out_dir]}" if gpu_of[out_dir] is not None else ""
            print(f"[{time.time() - t0:6.0f}s] {'resumed' if resume else 'started'} {out_dir}{on}", flush=True)
        if stop():
            for out_dir, p in running.items():
                p.kill()  # checkpoints are written atomically: the last good one stays
                p.wait()
                print(f"[{time.time() - t0:6.0f}s] {stop()}: stopped {out_dir}", flush=True)
                if eval_stopped and os.path.exists(os.path.join(out_dir, "ckpt.pt")):
                    record_stop(out_dir, stop())
            done += list(running) if eval_stopped else []
            running = {}
            waiting = []
        for out_dir, p in list(running.items()):
            if p.poll() is None:
                continue
            del running[out_dir]
            if p.returncode == IN_USE:
                # train.py found the run in use by another train.py (another experiments.py over this --root):
                # that one trains and evaluates it; here it is neither evaluated nor counted as done
                print(f"[{time.time() - t0:6.0f}s] left alone {out_dir}: in use by another train.py", flush=True)
                continue
            why = last_line(os.path.join(out_dir, "stdout.txt")) if p.returncode else ""  # e.g. out of memory
            # a run that train.py had ended (early stop, max_iters) but whose evaluation did not finish: train.py
            # refuses it with nothing left to train, and its checkpoint is evaluated; any other error is a failure
            ended = p.returncode == NOTHING_LEFT
            print(f"[{time.time() - t0:6.0f}s] {'finished' if not p.returncode or ended else 'failed'} {out_dir} "
                  f"(exit {p.returncode})" + (f"\n    {why}" if why else ""), flush=True)
            (done if not p.returncode or ended else failed).append(out_dir)
        time.sleep(1)
    evals = {}
    for d in done:
        if os.path.exists(os.path.join(d, "ckpt.pt")):
            gpu_of[d] = least_busy(devices, gpu_of, evals)
            p = launch(["evaluate.py", f"--out_dir={d}"] + eval_args.split(), d, "eval.txt", gpu_of[d])
            if p is None:
                print(f"[{time.time() - t0:6.0f}s] left alone {d}: evaluated by another experiments.py", flush=True)
                continue
            evals[d] = p
    for d, p in evals.items():
        if p.wait():
            print(f"[{time.time() - t0:6.0f}s] evaluation failed {d} (exit {p.returncode})\n    "
                  + last_line(os.path.join(d, "eval.txt")), flush=True)
            failed.append(d)
    print(f"[{time.time() - t0:6.0f}s] evaluated {sum(p.returncode == 0 for p in evals.values())} runs", flush=True)
    return failed


def last_line(path):
    """The last line a process wrote to its log (its error line, when it failed)."""
    with open(path, errors="replace") as f:
        return (f.read().strip().splitlines() or [""])[-1][:300]


def collected(task, column, quiet=False):
    """{run name: its row of the results table} of the task's runs under --root that are done (read_eval) and whose
    eval.json holds column; the others with an eval.json are skipped, saying why unless quiet."""
    names = [n for n in (sorted(os.listdir(root)) if os.path.isdir(root) else []) if n.startswith(task + "-")
             and os.path.exists(os.path.join(root, n, "eval.json"))]
    rows = {}
    for name in names:
        ev, why = read_eval(os.path.join(root, name))
        why = why and why + "; experiments.py over this --root (without --collect) resumes it or evaluates it again"
        if ev is not None and any(column not in r for r in ev["results"]):
            ev, why = None, f"its eval.json has no {column} (evaluated on data without a test split?)"
        if ev is None:
            if not quiet:
                print(f"skipped {name}: {why}")
            continue
        log = read_log(os.path.join(root, name, "log.jsonl"))
        vals = [r["val_loss"] for r in log if "val_loss" in r]
        tok_s = sorted(r["tok_s"] for r in log if "tok_s" in r)
        last = max((r.get("iter", 0) for r in log), default=0)
        rule = name[len(task) + 1:].rpartition("-")[0]  # the run's name: <task>-<mixer or rule>-<seed>
        row = {"mixer": ev["mixer"], "step_rule": rule if rule in STEP_RULE_FLAGS else "",
               "seed": str(ev["seed"]), "best_iter": ev["iter_num"],
               "last_iter": last, "best_val_loss": f"{min(vals):.4f}" if vals else "",
               "tok_s": f"{tok_s[len(tok_s) // 2]:.0f}" if tok_s else ""}
        row.update({f"{c}@{r['length']}": f"{r[c]:.4f}" for r in ev["results"]
                    for c in (column, "val_loss") if c in r})  # the lm task's val_loss beside its test_loss
        rows[name] = row
    return rows


def write_or_fail(path, data, what):
    """data to path whole (through a temporary file renamed over it), or one error line, the old file kept."""
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        write_file(path, data)
    except OSError as err:
        fail(f"cannot write {path}: {err.strerror or err}; the {what} there, if any, is left as it was")


def collect_results():
    """Each task of --tasks: its rows from --root merged into its table (one row per mixer or rule and seed), summed
    up and plotted. A task with no done run under --root keeps its table and plot as they are. The number of tables
    written."""
    written = 0
    for task in selected:
        column = TASKS[task][2]
        new = collected(task, column)
        if not new:
            continue
        path = results_path(task)
        rows = read_table(path)
        rows.update({(r["mixer"], r["step_rule"], r["seed"]): r for r in new.values()})
        fields = list(dict.fromkeys(k for r in rows.values() for k in r))
        text = io.StringIO()
        w = csv.DictWriter(text, fieldnames=fields)
        w.writeheader()
        w.writerows(sorted(rows.values(), key=lambda r: (r["mixer"], r["step_rule"], int(r["seed"]))))
        write_or_fail(path, text.getvalue(), "table")
        written += 1
        print(summary(task, column, list(rows.values())))
        png = plot(task, column, list(rows.values()))
        if png:
            write_or_fail(os.path.join(os.path.dirname(path), f"{task}.png"), png, "plot")
    return written


def by_mixer(rows, column):
    """{mixer, or the step rule of an ablation's run: (lengths, [values per length per seed])}, at the lengths that
    every seed of the group was evaluated at."""
    groups = {}
    for r in rows:
        groups.setdefault(r.get("step_rule") or r["mixer"], []).append(r)
    out = {}
    for name, group in groups.items():
        keys = sorted(set.intersection(*({int(k.split("@")[1]) for k in r if k.startswith(column + "@") and r[k] != ""}
                                         for r in group)))
        out[name] = keys, [[float(r[f"{column}@{n}"]) for n in keys] for r in group]
    return out


def spread(v):
    """The sample standard deviation over seeds (rows of v; n - 1 in the denominator), 0 for one seed."""
    return v.std(0, ddof=1) if len(v) > 1 else v.std(0)


def summary(task, column, rows):
    """A markdown table: mean ± sample standard deviation over seeds per mixer and evaluation length."""
    import numpy as np
    groups = sorted(by_mixer(rows, column).items())
    lengths = sorted(set.intersection(*(set(keys) for _, (keys, _) in groups))) if groups else []  # every group's
    unit = " (%)" if column == "accuracy" else ""
    lines = [f"{task}: {column}{unit} at each evaluation length, mean ± sample std over seeds", "",
             "| mixer or rule | seeds | " + " | ".join(str(n) for n in lengths) + " |", "|---|---|" + "---|" * len(lengths)]
    for mixer, (keys, vals) in groups:
        v = np.array(vals)[:, [keys.index(n) for n in lengths]] * (100 if column == "accuracy" else 1)
        cells = [f"{m:.2f} ± {sd:.2f}" if len(v) > 1 else f"{m:.2f}" for m, sd in zip(v.mean(0), spread(v))]  # no spread of one
        lines.append(f"| {mixer} | {len(v)} | " + " | ".join(cells) + " |")
    return "\n".join(lines + paired(rows, column, lengths))


def paired(rows, column, lengths, a="kla", b="gdn"):
    """Table lines of a - b seed by seed (the same seed: the same batches for both), where both ran a seed: the
    mean difference ± its sample std over seeds, and in how many seeds a is ahead (higher accuracy, lower loss)."""
    import numpy as np
    runs = {(r["mixer"], r.get("seed")): r for r in rows if not r.get("step_rule")}
    seeds = sorted({s for m, s in runs if m == a and s} & {s for m, s in runs if m == b and s}, key=int)
    if len(seeds) < 2:
        return []
    d = np.array([[float(runs[a, s][f"{column}@{n}"]) - float(runs[b, s][f"{column}@{n}"]) for n in lengths]
                  for s in seeds]) * (100 if column == "accuracy" else 1)
    ahead = (d > 0) if column == "accuracy" else (d < 0)
    return [f"| {a} - {b}, paired | {len(seeds)} | "
            + " | ".join(f"{m:+.2f} ± {sd:.2f} ({k} of {len(seeds)} {a} ahead)"
                         for m, sd, k in zip(d.mean(0), d.std(0, ddof=1), ahead.sum(0))) + " |"]


def plot(task, column, rows):
    """The task's plot, as the bytes of a PNG file; None without matplotlib."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        import numpy as np
    except ImportError:
        print("matplotlib is not installed: no plot")
        return None
    fig, ax = plt.subplots(figsize=(5.5, 3.8))
    for mixer, (lengths, vals) in sorted(by_mixer(rows, column).items()):
        v = np.array(vals) * (100 if column == "accuracy" else 1)
        line = ax.errorbar(lengths, v.mean(0), yerr=spread(v), marker="o", capsize=3, label=f"{mixer} (n={len(v)})")
        if mixer in PAPER.get(task, {}):
            ax.plot(lengths, PAPER[task][mixer][:len(lengths)], ls="--", color=line[0].get_color(),
                    label=f"{mixer}, paper")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("evaluation length (tokens)")
    ax.set_ylabel("accuracy (%)" if column == "accuracy" else "test loss (nats/token)")
    ax.set_title({"mqar": "MQAR (trained at 256)", "sniah": "S-NIAH proxy (trained at 1024)",
                  "stack": "Stack (trained at 1024)", "palindrome": "Palindrome (trained at 1024)",
                  "lm": "Python stdlib LM (trained at 512)", "lm_large": "Python code LM, 12 x 768 (trained at 1024)",
                  "mqar_small": "small MQAR on a CPU (trained at 128)",
                  "stack_small": "small stack on a CPU (trained at 128)",
                  "palindrome_small": "small palindrome on a CPU (trained at 64)"}[task])
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    png = io.BytesIO()
    fig.savefig(png, format="png", dpi=120)
    plt.close(fig)
    return png.getvalue()


def not_done():
    """The runs of runs() that are not done (read_eval), to train or resume; why, for those with an eval.json."""
    todo = []
    for r in runs():
        ev, why = read_eval(r[3])
        if ev is None:
            todo.append(r)
            if why:
                print(f"{r[3]}: {why}; the run is not done: it is resumed, or evaluated again if it has ended")
    return todo


def main():
    check_folders()
    if not collect:
        check_flags()
    failed = []
    if not collect:
        todo = not_done()
        clash = trained_otherwise([r for r in runs() if r not in todo]) if train_args else ""
        clash = clash or ("" if overwrite else replaced(todo))
        if clash:  # before any work: the tables' rows are kept, nothing is trained
            fail(clash)
        failed = run_all(todo)
    clash = "" if overwrite else replaced()
    for line in mixed(clashed()) if overwrite else []:
        print(line, file=sys.stderr)
    if clash:
        print(f"error: {clash}", file=sys.stderr)
    elif not collect_results() and collect:
        fail(f"no done run of {', '.join(selected)} under {root}: nothing to collect" if selected else
             f"no run under {root} (folders <task>-<mixer or rule>-<seed>, e.g. mqar-kla-1): nothing to collect")
    if failed:
        fail(f"{len(failed)} run(s) failed: {', '.join(failed)} (their error above, their log in stdout.txt / "
             "eval.txt there)")
    if clash:
        sys.exit(1)


if __name__ == "__main__":
    try:
        main()
    except KeyboardInterrupt:  # Ctrl-C: the runs stopped as at the deadline, one line, no traceback
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second Ctrl-C does not cut this short
        for p in children:
            if p.poll() is None:
                p.kill()  # checkpoints and eval.json are written atomically: the last good ones stay
                p.wait()
        print("interrupted; every results table is as it was or written in full: run the command again to collect"
              if collect else f"interrupted; the runs under {root} are stopped, their checkpoints kept: run the same "
              "command again to resume them", file=sys.stderr)
        sys.exit(130)  # 128 + SIGINT
