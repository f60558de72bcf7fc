"""What a person sees in the Prefect UI, measured: `python benchmarks/ui_check.py [--shots docs/ui]`.

Runs the served set-up (`python -m deployments.demo --served`: server, deployments, automations, worker and
a good run), then a run with a typo in the model path, and prints what the UI and the API show: whether the
page reaches its API, the flow runs' names, tags and state messages (and their lengths), how fast the typo
failed and whether anything re-ran it, the artifacts and how many versions each has, the events' resource
names, and the text Chromium rendered. Screenshots go to `--shots` (the README's are docs/ui/*.png).
The same run is asserted on by tests/integration/test_ui.py.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

from harness.ui import look


def main() -> int:
    """Look, then print the figures."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shots", type=Path, help="where the screenshots go (default: a temporary directory)")
    ap.add_argument("--json", type=Path, help="also write everything seen as JSON here")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="hsx-ui-") as tmp:
        shots = args.shots or Path(tmp) / "shots"
        seen = look(Path(tmp) / "work", shots.resolve())
        print(f"UI {seen['ui']}: /ui-settings api_url {seen['ui_settings']['api_url']}, API health "
              f"{seen['api_health']} (demo --served took {seen['demo_s']} s)")
        for name in ("demo", "typo"):
            for run in seen[name]["runs"]:
                message = run["message"] or ""
                print(f"\nflow run {run['name']!r}: {run['state']}, tags {run['tags']}, state message "
                      f"{len(message)} chars:\n  " + message.replace("\n", "\n  "))
            for kind in ("status", "shards", "failure"):
                art = seen[name][kind]
                if art:
                    print(f"artifact {kind}-{name}: {art['versions']} version(s); {art['description']!r}")
            for event in seen[name]["events"][-3:]:
                print(f"event {event['event']}: {event['resource']['prefect.resource.name']}")
        print(f"\ntypo: failed in {seen['typo_s']} s from `prefect deployment run --watch` to its end, "
              f"{len(seen['typo']['runs'])} flow run(s) (no automated re-run), failed attempts counted: "
              f"{sum(e['failed_attempts'] for e in seen['typo']['attempts'].values())}")
        status = json.loads(seen["demo"]["shards"]["data"])
        print(f"shard table columns ({len(status[0])}): {', '.join(status[0])}")
        for page, found in seen["pages"].items():
            connected = "Unable to connect" not in found["text"]
            print(f"page {page}: rendered in {found['seconds']} s, reached its API: {connected}, "
                  f"shows 'no such directory': {'no such directory' in found['text']}")
        print(f"screenshots: {', '.join(sorted(p.name for p in shots.glob('*.png')))} in {shots}")
        if args.json:
            args.json.write_text(json.dumps(seen, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
