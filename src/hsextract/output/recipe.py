"""The recipe of an output: everything that decides the states, recorded, fingerprinted and compared.

An output holds one recipe (the integrity contract): the model by content (its config and its weights), the
tokenizer and chat template by content, the resolved layer ids, whether the final normed state is stored, the
compute and stored dtypes, the kernels, the length policy, and the transformers version's major.minor (its
modeling code is what computes the states). `Recipe.fingerprint` is a hash of those fields; a copy of the same
checkpoint at another path has the same one, another checkpoint of the same shapes another.

Recorded, not compared: the versions of hsextract, torch and transformers (each run's own, in its journal's
`recipe` entry), the model's path and its layer count and hidden size (readable facts for the plan).

How the weights are identified: each weight file's name, size, its safetensors header (every tensor's name,
dtype, shape and offsets) and 32 strided 64 KiB pieces of its data, hashed with xxh3-128 (reading ~2 MiB of
each file, not its gigabytes: a worker's start is not slowed by a pass over 54 GB). Two checkpoints that
differ anywhere a fine-tune or another training run leaves its mark differ here; a change confined to bytes
no piece touches would not (`weights_method` says which rule made the digest).

No torch: the orchestrator's plan and `hsextract check` compare recipes too.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import cast

from hsextract.errors import UsageError

#: the fields two runs must share to write into one output (the fingerprint is a hash of them)
IDENTITY = ("model_config", "weights", "tokenizer", "chat_template", "layer_ids", "include_last", "dtype",
            "out_dtype", "kernels", "max_length", "long_samples", "transformers")
#: config.json keys that say nothing about the states (where it came from, how it was saved)
CONFIG_NOISE = frozenset({"_name_or_path", "transformers_version", "torch_dtype", "dtype", "use_cache",
                          "architectures", "_commit_hash"})
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json", "merges.txt",
                   "tokenizer.model", "added_tokens.json", "vocab.txt", "spiece.model")
WEIGHTS_METHOD = "xxh3-128: name, size, header, 32 x 64 KiB pieces per file"
PIECES, PIECE_BYTES = 32, 64 << 10
ABSENT = "absent"


@dataclass(frozen=True)
class Recipe:
    """What decides an output's states (see the module's docstring); `fingerprint` identifies it."""

    model_config: str
    weights: str
    tokenizer: str
    chat_template: str
    layer_ids: tuple[int, ...]
    include_last: bool
    dtype: str
    out_dtype: str
    kernels: str
    max_length: int | None
    long_samples: str
    transformers: str  # major.minor
    # recorded, not compared
    model: str = ""
    num_model_layers: int = 0
    hidden_size: int = 0
    weights_method: str = WEIGHTS_METHOD
    versions: dict = field(default_factory=dict, compare=False, hash=False)

    @property
    def fingerprint(self) -> str:
        """16 hex digits of the sha256 of the identity fields, as canonical JSON."""
        body = json.dumps({name: _plain(getattr(self, name)) for name in IDENTITY}, sort_keys=True,
                          separators=(",", ":"))
        return hashlib.sha256(body.encode()).hexdigest()[:16]

    def to_json(self) -> dict:
        """The recipe as JSON (every field, and its fingerprint)."""
        return {"fingerprint": self.fingerprint, **{k: _plain(v) for k, v in asdict(self).items()}}

    @classmethod
    def from_json(cls, data: dict, where: str = "recipe") -> Recipe:
        """A recipe as `to_json` wrote it; ValueError naming `where` when it is not one."""
        try:
            values = {f.name: data[f.name] for f in fields(cls) if f.name in data}
            values["layer_ids"] = tuple(int(i) for i in values["layer_ids"])
            return cls(**values)
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"{where}: not a recipe ({type(exc).__name__}: {exc})") from None

    def differences(self, other: Recipe, skip: tuple[str, ...] = ()) -> list[tuple[str, object, object]]:
        """(field, this value, the other's) of every identity field that differs (`skip`: fields left out)."""
        return [(name, getattr(self, name), getattr(other, name)) for name in IDENTITY
                if name not in skip and _plain(getattr(self, name)) != _plain(getattr(other, name))]


class RecipeMismatch(UsageError):
    """Asked to extend an output made with another recipe: nothing was written (exit 2, not retried)."""


def describe(differences: list[tuple[str, object, object]]) -> str:
    """`layer_ids [3, 7] here, [1, 2] in the output; weights ...`: each field with both values."""
    def short(value) -> str:  # a digest by its first 12 hex digits: enough to tell two apart
        text = value[:value.index(":") + 13] + "…" if isinstance(value, str) and ":" in value and len(value) > 24 \
            else json.dumps(_plain(value))
        return text if len(text) <= 60 else text[:57] + "..."
    return "; ".join(f"{name} {short(mine)} asked, {short(theirs)} in the output" for name, mine, theirs in differences)


def refuse(asked: Recipe, recorded: Recipe, where: str, skip: tuple[str, ...] = ()) -> None:
    """RecipeMismatch naming every identity field in which `asked` differs from the recipe `recorded` at
    `where`; nothing when they agree."""
    differences = asked.differences(recorded, skip)
    if differences:
        raise RecipeMismatch(f"recipe differs from {where}'s ({recorded.fingerprint}): {describe(differences)}. "
                             f"A deliberate change of recipe takes a new output")


def recipe_of(opts, layer_ids: list[int], dtype: str, kernels: str | None = None, transformers: str | None = None,
              versions: dict | None = None) -> Recipe:
    """The recipe of a shard of `opts` (WorkerOptions) capturing `layer_ids` in `dtype` (resolved: bfloat16,
    float32...), read from the model directory's files (UsageError naming a file that cannot be read)."""
    from hsextract.data.model import read_model_info

    model = Path(opts.model)
    info = read_model_info(model)
    if opts.synthetic is not None:
        weights = "synthetic"  # random states, whatever the rate
    elif opts.random_weights is not None:
        weights = f"random:{opts.random_weights}"
    else:
        weights = weights_digest(model)
    transformers = transformers if transformers is not None else _installed("transformers")
    kernels = kernels or cast(str, getattr(opts, "kernels", "default"))
    return Recipe(
        model_config=config_digest(model), weights=weights, tokenizer=tokenizer_digest(model),
        chat_template=chat_template_digest(model), layer_ids=tuple(layer_ids), include_last=bool(opts.include_last),
        dtype=dtype, out_dtype=dtype if opts.out_dtype == "auto" else opts.out_dtype, kernels=kernels,
        max_length=opts.max_length, long_samples=opts.overlong, transformers=major_minor(transformers),
        model=str(model), num_model_layers=info.num_layers, hidden_size=info.hidden_size,
        weights_method=WEIGHTS_METHOD if weights.startswith("xxh3") else "",
        versions=versions if versions is not None else {
            "hsextract": _installed("hsextract"), "transformers": transformers, "torch": _installed("torch")})


def major_minor(version: str) -> str:
    """`5.17` of `5.17.0.dev0`; the whole string when it has no two numbers."""
    parts = version.split(".")
    return ".".join(parts[:2]) if len(parts) >= 2 else version


def _installed(dist: str) -> str:
    import importlib.metadata

    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return ""


def _plain(value):
    return list(value) if isinstance(value, tuple) else value


def _read(path: Path) -> bytes:
    try:
        return path.read_bytes()
    except OSError as exc:
        raise UsageError(f"{path}: not readable ({exc.strerror or exc})") from None


def config_digest(model: Path) -> str:
    """sha256 of config.json as canonical JSON, without the keys that say where it came from or how it was saved."""
    try:
        config = json.loads(_read(model / "config.json"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise UsageError(f"{model / 'config.json'}: not valid JSON ({exc})") from None
    config = _without_noise(config)
    return "sha256:" + hashlib.sha256(json.dumps(config, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def _without_noise(config):
    if isinstance(config, dict):
        return {k: _without_noise(v) for k, v in config.items() if k not in CONFIG_NOISE}
    return config


def chat_template_text(model: Path) -> str | None:
    """The chat template the tokenizer applies: chat_template.jinja, chat_template.json's, or tokenizer_config's."""
    if (model / "chat_template.jinja").is_file():
        return _read(model / "chat_template.jinja").decode(errors="replace")
    for name in ("chat_template.json", "tokenizer_config.json"):
        if (model / name).is_file():
            try:
                template = json.loads(_read(model / name)).get("chat_template")
            except (json.JSONDecodeError, UnicodeDecodeError, AttributeError):
                template = None
            if template is not None:
                return json.dumps(template, sort_keys=True) if not isinstance(template, str) else template
    return None


def chat_template_digest(model: Path) -> str:
    text = chat_template_text(model)
    return ABSENT if text is None else "sha256:" + hashlib.sha256(text.encode()).hexdigest()


def tokenizer_digest(model: Path) -> str:
    """sha256 over the tokenizer's files (tokenizer_config.json without its chat template, which is its own field)."""
    digest, found = hashlib.sha256(), False
    for name in TOKENIZER_FILES:
        path = model / name
        if not path.is_file():
            continue
        data = _read(path)
        if name == "tokenizer_config.json":
            try:
                config = json.loads(data)
                config.pop("chat_template", None)
                data = json.dumps(config, sort_keys=True).encode()
            except (json.JSONDecodeError, UnicodeDecodeError, AttributeError):
                pass
        digest.update(f"{name}\0{len(data)}\0".encode())
        digest.update(hashlib.sha256(data).digest())
        found = True
    return "sha256:" + digest.hexdigest() if found else ABSENT


def weight_files(model: Path) -> list[Path]:
    """The model directory's weight files (safetensors, PyTorch .bin), by name."""
    return sorted(p for p in model.iterdir() if p.is_file() and (p.suffix == ".safetensors" or p.name.endswith(".bin")))


def weights_digest(model: Path) -> str:
    """`xxh3:<hex>` of every weight file's name, size, safetensors header and strided pieces (`WEIGHTS_METHOD`);
    `absent` when the directory has none."""
    import xxhash

    files = weight_files(model)
    if not files:
        return ABSENT
    digest = xxhash.xxh3_128()
    for path in files:
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError as exc:
            raise UsageError(f"{path}: not readable ({exc.strerror or exc})") from None
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)  # each piece alone: no read-ahead around it
            size = os.fstat(fd).st_size
            digest.update(f"{path.name}\0{size}\0".encode())
            head = os.pread(fd, 8, 0)
            if path.suffix == ".safetensors" and len(head) == 8:
                digest.update(os.pread(fd, min(int.from_bytes(head, "little"), 100 << 20), 8))
            for offset in [size * i // PIECES for i in range(PIECES)] + [max(0, size - PIECE_BYTES)]:
                digest.update(os.pread(fd, PIECE_BYTES, offset))
        except OSError as exc:
            raise UsageError(f"{path}: not readable ({exc.strerror or exc})") from None
        finally:
            os.close(fd)
    return "xxh3:" + digest.hexdigest()
