"""`hsextract extract --synthetic TOKENS_PER_S`: a worker without a model, for fleet simulations and preflights.

It imports no torch. It reads the dataset, takes its shard's samples, and packs them as the real worker does.
Then it writes batch files of the real per-token size, at a set rate, through the same path: the shard's
lock and journal, resume by sample id, skips with reasons, the heartbeat and exit record, the spool and the
S3 upload. The files hold what the real worker's would: `input_ids`, `loss_mask`, `cu_seqlens`, and
`hidden_states` of the model's hidden size times the layers asked for. Their states are random bytes (fp8
scales of 1), and their metadata says `synthetic`.

Token counts: a pre-tokenized record has its own. A chat record is not tokenized (that needs the
tokenizer, hence transformers): it counts one token per 4 characters of its messages' text plus 4 per
message, cut at --max-length.
"""

from __future__ import annotations

import array
import json
import os
import random
import time

from hsextract import __version__
from hsextract.data.model import read_model_info
from hsextract.data.records import Bad, Record
from hsextract.errors import Interrupted
from hsextract.options import WorkerOptions
from hsextract.output.payload import Prepared, TensorBytes, layout
from hsextract.output.quant import FP8_ENCODING, SCALE_KEY, fp8_bytes_per_token
from hsextract.output.recipe import recipe_of
from hsextract.run.batching import pack, padded_tokens
from hsextract.run.liveness import Heartbeat
from hsextract.run.shard import Shard, drive

#: one pool of random bytes, repeated to the size of a batch's states (its bytes need not differ per file)
POOL_BYTES = 1 << 20


class Sample:
    """A sample as the packer sees it: an id and a token count (its tokens made up, or its own)."""

    def __init__(self, record: Record, max_length: int | None):
        self.id = record.id
        self.input_ids = list(record.input_ids) if record.input_ids is not None else None
        self.loss_mask = list(record.loss_mask) if record.loss_mask is not None else None
        self.tokens = len(self.input_ids) if self.input_ids is not None else estimate_tokens(record.messages or [])
        if max_length is not None and self.tokens > max_length:
            self.tokens = max_length
            self.input_ids = self.input_ids[:max_length] if self.input_ids is not None else None
            self.loss_mask = self.loss_mask[:max_length] if self.loss_mask is not None else None

    def __len__(self) -> int:
        return self.tokens


def estimate_tokens(messages: list[dict]) -> int:
    """One token per 4 characters of the messages' text, plus 4 per message (role and template markers)."""
    chars = sum(len(c if isinstance(c := m.get("content"), str) else json.dumps(c))
                for m in messages if isinstance(m, dict))
    return max(2, chars // 4 + 4 * len(messages))


class SyntheticRun(Shard):
    """One shard's run without a model: random states of the real size, `opts.synthetic` tokens a second."""

    def run(self, layer_ids: list[int]) -> dict:
        opts = self.opts
        assert opts.synthetic is not None  # the CLI runs this worker only with --synthetic
        self.recipe = recipe_of(opts, layer_ids, "bfloat16")
        pending = self.begin()
        if not pending:
            return self.finish()
        info = read_model_info(opts.model)
        width = len(layer_ids) * info.hidden_size
        fp8 = opts.out_dtype == "fp8_e4m3"
        self.metadata = {
            "sample_ids": "", "layer_ids": json.dumps(layer_ids), "model": opts.model.name,
            "hidden_size": str(info.hidden_size), "num_model_layers": str(info.num_layers),
            "dtype": "bfloat16", "hsextract_version": __version__, "synthetic": f"{opts.synthetic:g}",
            **({"hidden_states_encoding": FP8_ENCODING} if fp8 else {}), **self.recipe_metadata(),
        }
        self.states = StatePool(width, len(layer_ids), fp8, info.vocab_size)
        self.log.info(f"synthetic: no model; random states of {self.states.bytes_per_token} bytes a token at "
                      f"{opts.synthetic:g} tokens/s")
        self.progress.phase = "extracting"
        self.progress.extract_started_at = time.time()
        spent = {"sleep_s": 0.0, "write_s": 0.0}
        began, tokens = time.monotonic(), 0
        try:
            for batch in pack(self.samples(pending), opts.token_budget, opts.sort_window):
                if self.stop_signal:
                    break
                tokens += sum(len(s) for s in batch)
                started = time.monotonic()
                self.pace(began + tokens / opts.synthetic)  # as long as a GPU at that rate would take
                spent["sleep_s"] += time.monotonic() - started
                if self.stop_signal:
                    break
                started = time.monotonic()
                self.progress.forward_passes += 1
                self.progress.padded_tokens += padded_tokens(batch)
                self.progress.tokens_forwarded += sum(len(s) for s in batch)
                prep = self.prepare(batch)
                unsealed = self.write_file(prep)
                if unsealed is not None:
                    self.seal_file(prep, unsealed)
                spent["write_s"] += time.monotonic() - started
        finally:
            self.extract_ended = time.time()
            self.pipeline = {k: round(v, 3) for k, v in spent.items()}
        if self.stop_signal:
            raise Interrupted(self.stop_signal)
        return self.finish()

    def samples(self, pending: list[Record | Bad]):
        """The pending records as samples; bad ones journaled as skipped with their reason on the way."""
        for item in pending:
            if isinstance(item, Bad):
                self.skip(item.id, item.reason, item.detail, item.line, counts_as_done=True)
            else:
                yield Sample(item, self.opts.max_length)

    def pace(self, until: float) -> None:
        """Sleep until `until` (monotonic), a little at a time: a stop is seen within 0.2 s."""
        while not self.stop_signal and (left := until - time.monotonic()) > 0:
            time.sleep(min(0.2, left))

    def prepare(self, batch: list[Sample]) -> Prepared:
        """One batch file's layout (and sha256): random states, the samples' tokens and lengths."""
        name = f"batch-{self.next_seq:06d}.safetensors"
        self.next_seq += 1
        lengths = [len(s) for s in batch]
        total = sum(lengths)
        ids = array.array("i")
        mask = bytearray()
        for s in batch:
            ids.extend(s.input_ids if s.input_ids is not None else self.states.token_ids(len(s)))
            mask.extend(bytes(s.loss_mask) if s.loss_mask is not None else b"\x01" * len(s))
        cu = array.array("q", [0])
        for n in lengths:
            cu.append(cu[-1] + n)
        entries = [TensorBytes("input_ids", "I32", (total,), ids), TensorBytes("loss_mask", "U8", (total,), mask),
                   TensorBytes("cu_seqlens", "I64", (len(batch) + 1,), cu), *self.states.entries(total)]
        metadata = {**self.metadata, "sample_ids": json.dumps([s.id for s in batch])}
        return Prepared(name, layout(entries, metadata), [s.id for s in batch], lengths)


class StatePool:
    """Random bytes for a batch's states, made once and reused (files are written one at a time)."""

    def __init__(self, width: int, layers: int, fp8: bool, vocab_size: int):
        self.width, self.layers, self.fp8, self.vocab_size = width, layers, fp8, vocab_size
        self.bytes_per_token = fp8_bytes_per_token(width, layers) if fp8 else 2 * width
        self.pool = os.urandom(POOL_BYTES)
        self.buffer = bytearray()
        self.scales = bytearray()
        self.rng = random.Random(0)

    def entries(self, tokens: int) -> list[TensorBytes]:
        """`hidden_states` (and fp8's scales, all 1.0) for `tokens` tokens."""
        size = tokens * self.width * (1 if self.fp8 else 2)
        if len(self.buffer) < size:
            grown = bytearray(size)
            for at in range(0, size, POOL_BYTES):
                grown[at:at + POOL_BYTES] = self.pool[:size - at]
            self.buffer = grown
        states = TensorBytes("hidden_states", "F8_E4M3" if self.fp8 else "BF16", (tokens, self.width),
                       memoryview(self.buffer)[:size])
        if not self.fp8:
            return [states]
        scale_bytes = tokens * self.layers * 4
        if len(self.scales) < scale_bytes:
            self.scales = bytearray(array.array("f", [1.0]) * (tokens * self.layers))
        return [states, TensorBytes(SCALE_KEY, "F32", (tokens, self.layers), memoryview(self.scales)[:scale_bytes])]

    def token_ids(self, n: int) -> list[int]:
        """Made-up token ids for a sample that was not tokenized."""
        return [self.rng.randrange(self.vocab_size) for _ in range(n)]


def run_synthetic(opts: WorkerOptions, heartbeat: Heartbeat | None = None) -> int:
    """The body of `hsextract extract --synthetic` after the STARTED line: the process exit code."""
    return drive(SyntheticRun, opts, heartbeat)
