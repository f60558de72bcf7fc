"""Load an `hsextract export` through the trainer's own code; run with the trainers' venv (harness.trainers).

    python trainer_load.py FORMAT DEST OUT --max-len N [--train-step VERIFIER_DIR]

Imports nothing of hsextract: what it saves to OUT (torch.save of a list, one dict per sample in the
loader's order) is exactly what the trainer's loader handed over, for the test to compare with the
extraction and with an independent reference. With --train-step (speculators), two optimisation steps of a
tiny EAGLE-3 draft on the loaded samples; their losses go to stdout as JSON.
"""

from __future__ import annotations

import argparse
import json
import warnings

import torch


def specforge(fmt: str, dest: str, max_len: int) -> list[dict]:
    """SpecForge 0.2.0's offline path: list_feature_files -> load_feature_file -> the algorithm's normalizer."""
    from specforge.runtime.data_plane.feature_store import load_feature_file
    from specforge.runtime.data_plane.offline_reader import list_feature_files

    if fmt == "specforge-dflash":
        from specforge.algorithms.common.dflash_family_data import normalize_offline_sample
    else:
        from specforge.algorithms.eagle3.data import normalize_offline_sample
    loaded = []
    for path in list_feature_files(dest):
        sample = normalize_offline_sample(load_feature_file(path), max_len)
        loaded.append({"file": path, **{k: v[0].clone() for k, v in sample.items() if torch.is_tensor(v)}})
    return loaded


def speculators(dest: str, max_len: int) -> tuple[list[dict], object]:
    """speculators 0.9.0: ArrowDataset(max_len, datapath=DEST, on_missing="raise"), every row; a row it
    would drop (token ids that do not match) is an error here."""
    from speculators.train.data import ArrowDataset
    from speculators.train.recovery import SampleUnavailable

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a mismatch is only a warning there: make it fail
        data = ArrowDataset(max_len, datapath=dest, on_missing="raise")
        loaded = []
        for row in range(len(data)):
            item = data[row]
            if isinstance(item, SampleUnavailable):
                raise SystemExit(f"row {row}: speculators dropped it: {item}")
            loaded.append({"row": row, **{k: v.clone() for k, v in item.items()}})
    return loaded, data


def train_steps(samples: list[dict], verifier: str, target_layer_ids: list[int], max_len: int) -> list[float]:
    """Two AdamW steps of a one-layer EAGLE-3 draft on `samples` (speculators' model, collate and loss; its
    Trainer needs an accelerator, so the step is driven here), with the verifier's embeddings, norm, head."""
    from transformers import AutoConfig, LlamaConfig

    from speculators.losses import resolve_loss_config
    from speculators.models.eagle3.core import Eagle3DraftModel
    from speculators.models.eagle3.data import shift_batch
    from speculators.train.data import CollateFn

    torch.manual_seed(0)
    text = AutoConfig.from_pretrained(verifier).get_text_config()
    heads = 4
    draft = LlamaConfig(vocab_size=text.vocab_size, hidden_size=text.hidden_size, num_hidden_layers=1,
                        intermediate_size=2 * text.hidden_size, num_attention_heads=heads, num_key_value_heads=heads,
                        head_dim=text.hidden_size // heads, max_position_embeddings=max_len, tie_word_embeddings=False)
    model = Eagle3DraftModel.from_training_args(
        verifier_config=draft, t2d=None, d2t=None, verifier_name_or_path=verifier, draft_vocab_size=text.vocab_size,
        norm_before_residual=True, ttt_steps=2, target_layer_ids=target_layer_ids, draft_attn_impl="sdpa")
    collate = CollateFn(max_len=max_len, hidden_size=text.hidden_size, num_target_layers=len(target_layer_ids),
                        dtype=torch.float32, preprocess=shift_batch)
    batch = collate([{k: v for k, v in s.items() if k != "row"} for s in samples[:4]])
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    losses = []
    for _ in range(2):
        optimizer.zero_grad()
        _, loss, _ = model(**batch, ttt_steps=2, ttt_step_loss_decay=1.0,
                           loss_config=resolve_loss_config("kl_div", "eager"))
        loss.backward()
        optimizer.step()
        losses.append(float(loss.detach()))
    return losses


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("format", choices=["specforge-dflash", "specforge-eagle3", "speculators"])
    parser.add_argument("dest")
    parser.add_argument("out")
    parser.add_argument("--max-len", type=int, required=True)
    parser.add_argument("--train-step", metavar="VERIFIER_DIR")
    parser.add_argument("--target-layer-ids", default="")
    args = parser.parse_args()
    report: dict = {"format": args.format}
    if args.format == "speculators":
        loaded, _ = speculators(args.dest, args.max_len)
        if args.train_step:
            ids = [int(i) for i in args.target_layer_ids.split(",")]
            report["losses"] = train_steps(loaded, args.train_step, ids, args.max_len)
    else:
        loaded = specforge(args.format, args.dest, args.max_len)
    torch.save(loaded, args.out)
    report["samples"] = len(loaded)
    print(json.dumps(report))


if __name__ == "__main__":
    main()
