"""`hsextract export`: an extraction output in the offline layout a drafter trainer's own loaders read.

Formats (the export contract), checked by loading exports through the trainers' own code
(tests/integration/test_export.py):

- `specforge-dflash` (SpecForge 0.2.0): one `torch.save` dict per sample, `NNNNN/NNNNNNNNN.ckpt` (its offline
  reader lists `*.ckpt` by a sorted recursive walk: the names sort in row order), keys `input_ids` [T] and
  `loss_mask` [T] int64, `hidden_states` [T, n*H] = every stored layer in stored order (SpecForge numbers
  layers as we do: id k is the output of decoder layer k, so the draft's `target_layer_ids` are ours).
- `specforge-eagle3`: the same files with keys `input_ids`, `loss_mask`, `hidden_state` [1, T, H] = the final
  state after the model's norm (`--include-last`) and `aux_hidden_state` [1, T, 3H] = the three stored
  layers other than the last decoder layer.
- `speculators` (speculators 0.9.0, `speculators.train.data.ArrowDataset(max_len, datapath=DEST)`): a
  `datasets` Arrow dataset saved at DEST in torch format (`input_ids`, `loss_mask`, `seq_len`),
  `hidden_states/hs_{row}.safetensors` with `token_ids` [T] int64 (equal to the row's `input_ids`, or the
  loader drops the sample) and `hidden_states` [T, n+1, H] (the aux layers, then the last decoder layer's
  output BEFORE the norm: speculators applies the verifier's norm itself), and `token_freq.pt` ({token id:
  count} over supervised tokens, for `--draft-vocab-size`). speculators numbers a layer by the stream
  entering it: its id = ours + 1 (`trainer_layer_ids` in export.json).

Every sample of SRC once, in SRC's reading order; a sample the trainer would reject is left out and counted
with its reason. DEST/index.jsonl records each sample as it is written (or left out), so an interrupted
export run again continues where it stopped; DEST/export.json holds the summary once it is complete.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import torch

from hsextract.errors import UsageError
from hsextract.options import EXPORT_FORMATS as FORMATS
from hsextract.store import local_dir

INDEX = "index.jsonl"
SUMMARY = "export.json"
SCRATCH = ".partial"  # temp files of a run in progress: cleared when a run starts, removed when it completes
ROWS_PER_DIR = 10_000  # specforge files: 10,000 per directory, not a million in one


@dataclass(frozen=True)
class Source:
    """What an extraction output holds, from its first batch's metadata."""

    layer_ids: list[int]
    num_model_layers: int
    hidden_size: int
    has_last: bool
    model: str

    @classmethod
    def of(cls, batch) -> Source:
        meta = batch.metadata
        return cls(json.loads(meta["layer_ids"]), int(meta["num_model_layers"]), int(meta["hidden_size"]),
                   batch.has_last, meta.get("model", ""))

    @property
    def last_layer(self) -> int:
        """The last decoder layer's id (its output before the model's final norm)."""
        return self.num_model_layers - 1


class Layout:
    """One trainer's offline layout: what it needs of SRC, which samples it rejects, how a sample is written."""

    name = ""

    def __init__(self, src: Source):
        self.src = src

    def plan(self) -> dict:
        """What the trainer must be told (layer ids in its numbering); UsageError when SRC lacks something."""
        raise NotImplementedError

    def reject(self, loss_mask: torch.Tensor) -> str | None:
        """Why the trainer would reject a sample with this (already truncated) loss mask, or None."""
        raise NotImplementedError

    def item(self, sample: dict, own: bool = True) -> dict:
        """`sample` (a reader record) as the trainer's per-sample record, in its key names; `own`: no tensor
        is a view of a larger buffer (saved, a view would carry its whole batch along)."""
        raise NotImplementedError

    def write(self, dest: Path, row: int, sample: dict) -> str:
        """Write `sample` as row `row`; returns its file, relative to dest."""
        raise NotImplementedError

    def finish(self, dest: Path, rows: int) -> dict:
        """Write what is made from every row (speculators: the Arrow dataset); facts for export.json."""
        return {}

    def _aux(self, count: int | None, hint: str) -> list[int]:
        """Positions (in stored order) of the stored layers other than the last decoder layer."""
        positions = [n for n, k in enumerate(self.src.layer_ids) if k != self.src.last_layer]
        if not positions or (count is not None and len(positions) != count):
            raise UsageError(f"--format {self.name}: needs {count or 'at least one'} layer(s) besides the last "
                             f"decoder layer, the source has layers {self.src.layer_ids} of a "
                             f"{self.src.num_model_layers}-layer model: extract with {hint}")
        return positions

    def _layers(self, states: torch.Tensor, positions: list[int]) -> torch.Tensor:
        """[T, n*H] -> [T, len(positions), H] of the stored layers at `positions` (a copy)."""
        size = self.src.hidden_size
        return states.reshape(states.shape[0], -1, size)[:, positions].contiguous()


class SpecForgeDFlash(Layout):
    name = "specforge-dflash"

    def plan(self) -> dict:
        return {"trainer_layer_ids": list(self.src.layer_ids),
                "trainer_note": "dflash_config.target_layer_ids (SpecForge numbers layers as hsextract does)"}

    def reject(self, loss_mask):
        pairs = loss_mask[:-1].bool() & loss_mask[1:].bool()
        return None if bool(pairs.any()) else "fewer than 2 consecutive supervised tokens"

    def item(self, sample: dict, own: bool = True) -> dict:
        return {"input_ids": _int64(sample["input_ids"]), "loss_mask": _int64(sample["loss_mask"]),
                "hidden_states": _own(sample["hidden_states"], own)}

    def write(self, dest, row, sample):
        name = f"{row // ROWS_PER_DIR:05d}/{row:09d}.ckpt"
        record = self.item(sample)
        _save_atomic(lambda tmp: torch.save(record, tmp), dest, name)  # zip format: SpecForge loads with mmap
        return name


class SpecForgeEagle3(SpecForgeDFlash):
    name = "specforge-eagle3"

    def plan(self):
        if not self.src.has_last:
            raise UsageError(f"--format {self.name}: needs the final state after the model's norm, which this "
                             f"source lacks: extract with --include-last (e.g. --layers eagle3 --include-last)")
        self.aux = self._aux(3, "--layers eagle3 --include-last (three aux layers)")
        return {"trainer_layer_ids": [self.src.layer_ids[n] for n in self.aux],
                "trainer_note": "aux_hidden_state_layer_ids (SpecForge numbers layers as hsextract does)"}

    def reject(self, loss_mask):
        # SpecForge's EAGLE-3 reader zeroes the last position's loss: the rest must supervise something
        if loss_mask.numel() < 2 or not bool(loss_mask[:-1].any()):
            return "no supervised token before the last"
        return None

    def item(self, sample, own=True):
        aux = self._layers(sample["hidden_states"], self.aux)
        return {"input_ids": _int64(sample["input_ids"]), "loss_mask": _int64(sample["loss_mask"]),
                "hidden_state": _own(sample["last_hidden_state"], own).unsqueeze(0),
                "aux_hidden_state": aux.reshape(1, aux.shape[0], -1)}


class Speculators(Layout):
    name = "speculators"

    def plan(self):
        if self.src.last_layer not in self.src.layer_ids:
            raise UsageError(f"--format {self.name}: needs the last decoder layer (id {self.src.last_layer}, "
                             f"before the final norm), which this source lacks (layers {self.src.layer_ids}): "
                             f"extract with --layers eagle3+last")
        self.aux = self._aux(None, "--layers eagle3+last")
        self.slots = self.aux + [self.src.layer_ids.index(self.src.last_layer)]
        return {"trainer_layer_ids": [self.src.layer_ids[n] + 1 for n in self.aux],
                "trainer_note": "--target-layer-ids (speculators/vLLM id = hsextract id + 1: the stream entering "
                                "that layer); the last slot is the verifier's last layer before its norm"}

    def reject(self, loss_mask):
        # speculators' EAGLE-3 shifts by one token (shift_batch): what is left must supervise something
        if loss_mask.numel() < 2 or not bool(loss_mask[1:].any()):
            return "no supervised token after the first"
        return None

    def item(self, sample, own=True):
        """What speculators' ArrowDataset hands its collate function for one sample (always copies: the
        stored layers are reordered into its slots)."""
        states = self._layers(sample["hidden_states"], self.slots)
        length = states.shape[0]
        return {"hidden_states": states[:, :-1].flatten(1), "input_ids": _int64(sample["input_ids"]),
                "verifier_last_hidden_states": states[:, -1].contiguous(), "loss_mask": _int64(sample["loss_mask"]),
                "lengths": torch.tensor([length]), "position_ids": torch.arange(length)}

    def write(self, dest, row, sample):
        from safetensors.torch import save_file

        name = f"hidden_states/hs_{row}.safetensors"
        tensors = {"token_ids": _int64(sample["input_ids"]),
                   "hidden_states": self._layers(sample["hidden_states"], self.slots),
                   "loss_mask": _int64(sample["loss_mask"])}  # read back by finish(); speculators ignores it
        _save_atomic(lambda tmp: save_file(tensors, str(tmp)), dest, name)
        return name

    def finish(self, dest: Path, rows: int) -> dict:
        """The Arrow dataset (input_ids, loss_mask, seq_len of every row, read back from the rows' files, so
        memory stays bounded) in torch format, and token_freq.pt."""
        from safetensors import safe_open

        try:
            import datasets
        except ImportError:
            raise UsageError("--format speculators needs the `datasets` package: pip install 'hsextract[export]'") \
                from None
        from datasets.arrow_writer import ArrowWriter

        freq: Counter = Counter()
        features = datasets.Features({"input_ids": datasets.Sequence(datasets.Value("int64")),
                                      "loss_mask": datasets.Sequence(datasets.Value("int64")),
                                      "seq_len": datasets.Value("int64")})
        build = dest / SCRATCH / "arrow"
        build.mkdir()
        with ArrowWriter(features=features, path=str(build / "rows.arrow")) as writer:  # rows in batches
            for row in range(rows):
                with safe_open(str(dest / f"hidden_states/hs_{row}.safetensors"), framework="pt") as f:
                    ids, mask = f.get_tensor("token_ids"), f.get_tensor("loss_mask")
                freq.update(ids[mask.bool()].tolist())
                writer.write({"input_ids": ids.tolist(), "loss_mask": mask.tolist(), "seq_len": len(ids)})
            writer.finalize()
        datasets.disable_progress_bars()
        table = datasets.Dataset.from_file(str(build / "rows.arrow"))
        table.set_format("torch")  # its loader compares rows with torch.equal
        table.save_to_disk(str(dest))
        del table
        _save_atomic(lambda tmp: torch.save({int(k): int(v) for k, v in freq.items()}, tmp), dest, "token_freq.pt")
        return {"token_freq": "token_freq.pt", "supervised_tokens": sum(freq.values())}


LAYOUTS = {cls.name: cls for cls in (SpecForgeDFlash, SpecForgeEagle3, Speculators)}


def cut(sample: dict, max_length: int | None) -> dict:
    """`sample` with every tensor cut to its first `max_length` tokens (as the trainer cuts it)."""
    if max_length is None:
        return sample
    return {k: v[:max_length] if torch.is_tensor(v) else v for k, v in sample.items()}


def _int64(tensor: torch.Tensor) -> torch.Tensor:
    return _own(tensor.to(torch.int64))


def _own(tensor: torch.Tensor, own: bool = True) -> torch.Tensor:
    """`tensor`, copied only if it is a view of a larger buffer (saved, a view carries its whole batch along)
    and `own` asks for that."""
    if not own:
        return tensor
    whole = tensor.untyped_storage().nbytes()
    return tensor if whole == tensor.numel() * tensor.element_size() and tensor.is_contiguous() else tensor.clone()


def _save_atomic(save, dest: Path, name: str) -> None:
    """`save(a path in DEST's scratch directory)`, then rename to DEST/`name`: a file is whole or absent, and
    what an interrupted save left (its own temp files too: safetensors makes one beside its target) is in
    the scratch directory, which each run clears."""
    path = dest / name
    path.parent.mkdir(parents=True, exist_ok=True)
    (dest / SCRATCH).mkdir(exist_ok=True)
    tmp = dest / SCRATCH / f"{path.name}.tmp"
    save(tmp)
    os.replace(tmp, path)


@dataclass
class Done:
    """What DEST/index.jsonl says was already exported (or left out)."""

    ids: set
    rows: int
    skipped: Counter

    @classmethod
    def read(cls, dest: Path) -> Done:
        done = cls(set(), 0, Counter())
        path = dest / INDEX
        if not path.exists():
            return done
        good = 0
        with path.open("rb") as f:
            for line in f:
                try:
                    entry = json.loads(line)
                except ValueError:
                    break  # a line cut short by the interruption: what follows it was never recorded
                good += len(line)
                done.ids.add(entry["id"])
                if "skipped" in entry:
                    done.skipped[entry["skipped"]] += 1
                else:
                    done.rows = entry["row"] + 1
        if good != path.stat().st_size:
            with path.open("r+b") as f:
                f.truncate(good)
        return done


def _start(dest: Path, settings: dict) -> bool:
    """Refuse a DEST that is not empty and not an export of these settings; True when it is complete."""
    summary = dest / SUMMARY
    if summary.exists():
        previous = json.loads(summary.read_text())
        differs = {k: (previous.get(k), v) for k, v in settings.items() if previous.get(k) != v}
        if differs:
            said = ", ".join(f"{k}: {a!r}, not {b!r}" for k, (a, b) in differs.items())
            raise UsageError(f"{dest}: holds an export with other settings ({said}): use a new DEST")
        return bool(previous.get("complete"))
    if dest.exists() and any(dest.iterdir()):
        raise UsageError(f"{dest}: not empty and not an hsextract export: use a new (or empty) directory")
    dest.mkdir(parents=True, exist_ok=True)
    _write_json(dest, SUMMARY, {**settings, "complete": False})
    return False


def _write_json(dest: Path, name: str, data: dict) -> None:
    _save_atomic(lambda tmp: tmp.write_text(json.dumps(data, indent=1) + "\n"), dest, name)


def _checked(src: str, dest: Path, fmt: str, max_length: int | None) -> tuple[str, Path | None]:
    """An export's arguments checked before anything is read (UsageError naming the one that is wrong): the
    source as it is named in the summary, and its local path (None on S3)."""
    if fmt not in LAYOUTS:
        raise UsageError(f"--format {fmt!r}: expected one of {', '.join(FORMATS)}")
    if max_length is not None and max_length < 2:
        raise UsageError(f"--max-length {max_length}: must be at least 2")
    try:
        local = local_dir(src)
    except ValueError as exc:
        raise UsageError(f"{src}: {exc}") from None
    if local is not None:
        local = local.resolve()
    if local is not None and dest.resolve().is_relative_to(local):
        raise UsageError(f"{dest}: inside the source {local}: an export goes to a directory of its own, outside the "
                         f"output (a later extraction or reconcile would meet it there)")
    return str(local or src), local


def _write_rows(dest: Path, layout, items, src: str, max_length: int | None, bar) -> tuple[int, Counter]:
    """Every sample of `items` (batch, position) written as the layout's row, or left out with the reason, each
    in the index as it lands; those an interrupted export wrote are kept. (rows, left out per reason)."""
    done = Done.read(dest)
    rows, skipped = done.rows, Counter(done.skipped)
    with (dest / INDEX).open("a") as index:
        for batch, position in items:  # a batch is held only while its samples are written
            sample_id = batch.sample_ids[position]
            bar.step()
            if sample_id in done.ids:
                continue
            _same_source(layout.src, batch, src)
            sample = cut(batch.sample(position), max_length)
            why = layout.reject(sample["loss_mask"])
            if why is not None:
                skipped[why] += 1
                entry = {"id": sample_id, "skipped": why}
            else:
                entry = {"row": rows, "id": sample_id, "file": layout.write(dest, rows, sample),
                         "tokens": int(sample["input_ids"].shape[0])}
                rows += 1
            index.write(json.dumps(entry) + "\n")
            index.flush()
    bar.close()
    return rows, skipped


def export(src: str, dest: str | Path, fmt: str, max_length: int | None = None, verify: bool | str = True,
           progress: bool | None = None, client=None, allow_partial: bool = False) -> dict:
    """Export `src` (an output: path, file://, s3://) to the new local directory `dest` in trainer format
    `fmt`; `max_length`: samples cut to the trainer's max length first (and judged after the cut). An output
    must be sealed (`_SUCCESS`: every sample accounted for) unless `allow_partial`, and hold one recipe; each
    batch file's bytes are checked as it is read (`verify`, as `read_samples`'s). Returns the summary that
    export.json holds (with the source's recipe, and what is missing from a partial one)."""
    from hsextract.training.reader import describe_output, sample_positions

    dest = Path(dest)
    src, local = _checked(src, dest, fmt, max_length)
    settings = {"format": fmt, "src": src, "max_length": max_length}
    if local is not None and local.is_file():
        from hsextract.output.batchfile import BatchFile

        total, standing = len(BatchFile(local)), {}
    else:
        described = describe_output(src, client=client)
        total, standing = described["samples"], _standing(src, described, client, allow_partial)
    settings.update(standing.pop("settings", {}))
    positions = sample_positions(src, verify, client)
    first = next(positions, None)
    if first is None:
        raise UsageError(f"{src}: no samples to export")
    layout = LAYOUTS[fmt](Source.of(first[0]))
    facts = layout.plan()  # before anything is written: a source that cannot serve this trainer is refused
    if _start(dest, settings):
        return json.loads((dest / SUMMARY).read_text())
    if (dest / SCRATCH).exists():
        shutil.rmtree(dest / SCRATCH)  # what an interrupted run left half-written
    (dest / SCRATCH).mkdir()  # there even where no row is left to write (killed after its last row)
    began, items = time.monotonic(), _chain(first, positions)
    del first  # a batch is held only while its samples are written
    rows, skipped = _write_rows(dest, layout, items, src, max_length, _Bar(total, progress))
    summary = {**settings, "complete": True, "samples_in_src": total, "exported": rows,
               "skipped": dict(skipped), "skipped_examples": _examples(dest), "layer_ids": layout.src.layer_ids,
               "num_model_layers": layout.src.num_model_layers, "hidden_size": layout.src.hidden_size,
               "model": layout.src.model, **facts, **layout.finish(dest, rows), **standing,
               "index": INDEX, "seconds": round(time.monotonic() - began, 1)}
    if rows + sum(skipped.values()) != total:
        raise RuntimeError(f"{src}: {rows} exported + {sum(skipped.values())} left out != {total} samples in the "
                           f"source (did it change during the export?)")
    _write_json(dest, SUMMARY, summary)
    shutil.rmtree(dest / SCRATCH)
    return summary


def _standing(src: str, described: dict, client, allow_partial: bool) -> dict:
    """What the source output is, for export.json: its recipe (its fingerprint goes into the settings: an
    export continued from another source is refused), whether it is complete (sealed by reconcile, or every
    shard of one shard count done: each worker proved every sample it was given written or skipped), and, for
    a partial one that `allow_partial` lets through, what is missing; UsageError for a partial one otherwise."""
    from hsextract.output.journal import SUCCESS_NAME, scan, shard_dir_name
    from hsextract.store import open_store

    store = open_store(src, client)
    state = scan(store)
    recipes = state.fingerprints()
    if len(recipes) > 1:  # the reader refuses too; said here before anything is written
        raise UsageError(f"{src}: holds {len(recipes)} recipes ({', '.join(recipes)}): not one dataset, not "
                         f"exported (`hsextract fsck {src}` lists which files are which)")
    entry = next(iter(state.recipes.values()), {})
    out = {"settings": {"recipe_fingerprint": entry.get("fingerprint")}, "recipe": entry.get("recipe"),
           "sealed": SUCCESS_NAME in state.objects}
    if out["sealed"]:
        seal = json.loads(store.read(SUCCESS_NAME))
        out["seal"] = {k: seal.get(k) for k in ("generation", "fingerprint", "done", "expected", "skipped")}
        return out
    counts = {int(d.rsplit("-of-", 1)[1]) for d in state.done_shards}
    whole = [n for n in sorted(counts) if all(shard_dir_name(i, n) in state.done_shards for i in range(n))]
    if whole:
        return {**out, "complete_shards": f"all {whole[0]} shard(s) of {whole[0]} done (not sealed by a reconcile)"}
    shards = sorted({key.split("/")[0] for key in state.objects if key.startswith("shard-")})
    expected = {int(d.rsplit("-of-", 1)[1]) for d in shards}
    unfinished = sorted({shard_dir_name(i, n) for n in expected for i in range(n)} - state.done_shards)
    missing = (f"not complete: no _SUCCESS, and {len(unfinished)} shard(s) not done"
               + (f" ({', '.join(unfinished[:6])}" + (" ..." if len(unfinished) > 6 else "") + ")" if unfinished
                  else "") + f"; {described['samples']} sample(s) stored")
    if not allow_partial:
        raise UsageError(f"{src}: {missing}. Export a sealed output, or pass --allow-partial to export what is "
                         f"there and have export.json say what is missing")
    print(f"hsextract export: warning: {src}: {missing}; exported as it is (--allow-partial)", file=sys.stderr)
    return {**out, "partial": missing, "shards_not_done": unfinished}


def _examples(dest: Path, most: int = 20) -> dict[str, list[str]]:
    """Up to `most` ids of the samples left out, per reason (DEST/index.jsonl names every one)."""
    found: dict[str, list[str]] = {}
    with (dest / INDEX).open() as f:
        for line in f:
            entry = json.loads(line)
            if "skipped" in entry and len(ids := found.setdefault(entry["skipped"], [])) < most:
                ids.append(entry["id"])
    return found


def _chain(first, rest):
    yield first
    del first
    yield from rest


def _same_source(src: Source, batch, where: str) -> None:
    """Every batch must hold the layers of the first (a source mixing extractions cannot be exported as one)."""
    if json.loads(batch.metadata["layer_ids"]) != src.layer_ids or batch.has_last != src.has_last:
        raise UsageError(f"{where}: its batch files hold different layers ({batch.metadata['layer_ids']} vs "
                         f"{src.layer_ids}, or --include-last on some only): export each extraction on its own")


class _Bar:
    """A progress bar on a terminal (stderr), nothing otherwise."""

    def __init__(self, total: int, show: bool | None):
        self.bar = None
        if show if show is not None else sys.stderr.isatty():
            from tqdm import tqdm

            self.bar = tqdm(total=total, unit="sample", desc="export", file=sys.stderr)

    def step(self) -> None:
        if self.bar is not None:
            self.bar.update(1)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
