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
from typing import cast

import torch
from torch import nn

from hsextract.options import DEFAULT_KERNELS, KERNEL_CHOICES

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


# --- Fast paths for the Qwen3.5/3.6 hybrid's decoder (issue 40's levers) -------------------------------------
#
# Each switch below returns what it switched ("<what> -> <kernel>") and is undone by `restore_forwards`. A switch
# is `EXACT` when it computes the same values to the bit as transformers' modules (checked on a GPU by
# benchmarks/gpu_profile.py, which says so per switch); the others round differently (fused kernels keep fp32
# where transformers rounds to bf16 between steps), so the worker takes them only when asked.

_FORWARD = "_hsextract_forward"  # an instance attribute marking a forward this module put in place


def _set_forward(module: nn.Module, forward) -> None:
    import types

    module.forward = types.MethodType(forward, module)
    setattr(module, _FORWARD, forward.__name__)


def restore_forwards(model: nn.Module) -> None:
    """Undo every fast path of this module on `model`'s submodules (their class's forward again)."""
    for module in model.modules():
        if hasattr(module, _FORWARD):
            del module.forward
            delattr(module, _FORWARD)


def _fla_available(device: torch.device) -> bool:
    return device.type == "cuda" and importlib.util.find_spec("fla") is not None


def _gated_delta_modules(model: nn.Module) -> list[nn.Module]:
    """The Gated DeltaNet mixers of the Qwen3.5-style layers (the projections and parameters this module's
    forwards read: in_proj_qkv/z/a/b, conv1d, A_log, dt_bias, norm, out_proj)."""
    need = ("in_proj_qkv", "in_proj_z", "in_proj_a", "in_proj_b", "conv1d", "A_log", "dt_bias", "norm", "out_proj")
    return [m for m in model.modules() if all(hasattr(m, name) for name in need) and hasattr(m, "num_v_heads")]


def _gdn_grouped_forward(self, hidden_states, cache_params=None, attention_mask=None, **kwargs):
    """transformers' Gated DeltaNet forward for a cacheless, unmasked batch, with the keys and queries handed to
    fla's kernel at their own head count (it maps value head i to key head i // (HV / H), as transformers'
    `repeat_interleave` does): two copies of q and k per layer, and their l2 norms on 3x the heads, saved.
    Anything else (a cache, a padding mask, packed sequences) goes through the class's own forward."""
    if cache_params is not None or attention_mask is not None or kwargs.get("cu_seq_lens_q") is not None:
        return type(self).forward(self, hidden_states, cache_params=cache_params, attention_mask=attention_mask,
                                  **kwargs)
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule

    owner = sys.modules[type(self).__module__]
    batch, seq_len, _ = hidden_states.shape
    mixed_BDT = self.in_proj_qkv(hidden_states).transpose(1, 2)
    z = self.in_proj_z(hidden_states).reshape(batch, seq_len, -1, self.head_v_dim)
    b = self.in_proj_b(hidden_states)
    a = self.in_proj_a(hidden_states)
    mixed = getattr(owner, CONV_NAME)(mixed_BDT, self.conv1d.weight.squeeze(1), self.conv1d.bias,
                                      activation=self.activation).transpose(1, 2)
    query, key, value = torch.split(mixed, [self.key_dim, self.key_dim, self.value_dim], dim=-1)
    query = query.reshape(batch, seq_len, -1, self.head_k_dim)
    key = key.reshape(batch, seq_len, -1, self.head_k_dim)
    value = value.reshape(batch, seq_len, -1, self.head_v_dim)
    beta = b.sigmoid()
    g = -self.A_log.float().exp() * nn.functional.softplus(a.float() + self.dt_bias)
    core, _ = chunk_gated_delta_rule(query, key, value, g=g, beta=beta, initial_state=None,
                                     output_final_state=False, use_qk_l2norm_in_kernel=True)
    core = self.norm(core.reshape(-1, self.head_v_dim), z.reshape(-1, self.head_v_dim))
    return self.out_proj(core.reshape(batch, seq_len, -1))


def grouped_delta_rule(model: nn.Module, device: torch.device) -> list[str]:
    """fla's delta rule given the keys and queries at their own head count (no `repeat_interleave`)."""
    if not _fla_available(device):
        return []
    modules = [m for m in _gated_delta_modules(model) if cast(int, m.num_v_heads) > cast(int, m.num_k_heads)]
    for module in modules:
        _set_forward(module, _gdn_grouped_forward)
    return [f"{len(modules)} GatedDeltaNet: grouped q/k -> fla"] if modules else []


def _rms_norm_fused(self, hidden_states):
    """Qwen3.5's zero-centred RMSNorm, x * rsqrt(mean(x^2) + eps) * (1 + w), in one pass (fla's Triton kernel;
    fp32 inside, one rounding at the end as transformers does, the mean summed in another order)."""
    from fla.modules.norm.layernorm import layer_norm_fwd

    shape = hidden_states.shape
    weight = getattr(self, "_hsextract_scale", None)
    if weight is None or weight.device != hidden_states.device:
        weight = self._hsextract_scale = (1.0 + self.weight.float()).contiguous()
    rows = hidden_states.reshape(-1, shape[-1]).contiguous()  # q/k norms get a strided view of q_proj's output
    y, *_ = layer_norm_fwd(rows, weight, None, eps=self.eps, is_rms_norm=True)
    return y.reshape(shape)


def _rms_norm_gated_fused(self, hidden_states, gate):
    """The Gated DeltaNet's output norm, rmsnorm(x) * w * silu(gate), in one pass (fla's kernel; transformers
    rounds to bf16 after the weight, this keeps fp32 to the end)."""
    from fla.modules.norm.fused_norm_gate import layer_norm_gated_fwd

    y, *_ = layer_norm_gated_fwd(hidden_states.contiguous(), gate.contiguous(), self.weight, None,
                                 activation="swish", eps=self.variance_epsilon, is_rms_norm=True)
    return y


def fused_norms(model: nn.Module, device: torch.device) -> list[str]:
    """Every Qwen3.5 RMSNorm (zero-centred: its weight is added to 1) and gated RMSNorm as one fused kernel."""
    if not _fla_available(device):
        return []
    plain = gated = 0
    for module in model.modules():
        name = type(module).__name__
        if name.endswith("RMSNormGated") and getattr(module, "activation", None) == "silu":
            _set_forward(module, _rms_norm_gated_fused)
            gated += 1
        elif name == "Qwen3_5RMSNorm" or name == "Qwen3_5TextRMSNorm" or name == "Qwen3NextRMSNorm":
            module._hsextract_scale = None  # type: ignore[assignment]  # torch: Tensor | Module only; None is fine
            _set_forward(module, _rms_norm_fused)
            plain += 1
    return [f"{plain} RMSNorm, {gated} gated RMSNorm -> fla fused"] if plain or gated else []


def _mlp_fused(self, x):
    """down(silu(gate(x)) * up(x)) with silu and the product in one kernel (fla's swiglu: one rounding)."""
    from fla.modules.activations.ops import swiglu_fwd

    return self.down_proj(swiglu_fwd(self.gate_proj(x), self.up_proj(x)))


def _mlp_merged(self, x):
    """The same with gate and up as one matrix product (their weights made one block: `merged_gate_up`)."""
    from fla.modules.activations.ops import swiglu_fwd

    both = nn.functional.linear(x, self._hsextract_gate_up)
    half = both.shape[-1] // 2
    return self.down_proj(swiglu_fwd(both[..., :half], both[..., half:]))


def fused_swiglu(model: nn.Module, device: torch.device) -> list[str]:
    """Every gated SiLU MLP's activation and product as one kernel."""
    if not _fla_available(device):
        return []
    modules = [m for m in model.modules() if all(hasattr(m, n) for n in ("gate_proj", "up_proj", "down_proj"))
               and getattr(getattr(m, "config", None), "hidden_act", None) == "silu"]
    for module in modules:
        _set_forward(module, _mlp_fused)
    return [f"{len(modules)} MLP: silu * up -> fla swiglu"] if modules else []


def merged_gate_up(model: nn.Module, device: torch.device) -> list[str]:
    """Every gated SiLU MLP's gate and up projections as one matrix product, then one fused swiglu. The two
    weights are moved into one block, module by module (gate_proj and up_proj keep views of its halves, so the
    class's own forward still works and no memory is added)."""
    if not _fla_available(device):
        return []
    modules = [m for m in model.modules() if all(hasattr(m, n) for n in ("gate_proj", "up_proj", "down_proj"))
               and getattr(getattr(m, "config", None), "hidden_act", None) == "silu"
               and cast(nn.Linear, m.gate_proj).bias is None and cast(nn.Linear, m.up_proj).bias is None]
    for module in modules:
        gate, up = cast(nn.Linear, module.gate_proj).weight, cast(nn.Linear, module.up_proj).weight
        if getattr(module, "_hsextract_gate_up", None) is None:
            block = torch.cat([gate.data, up.data])
            half = gate.shape[0]
            gate.data, up.data = block[:half], block[half:]
            module._hsextract_gate_up = block
        _set_forward(module, _mlp_merged)
    return [f"{len(modules)} MLP: gate+up one GEMM, swiglu -> fla"] if modules else []


#: `--kernels`: which decoder kernels the worker runs. "default" computes what transformers computes, to the bit
#: (fla's convolution where transformers would take its PyTorch reference; fla's delta rule given q/k at their own
#: head count); "fused" adds the fused norms and gate/up GEMM with swiglu, which round differently (the recipe
#: records the choice). On an H100 at 64 layers of the 27B shape: default MFU 0.471, fused 0.569, against 0.455
#: before (benchmarks/RESULTS.md, issue 40).
KERNELS = KERNEL_CHOICES


def apply_kernels(model: nn.Module, device: torch.device, choice: str = DEFAULT_KERNELS) -> list[str]:
    """Switch `model`'s modules to the kernels of `choice` (KERNELS); returns what was switched."""
    if choice not in KERNELS:
        raise ValueError(f"kernels {choice!r}: choose one of {KERNELS}")
    switched = use_fla_conv(model, device) + grouped_delta_rule(model, device)
    if choice == "fused":
        switched += fused_norms(model, device) + merged_gate_up(model, device)
    return switched


def fused_available(device: torch.device) -> str | None:
    """Why `--kernels fused` cannot run on `device` (None: it can)."""
    if device.type != "cuda":
        return f"needs a CUDA device, not {device}"
    if importlib.util.find_spec("fla") is None:
        return "needs flash-linear-attention (fla) installed"
    return None

