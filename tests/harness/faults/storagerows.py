"""Rows that fault the store: 5xx bursts, revoked credentials, a missing bucket, a deleted object, a file
altered in the spool, and a spool held at its high-water mark."""

from __future__ import annotations

import os
import time

from .lab import Case, Lab, Outcome, observed


class Store:
    """A bucket on the lab's moto behind a fault proxy, and a credentials block whose endpoint is the proxy."""

    def __init__(self, lab: Lab, case: Case, rule=None, bandwidth: float | None = None):
        import uuid

        import boto3
        from prefect_aws import AwsCredentials
        from harness.s3proxy import FaultProxy

        self.proxy = FaultProxy(lab.s3_url, rule, bandwidth).start()
        self.bucket = f"hsx-{case.run_name.replace('_', '-')}"
        self.client = boto3.client("s3", endpoint_url=lab.s3_url, region_name="us-east-1")
        self.client.create_bucket(Bucket=self.bucket)
        self.block = f"fm-{case.run_name.replace('_', '-')}"
        key_id, secret = f"AKIAHSX{uuid.uuid4().hex[:13].upper()}", f"hsx-secret-{uuid.uuid4().hex}"
        lab.secrets += [key_id, secret]
        lab.key_ids.add(key_id)
        AwsCredentials(aws_access_key_id=key_id, aws_secret_access_key=secret, region_name="us-east-1",
                       aws_client_parameters={"endpoint_url": self.proxy.url}).save(self.block, overwrite=True)
        self.output = f"s3://{self.bucket}/run"

    def heal(self) -> None:
        self.proxy.rule, self.proxy.bandwidth = (lambda method, path: None), None

    def close(self) -> None:
        self.proxy.stop()


def batch_put(method: str, path: str) -> bool:
    return method in ("PUT", "POST") and "/batch-" in path


def storage_fault(rule_for=None, bandwidth=None, strike=None, output_for=None, words=""):
    """A run on s3:// through the fault proxy; the re-run path goes through a healed proxy."""
    def run(lab: Lab, case: Case) -> Outcome:
        store = Store(lab, case, rule_for() if rule_for else None, bandwidth)
        try:
            hosts = case.inventory(("lo",))
            output = output_for(store) if output_for else store.output
            kwargs = dict(hosts=hosts, aws_credentials=store.block)
            if strike:
                case.data = lab.long_data
                box = case.flow_in_thread(output=output, token_budget=128, **kwargs)
                acted = strike(case, store)
                box["thread"].join(300)
                state, why = box["state"], box["reason"]
                failed_at = case.task_failed_at(state)
                detect = failed_at and failed_at - acted
            else:
                state, detect, why = case.flow(output=output, **kwargs)
                detect = None if state.is_completed() else detect
            store.heal()
            launched = any(t.name.startswith("launch-") for t in case.task_runs(state))
            return case.finish(observed(state, why), detect, kwargs, store.output, client=store.client,
                               note=f"{len(store.proxy.seen)} requests through the proxy"
                                    + ("" if launched else "; failed before any launch"))
        finally:
            store.close()
    return run


def burst(statuses=(503, 500, 503, 503, 500, 503)):
    def rule_for():
        pending = list(statuses)

        def rule(method, path):
            return pending.pop(0) if batch_put(method, path) and pending else None
        return rule
    return rule_for


def revoke_after(puts: int):
    def rule_for():
        seen = [0]

        def rule(method, path):
            if batch_put(method, path):
                seen[0] += 1
                return 403 if seen[0] > puts else None
            return None
        return rule
    return rule_for


def corrupt_spooled(case: Case, store: Store) -> float:
    """Flip bytes of a batch file waiting in the spool (the link is slow), before its upload."""
    spool = case.control_dir("lo") / "spool" / "shard-00000-of-00001"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        waiting = sorted(spool.glob("batch-*.safetensors"))
        if len(waiting) >= 10:  # more than the uploader has in flight: the newest one is still waiting
            victim = waiting[-1]
            with victim.open("r+b") as handle:  # the last bytes of the tensor data, inverted
                handle.seek(-64, os.SEEK_END)
                tail = handle.read(64)
                handle.seek(-64, os.SEEK_END)
                handle.write(bytes(b ^ 0xFF for b in tail))
            return time.time()
        time.sleep(0.02)
    raise AssertionError(f"no batch file waited in {spool}")


def object_deleted(lab: Lab, case: Case) -> Outcome:
    """A clean run, then one stored batch object deleted: the next run's reconcile must say so."""
    store = Store(lab, case)
    try:
        kwargs = dict(hosts=case.inventory(("lo",)), aws_credentials=store.block)
        first, _, why = case.flow(output=store.output, **kwargs)
        if not first.is_completed():
            return Outcome(f"ERROR: the clean first run failed: {why}")
        listed = store.client.list_objects_v2(Bucket=store.bucket, Prefix="run/")["Contents"]
        victim = next(o["Key"] for o in listed if "/batch-" in o["Key"])
        store.client.delete_object(Bucket=store.bucket, Key=victim)
        state, seconds, why = case.flow(output=store.output, **kwargs)
        return case.finish(observed(state, why), seconds, kwargs, store.output, client=store.client,
                           note=f"deleted {victim}")
    finally:
        store.close()


def spool_high_water(lab: Lab, case: Case) -> Outcome:
    """The link is slower than extraction: the spool must stop at its high-water mark (extraction paused, not
    killed as stalled) and the run complete."""
    from hsextract.output.journal import parse_entries

    high, low = 512 << 10, 256 << 10
    store = Store(lab, case, bandwidth=100_000)
    try:
        kwargs = dict(hosts=case.inventory(("lo",)), aws_credentials=store.block)
        state, seconds, why = case.flow(output=store.output, spool_high_gb=high / 2**30, spool_low_gb=low / 2**30,
                                        progress_timeout_s=6, **kwargs)
        key = "run/shard-00000-of-00001/journal.jsonl"
        entries = list(parse_entries(store.client.get_object(Bucket=store.bucket, Key=key)["Body"].read(), key)) \
            if state.is_completed() else []
        files = [e["bytes"] for e in entries if e.get("kind") == "file"]
        upload = next((e["summary"].get("upload", {}) for e in entries if e.get("kind") == "done"), {})
        peak, paused = upload.get("max_spool_bytes", 0), upload.get("paused_s", 0.0)
        held = peak <= high + max(files, default=0)
        note = (f"spool peaked at {peak / 1024:.0f} KiB (high-water {high >> 10} KiB + one file of at most "
                f"{max(files, default=0) / 1024:.0f} KiB: {'held' if held else 'OVERRUN'}), extraction paused "
                f"{paused:.1f}s of {seconds:.0f}s")
        seen = observed(state, why)
        if state.is_completed() and not (held and paused > 0):
            seen = f"Failed: {'the spool overran its mark' if not held else 'never paused: nothing was tested'}"
        return case.finish(seen, None, None, store.output, client=store.client, note=note)
    finally:
        store.close()
