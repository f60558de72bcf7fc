"""Fast kernels where transformers would take its slow PyTorch reference path.

transformers runs a Gated DeltaNet layer's short causal convolution with the `causal_conv1d` package when it
is installed, else with its PyTorch reference (a grouped `F.conv1d`, then the activation, as two passes over
the layer's largest activation). That package needs a CUDA build on the host; flash-linear-attention (fla),
which the hybrid models need anyway for their delta rule, ships a Triton kernel for the same convolution
with the activation fused. `use_fla_conv` points the models' modules at it: only on CUDA, only where
`causal_conv1d` is absent and fla importable, and only for modules whose reference has the signature
this adapter was written against; it returns what it switched, which the worker's log line names.
Measured on an H100 at 32 layers of the Qwen3.6-27B shape: +11% on the bare forward; the fla kernel is
closer to an fp32 reference than transformers' bf16 path (benchmarks/RESULTS.md, issue 20).
"""

from __future__ import annotations

import importlib.util
import inspect
import sys

import torch
from torch import nn

CONV_NAME = "causal_conv1d_fn"
_SAVED = f"_hsextract_reference_{CONV_NAME}"  # where use_fla_conv keeps what it replaced
_REFERENCE_PARAMS = ("hidden_states", "weight", "bias", "activation")


def fla_causal_conv1d(hidden_states: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                       activation: str | None = None, **_kwargs) -> torch.Tensor:
    """transformers' `causal_conv1d_fn` contract ([B, D, T] in and out, weight [D, W]) over fla's kernel
    ([B, T, D]): the transposes are views, as transformers made [B, D, T] by transposing [B, T, D]."""
    from fla.modules.causal_conv1d import causal_conv1d

    out_BTD, _ = causal_conv1d(hidden_states.transpose(1, 2), weight, bias, activation=activation)
    return out_BTD.transpose(1, 2)


def _conv_modules(model: nn.Module) -> list:
    """The modeling modules (Python modules) of `model`'s layers that define a `causal_conv1d_fn`."""
    found = {}
    for module in model.modules():
        owner = sys.modules.get(type(module).__module__)
        if owner is not None and callable(getattr(owner, CONV_NAME, None)):
            found[owner.__name__] = owner
    return list(found.values())


def use_fla_conv(model: nn.Module, device: torch.device) -> list[str]:
    """Point `model`'s modeling modules' causal convolution at fla's Triton kernel where that is faster and
    fits; returns what was switched ("<module>.causal_conv1d_fn -> fla"), empty when nothing was."""
    if device.type != "cuda" or importlib.util.find_spec("causal_conv1d") is not None:
        return []  # CPU: the reference is what there is; causal_conv1d installed: transformers uses it
    if importlib.util.find_spec("fla") is None:
        return []
    switched = []
    for owner in _conv_modules(model):
        current = getattr(owner, CONV_NAME)
        if current is fla_causal_conv1d:
            continue
        params = tuple(inspect.signature(current).parameters)
        if params[:len(_REFERENCE_PARAMS)] != _REFERENCE_PARAMS:
            continue  # not the contract the adapter speaks: leave it as transformers made it
        setattr(owner, _SAVED, current)
        setattr(owner, CONV_NAME, fla_causal_conv1d)
        switched.append(f"{owner.__name__.rsplit('.', 1)[-1]}.{CONV_NAME} -> fla")
    return switched


def reference_conv(module: nn.Module):
    """transformers' own convolution for `module`'s modeling module (what `use_fla_conv` replaced, if it did)."""
    owner = sys.modules[type(module).__module__]
    return getattr(owner, _SAVED, None) or getattr(owner, CONV_NAME)


def restore_reference_conv(model: nn.Module) -> None:
    """Undo `use_fla_conv` (for side-by-side measurements)."""
    for owner in _conv_modules(model):
        reference = getattr(owner, _SAVED, None)
        if reference is not None:
            setattr(owner, CONV_NAME, reference)
