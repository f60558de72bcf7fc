"""Deployment `qwen` of flow `extract` (the Qwen3.6-27B DFlash recipe), its scheduled re-run, and automations.

    python -m deployments.qwen --model /models/Qwen3.6-27B --data /data/chats.jsonl \\
        --output s3://bucket/hidden/qwen36 --hosts gpu-fleet --aws-credentials hsextract-s3

(`--model` and `--data` are paths on every host, or `s3://...` / `orchestrator:/path` sources the flow stages
onto them, verified by sha256; the dataset is JSONL (plain, .gz, .zst), Parquet or a `datasets` directory.)

registers, on the Prefect server of PREFECT_API_URL, idempotently (run it again to change anything):
- the process work pool (default `hsextract`); start its worker with `prefect worker start --pool hsextract`;
- deployment `extract/qwen`: layers dflash:5 (ids 1,16,31,46,61 of 64), max_length 4096, bf16, the
  inventory and storage blocks by name. `prefect deployment run extract/qwen --watch` runs it; every
  `--param` is validated against the flow's schema before a run is created;
- deployment `extract/qwen-rerun`: the same parameters on a schedule (`--rerun-every`, paused unless
  given): each run reads the journals, launches only incomplete shards, and stops at the attempt cap;
- deployment `extract/qwen-preflight`: the same parameters with `preflight="only"`: every host checked in
  parallel and the plan in numbers (artifacts `preflight-<run>`, `plan-<run>`), nothing launched;
  `prefect deployment run extract/qwen-preflight -p benchmark=true` also times the worker on each host;
- three automations: a failed run's `extract.run.incomplete` event starts a run of exactly its failed
  shards (same parameters, `rerun_depth` + 1); a run whose heartbeats stop is marked Crashed; a Crashed
  run is run again with the same parameters, which adopts the shards still running on the hosts.
"""

from __future__ import annotations

import argparse
import inspect
import json
import sys
from datetime import timedelta
from pathlib import Path
from typing import Any, cast

from flows.extract import PARAMETERS, ROOT, extract
from tasks.rerun import RERUN_EVENT
from tasks.settings import Settings

POOL = "hsextract"
#: the Qwen3.6-27B DFlash recipe (64 layers: dflash:5 = 1,16,31,46,61)
RECIPE = {"layers": "dflash:5", "max_length": 4096, "dtype": "bfloat16"}
#: flow-run heartbeats (Prefect's minimum is 30 s); a run silent for ZOMBIE_AFTER is marked Crashed
HEARTBEAT_S = 30
ZOMBIE_AFTER = timedelta(seconds=3 * HEARTBEAT_S)
AUTOMATIONS = ("hsextract: re-run incomplete shards", "hsextract: mark silent extract runs Crashed",
               "hsextract: re-run crashed extract runs")
TAG = "hsextract"
# runs of flow extract started from these deployments (they carry the tag and heartbeat every HEARTBEAT_S);
# a direct call of the flow heartbeats at Prefect's default (180 s) and must not be taken for a zombie
OF_OUR_DEPLOYMENTS = [{"prefect.resource.role": "flow", "prefect.resource.name": "extract"},
                      {"prefect.resource.id": f"prefect.tag.{TAG}"}]


def defaults() -> dict:
    """The flow's parameter defaults (a crashed run's re-run fills the parameters it lacks with them)."""
    return {name: p.default for name, p in inspect.signature(extract.fn).parameters.items()
            if p.default is not inspect.Parameter.empty}


def ensure_pool(name: str) -> None:
    """Create the process work pool `name`, or check that the one of that name is a process pool."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import WorkPoolCreate
    from prefect.exceptions import ObjectAlreadyExists

    with get_client(sync_client=True) as client:
        try:
            client.create_work_pool(WorkPoolCreate(name=name, type="process"))
        except ObjectAlreadyExists:
            pool = client.read_work_pool(name)
            if pool.type != "process":
                raise SystemExit(f"work pool {name!r} exists with type {pool.type!r}, not 'process': "
                                 f"pick another --pool") from None


def register_deployments(parameters: dict, pool: str, rerun_every: timedelta | None, env: dict | None = None,
                         source: Path = ROOT) -> dict[str, str]:
    """Apply `extract/qwen`, `extract/qwen-rerun` and `extract/qwen-preflight`; returns {name: deployment id}."""
    from prefect import Flow
    from prefect import flow as prefect_flow
    from prefect.schedules import Interval

    # Prefect's sync/async dispatch types from_source, to_deployment and apply as maybe coroutines: called here,
    # outside an event loop, they return the flow, the deployment and its id
    loaded = cast(Flow, prefect_flow.from_source(source=str(source), entrypoint="flows/extract.py:extract"))
    job = {"env": {"PREFECT_FLOWS_HEARTBEAT_FREQUENCY": str(HEARTBEAT_S), **(env or {})}}
    ids = {}
    specs = [("qwen", None, "Qwen3.6-27B DFlash hidden states: run the shards that are not complete yet"),
             ("qwen-rerun", rerun_every or timedelta(hours=1),
              "Scheduled re-run of the same run: reconciles, launches only incomplete shards, stops at the cap"),
             ("qwen-preflight", None, "Preflight of the same run: every host checked (SSH, clock, bundle, GPUs, "
              "model, dataset, output, disk; benchmark=true times the worker), the plan in numbers; launches "
              "nothing")]
    for name, every, description in specs:
        given = {**parameters, "preflight": "only"} if name == "qwen-preflight" else parameters
        kwargs: dict[str, Any] = {}
        if every is not None:
            kwargs["schedules"] = [Interval(every, active=rerun_every is not None, slug=f"{name}-every")]
        deployment = loaded.to_deployment(name=name, parameters=given, work_pool_name=pool,
                                          job_variables=job, tags=[TAG], description=description,
                                          enforce_parameter_schema=True, **kwargs)
        ids[name] = str(deployment.apply(work_pool_name=pool))  # type: ignore[union-attr]  # sync: see above
    return ids


def rerun_parameters(source: str) -> dict:
    """RunDeployment parameters passing every flow parameter on. `source` "event": from the payload of
    `extract.run.incomplete` (which holds all of them); "flow_run": from the crashed run, defaults for the rest."""
    if source == "event":
        return {name: f"{{{{ event.payload.parameters.{name} }}}}" for name in PARAMETERS}
    known = defaults()
    out = {}
    for name in PARAMETERS:
        if name == "rerun_depth":
            out[name] = "{{ (flow_run.parameters.get('rerun_depth', 0) + 1) }}"  # () binds before the tojson filter
        elif name in known:
            out[name] = f"{{{{ flow_run.parameters.get('{name}', {known[name]!r}) }}}}"
        else:
            out[name] = f"{{{{ flow_run.parameters['{name}'] }}}}"
    return out


def automations(rerun_delay: timedelta = timedelta(0), zombie_after: timedelta = ZOMBIE_AFTER) -> list:
    """The three automations (re-run incomplete shards, mark silent runs Crashed, re-run Crashed runs)."""
    from prefect.automations import (
        Automation,
        ChangeFlowRunState,
        EventTrigger,
        Posture,
        ResourceSpecification,
        RunDeployment,
    )
    from prefect.client.schemas.objects import StateType

    incomplete = Automation(
        name=AUTOMATIONS[0],
        description="A failed extract run with shards under the attempt cap asked for a re-run: run exactly "
                    "those shards on the same deployment with the same parameters.",
        trigger=EventTrigger(expect={RERUN_EVENT},
                             match=ResourceSpecification({"prefect.resource.id": "hsextract.run.*"}),
                             posture=Posture.Reactive, threshold=1, within=timedelta(0)),
        actions=[RunDeployment(source="inferred", parameters=rerun_parameters("event"), schedule_after=rerun_delay)])
    zombies = Automation(
        name=AUTOMATIONS[1],
        description=f"An extract run that sent no heartbeat for {zombie_after.seconds} s (its process or machine "
                    f"is gone) is marked Crashed; the next automation runs it again.",
        trigger=EventTrigger(after={"prefect.flow-run.heartbeat"},
                             expect={"prefect.flow-run.heartbeat", "prefect.flow-run.Completed",
                                     "prefect.flow-run.Failed", "prefect.flow-run.Cancelled",
                                     "prefect.flow-run.Crashed"},
                             match=ResourceSpecification({"prefect.resource.id": ["prefect.flow-run.*"]}),
                             match_related=[ResourceSpecification(r) for r in OF_OUR_DEPLOYMENTS],
                             for_each={"prefect.resource.id"}, posture=Posture.Proactive, threshold=1,
                             within=zombie_after),
        actions=[ChangeFlowRunState(state=StateType.CRASHED,
                                    message=f"no heartbeat for {zombie_after.seconds} s: the flow-run process or "
                                            f"its machine is gone (marked by automation)")])
    crashed = Automation(
        name=AUTOMATIONS[2],
        description="A Crashed extract run is run again with the same parameters: the shards still running on "
                    "the hosts are adopted (same run_name), the others resume from their journals.",
        trigger=EventTrigger(expect={"prefect.flow-run.Crashed"},
                             match=ResourceSpecification({"prefect.resource.id": "prefect.flow-run.*"}),
                             match_related=[ResourceSpecification(r) for r in OF_OUR_DEPLOYMENTS],
                             posture=Posture.Reactive, threshold=1, within=timedelta(0)),
        actions=[RunDeployment(source="inferred", parameters=rerun_parameters("flow_run"), schedule_after=rerun_delay)])
    return [incomplete, zombies, crashed]


def register_automations(rerun_delay: timedelta = timedelta(0), zombie_after: timedelta = ZOMBIE_AFTER
                         ) -> dict[str, str]:
    """Create or replace the automations by name; returns {name: id}."""
    from prefect.automations import Automation

    ids = {}
    for automation in automations(rerun_delay, zombie_after):
        existing = Automation.read(name=automation.name) if _exists(automation.name) else None
        if existing is not None:
            existing.delete()  # type: ignore[attr-defined]  # Prefect types read() async only; sync here: an Automation
        ids[automation.name] = str(automation.create().id)
    return ids


def _exists(name: str) -> bool:
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as client:
        return bool(client.read_automations_by_name(name))


def register(model: str, data: str, output: str, hosts: str, aws_credentials: str | None = None,
             pool: str = POOL, rerun_every: timedelta | None = None, rerun_delay: timedelta = timedelta(0),
             overrides: dict | None = None, env: dict | None = None, zombie_after: timedelta = ZOMBIE_AFTER) -> dict:
    """The whole set-up on the current Prefect server: pool, both deployments, the automations."""
    parameters = {"model": model, "data": data, "output": output, "hosts": hosts, **RECIPE,
                  **({"aws_credentials": aws_credentials} if aws_credentials else {}), **(overrides or {})}
    try:  # a name the flow does not take, or a value its type refuses: said now, not at the first run
        Settings.from_flat(parameters)
    except ValueError as exc:
        raise SystemExit(f"the deployments' parameters: {exc}") from None
    ensure_pool(pool)
    deployments = register_deployments(parameters, pool, rerun_every, env)
    return {"pool": pool, "deployments": deployments, "automations": register_automations(rerun_delay, zombie_after),
            "parameters": parameters}


def _seconds(text: str) -> timedelta:
    units = {"s": 1, "m": 60, "h": 3600, "d": 86400}
    try:
        return timedelta(seconds=float(text[:-1]) * units[text[-1]]) if text[-1] in units else \
            timedelta(seconds=float(text))
    except (ValueError, IndexError):
        raise argparse.ArgumentTypeError(f"{text!r}: a duration like 90s, 30m, 6h or 1d") from None


def main(argv: list[str] | None = None) -> int:
    """`python -m deployments.qwen`: register everything, print what was registered and what to run next."""
    ap = argparse.ArgumentParser(prog="python -m deployments.qwen", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="model directory as seen on the hosts")
    ap.add_argument("--data", required=True, help="dataset path or URI as seen on the hosts")
    ap.add_argument("--output", required=True, help="file:///path or s3://bucket/prefix")
    ap.add_argument("--hosts", required=True, help="inventory YAML path, or the name of a HostInventory block")
    ap.add_argument("--aws-credentials", help="name of an AwsCredentials (or S3Bucket) block")
    ap.add_argument("--pool", default=POOL, help=f"process work pool (default {POOL})")
    ap.add_argument("--rerun-every", type=_seconds, help="activate the scheduled re-run at this interval (6h)")
    ap.add_argument("--rerun-delay", type=_seconds, default=timedelta(0),
                    help="wait this long before an automated re-run (default 0)")
    ap.add_argument("--param", action="append", default=[], metavar="NAME=JSON",
                    help="another flow parameter default, e.g. --param token_budget=16384 (repeatable)")
    args = ap.parse_args(argv)
    overrides = {}
    for item in args.param:
        name, sep, value = item.partition("=")
        if not sep:
            ap.error(f"--param {item!r}: use NAME=VALUE")
        try:
            overrides[name] = json.loads(value)
        except json.JSONDecodeError:
            overrides[name] = value
    done = register(args.model, args.data, args.output, args.hosts, args.aws_credentials, args.pool,
                    args.rerun_every, args.rerun_delay, overrides)
    print(json.dumps(done, indent=1))
    print(f"start a worker:  prefect worker start --pool {args.pool}\n"
          f"run it:          prefect deployment run extract/qwen --watch")
    return 0


if __name__ == "__main__":
    sys.exit(main())
