"""The verdict of a run that is not complete, and the request for a re-run of exactly its failed shards.

A run that ends with failed shards under the attempt cap emits `extract.run.incomplete` (payload: every
parameter of the run, `shards` = the ones to re-run, `rerun_depth` + 1); the automation *hsextract: re-run
incomplete shards* (deployments/qwen.py) starts that run on the same deployment. Events carry the flow run,
its flow and its deployment as related resources, which is what automations match on.
"""

from __future__ import annotations

from prefect.events import emit_event

from .board import run_key
from .plan import Plan, RunIncomplete

RERUN_EVENT = "extract.run.incomplete"


def related_resources() -> list[dict]:
    """The flow run, its flow and deployment: what `extract.*` events are related to (automations match these)."""
    from prefect.context import FlowRunContext

    ctx = FlowRunContext.get()
    run = ctx.flow_run if ctx else None
    if run is None:
        return []
    related = [{"prefect.resource.id": f"prefect.flow-run.{run.id}", "prefect.resource.role": "flow-run",
                "prefect.resource.name": run.name or ""},
               {"prefect.resource.id": f"prefect.flow.{run.flow_id}", "prefect.resource.role": "flow",
                "prefect.resource.name": "extract"}]
    if run.deployment_id:
        related.append({"prefect.resource.id": f"prefect.deployment.{run.deployment_id}",
                        "prefect.resource.role": "deployment"})
    return related


def request_rerun(plan: Plan, params: dict, rerun: list[int], capped: list[int], log) -> str:
    """Emit `extract.run.incomplete` asking for a run of the shards `rerun` (unless the chain of automated re-runs
    is at `max_reruns`); `capped`: failed shards left out at the attempt cap. Returns what was asked, for the
    run's message."""
    depth, most = params["rerun_depth"], params["max_reruns"]
    if not rerun:
        return f"no re-run requested: shard(s) {capped} are at the attempt cap" if capped else "no re-run requested"
    if depth >= most:
        return f"no re-run requested: {depth} automated re-run(s) already, max_reruns={most}"
    # num_shards pinned: shard i means the same samples in the re-run even if the inventory changed meanwhile
    parameters = {**params, "run_name": plan.run, "shards": rerun, "rerun_depth": depth + 1, "reset_attempts": False}
    emit_event(RERUN_EVENT, resource={"prefect.resource.id": f"hsextract.run.{run_key(plan.run)}",
                                      "prefect.resource.name": plan.run, "hsextract.run": plan.run},
               related=related_resources(),
               payload={"run_name": plan.run, "rerun": rerun, "capped": capped, "parameters": parameters})
    log.info("run %s: asked for a re-run of shard(s) %s (automated re-run %d)%s", plan.run, rerun, depth + 1,
             f"; shard(s) {capped} are at the attempt cap" if capped else "")
    return (f"re-run of shard(s) {rerun} requested ({RERUN_EVENT}, re-run {depth + 1} of at most {most})"
            + (f"; shard(s) {capped} at the attempt cap" if capped else ""))


def incomplete(plan: Plan, shards: dict[str, str], failures: dict[str, str], params: dict, log) -> RunIncomplete:
    """The run's error when shards failed: every failure on its own line (host, shard, what ran, what it
    printed), after the re-run it asked for."""
    failed = [s for s in plan.requested if shards[str(s)] not in ("done", "done (already complete)")]
    rerun = [s for s in failed if plan.attempts.get(s).failed_attempts < params["max_attempts"]]
    note = request_rerun(plan, params, rerun, sorted(set(failed) - set(rerun)), log)
    text = "\n".join(f"- {where}: {why}" for where, why in sorted(failures.items()))
    return RunIncomplete(f"run {plan.run}: {len(failures)} failure(s), shards {shards}; {note}:\n{text}")


def unreconciled(plan: Plan, checked: dict, params: dict, log) -> RunIncomplete | None:
    """The run's error when reconcile found requested shards' samples missing (their journals now retract the
    lost files, so a re-run redoes exactly those samples); None when it found nothing to redo."""
    redo = sorted(set(checked["shards_to_rerun"]) & set(plan.requested))
    if not redo:
        return None
    note = request_rerun(plan, params, redo, [], log)
    return RunIncomplete(f"run {plan.run}: reconcile found {checked['missing']} sample(s) missing "
                         f"({checked['missing_objects']} object(s) missing, {checked['corrupt_objects']} corrupt); "
                         f"re-run shards {checked['shards_to_rerun']} (their journals now say which files were "
                         f"lost, so a re-run redoes exactly those samples); {note}")
