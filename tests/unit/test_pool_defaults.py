"""What a later ``trainyard infra apply`` keeps of a pool's defaults (``infra/pool_defaults.py``), without a server
(``tests/integration/test_infra.py`` applies to one)."""

from __future__ import annotations

from infra import apply as infra
from infra.pool_defaults import kept


def _with(template: dict, **defaults) -> dict:
    for name, value in defaults.items():
        template["variables"]["properties"][name]["default"] = value
    return template


def test_the_pools_defaults_stand_and_apply_sets_its_own_env_entry_and_a_given_image():
    desired = infra.pool_template(infra.GPU_TEMPLATES["kubernetes"], 60, "registry.example/ty:2")
    stored = _with(
        infra.pool_template(infra.GPU_TEMPLATES["kubernetes"], 30, "registry.example/ty:1"),
        namespace="ml",
        env={"AWS_REGION": "eu-west-1", infra.HEARTBEAT_ENV: "30"},
    )
    merged, changed = kept(stored, desired, frozenset({"image"}), infra.HEARTBEAT_ENV)
    props = merged["variables"]["properties"]
    assert props["namespace"]["default"] == "ml" and props["image"]["default"] == "registry.example/ty:2"
    assert props["env"]["default"] == {"AWS_REGION": "eu-west-1", infra.HEARTBEAT_ENV: "60"}
    assert sorted(changed) == ["env", "namespace"]
    assert desired["variables"]["properties"]["namespace"]["default"] != "ml"  # the template itself untouched


def test_a_pool_whose_env_default_is_null_gets_the_heartbeat_back():
    # kept as null, the heartbeat entry was lost, and the zombie automation never saw a heartbeat to miss
    desired = infra.pool_template(infra.GPU_TEMPLATES["kubernetes"])
    stored = _with(infra.pool_template(infra.GPU_TEMPLATES["kubernetes"]), env=None)
    merged, _ = kept(stored, desired, frozenset(), infra.HEARTBEAT_ENV)
    assert merged["variables"]["properties"]["env"]["default"] == {infra.HEARTBEAT_ENV: "30"}
