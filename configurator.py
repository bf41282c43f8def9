"""
Poor man's configurator, as in nanoGPT. Run from a script with
    exec(open('configurator.py').read())
after the script has defined its config as module-level globals. Then
    $ python train.py config/override_file.py --batch_size=32
first runs config/override_file.py (plain Python that assigns some of those globals; its imports, functions,
classes and _private names are not settings), then applies
each --key=value. Every key must already exist as a global of type int, float, bool or str, and every
value must have that type (an int is accepted for a float): a typo or a wrong type is one clear error
and a non-zero exit before anything runs, not a silently ignored setting or a traceback.

It also gives the script check() and check_device(), with which it checks the range of every setting
right after the overrides, before any work: a value out of range is the same kind of one-line error;
check_run_folder() for a script's out_dir that names a trained run; quit_on_ctrl_c(); and settings_checked(), which
ends the script there when only its settings are to be checked.
"""
import builtins
import os
import signal
import sys
import types
from ast import literal_eval

# a reader of the output that stops early (python sample.py | head) ends the script quietly, as it ends any Unix
# command, not with a BrokenPipeError traceback (Python ignores SIGPIPE unless told otherwise). Every file the
# scripts write is written whole or not at all, so an end at any print loses nothing.
if hasattr(signal, "SIGPIPE"):
    signal.signal(signal.SIGPIPE, signal.SIG_DFL)


def _config_error(msg):
    print(f"config error: {msg}", file=sys.stderr)
    sys.exit(2)


def _checked(key, value, source):
    if key not in globals() or key.startswith("_") or type(globals()[key]) not in (int, float, bool, str):
        _config_error(f"unknown config key {key!r} (from {source})")
    want = type(globals()[key])
    if want is float and type(value) is int:
        value = float(value)
    if type(value) is not want:
        _config_error(f"{key} must be of type {want.__name__}, got {value!r} ({type(value).__name__}) from {source}")
    return value


for _arg in sys.argv[1:]:
    if not _arg.startswith("--"):
        try:
            with open(_arg, encoding="utf-8") as _f:  # Python source is UTF-8
                _src = _f.read()
        except OSError as _err:
            _config_error(f"cannot read config file {_arg}: {_err.strerror}")
        except UnicodeDecodeError:
            _config_error(f"cannot read config file {_arg}: not UTF-8 text")
        print(f"Overriding config with {_arg}:\n{_src}")
        _file_globals = {"__file__": _arg}  # so that a config file can build on another beside it
        try:
            # compiled with its path, so that errors name the file (train.py's own `compile` setting hides the builtin)
            exec(builtins.compile(_src, _arg, "exec"), _file_globals)
        except SystemExit:  # sys.exit() in a config file: not a way to end the script that runs it
            _config_error(f"config file {_arg} exited")
        except Exception as _err:
            _config_error(f"{_arg} failed: {type(_err).__name__}: {_err}")
        for _key, _val in _file_globals.items():
            # a config file may import modules and define helper functions and classes, and _private names: only
            # its other names are settings (a helper given a setting's name is that setting, of the wrong type)
            _helper = isinstance(_val, (types.ModuleType, types.FunctionType, types.BuiltinFunctionType, type))
            if not _key.startswith("_") and not (_helper and type(globals().get(_key)) not in (int, float, bool, str)):
                globals()[_key] = _checked(_key, _val, _arg)
    else:
        _key, _eq, _val = _arg[2:].partition("=")
        if not _eq:
            _config_error(f"expected --key=value, got {_arg!r}")
        if _key in globals() and type(globals()[_key]) is str:
            _value = _val  # strings are taken as written: --out_dir=out-kla, --start=FILE:prompt.txt
        else:
            try:
                _value = literal_eval(_val)  # numbers, True/False
            except (SyntaxError, ValueError):
                _value = _val
        globals()[_key] = _checked(_key, _value, _arg)
        print(f"Overriding: {_key} = {globals()[_key]!r}")


def check(key, ok, allowed):
    """A setting outside its allowed range: one line naming the value and the range, exit 2."""
    if not ok:
        _config_error(f"{key} = {globals()[key]!r}: must be {allowed}")


def check_device(device, dtype):
    """The device must be one this machine has, and the dtype one it computes in. Half precision on the CPU
    works but is several times slower than float32 there: a warning. Returns the device type."""
    import torch
    kind, _, index = device.partition(":")
    if kind not in ("cpu", "cuda", "mps") or (index and not (kind == "cuda" and index.isdecimal())):
        _config_error(f"device = {device!r}: must be 'cpu', 'cuda', 'cuda:<index>' or 'mps'")
    if kind == "cuda" and not torch.cuda.is_available():
        _config_error(f"device = {device!r}: no CUDA GPU is available here; use --device=cpu")
    if kind == "cuda" and index and int(index) >= torch.cuda.device_count():
        _config_error(f"device = {device!r}: this machine has {torch.cuda.device_count()} CUDA GPU(s), "
                      f"cuda:0 to cuda:{torch.cuda.device_count() - 1}")
    if kind == "mps" and not torch.backends.mps.is_available():
        _config_error(f"device = {device!r}: MPS is not available here; use --device=cpu")
    if dtype not in ("float32", "bfloat16", "float16"):
        _config_error(f"dtype = {dtype!r}: must be 'float32', 'bfloat16' or 'float16'")
    if dtype == "bfloat16" and kind == "cuda" and not torch.cuda.is_bf16_supported():
        _config_error("dtype = 'bfloat16': this GPU does not support it; use --dtype=float16 or float32")
    if dtype != "float32" and kind == "cpu":
        print(f"warning: dtype = {dtype!r} on the CPU runs several times slower than float32 "
              "(--dtype=float32)", file=sys.stderr)
    return kind


def check_run_folder(key="out_dir"):
    """The setting key names the folder of a trained run (train.py's out_dir, which holds ckpt.pt), not a file."""
    check(key, not os.path.isfile(globals()[key]),
          "the folder of a run (train.py's out_dir, which holds ckpt.pt), not a file")


def quit_on_ctrl_c():
    """From here on Ctrl-C prints one line, `interrupted`, on stderr and exits with status 130 (a shell's for an
    interrupted command), instead of a KeyboardInterrupt traceback. For scripts that write their one file last and
    atomically, or none (sample.py, evaluate.py); nothing goes to stdout, which the interrupt may have cut mid-print."""
    def on_sigint(signum, frame):
        print("interrupted", file=sys.stderr, flush=True)
        sys.exit(130)
    signal.signal(signal.SIGINT, on_sigint)


def settings_checked():
    """Called by a script once every setting is checked, before any work. With KLA_CHECK_SETTINGS=1 in the environment
    the script ends there, exit status 0: experiments.py checks in this way the flags it passes to train.py and
    evaluate.py (--train_args, --eval_args) before it prepares data or trains."""
    if os.environ.get("KLA_CHECK_SETTINGS") == "1":
        sys.exit(0)
