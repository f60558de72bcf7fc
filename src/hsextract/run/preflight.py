"""What a shard will need, checked on its host before any launch, without torch: `hsextract check`.

The orchestrator runs `hsextract check` with a run's options once per host after deploying the bundle: the
model directory and its config.json readable, the layers asked for in the model, the dataset readable, a
local output writable. A problem is a `UsageError` naming the option and what is wrong with it (exit 2):
the mistake is fixed before a GPU is taken, instead of failing every shard the same way.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

from hsextract.data.model import read_model_info
from hsextract.errors import UsageError
from hsextract.options import WorkerOptions, prove_writable
from hsextract.run.layers import parse_layer_spec


def model_bytes(model_dir: Path) -> int:
    """Bytes of the model's weight files (safetensors or PyTorch `.bin`) in its directory: 0 when it has none
    (`--random-weights` needs only config.json)."""
    return sum(p.stat().st_size for p in model_dir.iterdir()
               if p.is_file() and (p.suffix == ".safetensors" or p.name.endswith(".bin")))


def readable_dataset(path: Path) -> int:
    """The dataset's bytes, once its format is known and its first row reads (UsageError naming the problem)."""
    from hsextract.data.inputs import data_bytes, rows

    try:
        next(rows(path), None)
        return data_bytes(path)
    except OSError as exc:
        raise UsageError(f"--data {str(path)!r}: not readable ({exc.strerror or exc})") from None


def count_tokens(opts: WorkerOptions, sample: int) -> dict:
    """The dataset's samples (its lines), and its tokens: counted with the model's tokenizer and chat template
    (or, for `--synthetic`, as the synthetic worker counts them) on up to `sample` records spread evenly over the
    file, cut at --max-length, then scaled to the whole. Malformed records count as samples, not tokens."""
    from hsextract.data.inputs import sample_rows
    from hsextract.data.records import Bad, parse_line, parse_obj

    samples, rows = sample_rows(opts.data, sample)
    picks = [parse_line(raw, n) if isinstance(raw, bytes) else parse_obj(raw, n) for n, raw in rows]
    usable = [r for r in picks if not isinstance(r, Bad)]
    example = next((f"{f'line {r.line}' if r.line else 'a sampled record'}: {r.reason}: {r.detail}" for r in picks
                    if isinstance(r, Bad)), None)
    if opts.synthetic is not None:
        from hsextract.run.synthetic import estimate_tokens

        lengths = [len(r.input_ids) if r.input_ids is not None else estimate_tokens(r.messages or []) for r in usable]
        lengths = [min(n, opts.max_length) if opts.max_length else n for n in lengths]
        how = "estimated as the synthetic worker counts"
    else:
        from hsextract.data.chat import ChatEncoder, Tokenized
        from hsextract.run.extract import load_tokenizer

        info = read_model_info(opts.model)
        encoder = ChatEncoder(load_tokenizer(opts.model), info.vocab_size, info.max_length(opts.max_length),
                              opts.overlong)
        lengths = [len(t) for t in map(encoder.encode, usable) if isinstance(t, Tokenized)]
        how = "the model's tokenizer and chat template"
    mean = sum(lengths) / len(picks) if picks else 0.0  # a malformed or rejected sample adds no tokens
    return {"samples": samples, "sampled": len(picks), "malformed_sampled": len(picks) - len(usable),
            "mean_tokens": round(mean, 1), "max_tokens": max(lengths, default=0), "tokens": round(mean * samples),
            "exact": len(picks) == samples, "counted": how,
            **({"malformed_example": example[:160]} if example else {})}


def probe_output(opts: WorkerOptions) -> dict:
    """Write, read back and delete one small object under the output (S3 with the run's credentials and
    endpoint, or the output directory): UsageError naming the step and what the store said."""
    import os
    import socket
    import uuid

    from hsextract.store import S3Store, StoreError, open_store, s3_client

    key = f"_preflight/{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    body = uuid.uuid4().bytes * 64
    store = S3Store(opts.upload, s3_client(opts.s3_endpoint, attempts=2)) if opts.upload else open_store(opts.out)
    step = "write"
    try:
        store.write(key, body)
        step = "read back"
        if store.read(key) != body:
            raise UsageError(f"--out {opts.out!r}: {store.where(key)} read back differs from what was written")
        step = "delete"
        store.delete(key)
        if (where := store.local_path(key)) is not None:
            with contextlib.suppress(OSError):  # the directory made for it, when nothing else is in it
                where.parent.rmdir()
    except UsageError:
        raise
    except (StoreError, OSError, ValueError) as exc:
        raise UsageError(f"--out {opts.out!r}: cannot {step} a probe object ({store.where(key)}): {exc}") from None
    except Exception as exc:  # botocore's own errors (no credentials, a refused endpoint...)
        raise UsageError(f"--out {opts.out!r}: cannot {step} a probe object ({store.where(key)}): "
                         f"{type(exc).__name__}: {exc}") from None
    return {"probe_object": store.where(key), "bytes": len(body)}


def report(opts: WorkerOptions, probe: bool = False, sample_tokens: int = 0) -> dict:
    """Each check on its own, for a table: {"model": found or {"error"}, "dataset": ..., "output": ...} (a failed
    check does not hide the others' verdicts)."""
    out: dict = {}

    def attempt(name, fn):
        try:
            out[name] = fn()
        except ValueError as exc:  # UsageError, and what the options' own checks raise
            out[name] = {"error": str(exc)}

    def model():
        info = read_model_info(opts.model)
        return {"model_type": info.model_type, "num_layers": info.num_layers, "hidden_size": info.hidden_size,
                "layers": parse_layer_spec(opts.layers, info.num_layers), "model_bytes": model_bytes(opts.model)}

    def dataset():
        found = {"data_bytes": readable_dataset(opts.data)}
        if sample_tokens and "error" not in out.get("model", {}):  # the tokenizer is the model's
            found.update(count_tokens(opts, sample_tokens))
        return found

    def output():
        if opts.upload is None:
            try:
                opts.out_dir.mkdir(parents=True, exist_ok=True)
            except OSError as exc:
                raise UsageError(f"--out {str(opts.out_dir)!r}: cannot be made ({exc.strerror or exc})") from None
        return probe_output(opts) if probe else {}

    attempt("model", model)
    attempt("dataset", dataset)
    attempt("output", output)
    return out


def preflight(opts: WorkerOptions, probe: bool = False, sample_tokens: int = 0) -> dict:
    """Check everything a shard of `opts` needs that can be checked without loading the model; returns what
    was found (model type, layer count, hidden size, the layer ids, the weight files' bytes, dataset size).
    UsageError on the first problem. `probe`: also write, read and delete an object under the output;
    `sample_tokens`: also count the dataset's samples and tokens (`count_tokens`)."""
    opts.check_inputs()
    info = read_model_info(opts.model)
    layer_ids = parse_layer_spec(opts.layers, info.num_layers)
    size = readable_dataset(opts.data)
    if opts.upload is None:
        prove_writable("--out", opts.out_dir)
    found = {"model_type": info.model_type, "num_layers": info.num_layers, "hidden_size": info.hidden_size,
             "layers": layer_ids, "data_bytes": size, "model_bytes": model_bytes(opts.model)}
    if probe:
        found["output"] = probe_output(opts)
    if sample_tokens:
        found["dataset"] = counted = count_tokens(opts, sample_tokens)
        bad, seen = counted["malformed_sampled"], counted["sampled"]
        if seen and (bad == seen or bad > opts.max_skipped * seen):
            raise UsageError(f"--data {str(opts.data)!r}: {bad} of the {seen} record(s) sampled are malformed "
                             f"(over --max-skipped {opts.max_skipped:g}; e.g. {counted.get('malformed_example')}): "
                             f"a run would skip them")
    return found
