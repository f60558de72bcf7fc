"""The target model as the worker sees it: what its `config.json` says (read without loading weights, without
torch), and where its decoder stack sits inside a loaded one."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from hsextract.errors import UsageError

if TYPE_CHECKING:
    from torch.nn import Module


@dataclass(frozen=True)
class ModelInfo:
    """What `config.json` says, read without loading weights (used to validate arguments early)."""

    model_type: str
    num_layers: int
    hidden_size: int
    vocab_size: int
    max_positions: int | None = None  # the longest sequence the model takes (`max_position_embeddings`)

    def max_length(self, asked: int | None) -> int | None:
        """The samples' length limit: --max-length, else the model's own."""
        return asked if asked is not None else self.max_positions


def read_model_info(model_dir: Path) -> ModelInfo:
    """The model's config.json, read without loading weights; UsageError naming what is missing or wrong."""
    config_path = model_dir / "config.json"
    if not model_dir.is_dir():
        raise UsageError(f"--model {str(model_dir)!r}: no such directory")
    if not config_path.is_file():
        raise UsageError(f"--model {str(model_dir)!r}: no config.json in it (is this a model directory?)")
    try:
        raw = json.loads(config_path.read_text())
    except OSError as exc:
        raise UsageError(f"{config_path}: not readable ({exc.strerror or exc})") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise UsageError(f"{config_path}: not valid JSON ({exc})") from None
    text = raw.get("text_config", raw)
    try:
        limit = text.get("max_position_embeddings")
        return ModelInfo(raw.get("model_type", "?"), int(text["num_hidden_layers"]),
                         int(text["hidden_size"]), int(text["vocab_size"]),
                         int(limit) if isinstance(limit, int) and limit > 1 else None)
    except KeyError as exc:
        raise UsageError(f"{config_path}: missing {exc.args[0]!r}") from None


def decoder_backbone(model: Module) -> Module:
    """The module holding `embed_tokens`, `layers` and `norm` (the text model inside any wrapper)."""
    from torch.nn import ModuleList

    for module in model.modules():
        if isinstance(getattr(module, "layers", None), ModuleList) and hasattr(module, "embed_tokens"):
            return module
    raise UsageError(f"{type(model).__name__}: no decoder stack (module with embed_tokens and layers) found")
