"""The models the planner runs: bench/'s MLP, a small GPT, or yours.

    python -m minishard.plan --model FILE.py:FUNCTION --ranks 4 [--memory 24GB]
    torchrun --standalone --nproc_per_node=2 -m minishard.plan --check --model FILE.py:FUNCTION
    python -m minishard.plan --timeline 3 --ranks 2 --model FILE.py:FUNCTION

``FUNCTION()`` takes no argument and returns a dict::

    model   an nn.Module (on the meta device: the memory plan only, nothing runs)
    batch   what one rank's forward takes: a tensor, or a tuple (``model(*batch)``)
    units   optional: the module class (or classes) that are ZeRO units, as ZeRO(units=...)
    loss    optional: output -> a scalar tensor; default the output's mean

A dry run calls it once for every system and rank it trains, under ``torch.manual_seed(0)``,
so give it the model you would train and one rank's batch. ``--model mlp`` and ``--model gpt``
are bench/'s models (:func:`mlp`, :func:`gpt`). From Python: ``Model("FILE.py:FUNCTION")`` is a
``build`` for observe/predict.py (``predict``, ``train``, ``timelines``), with its ``units`` and
``loss``; observe/model_plan.py is the command.
"""
from __future__ import annotations

import dataclasses
import functools
import importlib.util
import os
import sys

import torch
from torch import nn

__all__ = ["ModelError", "Model", "mlp", "MLP_UNITS", "gpt", "GPT_UNITS", "OPTIMIZERS",
           "on_meta", "runs_once"]


class _Block(nn.Module):  # bench/zero_vs_stock.py's MLP block
    def __init__(self, d: int) -> None:
        super().__init__()
        self.linear = nn.Linear(d, d)

    def forward(self, x):
        return nn.functional.gelu(self.linear(x))


def mlp(width: int = 512, blocks: int = 8, batch: int = 32):
    """bench/'s MLP: ``blocks`` Linear(width, width) + GELU, and a batch of ``batch`` rows."""
    return nn.Sequential(*[_Block(width) for _ in range(blocks)]), torch.randn(batch, width)


MLP_UNITS = {_Block}  # its ZeRO units


class _Attention(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.heads, self.qkv, self.proj = heads, nn.Linear(d, 3 * d), nn.Linear(d, d)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2)
                   for z in self.qkv(x).split(d, dim=2))
        y = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, d))


class _GPTBlock(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.ln1, self.attn, self.ln2 = nn.LayerNorm(d), _Attention(d, heads), nn.LayerNorm(d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class _GPT(nn.Module):
    """nanoGPT's shape: token and position embeddings, blocks, a head tied to the embedding."""

    def __init__(self, vocab: int, seq: int, d: int, heads: int, layers: int) -> None:
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, d), nn.Embedding(seq, d)
        self.blocks = nn.Sequential(*[_GPTBlock(d, heads) for _ in range(layers)])
        self.ln_f, self.head = nn.LayerNorm(d), nn.Linear(d, vocab, bias=False)
        self.head.weight = self.wte.weight

    def forward(self, idx):
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1]))
        return self.head(self.ln_f(self.blocks(x)))


def gpt(vocab: int = 512, seq: int = 64, d: int = 128, layers: int = 4, batch: int = 4):
    """A small GPT (4 heads) and a batch of ``batch`` sequences of ``seq`` tokens."""
    return _GPT(vocab, seq, d, 4, layers), torch.randint(0, vocab, (batch, seq))


GPT_UNITS = {_GPTBlock}


def mean_square(out) -> torch.Tensor:
    """bench/'s models' loss: the output's mean square."""
    return out.float().square().mean()


def mean(out) -> torch.Tensor:
    """A model of yours without ``loss``: the output's mean."""
    return out.float().mean()


BUILT_IN = {"mlp": (mlp, MLP_UNITS), "gpt": (gpt, GPT_UNITS)}
# plan.py's --optimizer, as the dry runs build it (lr 1e-4, as predict.train's default)
OPTIMIZERS = {"adam": functools.partial(torch.optim.Adam, lr=1e-4),
              "adamw": functools.partial(torch.optim.AdamW, lr=1e-4),
              "sgd": functools.partial(torch.optim.SGD, lr=1e-4, momentum=0.9),
              "sgd-nomomentum": functools.partial(torch.optim.SGD, lr=1e-4)}
KEYS = ("model", "batch", "units", "loss")


class ModelError(ValueError):
    """``--model`` cannot be used: one line saying what is wrong and what is expected."""


_loaded: dict[str, object] = {}  # FILE.py:FUNCTION -> the function, once a process


def _function(where: str):
    """The FUNCTION of ``FILE.py:FUNCTION``, its file imported once (its folder on sys.path, so
    that it may import its neighbours)."""
    if where in _loaded:
        return _loaded[where]
    path, _, name = where.rpartition(":")
    if not path or not name or not path.endswith(".py"):
        raise ModelError(f"--model {where}: give FILE.py:FUNCTION (or mlp, gpt)")
    if not os.path.isfile(path):
        raise ModelError(f"--model {where}: no such file {path}")
    folder = os.path.dirname(os.path.abspath(path))
    if folder not in sys.path:
        sys.path.insert(0, folder)
    module_name = f"_minishard_model_{len(_loaded)}"
    spec = importlib.util.spec_from_file_location(module_name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module  # (dataclasses and pickling look classes up here)
    try:
        spec.loader.exec_module(module)
    except Exception as exc:
        raise ModelError(f"--model {where}: importing {path} raised "
                         f"{type(exc).__name__}: {exc}") from exc
    function = getattr(module, name, None)
    if not callable(function):
        defined = sorted(k for k, v in vars(module).items()
                         if callable(v) and getattr(v, "__module__", "") == module_name)
        raise ModelError(f"--model {where}: {path} defines no function {name!r} (it defines: "
                         f"{', '.join(defined) or 'none'})")
    _loaded[where] = function
    return function


def _is_unit_class(c) -> bool:
    return isinstance(c, type) and issubclass(c, nn.Module)


def _checked(where: str, got) -> dict:
    """FUNCTION()'s dict, or a ModelError naming the first thing that is not as expected."""
    say = f"--model {where}: {where.rpartition(':')[2]}() returned"
    if not isinstance(got, dict):
        raise ModelError(f"{say} a {type(got).__name__}; return a dict: {{'model': an "
                         "nn.Module, 'batch': a tensor or a tuple, 'units' and 'loss' optional}")
    unknown = sorted(set(got) - set(KEYS), key=str)
    if unknown:
        raise ModelError(f"{say} unknown key(s) {', '.join(map(repr, unknown))}: the dict "
                         f"takes {', '.join(KEYS)}")
    if not isinstance(got.get("model"), nn.Module):
        raise ModelError(f"{say} 'model': {type(got.get('model')).__name__}; an nn.Module "
                         "is needed")
    batch = got.get("batch")
    if not isinstance(batch, (torch.Tensor, tuple, list)):
        raise ModelError(f"{say} 'batch': {type(batch).__name__}; a tensor, or a tuple of what "
                         "the forward takes, is needed")
    units = got.get("units")
    listed = [units] if _is_unit_class(units) else list(units or ())
    if not all(_is_unit_class(c) for c in listed):
        raise ModelError(f"{say} 'units': {units!r}; module classes (a class, or a set of them) "
                         "are needed")
    kinds = {type(m) for m in got["model"].modules()}
    absent = [c.__name__ for c in listed if c not in kinds]
    if absent:
        raise ModelError(f"{say} 'units' {', '.join(absent)}: no module of the model is one")
    if got.get("loss") is not None and not callable(got["loss"]):
        raise ModelError(f"{say} 'loss': {type(got['loss']).__name__}; a function of the "
                         "output returning a scalar is needed")
    return {"model": got["model"], "batch": tuple(batch) if isinstance(batch, list) else batch,
            "units": set(listed) or None, "loss": got.get("loss") or mean}


@dataclasses.dataclass(frozen=True)
class Model:
    """A model the planner runs: ``"mlp"``, ``"gpt"`` or ``"FILE.py:FUNCTION"``. Calling it
    builds ``(module, batch)`` (observe/predict.py's ``build``); it pickles as its name, so
    warm ranks load it themselves."""
    where: str

    def built(self) -> dict:
        """A fresh {model, batch, units, loss}."""
        if self.where in BUILT_IN:
            make, units = BUILT_IN[self.where]
            module, batch = make()
            return {"model": module, "batch": batch, "units": units, "loss": mean_square}
        function = _function(self.where)
        try:
            got = function()
        except Exception as exc:
            raise ModelError(f"--model {self.where}: {function.__name__}() raised "
                             f"{type(exc).__name__}: {exc}") from exc
        return _checked(self.where, got)

    def __call__(self):
        made = self.built()
        return made["model"], made["batch"]

    def check(self, runs: bool) -> dict:
        """One build, checked; ``runs``: also one forward and the loss, under no_grad (a dry run
        will train it: it must hold real tensors and its loss must be a scalar)."""
        made = self.built()
        if runs:
            if on_meta(made["model"]):
                raise ModelError(f"--model {self.where}: the model is on the meta device; "
                                 "--check and --timeline run its step: build it on the CPU")
            runs_once(self.where, made)
        return made


def on_meta(module: nn.Module) -> bool:
    return any(t.is_meta for t in (*module.parameters(), *module.buffers()))


def runs_once(where: str, made: dict) -> None:
    """One forward and the loss, under no_grad: a ModelError if either fails or the loss is not
    a scalar."""
    batch, module = made["batch"], made["model"]
    with torch.no_grad():
        try:
            loss = made["loss"](module(*batch) if isinstance(batch, tuple) else module(batch))
        except Exception as exc:
            raise ModelError(f"--model {where}: the forward and loss on 'batch' raised "
                             f"{type(exc).__name__}: {exc} (a model whose output is not a "
                             "tensor needs 'loss')") from exc
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        raise ModelError(f"--model {where}: the loss is "
                         f"{getattr(loss, 'shape', type(loss).__name__)}; a scalar is needed")
