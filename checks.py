"""
The input checks of model.py: of the reference functions (kla_recurrent, kla_chunkwise) and packed sequences
(cu_seqlens), of GPTConfig, of a checkpoint's weights and of sampling's settings. Each raises a ValueError naming the
first input that breaks the contract, before any work.
"""

import math
import numbers
from dataclasses import fields

import torch


def check_inputs(q, k, v, g, eta, initial_state=None, eps=0.0, cu_seqlens=None, scale=None):
    """Raise a ValueError naming the first input that breaks the contract; last, g <= 0 (a value check:
    on a GPU it waits for the data). Returns cu_seqlens as a list (None without it)."""
    for name, x in (("q", q), ("k", k), ("v", v), ("g", g), ("eta", eta)):
        if not torch.is_tensor(x) or not x.is_floating_point():
            raise ValueError(f"{name} must be a floating-point tensor, got {getattr(x, 'dtype', type(x))}")
        if x.device != q.device:
            raise ValueError(f"{name} is on {x.device}, q on {q.device}")
    if q.dim() != 4:
        raise ValueError(f"q must be (B, T, H, K), got shape {tuple(q.shape)}")
    B, T, H, K = q.shape
    if k.shape != q.shape:
        raise ValueError(f"k must have q's shape {tuple(q.shape)}, got {tuple(k.shape)}")
    if v.dim() != 4 or v.shape[:3] != q.shape[:3]:
        raise ValueError(f"v must be (B, T, H, V) = ({B}, {T}, {H}, V), got shape {tuple(v.shape)}")
    for name, x in (("g", g), ("eta", eta)):
        if x.shape != q.shape[:3]:
            raise ValueError(f"{name} must be (B, T, H) = ({B}, {T}, {H}), got shape {tuple(x.shape)}")
    if B == 0 or T == 0:
        raise ValueError(f"the input is empty: (B, T) = ({B}, {T})")
    bounds = None if cu_seqlens is None else check_cu_seqlens(cu_seqlens, q)
    if initial_state is not None:
        want = (B if bounds is None else len(bounds) - 1, H, K, v.shape[-1])
        if not torch.is_tensor(initial_state) or tuple(initial_state.shape) != want:
            raise ValueError(f"initial_state must be ({'B' if bounds is None else 'N'}, H, K, V) = {want}, "
                             f"got {tuple(getattr(initial_state, 'shape', ()))}")
        if not initial_state.is_floating_point():
            raise ValueError(f"initial_state must be floating point, got {initial_state.dtype}")
        if initial_state.device != q.device:
            raise ValueError(f"initial_state is on {initial_state.device}, q on {q.device}")
    if not (isinstance(eps, numbers.Real) and eps >= 0):
        raise ValueError(f"eps must be a number >= 0, got {eps!r}")
    if scale is not None and not (isinstance(scale, numbers.Real) and math.isfinite(scale)):
        raise ValueError(f"scale must be a finite number (None: K^-0.5), got {scale!r}")
    if (g > 0).any():  # NaN passes, as NaN weights make it in training: the loss is then NaN, which train.py reports
        raise ValueError(f"g is a log decay and must be <= 0, but its maximum is {g.max().item():.3g}")
    return bounds


def check_cu_seqlens(cu_seqlens, q):
    """The boundaries of packed sequences as a list [0, t_1, ..., T] (a host read), or a ValueError naming
    what is wrong: cu_seqlens must be an int32 / int64 tensor (N + 1,) on q's device, 0 first, strictly
    increasing, last T, with q of batch 1. kernel.py checks the same (it imports no project module)."""
    if not torch.is_tensor(cu_seqlens) or cu_seqlens.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"cu_seqlens must be an int32 or int64 tensor, got {getattr(cu_seqlens, 'dtype', type(cu_seqlens))}")
    if cu_seqlens.dim() != 1 or len(cu_seqlens) < 2:
        raise ValueError(f"cu_seqlens must be 1-D of length N + 1 >= 2, got shape {tuple(cu_seqlens.shape)}")
    if cu_seqlens.device != q.device:
        raise ValueError(f"cu_seqlens is on {cu_seqlens.device}, q on {q.device}")
    if q.shape[0] != 1:
        raise ValueError(f"with cu_seqlens the sequences are packed in a batch of 1, got B = {q.shape[0]}")
    bounds = cu_seqlens.tolist()
    if bounds[0] != 0:
        raise ValueError(f"cu_seqlens must start at 0, got {bounds[0]}")
    if any(b <= a for a, b in zip(bounds[:-1], bounds[1:])):
        raise ValueError(f"cu_seqlens must be strictly increasing (no empty sequence), got {bounds}")
    if bounds[-1] != q.shape[1]:
        raise ValueError(f"cu_seqlens must end at T = {q.shape[1]}, got {bounds[-1]}")
    return bounds


MIXERS = ("kla", "gdn", "attn")  # a layer's sequence mixer (model.Block)


def mixer_layers(mixer, n_layer):
    """Each of n_layer layers' mixer from the pattern mixer, names of MIXERS separated by commas repeated to n_layer
    ('kla,kla,kla,attn': every fourth layer attention; one name: every layer); None where mixer is not such a pattern
    (an unknown or empty name, or a length that does not divide n_layer)."""
    names = mixer.split(",")
    if any(name not in MIXERS for name in names) or n_layer % len(names):
        return None
    return names * (n_layer // len(names))


def check_config(config, step_rules):
    """A ValueError naming the first field of a GPTConfig that breaks its contract, its type first (n_layer=2.5,
    n_head="4" or n_layer=True is refused), then its range; step_rules: model.STEP_RULES."""
    for f in fields(config):
        value = getattr(config, f.name)
        if not isinstance(value, {int: numbers.Integral, float: numbers.Real}.get(f.type, f.type)) or (
                isinstance(value, bool) and f.type is not bool):
            kind = {int: "an integer", float: "a number", str: "a string", bool: "True or False"}[f.type]
            raise ValueError(f"{f.name} must be {kind}, got {value!r}")
    for name in ("block_size", "vocab_size", "n_layer", "n_head", "n_embd", "chunk_size"):
        if not getattr(config, name) >= 1:
            raise ValueError(f"{name} must be an integer >= 1, got {getattr(config, name)!r}")
    if mixer_layers(config.mixer, config.n_layer) is None:
        raise ValueError(f"mixer must be one of {', '.join(MIXERS)}, or a pattern of them separated by commas whose "
                         f"length divides n_layer ({config.n_layer}), got {config.mixer!r}")
    attention_only = set(config.mixers) == {"attn"}  # step_rule and decay are the KLA / GDN layers'
    if config.step_rule not in ("", *step_rules) or (config.step_rule and attention_only):
        raise ValueError(f"step_rule must be '' (the mixer's own) or, with a mixer 'kla' or 'gdn' in mixer, one of "
                         f"{', '.join(step_rules)}; got {config.step_rule!r} with mixer {config.mixer!r}")
    if not isinstance(config.decay, bool) or (not config.decay and attention_only):
        raise ValueError(f"decay must be True or False (False only with a mixer 'kla' or 'gdn' in mixer); got "
                         f"{config.decay!r} with mixer {config.mixer!r}")
    if not config.conv_size >= 2:
        raise ValueError(f"conv_size must be an integer >= 2 (the current token and one before it at least), "
                         f"got {config.conv_size!r}")
    for name in ("kla_eps", "norm_eps"):
        if not getattr(config, name) >= 0:
            raise ValueError(f"{name} must be >= 0, got {getattr(config, name)!r}")
    if not 0 <= config.dropout < 1:
        raise ValueError(f"dropout must be in [0, 1), got {config.dropout!r}")
    if config.n_embd % config.n_head:
        raise ValueError(f"n_embd ({config.n_embd}) must be divisible by n_head ({config.n_head})")
    if not attention_only:
        for name in ("expand_k", "expand_v"):
            width = getattr(config, name) * config.n_embd
            if width != int(width) or int(width) % config.n_head:
                raise ValueError(f"{name} * n_embd = {width} must be an integer divisible by n_head ({config.n_head})")


def check_sampling(temperature, top_k):
    """A ValueError naming a temperature or top_k that sampling cannot take."""
    if isinstance(temperature, bool) or not (isinstance(temperature, numbers.Real) and 0 <= temperature < math.inf):
        raise ValueError(f"temperature must be a finite number >= 0 (0: greedy), got {temperature!r}")
    if top_k is not None and (isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 1):
        raise ValueError(f"top_k must be an integer >= 1 or None (all tokens), got {top_k!r}")


def check_weights(state, ours):
    """A ValueError naming what of a checkpoint's weights state does not fit the model's state_dict ours: missing,
    unexpected or other shapes (another version of the model), or not finite (a damaged file)."""
    missing, unexpected = ours.keys() - state.keys(), state.keys() - ours.keys()
    resized = {k for k in ours.keys() & state.keys() if state[k].shape != ours[k].shape}
    if missing or unexpected or resized:
        raise ValueError(f"checkpoint does not match this model.py: missing {sorted(missing)[:4]}, unexpected "
                         f"{sorted(unexpected)[:4]}, other shapes {sorted(resized)[:4]}; it was written by a "
                         "different version of the model")
    nonfinite = sorted(k for k, v in state.items() if v.is_floating_point() and not torch.isfinite(v).all())
    if nonfinite:  # train.py saves none: the file was damaged or made otherwise
        raise ValueError(f"checkpoint holds weights that are not finite: {nonfinite[:4]}; train.py never saves "
                         "such weights: a damaged file")
