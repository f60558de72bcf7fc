"""What a shard will need, checked on its host before any launch, without torch: `hsextract check`.

The orchestrator runs `hsextract check` with a run's options once per host after deploying the bundle: the
model directory and its config.json readable, the layers asked for in the model, the dataset readable, a
local output writable. A problem is a `UsageError` naming the option and what is wrong with it (exit 2):
the mistake is fixed before a GPU is taken, instead of failing every shard the same way.
"""

from __future__ import annotations

import json
import tempfile
from dataclasses import dataclass
from pathlib import Path

from .errors import UsageError
from .layers import parse_layer_spec
from .options import WorkerOptions


@dataclass(frozen=True)
class ModelInfo:
    """What `config.json` says, read without loading weights (used to validate arguments early)."""

    model_type: str
    num_layers: int
    hidden_size: int
    vocab_size: int


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
        return ModelInfo(raw.get("model_type", "?"), int(text["num_hidden_layers"]),
                         int(text["hidden_size"]), int(text["vocab_size"]))
    except KeyError as exc:
        raise UsageError(f"{config_path}: missing {exc.args[0]!r}") from None


def preflight(opts: WorkerOptions) -> dict:
    """Check everything a shard of `opts` needs that can be checked without loading the model; returns what
    was found (model type, layer count, the layer ids, dataset size). UsageError on the first problem."""
    opts.check_inputs()
    info = read_model_info(opts.model)
    layer_ids = parse_layer_spec(opts.layers, info.num_layers)
    try:
        with open(opts.data, "rb") as f:
            f.read(1 << 16)
    except OSError as exc:
        raise UsageError(f"--data {str(opts.data)!r}: not readable ({exc.strerror or exc})") from None
    if opts.upload is None:
        out = opts.out_dir
        try:
            out.mkdir(parents=True, exist_ok=True)
            with tempfile.NamedTemporaryFile(dir=out, prefix=".preflight-"):
                pass
        except OSError as exc:
            raise UsageError(f"--out {str(out)!r}: not writable ({exc.strerror or exc})") from None
    return {"model_type": info.model_type, "num_layers": info.num_layers, "layers": layer_ids,
            "data_bytes": opts.data.stat().st_size}
