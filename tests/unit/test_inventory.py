"""Inventory contract: validation names every bad field; key checking is strict unless opted in."""

from __future__ import annotations

import pytest

from tasks.inventory import InventoryError, parse_inventory

GOOD = """
hosts:
  - name: a
    hostname: 10.0.0.1
    user: ubuntu
    key_filename: ~/.ssh/id
    gpus: [0, 1]
    workdir: /scratch/x
    python: /opt/venv/bin/python
  - name: b
    hostname: b.example
    port: 2222
    gpus: [3]
    workdir: /w
    accept_unknown_host_keys: true
"""


def test_good_inventory_and_slots():
    inv = parse_inventory(GOOD)
    assert [h.name for h in inv.hosts] == ["a", "b"]
    assert inv.slots == [("a", 0), ("a", 1), ("b", 3)]
    assert inv.host("b").port == 2222 and inv.host("a").port == 22
    assert inv.host("b").python == "python3"
    assert not inv.accepts_unknown_keys(inv.host("a")), "strict host keys by default"
    assert inv.accepts_unknown_keys(inv.host("b")), "per-host opt-in"
    assert parse_inventory("accept_unknown_host_keys: true\n" + GOOD).accepts_unknown_keys(inv.host("a"))


@pytest.mark.parametrize("mutate, message", [
    (lambda t: t.replace("    python: /opt/venv/bin/python", "    pyhton: x"), "host a.pyhton: unknown key"),
    (lambda t: t.replace("    hostname: 10.0.0.1\n", ""), "host a.hostname: missing"),
    (lambda t: t.replace("name: b", "name: a"), "duplicate host name(s): a"),
    (lambda t: t.replace("gpus: [3]", "gpus: []"), "host b.gpus"),
    (lambda t: t.replace("workdir: /w", "workdir: relative/dir"), "host b.workdir"),
    (lambda t: t.replace("gpus: [0, 1]", "gpus: [0, 0]"), "host a.gpus"),
    (lambda t: t.replace("port: 2222", "port: 99999"), "host b.port"),
    (lambda t: t + "colour: blue\n", "colour: unknown key"),
])
def test_each_bad_field_is_named(mutate, message):
    with pytest.raises(InventoryError) as err:
        parse_inventory(mutate(GOOD), "hosts.yaml")
    assert message in str(err.value) and str(err.value).startswith("hosts.yaml: ")


def test_several_errors_reported_together():
    text = GOOD.replace("gpus: [3]", "gpus: []").replace("workdir: /scratch/x", "workdir: x")
    message = str(pytest.raises(InventoryError, parse_inventory, text).value)
    assert "host a.workdir" in message and "host b.gpus" in message


def test_not_yaml_or_not_mapping():
    with pytest.raises(InventoryError, match="not valid YAML"):
        parse_inventory("hosts: [")
    with pytest.raises(InventoryError, match="expected a mapping"):
        parse_inventory("just a string")
