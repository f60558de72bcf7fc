"""The recipe: what decides an output's states, read from the model directory's files, and its fingerprint."""

from __future__ import annotations

import json
import shutil
from argparse import Namespace

import pytest

from hsextract import tiny
from hsextract.output.recipe import Recipe, RecipeMismatch, recipe_of, refuse


def opts(model, **kw):
    base = dict(model=model, synthetic=None, random_weights=None, include_last=False, out_dtype="auto",
                max_length=None, overlong="truncate")
    return Namespace(**{**base, **kw})


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("recipe")
    a = tiny.build_model(root / "a", num_layers=4, seed=0)
    b = tiny.build_model(root / "b", num_layers=4, seed=1)  # the same shapes, other weights
    return root, a, b


def test_a_copy_elsewhere_is_the_same_recipe_and_another_checkpoint_is_not(models):
    root, a, b = models
    copy = root / "copy-of-a"
    shutil.copytree(a, copy)
    config = json.loads((copy / "config.json").read_text())
    config["_name_or_path"] = "/somewhere/else"  # where it came from says nothing about the states
    (copy / "config.json").write_text(json.dumps(config, indent=4))
    ra, rcopy, rb = (recipe_of(opts(m), [1, 2], "float32") for m in (a, copy, b))
    assert ra.fingerprint == rcopy.fingerprint and ra.model != rcopy.model
    assert rb.fingerprint != ra.fingerprint
    assert [d[0] for d in rb.differences(ra)] == ["weights"]
    assert ra.weights.startswith("xxh3:") and ra.tokenizer.startswith("sha256:")


def test_every_field_that_decides_the_states_is_named_with_both_values(models):
    _, a, _ = models
    base = recipe_of(opts(a), [1, 2], "bfloat16")
    other = recipe_of(opts(a, include_last=True, out_dtype="fp8_e4m3", max_length=64, overlong="skip"), [1, 3],
                      "bfloat16")
    assert [d[0] for d in other.differences(base)] == ["layer_ids", "include_last", "out_dtype", "max_length",
                                                      "long_samples"]
    with pytest.raises(RecipeMismatch) as caught:
        refuse(other, base, "the output")
    text = str(caught.value)
    assert "layer_ids [1, 3] asked, [1, 2] in the output" in text and "max_length 64 asked, null" in text
    assert base.fingerprint in text and "new output" in text
    refuse(recipe_of(opts(a), [1, 2], "bfloat16"), base, "the output")  # the same: nothing said


def test_the_chat_template_and_the_tokenizer_count(models, tmp_path):
    _, a, _ = models
    changed = tmp_path / "m"
    shutil.copytree(a, changed)
    config = json.loads((changed / "tokenizer_config.json").read_text())
    config["chat_template"] = (config.get("chat_template") or "") + "{# another template #}"
    (changed / "tokenizer_config.json").write_text(json.dumps(config))
    (changed / "chat_template.jinja").unlink(missing_ok=True)
    base, now = recipe_of(opts(a), [1], "float32"), recipe_of(opts(changed), [1], "float32")
    assert "chat_template" in [d[0] for d in now.differences(base)]


def test_the_recipe_round_trips_through_json_and_the_versions_are_recorded_not_compared(models):
    _, a, _ = models
    recipe = recipe_of(opts(a), [1, 2], "float32")
    again = Recipe.from_json(json.loads(json.dumps(recipe.to_json())))
    assert again == recipe and again.fingerprint == recipe.fingerprint
    newer = recipe_of(opts(a), [1, 2], "float32", versions={"torch": "9.9"})
    assert newer.fingerprint == recipe.fingerprint and newer.differences(recipe) == []
    other_major = recipe_of(opts(a), [1, 2], "float32", transformers="6.0.1")
    assert [d[0] for d in other_major.differences(recipe)] == ["transformers"]
    with pytest.raises(ValueError, match="not a recipe"):
        Recipe.from_json({"weights": "x"}, "j:3")


def test_random_weights_and_synthetic_runs_say_so(models):
    _, a, _ = models
    assert recipe_of(opts(a, random_weights=7), [1], "bfloat16").weights == "random:7"
    assert recipe_of(opts(a, synthetic=5000.0), [1], "bfloat16").weights == "synthetic"


def test_the_plan_compares_what_it_can_tell_without_the_model(models):
    from dataclasses import replace

    from hsextract.output.journal import OutputState
    from hsextract.options import WorkerOptions
    from tasks.plan import check_recipe

    _, a, _ = models
    base = WorkerOptions(model=a, data=a / "d.jsonl", out="/o", layers="1,2", device="cpu")
    recorded = recipe_of(opts(a, overlong="skip"), [1, 2], "float32")
    state = OutputState(recipes={"shard-00000-of-00001": {"fingerprint": recorded.fingerprint,
                                                          "recipe": recorded.to_json()}})
    check_recipe(state, base, "/o")  # the same parameters: nothing said
    with pytest.raises(RecipeMismatch, match=r"layer_ids \[1, 3\] asked, \[1, 2\] in the output"):
        check_recipe(state, replace(base, layers="1,3"), "/o")
    with pytest.raises(RecipeMismatch, match='dtype "bfloat16" asked, "float32"'):
        check_recipe(state, replace(base, device="cuda"), "/o")
    synthetic = recipe_of(opts(a, synthetic=300.0, overlong="skip"), [1, 2], "bfloat16")
    state.recipes["shard-00000-of-00001"] = {"fingerprint": synthetic.fingerprint, "recipe": synthetic.to_json()}
    check_recipe(state, replace(base, synthetic=1e6), "/o")  # a synthetic run writes bf16 on any device
    state.recipes["shard-00001-of-00002"] = {"fingerprint": recorded.fingerprint, "recipe": recorded.to_json()}
    with pytest.raises(RecipeMismatch, match="holds 2 recipes"):
        check_recipe(state, base, "/o")
