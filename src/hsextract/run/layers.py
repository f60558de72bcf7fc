"""Layer SPEC parsing (the layer-id contract).

Layer id k is the output of decoder layer k (0-based), i.e. `hidden_states[k + 1]` of transformers'
`output_hidden_states` for every k below the last layer (transformers replaces the last entry with the
final-normed state; that one is what `--include-last` stores, as its own tensor).
"""

from __future__ import annotations

from hsextract.errors import UsageError


def dflash_layer_ids(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """z-lab DFlash's `build_target_layer_ids`: evenly spaced between layer 1 and layer L-3."""
    if num_draft_layers == 1:
        return [num_target_layers // 2]
    start, end = 1, num_target_layers - 3
    span = end - start
    return [int(round(start + i * span / (num_draft_layers - 1))) for i in range(num_draft_layers)]


def eagle3_layer_ids(num_target_layers: int) -> list[int]:
    """EAGLE-3's low / middle / high layers: 1, L//2 - 1, L - 4."""
    return [1, num_target_layers // 2 - 1, num_target_layers - 4]


def layers_to_load(layer_ids: list[int], num_layers: int, include_last: bool) -> int:
    """How many decoder layers the worker loads and runs: up to the last captured one, or all of them when the
    final normed state is stored too (`--include-last`)."""
    return num_layers if include_last else max(layer_ids) + 1


def parse_layer_spec(spec: str, num_layers: int) -> list[int]:
    """Resolve `dflash:N`, `eagle3` or an explicit `1,16,31` list against a model of `num_layers` layers;
    `SPEC+last` adds the last decoder layer (id L-1, before the final norm) after them, unless it is there:
    `eagle3+last` holds what EAGLE-3 trainers read as aux layers and what speculators reads as the verifier's
    last layer."""
    text = spec.strip()
    with_last = text.endswith("+last")
    text = text.removesuffix("+last")
    if text.startswith("dflash:"):
        count = text.removeprefix("dflash:")
        if not (count.isascii() and count.isdigit()) or int(count) < 1:
            raise UsageError(f"--layers {spec!r}: dflash:N needs a positive integer N")
        ids = dflash_layer_ids(num_layers, int(count))
    elif text == "eagle3":
        ids = eagle3_layer_ids(num_layers)
    else:
        try:
            ids = [int(part) for part in text.split(",")]
        except ValueError:
            raise UsageError(
                f"--layers {spec!r}: expected dflash:N, eagle3 or a comma-separated list of layer ids, "
                f"each optionally followed by +last"
            ) from None
    bad = [i for i in ids if not 0 <= i < num_layers]
    if bad:
        raise UsageError(
            f"--layers {spec!r}: layer id(s) {bad} out of range for a model with {num_layers} layers "
            f"(valid ids are 0..{num_layers - 1})"
        )
    if len(set(ids)) != len(ids):
        raise UsageError(f"--layers {spec!r}: layer ids repeat: {ids}")
    return ids + [num_layers - 1] if with_last and num_layers - 1 not in ids else ids
