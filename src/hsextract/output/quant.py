"""Optional fp8 storage of hidden states: e4m3 values with one float32 scale per token and layer.

`--out-dtype fp8_e4m3` halves the bytes of bf16 (quarters fp32) plus 4 bytes per token and layer. Each
layer's slice of a token is divided by amax/448 (448 is e4m3's largest finite value) and rounded to e4m3:
3 mantissa bits, so an element's relative rounding error is at most 2^-4 (measured ~2-3% RMS per sample, see
docs/worker.md). The reader multiplies back and returns bf16, so consumers see the same record shape.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

FP8_ENCODING = "fp8_e4m3_per_token_layer_scale"  # metadata `hidden_states_encoding`
SCALE_KEY = "hidden_states_scale"
E4M3_MAX = 448.0


def fp8_bytes_per_token(width: int, layers: int) -> int:
    """Bytes a token's `--out-dtype fp8_e4m3` states take: an e4m3 value each, a float32 scale per layer."""
    return width + 4 * layers


def quantize(states_TW: torch.Tensor, hidden: int) -> tuple[torch.Tensor, torch.Tensor]:
    """[T, L*H] -> ([T, L*H] float8_e4m3fn, [T, L] float32 scales), on the tensor's device."""
    import torch  # here: the constants above serve the synthetic worker, which imports no torch

    tokens = states_TW.shape[0]
    layers_TLH = states_TW.float().view(tokens, -1, hidden)
    scale_TL = layers_TLH.abs().amax(dim=-1).clamp_min(1e-12) / E4M3_MAX
    q_TLH = (layers_TLH / scale_TL[..., None]).to(torch.float8_e4m3fn)
    return q_TLH.view(tokens, -1), scale_TL


def dequantize(q_TW: torch.Tensor, scale_TL: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """[T, L*H] fp8 states and [T, L] scales back to `dtype` (default bfloat16: what the reader returns)."""
    import torch

    tokens, layers = scale_TL.shape
    values_TLH = q_TW.float().view(tokens, layers, -1) * scale_TL.float()[..., None]
    return values_TLH.view(tokens, -1).to(dtype or torch.bfloat16)
