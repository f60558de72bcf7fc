"""The fast rows of the fault matrix (benchmarks/fault_matrix.py), each a test: the same real system, the same
verdict. The rows live in tests/harness/faults/; the latest table of the whole matrix is in benchmarks/RESULTS.md."""

from __future__ import annotations

import pytest

from harness.faults import ROWS
from harness.faults.lab import Lab, run_rows
from hsextract import tiny

FAST_ROWS = [row for row in ROWS if row.fast]


@pytest.fixture(scope="module")
def lab(tmp_path_factory, farm, s3_endpoint, tiny_model, prefect_server):
    work = tmp_path_factory.mktemp("faults")
    data = tiny.build_dataset(work / "chat.jsonl", 48, seed=7)
    lab = Lab(work, farm, s3_endpoint, tiny_model, data)
    yield lab
    lab.close()


def test_the_fast_subset_covers_every_kind_of_fault():
    assert {row.group for row in FAST_ROWS} >= {"launch", "run", "data", "storage", "abuse"}


@pytest.mark.parametrize("row", FAST_ROWS, ids=lambda row: row.name)
def test_fault_row(lab, row):
    [(_, outcome)] = run_rows(lab, [row], progress=lambda line: None)
    assert row.passed(outcome), (f"{row.group}/{row.name} ({row.fault}): expected {row.expected} naming "
                                 f"{row.words}, re-run Completed, nothing lost, duplicated or left; got {outcome}")
