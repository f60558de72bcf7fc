"""A dataset's rows, whatever the format it is kept in (no torch here).

`--data` names one of:
  - a JSONL file, plain, gzip (`.gz`) or zstandard (`.zst`) compressed;
  - a Parquet file, or a directory of Parquet files (read in name order, one schema across them);
  - a directory a Hugging Face `datasets` Dataset was saved to (`save_to_disk`: its Arrow files, read with
    pyarrow; the `datasets` package is not needed).
`rows` yields each row as the raw JSONL line (bytes) or, from Arrow, as a dict whose null fields are dropped
(Arrow has no "absent": a column missing from a row reads as null), numbered from 1 across the files. The
record contract (`records.py`) is the same for all, so are the sample ids: a record's id is its `id`, else a
hash of its content, and a Parquet row hashes like the JSONL line of the same record without nulls. A file
that cannot be read (a truncated `.gz`, a corrupt Parquet file, files with different columns) raises
UsageError naming the file and the row reached.
"""

from __future__ import annotations

import gzip
import io
import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from hsextract.errors import UsageError

#: the columns that make a row a sample (records.py): one of these must be in every Arrow file
CONTENT_COLUMNS = ("messages", "conversations", "input_ids")
ARROW_BATCH = 1024


def dataset_files(path: Path) -> tuple[str, list[Path]]:
    """(kind, files) of the dataset at `path`: kind is jsonl, jsonl.gz, jsonl.zst, parquet or arrow (a
    `save_to_disk` directory). UsageError naming what is missing or not understood."""
    if path.is_file():
        name = path.name.lower()
        if name.endswith(".parquet"):
            return "parquet", [path]
        if name.endswith(".gz"):
            return "jsonl.gz", [path]
        if name.endswith(".zst") or name.endswith(".zstd"):
            return "jsonl.zst", [path]
        return "jsonl", [path]
    if not path.is_dir():
        if str(path).startswith(("s3:/", "orchestrator:")):  # argparse's Path turned s3://b/k into s3:/b/k
            raise UsageError(f"--data {str(path).replace('s3:/', 's3://', 1)!r}: the worker reads a local path; "
                             f"the extract flow stages s3:// and orchestrator: sources onto the hosts first")
        raise UsageError(f"--data {str(path)!r}: no such file or directory")
    if (path / "dataset_dict.json").is_file():
        splits = json.loads((path / "dataset_dict.json").read_text()).get("splits", [])
        raise UsageError(f"--data {str(path)!r}: a DatasetDict; name one split's directory ({', '.join(splits)})")
    if (path / "state.json").is_file():
        try:
            state = json.loads((path / "state.json").read_text())
            files = [path / f["filename"] for f in state["_data_files"]]
        except (ValueError, KeyError, TypeError) as exc:
            raise UsageError(f"--data {str(path)!r}: state.json does not list the data files ({exc})") from None
        if missing := [f.name for f in files if not f.is_file()]:
            raise UsageError(f"--data {str(path)!r}: data file(s) {missing} listed in state.json are missing")
        return "arrow", files
    parquet = sorted(p for p in path.iterdir() if p.is_file() and p.name.lower().endswith(".parquet"))
    if not parquet:
        raise UsageError(f"--data {str(path)!r}: a directory without *.parquet files or a `datasets` save_to_disk "
                         f"(state.json)")
    return "parquet", parquet


def data_bytes(path: Path) -> int:
    """The dataset's bytes on disk (all its files)."""
    return sum(f.stat().st_size for f in dataset_files(path)[1])


def rows(path: Path, keep: Callable[[str], bool] | None = None) -> Iterator[tuple[int, bytes | dict]]:
    """(row number from 1, the JSONL line or the Arrow row) of every row of the dataset at `path`; a JSONL row's
    number is its line's (blank lines are numbered, not yielded). `keep(id)`: Arrow rows whose own `id` it
    refuses are not made Python objects at all (their id column is read alone); a JSONL line is yielded anyway
    (its id is inside it), as is a row without an id of its own."""
    kind, files = dataset_files(path)
    if kind.startswith("jsonl"):
        yield from _jsonl_rows(files[0], kind)
    else:
        yield from ((row, record) for row, _, record in _arrow_rows(path, files, kind, keep) if record is not None)


def _open_text(path: Path, kind: str):
    if kind == "jsonl.gz":
        return gzip.open(path, "rb")
    if kind == "jsonl.zst":
        try:
            import zstandard
        except ImportError:
            raise UsageError(f"--data {str(path)!r}: reading .zst needs the zstandard package "
                             f"(pip install zstandard)") from None
        return io.BufferedReader(zstandard.ZstdDecompressor().stream_reader(path.open("rb"), closefd=True))
    return path.open("rb")


def _jsonl_rows(path: Path, kind: str) -> Iterator[tuple[int, bytes]]:
    line_no = 0
    try:
        with _open_text(path, kind) as handle:
            for line_no, raw in enumerate(handle, start=1):
                if raw.strip():
                    yield line_no, raw
    except (OSError, EOFError, ValueError) as exc:  # gzip: BadGzipFile, EOFError; zstandard: ZstdError (ValueError)
        raise UsageError(f"--data {str(path)!r}: cannot be read past line {line_no} "
                         f"({type(exc).__name__}: {exc})") from None


def _arrow_batches(root: Path, files: list[Path], kind: str) -> Iterator[tuple[dict, Any]]:
    """(columns, record batch) of every batch of the Arrow files, in order; every file's columns checked
    against the first's. A file that cannot be read is named with the row reached."""
    try:
        import pyarrow.ipc as ipc
        import pyarrow.parquet as pq
    except ImportError:
        raise UsageError(f"--data {str(root)!r}: reading {kind} needs the pyarrow package") from None
    first: tuple[Path, dict] | None = None
    row = 0
    for path in files:
        try:
            if kind == "parquet":
                source = pq.ParquetFile(path)
                schema, batches = source.schema_arrow, source.iter_batches(batch_size=ARROW_BATCH)
            else:
                reader = ipc.open_stream(path.open("rb"))
                schema, batches = reader.schema, reader
            columns = {f.name: str(f.type) for f in schema}
            if not any(c in columns for c in CONTENT_COLUMNS):
                raise UsageError(f"--data {str(root)!r}: {path.name} has no {'/'.join(CONTENT_COLUMNS)} column "
                                 f"(its columns: {', '.join(columns) or 'none'})")
            if first is None:
                first = (path, columns)
            elif columns != first[1]:
                differ = sorted(set(columns.items()) ^ set(first[1].items()))
                raise UsageError(f"--data {str(root)!r}: {path.name} and {first[0].name} have different columns "
                                 f"({', '.join(f'{n}: {t}' for n, t in differ[:6])}): one schema across the files")
            for batch in batches:
                yield columns, batch
                row += batch.num_rows
        except UsageError:
            raise
        except Exception as exc:  # pyarrow's ArrowInvalid, OSError...: the file and the row reached
            raise UsageError(f"--data {str(root)!r}: {path.name} cannot be read past row {row} "
                             f"({type(exc).__name__}: {exc})") from None


def _arrow_rows(root: Path, files: list[Path], kind: str, keep=None) -> Iterator[tuple[int, str | None, dict | None]]:
    """(row number, its own id, the row as a record) of every Arrow row. Without `keep` every row comes whole (its
    id left to the record: None here). With `keep(id)` and an `id` column, each row's id is read from that column
    alone, and only a row that `keep` takes, or that has no id of its own (its content's hash is its id:
    records.py decides), comes whole; the others' record is None."""

    row = 0
    for columns, batch in _arrow_batches(root, files, kind):
        if keep is None or "id" not in columns:
            for i, item in enumerate(batch.to_pylist(), start=row + 1):
                yield i, None, _arrow_record(item)
        else:
            found = [id_value(v) for v in batch.column("id").to_pylist()]
            whole = [i for i, f in enumerate(found) if f is None or keep(f)]
            items = dict(zip(whole, batch.take(whole).to_pylist())) if whole else {}
            for i, f in enumerate(found):
                item = items.get(i)
                yield row + i + 1, f, None if item is None else _arrow_record(item)
        row += batch.num_rows


def own_id(obj: dict) -> str | None:
    """The record's own `id` (a non-empty string or an integer), as a string; None when it has none."""
    return id_value(obj.get("id"))


def id_value(raw_id: object) -> str | None:
    """An `id` field's value as a sample id: a non-empty string or an integer, as a string; else None."""
    if isinstance(raw_id, (str, int)) and not isinstance(raw_id, bool) and str(raw_id) != "":
        return str(raw_id)
    return None


def id_rows(path: Path) -> Iterator[tuple[int, str | None, bytes | dict | None]]:
    """(row number, the row's own id or None, the row where its id is not known without it) of every row, as
    `rows` numbers them: an Arrow row with an `id` of its own costs its id column alone; a JSONL line, or a row
    without an id of its own, comes whole (its id is inside it, or the hash of its content)."""
    kind, files = dataset_files(path)
    if kind.startswith("jsonl"):
        for row, raw in _jsonl_rows(files[0], kind):
            yield row, None, raw
    else:
        yield from _arrow_rows(path, files, kind, keep=lambda _id: False)


def _arrow_record(item: dict) -> dict:
    """An Arrow row as the record its JSONL line would be: its null fields left out. Deep only where it counts:
    a record without an id is hashed whole (records.py reads nested nulls as absent anyway)."""
    top = {k: v for k, v in item.items() if v is not None}
    return top if own_id(top) is not None else _without_nulls(top)


def _without_nulls(value):
    """Arrow rows without their null fields, at every depth (so a row hashes like its JSONL line)."""
    if isinstance(value, dict):
        return {k: _without_nulls(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_without_nulls(v) for v in value]
    return value


def count_rows(path: Path) -> int:
    """Rows of the dataset (blank JSONL lines not counted): from Parquet's metadata, else one pass."""
    kind, files = dataset_files(path)
    if kind == "parquet":
        import pyarrow.parquet as pq

        return sum(pq.ParquetFile(f).metadata.num_rows for f in files)
    if kind == "jsonl":
        count = 0
        with files[0].open("rb") as f:
            for raw in f:
                count += bool(raw.strip())
        return count
    return sum(1 for _ in rows(path))


def sample_rows(path: Path, n: int) -> tuple[int, list[tuple[int, bytes | dict]]]:
    """(rows in the dataset, up to `n` of them spread evenly over it): a plain JSONL file by `n` byte offsets
    (a large file is not parsed whole), the other formats by every k-th row."""
    kind, files = dataset_files(path)
    total = count_rows(path)
    if total <= n:
        return total, list(rows(path))
    if kind == "jsonl":
        picked: list[tuple[int, bytes | dict]] = []
        size = files[0].stat().st_size
        with files[0].open("rb") as f:
            for i in range(n):
                f.seek(i * size // n)
                if i:
                    f.readline()  # the rest of a line cut by the offset
                raw = f.readline()
                if raw.strip():
                    picked.append((0, raw))
        return total, picked
    step = total / n
    wanted = {int(i * step) for i in range(n)}
    return total, [r for i, r in enumerate(rows(path)) if i in wanted]
