"""The verdict of a run that is not complete, and the request for a re-run of exactly its failed shards.

The verdict is short (flow run state message: what failed, why, in one line per cause, and whether a re-run
was asked for); the evidence of every failure goes to the markdown artifact `failure-<run>`.

A run that ends with failed shards under the attempt cap emits `extract.run.incomplete` (payload: every
parameter of the run, `shards` = the ones to re-run, `rerun_depth` + 1); the automation *hsextract: re-run
incomplete shards* (deployments/qwen.py) starts that run on the same deployment. Events carry the flow run,
its flow and its deployment as related resources, which is what automations match on. Every run ends with
`extract.run.failed` or `extract.run.complete`, whose resource name is the verdict in a few words.
"""

from __future__ import annotations

from dataclasses import replace

from prefect.artifacts import create_markdown_artifact
from prefect.events import emit_event
from prefect.states import Failed, State

from hsextract.errors import Retry

from .board import run_key
from .failures import NOT_LAUNCHED, WHY_CHARS, Failure, grouped, one_line, report, same_cause, shard_list, summary
from .plan import Plan, RunIncomplete

RERUN_EVENT = "extract.run.incomplete"


def related_resources() -> list[dict]:
    """The flow run, its flow and deployment (with their names: the event feed shows them): what `extract.*`
    events are related to (automations match these)."""
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
                        "prefect.resource.role": "deployment", "prefect.resource.name": deployment_name()})
    return related


def deployment_name() -> str:
    """`extract/qwen`: the name of the deployment this flow run came from ("" when the server will not say)."""
    try:
        from prefect.runtime import deployment

        return f"extract/{deployment.name}" if deployment.name else ""
    except Exception:  # a name is a nicety: the id is what automations match
        return ""


def request_rerun(plan: Plan, rerun: list[int], capped: list[int], log) -> str:
    """Emit `extract.run.incomplete` asking for a run of the shards `rerun` (unless the chain of automated re-runs
    is at `max_reruns`); `capped`: failed shards left out at the attempt cap. Returns what was asked, for the
    run's message."""
    depth, most = plan.settings.retries.rerun_depth, plan.settings.retries.max_reruns
    if not rerun:
        return f"no re-run requested: shard(s) {capped} are at the attempt cap" if capped else "no re-run requested"
    if depth >= most:
        return f"no re-run requested: {depth} automated re-run(s) already, max_reruns={most}"
    # num_shards pinned: shard i means the same samples in the re-run even if the inventory changed meanwhile
    parameters = plan.settings.replace(run_name=plan.run, shards=rerun, rerun_depth=depth + 1,
                                       reset_attempts=False).flat()
    emit_event(RERUN_EVENT, resource={"prefect.resource.id": f"hsextract.run.{run_key(plan.run)}",
                                      "prefect.resource.name": plan.run, "hsextract.run": plan.run},
               related=related_resources(),
               payload={"run_name": plan.run, "rerun": rerun, "capped": capped, "parameters": parameters})
    log.info("run %s: asked for a re-run of shard(s) %s (automated re-run %d)%s", plan.run, rerun, depth + 1,
             f"; shard(s) {capped} are at the attempt cap" if capped else "")
    return (f"re-run of shard(s) {rerun} requested ({RERUN_EVENT}, re-run {depth + 1} of at most {most})"
            + (f"; shard(s) {capped} at the attempt cap" if capped else ""))


def incomplete(plan: Plan, shards: dict[str, str], failures: dict[str, Failure], log) -> RunIncomplete:
    """The run's error when shards or hosts failed: a short message (what happened, the re-run asked for or
    why none, one line per cause) and the evidence of every failure in the `failure-<run>` artifact.

    A failure a re-run cannot fix is not retried and burns no attempt: a worker's bad-argument exit, a host's
    preflight check finding the inputs unusable, and the same worker error on every shard this run launched
    (none of them done)."""
    launched = [f for f in failures.values() if f.shard is not None and f.shard in plan.todo]
    if failures and same_cause(launched) and not any(v == "done" for v in shards.values()):
        plan.attempts.forgive([f.shard for f in launched if f.shard is not None and f.retry is not Retry.NEVER])
        failures = {k: replace(f, retry=Retry.NEVER) if f in launched else f for k, f in failures.items()}
    ended = [s for s in plan.requested if shards[str(s)] not in ("done", "done (already complete)")]
    stopped = [s for s in ended if shards[str(s)] in ("stopped", "cancelled")]  # on purpose: not failures
    failed = [s for s in ended if s not in stopped]
    mistakes = sorted({f.shard for f in failures.values() if f.shard is not None and f.retry is Retry.NEVER}
                      & set(failed))
    most = plan.settings.retries.max_attempts
    rerun = [s for s in failed if s not in mistakes and plan.attempts.get(s).failed_attempts < most]
    capped = sorted(set(failed) - set(rerun) - set(mistakes))
    fix = "not retried (a re-run cannot fix this): fix it, then run again"
    if (mistakes or stopped) and not rerun and not capped:
        note = fix if mistakes else ""
    else:
        note = request_rerun(plan, rerun, capped, log) + (f"; shard(s) {mistakes} {fix}" if mistakes else "")
    if stopped:
        note = "; ".join(filter(None, [note, f"shard(s) {shard_list(stopped)} stopped on purpose: not re-run until "
                                             f"a person starts the run again"]))
    head = f"run {plan.run}: {len(failed)} of {len(plan.requested)} shard(s) failed; {note}"
    if not failed:
        head = (f"run {plan.run}: {note}" if stopped else
                f"run {plan.run}: every shard is done, but {len(failures)} host(s) failed; {note}")
    return _verdict(plan.run, head, list(failures.values()), log)


def refused(run: str, error: Exception, log) -> State:
    """End a run refused before anything ran (another recipe, a bad inventory, no credentials, a source changed
    under its manifest) as a failed shard ends one: Failed with the refusal's own message, its evidence in the
    `failure-<run>` artifact (whose address ends the message), the event `extract.run.failed`; never retried."""
    why = str(error) or type(error).__name__
    failure = Failure("", one_line(why), why if "\n" in why or len(why) > WHY_CHARS else "", Retry.NEVER)
    where = _evidence(run, f"run {run}: refused before anything ran; not retried (a re-run cannot fix this)",
                      [failure], log)
    message = f"{why}\n{where}"
    log.error("run %s: %s", run, message)
    announce(run, "failed", failure.why, {"message": message, "failures": 1})
    return Failed(message=message, data=RunIncomplete(message, why))


def _evidence(run: str, head: str, failures: list[Failure], log) -> str:
    """The `failure-<run>` artifact (`head`, then every failure with its evidence) published; the line that says
    where it is (its address when the UI's is known)."""
    key = f"failure-{run_key(run)}"
    try:
        create_markdown_artifact(report(run, head, failures), key=key, description=head[:500])
        return f"evidence: artifact {key}" + (f" ({_ui_url()}/artifacts/key/{key})" if _ui_url() else "")
    except Exception as exc:  # the verdict stands without its artifact; say where the evidence is instead
        log.warning("run %s: artifact %s not published: %s", run, key, exc)
        return "evidence: this run's logs"


def _verdict(run: str, head: str, failures: list[Failure], log) -> RunIncomplete:
    """RunIncomplete with `head` and one line per cause; the evidence goes to the `failure-<run>` artifact
    (its address ends the message) and the old-style list of every failure to `details`."""
    where = _evidence(run, head, failures, log)
    hosts = [f for f in failures if f.shard is None]  # shards no host could take: the host lines say why
    told = [f for f in failures if not (hosts and f.shard is not None and f.why.startswith(NOT_LAUNCHED))]
    causes = summary(told)
    message = f"{head}\n{causes}\n{where}"
    log.error("%s", message)
    first, more = causes.split("\n")[0].removeprefix("- "), len(grouped(told)) - 1
    announce(run, "failed", first + (f" (and {more} more cause(s))" if more else ""),
             {"message": message, "failures": len(failures)})
    details = "\n".join(f"- {f.evidence or f'{f.where}: {f.why}'}" for f in failures)
    return RunIncomplete(message, f"{head}:\n{details}")


def failed(plan: Plan, board, error: RunIncomplete, verdict: str = "failed") -> State:
    """End the run Failed with `error`'s short message (returned, not raised: raising adds a traceback to the
    state message); the status artifact says `verdict` and where the evidence is."""
    board.finish(verdict, {"why": f"artifact `failure-{run_key(plan.run)}`"})
    return Failed(message=str(error), data=error)


def completed(plan: Plan, board, summary: dict, what: str, links: dict | None = None) -> dict:
    """End the run Completed with `summary`: the status artifact, and `extract.run.complete` saying `what`."""
    board.finish("complete" if links else "complete (not reconciled)", links)
    announce(plan.run, "complete", what, summary)
    return summary


def announce(run: str, verdict: str, what: str, payload: dict | None = None) -> None:
    """Event `extract.run.<verdict>` (failed, complete) whose resource name says what happened: the event feed
    and `prefect deployment run --watch` show it (the watch shows events, not logs)."""
    try:
        emit_event(f"extract.run.{verdict}", resource={"prefect.resource.id": f"hsextract.run.{run_key(run)}",
                                                     "prefect.resource.name": f"{run}: {verdict}: {what}",
                                                     "hsextract.run": run},
                   related=related_resources(), payload={"run_name": run, **(payload or {})})
    except Exception:  # the verdict stands without its event
        pass


def _ui_url() -> str:
    """The Prefect UI's address, as this process's settings have it ("" when unknown)."""
    from prefect.settings import get_current_settings

    return (get_current_settings().ui_url or "").rstrip("/")


def unreconciled(plan: Plan, checked: dict, log) -> RunIncomplete | None:
    """The run's error when reconcile found requested shards' samples missing (their journals now retract the
    lost files, so a re-run redoes exactly those samples); None when it found nothing to redo."""
    redo = sorted(set(checked["shards_to_rerun"]) & set(plan.requested))
    if not redo:
        return None
    note = request_rerun(plan, redo, [], log)
    head = f"run {plan.run}: reconcile found {checked['missing']} sample(s) missing; {note}"
    why = (f"{checked['missing_objects']} object(s) missing, {checked['corrupt_objects']} corrupt: the journals now "
           f"say which files were lost, so a re-run redoes exactly those samples")
    return _verdict(plan.run, head, [Failure("", why, shard=s, num_shards=plan.num_shards) for s in redo], log)
