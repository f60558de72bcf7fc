"""The re-run automations' parameter templates, rendered by Prefect's own server-side hydration."""

from __future__ import annotations

import copy
import inspect

import pytest

from deployments.qwen import RECIPE, automations, defaults, rerun_parameters
from flows.extract import PARAMETERS, extract
from tasks.board import run_key


def render(parameters: dict, context: dict) -> dict:
    from prefect.server.events.actions import RunDeployment
    from prefect.utilities.schema_tools.hydration import HydrationContext, hydrate

    parameters = copy.deepcopy(parameters)
    RunDeployment._upgrade_v1_templates(parameters)
    return hydrate(parameters, HydrationContext(raise_on_error=True, render_jinja=True, jinja_context=context))


class CrashedRun:
    def __init__(self, parameters):
        self.parameters = parameters


def test_every_flow_parameter_is_passed_on():
    assert tuple(inspect.signature(extract.fn).parameters) == PARAMETERS
    for source in ("event", "flow_run"):
        assert set(rerun_parameters(source)) == set(PARAMETERS)


def test_a_crashed_runs_parameters_are_passed_on_with_defaults_and_one_more_rerun():
    given = {"model": "/m", "data": "/d.jsonl", "output": "s3://b/p", "hosts": "fleet", **RECIPE,
             "run_name": "r", "shards": [3, 7], "token_budget": 4096}
    out = render(rerun_parameters("flow_run"), {"flow_run": CrashedRun(given)})
    assert out["shards"] == [3, 7] and out["token_budget"] == 4096 and out["max_length"] == 4096
    assert out["rerun_depth"] == 1 and out["num_shards"] is None and out["verify_checksums"] is False
    assert {k: out[k] for k in defaults() if k not in given and k != "rerun_depth"} == \
        {k: v for k, v in defaults().items() if k not in given and k != "rerun_depth"}
    again = render(rerun_parameters("flow_run"), {"flow_run": CrashedRun({**given, "rerun_depth": 4})})
    assert again["rerun_depth"] == 5
    extract.validate_parameters(out)  # what the server would enforce


def test_the_incomplete_event_payload_is_the_next_runs_parameters():
    params = {name: defaults().get(name) for name in PARAMETERS}
    params.update(model="/m", data="/d", output="file:///o", hosts="h.yaml", shards=[1], rerun_depth=2)

    class Event:
        payload = {"parameters": params}

    assert render(rerun_parameters("event"), {"event": Event()}) == params


def test_automations_are_valid_and_named():
    names = [a.name for a in automations()]
    assert len(set(names)) == 3 and all(n.startswith("hsextract: ") for n in names)


@pytest.mark.parametrize("run,key", [("demo", "demo"), ("Run A", "run-a-"), ("x/../y", "x-y-")])
def test_run_keys_are_artifact_safe_and_distinct(run, key):
    assert run_key(run).startswith(key)
    assert set(run_key(run)) <= set("abcdefghijklmnopqrstuvwxyz0123456789-")
    assert run_key("Run A") != run_key("run-a")


def heartbeat(tags: list[str]):
    from prefect.server.events.schemas.events import ReceivedEvent

    return ReceivedEvent.model_validate({
        "id": "1b6e0a8e-0000-4000-8000-000000000003", "event": "prefect.flow-run.heartbeat",
        "occurred": "2026-12-03T00:00:00Z",
        "resource": {"prefect.resource.id": "prefect.flow-run.1b6e0a8e-0000-4000-8000-000000000001"},
        "related": [{"prefect.resource.id": "prefect.flow.1b6e0a8e-0000-4000-8000-000000000002",
                     "prefect.resource.role": "flow", "prefect.resource.name": "extract"}]
                   + [{"prefect.resource.id": f"prefect.tag.{t}", "prefect.resource.role": "tag"} for t in tags]})


def test_only_runs_of_our_deployments_can_be_taken_for_zombies_or_rerun_as_crashed():
    """A direct call of the flow heartbeats every 180 s (Prefect's default): never marked Crashed at 90 s."""
    from prefect.server.events.schemas.automations import EventTrigger as ServerTrigger

    incomplete, zombies, crashed = automations()
    trigger = ServerTrigger.model_validate(zombies.trigger.model_dump(mode="json"))
    assert trigger.covers(heartbeat(["hsextract"]))
    assert not trigger.covers(heartbeat([])), "a heartbeat of a direct extract() call"
    crash_trigger = ServerTrigger.model_validate(crashed.trigger.model_dump(mode="json"))
    assert crash_trigger.covers_resources(heartbeat(["hsextract"]).resource, heartbeat(["hsextract"]).related)
    assert not crash_trigger.covers_resources(heartbeat([]).resource, heartbeat([]).related)


@pytest.mark.parametrize("run_name", ["../../etc", "a/b", "x y", "$(touch /tmp/x)", "-rf"])
def test_a_run_name_that_is_not_one_plain_directory_name_is_refused(run_name):
    from prefect.exceptions import ParameterTypeError

    with pytest.raises(ParameterTypeError, match="run_name"):
        extract.validate_parameters({"model": "/m", "data": "/d", "output": "file:///o", "hosts": "h.yaml",
                                     "run_name": run_name})
    assert extract.validate_parameters({"model": "/m", "data": "/d", "output": "file:///o", "hosts": "h.yaml",
                                        "run_name": "qwen36.r-2_b"})["run_name"] == "qwen36.r-2_b"
