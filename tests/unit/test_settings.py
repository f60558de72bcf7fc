"""The settings are declared once (tasks/settings.py): the flows' flat parameters are exactly the groups' fields,
typed and defaulted from them; the flat form goes in and comes back out unchanged."""

import inspect
import typing

import pytest

from flows.extract import PARAMETERS, extract
from flows.preflight import PREFLIGHT_PARAMETERS, preflight
from tasks.settings import DEFAULT, GROUP_OF, GROUPS, Settings

REQUIRED = {"model": "/m", "data": "/d.jsonl", "output": "file:///o", "hosts": "hosts.yaml"}


def declared(name: str):
    """A setting's type as its group declares it."""
    return typing.get_type_hints(GROUPS[GROUP_OF[name]], include_extras=True)[name]


@pytest.mark.parametrize("flow, names", [(extract, PARAMETERS), (preflight, PREFLIGHT_PARAMETERS)])
def test_the_flows_parameters_are_the_settings(flow, names):
    """Each flow parameter that is a setting has the group's type and default (nothing declared twice), and
    `extract` takes every setting."""
    signature = inspect.signature(flow.fn)
    hints = typing.get_type_hints(flow.fn, include_extras=True)
    for name in names:
        param = signature.parameters[name]
        assert hints[name] == declared(name), name
        field = GROUPS[GROUP_OF[name]].model_fields[name]
        if field.is_required():
            assert param.default is inspect.Parameter.empty, name
        else:
            assert param.default == field.default == getattr(DEFAULT, name), name
    if flow is extract:
        assert set(names) == set(GROUP_OF) == set(signature.parameters)
    else:
        assert set(signature.parameters) - set(names) == {"benchmark_samples", "sample_tokens"}  # its own


def test_flat_in_grouped_inside_flat_out():
    settings = Settings.from_flat({**REQUIRED, "stall_timeout_s": 5, "shards": [2, 0], "max_length": 4096})
    assert settings.deadlines.stall_timeout_s == 5.0 and settings.job.shards == [2, 0]
    assert settings.capture.max_length == 4096 and settings.capture.layers == DEFAULT.layers
    flat = settings.flat()
    assert set(flat) == set(PARAMETERS) and flat["stall_timeout_s"] == 5.0 and flat["model"] == "/m"
    assert Settings.from_flat(flat) == settings
    assert settings.flat(["hosts", "layers"]) == {"hosts": "hosts.yaml", "layers": DEFAULT.layers}
    changed = settings.replace(rerun_depth=2, shards=[1])
    assert changed.retries.rerun_depth == 2 and changed.job.shards == [1] and settings.retries.rerun_depth == 0


def test_the_run_name_is_given_or_made():
    assert Settings.from_flat({**REQUIRED, "run_name": "mine"}).job.run == "mine"
    made = Settings.from_flat(REQUIRED).job.run
    assert made.startswith("m-d-") and made == Settings.from_flat(REQUIRED).job.run


@pytest.mark.parametrize("given, said", [
    ({"stall_timeot_s": 5}, r"unknown setting\(s\) \['stall_timeot_s'\]"),
    ({"stall_timeout_s": 0}, "stall_timeout_s"),
    ({"output": "bucket/prefix"}, "output"),
    ({"kernels": "fastest"}, "kernels"),
    ({"run_name": "../up"}, "run_name"),
    ({"max_skipped": 1.5}, "max_skipped"),
])
def test_a_bad_setting_is_named(given, said):
    with pytest.raises(ValueError, match=said):
        Settings.from_flat({**REQUIRED, **given})


def test_stored_parameters_of_another_version_still_read():
    """A flow run's stored parameters may name settings this version dropped: they are left out."""
    settings = Settings.from_stored({**REQUIRED, "cancel_grace_s": 5, "an_old_setting": 1})
    assert settings.deadlines.cancel_grace_s == 5.0
    with pytest.raises(ValueError, match="an_old_setting"):
        Settings.from_flat({**REQUIRED, "an_old_setting": 1})


def test_the_groups_are_frozen():
    settings = Settings.from_flat(REQUIRED)
    with pytest.raises(ValueError):
        settings.deadlines.stall_timeout_s = 1.0
