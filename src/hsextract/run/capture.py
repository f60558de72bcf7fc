"""Load the target model from a local directory and capture chosen layers with forward hooks.

Only the layers up to the last captured one are loaded and run (no lm_head, no logits), unless the final
normed state is asked for (`include_last`), which needs every layer. Batches are right-padded: the model
is causal, so pad tokens after a sample never change its states, and no attention mask is needed.
"""

from __future__ import annotations

import contextlib
import importlib.util
from pathlib import Path
from typing import TYPE_CHECKING, cast

import torch
from torch import nn

from hsextract.data.model import decoder_backbone, read_model_info
from hsextract.errors import UsageError
from hsextract.options import DEFAULT_KERNELS
from hsextract.run.batching import batch_size_buckets
from hsextract.run.kernels import apply_kernels
from hsextract.run.layers import layers_to_load
from hsextract.run.prewarm import SHORTEST, linear_attention_modules, run_sizes

if TYPE_CHECKING:
    from hsextract.run.preload import Preload


class LayerCapture:
    """A loaded model plus hooks that write the chosen layers' outputs for real tokens into one buffer."""

    def __init__(self, model_dir: Path, layer_ids: list[int], include_last: bool, device: str, dtype: torch.dtype,
                 random_weights: int | None = None, preload: Preload | None = None, kernels: str = DEFAULT_KERNELS):
        from transformers import AutoConfig, AutoModelForCausalLM
        from transformers.utils import logging as hf_logging

        hf_logging.set_verbosity_error()  # the load report lists the layers we drop on purpose
        hf_logging.disable_progress_bar()

        self.info = read_model_info(model_dir)
        self.layer_ids = layer_ids
        self.include_last = include_last
        self.device = torch.device(device)
        self.dtype = dtype
        self.hidden_size = self.info.hidden_size
        self.load_path = "made on the device from the seed" if random_weights is not None else ""
        config = AutoConfig.from_pretrained(model_dir, local_files_only=True)
        _truncate_layers(config.get_text_config(), layers_to_load(layer_ids, self.info.num_layers, include_last))
        if random_weights is not None:  # no checkpoint read: made where it runs, from the seed
            torch.manual_seed(random_weights)
            with torch.device(self.device):
                model = AutoModelForCausalLM.from_config(config, dtype=dtype)
            loading: dict[str, list[str]] = {"missing_keys": []}
        else:
            model, loading = self._load_weights(model_dir, config, dtype, preload)
        missing = [k for k in loading["missing_keys"] if "lm_head" not in k]
        if missing:
            raise UsageError(
                f"--model {str(model_dir)!r}: weights missing for {len(missing)} parameter(s), "
                f"e.g. {missing[:3]} (incomplete download or a missing shard file?)"
            )
        self.backbone = decoder_backbone(model).to(self.device).eval()
        self.kernels = apply_kernels(self.backbone, self.device, kernels)
        del model  # drops lm_head (unless tied to the embeddings)
        if preload is not None and preload.taken and self.device.type == "cuda":
            torch.cuda.empty_cache()  # what the model did not take (a vision tower) freed in the preload stream's pool
        self._out: torch.Tensor | None = None
        self._rows: torch.Tensor | None = None
        self._text_config = config.get_text_config()
        self.masks: dict | None = None  # the masks every batch gets, made once (`settle_masks`); None: the model's
        self._masks_settled = False
        for slot, layer_id in enumerate(layer_ids):
            cast(nn.ModuleList, self.backbone.layers)[layer_id].register_forward_hook(self._hook(slot))

    def _load_weights(self, model_dir: Path, config, dtype: torch.dtype, preload: Preload | None):
        """The model read from its checkpoint: from the tensors `preload` read to the device while the worker
        imported, else by transformers from the files (straight to the GPU where it can: it needs accelerate;
        else through host memory). (model, transformers' loading info); UsageError when weights are missing."""
        from transformers import AutoModelForCausalLM

        direct = self.device.type == "cuda" and importlib.util.find_spec("accelerate") is not None
        self.load_path = "direct to the device" if direct else "through host memory"
        place = {"device_map": str(self.device)} if direct else {}
        built = _causal_lm_class(config) if preload is not None else None  # None: remote code, say
        state = preload.tensors() if preload is not None and built is not None else None  # read beside the imports
        if preload is not None and state is None:
            preload.stop()
        try:
            if state is not None:
                self.load_path = "read to the device beside the imports"
                assert built is not None  # `state` is read only where `built` is
                with _no_allocator_warmup():
                    return built[0].from_pretrained(
                        None, config=built[1], state_dict=state, dtype=dtype, output_loading_info=True, **place)
            return AutoModelForCausalLM.from_pretrained(
                model_dir, config=config, dtype=dtype, local_files_only=True, output_loading_info=True, **place)
        except OSError as exc:  # no weights, or a shard file named by the index is missing
            raise UsageError(f"--model {str(model_dir)!r}: cannot load weights: {exc}") from None

    def warm_up(self, token_budget: int, shortest: int = SHORTEST, run: bool = True) -> list[int]:
        """Run each kind of linear-attention module once per bucketed batch size a run can meet (up to
        `token_budget // shortest` samples), on random input within the budget: kernels that autotune per
        batch size (fla's cumsum) tune now, not in the middle of the run, and persist their choice on the
        host (fla caches autotune results), so a later process (or `hsextract.run.prewarm`'s children, before
        this) finds them. With `run` False the sizes were run in this process already (`WarmThread`, on
        modules of the same kinds and shapes): only the masks settle. Returns the sizes warmed."""
        modules = linear_attention_modules(self.backbone)
        if not modules:
            return []
        sizes = batch_size_buckets(max(1, token_budget // shortest))
        if run:
            run_sizes(modules, sizes, token_budget, self.hidden_size, self.device, self.dtype)
        self.settle_masks()  # its test batch is of a shape just warmed: no kernel compiles or tunes for it
        return sizes

    def settle_masks(self) -> bool:
        """Decide once whether every batch gets the masks made once (`_masks_made_once`; True) or the model makes
        its own per batch. Runs two forwards of a small test batch; `forward` calls it if nothing did before
        (after the kernels are warm, so that the test batch compiles and tunes nothing: `warm_up` calls it)."""
        if not self._masks_settled:
            self._masks_settled = True
            self.masks = _masks_made_once(self.backbone, self._text_config, self.info.vocab_size, self.device)
        return self.masks is not None

    @property
    def width(self) -> int:
        """Values per token in the output buffer: captured layers x hidden size."""
        return len(self.layer_ids) * self.hidden_size

    def _hook(self, slot: int):
        lo, hi = slot * self.hidden_size, (slot + 1) * self.hidden_size

        def capture(_module, _inputs, output):
            hidden_BTH = output[0] if isinstance(output, tuple) else output
            self._out[:, lo:hi] = hidden_BTH.reshape(-1, self.hidden_size).index_select(0, self._rows)

        return capture

    def forward(self, ids_BT: torch.Tensor):
        """The decoder stack over a right-padded batch of token ids (hooks fire, no cache); its output."""
        if not self.settle_masks():
            return self.backbone(input_ids=ids_BT, use_cache=False)
        return self.backbone(input_ids=ids_BT, attention_mask=self.masks, use_cache=False)

    @torch.inference_mode()
    def run(self, samples: list[list[int]]) -> dict[str, torch.Tensor]:
        """Forward one right-padded batch; returns states of real tokens only, concatenated in order.

        Nothing here waits for the device: the inputs go over from pinned memory on the same stream, so
        the host queues this batch while the previous one still runs (no idle gap between batches)."""
        lengths = [len(s) for s in samples]
        width_T = max(lengths)
        pinned = self.device.type == "cuda"
        ids_BT = torch.zeros(len(samples), width_T, dtype=torch.long, pin_memory=pinned)
        for row, sample in enumerate(samples):
            ids_BT[row, : len(sample)] = torch.tensor(sample, dtype=torch.long)
        lengths_B = torch.tensor(lengths)
        valid_BT = torch.arange(width_T)[None, :] < lengths_B[:, None]
        rows_T = valid_BT.reshape(-1).nonzero().squeeze(1)
        rows_T = (rows_T.pin_memory() if pinned else rows_T).to(self.device, non_blocking=True)
        self._rows = rows_T
        self._out = torch.empty(len(rows_T), self.width, dtype=self.dtype, device=self.device)
        try:
            result = self.forward(ids_BT.to(self.device, non_blocking=True))
            out = {"hidden_states": self._out}
            if self.include_last:
                last_BTH = result.last_hidden_state
                out["last_hidden_state"] = last_BTH.reshape(-1, self.hidden_size).index_select(0, rows_T)
            return out
        finally:
            self._out = self._rows = None


#: layer kinds whose mask a causal batch without padding or packing needs none of (sdpa and flash attention
#: take "causal" as a flag; a recurrent layer masks only padding); a sliding window needs a real mask
_UNMASKED_KINDS = {"full_attention", "linear_attention"}


def _masks_made_once(backbone: nn.Module, text_config, vocab_size: int, device: torch.device) -> dict | None:
    """The attention masks every batch of the worker gets, made once, or None when the model must make them.

    transformers makes a batch's masks in its forward, and to tell packed sequences from one sequence per
    row it reads a value back from the GPU (`find_packed_sequence_indices`): a host sync at the start of
    every forward, so the host cannot queue the next batch while the GPU runs this one, and any host
    hiccup is GPU idle time. A right-padded causal batch needs no mask at all in sdpa/flash attention and
    linear-attention layers (what the model makes then is None for each kind). The models that take a
    mapping from layer kind to mask in `attention_mask` use it as it is. The mapping of Nones is used only
    where every layer is of such a kind and it gives bit-identical states to the model's own masks on a
    test batch (an eager-attention model, which needs a real causal mask, fails that and keeps its own)."""
    kinds = set(getattr(text_config, "layer_types", None) or ())
    if not kinds or not kinds <= _UNMASKED_KINDS:
        return None
    masks = dict.fromkeys(sorted(kinds))
    generator = torch.Generator().manual_seed(0)
    ids_BT = torch.randint(0, vocab_size, (2, 64), generator=generator).to(device)  # a shape `run_sizes` warms
    try:
        with _hooks_off(backbone), torch.inference_mode():
            want = backbone(input_ids=ids_BT, use_cache=False).last_hidden_state
            got = backbone(input_ids=ids_BT, attention_mask=masks, use_cache=False).last_hidden_state
    except (TypeError, ValueError, AttributeError, KeyError, RuntimeError):
        return None  # the model does not take a mapping: it makes its masks itself
    return masks if torch.equal(want, got) else None


def _causal_lm_class(config):
    """The class `AutoModelForCausalLM` makes of `config`, and the config it gives that class (a composite
    config's text part where the class is text-only, as `AutoModelForCausalLM.from_pretrained` does); None where
    it maps none (remote code, say): the load then goes through `AutoModelForCausalLM` from the files."""
    from transformers import AutoModelForCausalLM

    try:
        built = AutoModelForCausalLM._model_mapping[type(config)]
    except KeyError:
        return None
    text_class = (getattr(config, "sub_configs", None) or {}).get("text_config")
    if text_class is not None and getattr(built, "config_class", None) is text_class:
        config = config.get_text_config()  # (a quantized checkpoint is never preloaded: `preload.why_not`)
    return built, config


@contextlib.contextmanager
def _no_allocator_warmup():
    """transformers' load with a device map first reserves the model's size on the device in one block
    (`caching_allocator_warmup`, for the copies to come); the preloaded tensors are there already, so that block
    would double the memory the weights take (a 27B model would not fit an 80 GB GPU). Off for this load."""
    from transformers import modeling_utils

    warmup = getattr(modeling_utils, "caching_allocator_warmup", None)
    if warmup is None:
        yield
        return
    modeling_utils.caching_allocator_warmup = lambda *args, **kwargs: None
    try:
        yield
    finally:
        modeling_utils.caching_allocator_warmup = warmup


@contextlib.contextmanager
def _hooks_off(backbone: nn.Module):
    """The decoder layers' forward hooks (the capture's) set aside: a test forward writes into no batch."""
    layers = cast(nn.ModuleList, backbone.layers)
    saved = {i: dict(layer._forward_hooks) for i, layer in enumerate(layers)}
    for layer in layers:
        layer._forward_hooks.clear()
    try:
        yield
    finally:
        for i, hooks in saved.items():
            layers[i]._forward_hooks.update(hooks)


def _truncate_layers(text_config, keep: int) -> None:
    text_config.num_hidden_layers = keep
    layer_types = getattr(text_config, "layer_types", None)
    if isinstance(layer_types, list):
        text_config.layer_types = layer_types[:keep]


def resolve_device(device: str | None) -> str:
    """`auto`: cuda when a GPU is visible, else cpu; otherwise the device named."""
    if device in (None, "auto"):
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise UsageError(f"--device {device}: CUDA is not available on this host")
    return device


def resolve_dtype(dtype: str, device: str) -> torch.dtype:
    """`auto`: bfloat16 on CUDA, float32 on CPU; otherwise the dtype named."""
    if dtype == "auto":
        return torch.bfloat16 if device.startswith("cuda") else torch.float32
    return {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}[dtype]
