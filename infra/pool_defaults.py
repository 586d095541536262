"""The defaults an operator set on a pool's variables, kept when ``trainyard infra apply`` updates its template.

An operator sets a pool's defaults in the Prefect UI or API (``trainyard_home_efs_id``, a namespace, a service
account, ``env`` entries such as ``AWS_REGION``), as infra/README.md tells them to. Apply compared the stored
template with the one built from ``infra/`` and wrote the whole of it where they differed: a later apply (to
resize the pool, say) put every such default back to the template's, and on ECS every group's task definition
was then refused for want of its file system. Apply now keeps each default the pool has for a variable both
templates declare, except those it is asked to set (``--image``) and its own ``env`` entry (the heartbeat);
``--reset-defaults`` takes the template's. Prefect-free: the apply and its tests share it.
"""

from __future__ import annotations

import copy
from typing import Any

_ABSENT = object()


def kept(stored: dict[str, Any], desired: dict[str, Any], managed: frozenset[str], own_env: str):
    """``desired`` with the stored defaults kept, and the names of the variables whose default was kept where
    it differed. ``managed``: variables whose default apply sets this time; ``own_env``: apply's ``env`` key,
    whose value is apply's whatever the pool has (the env default is otherwise merged: the stored entries win)."""
    result = copy.deepcopy(desired)
    stored_props = (stored.get("variables") or {}).get("properties") or {}
    changed = []
    for name, prop in (result.get("variables") or {}).get("properties", {}).items():
        before = stored_props.get(name)
        old = before.get("default", _ABSENT) if isinstance(before, dict) else _ABSENT
        if old is _ABSENT or name in managed:
            continue
        new = prop.get("default", _ABSENT)
        if name == "env" and isinstance(new, dict):  # (a stored null: none of the operator's, apply's own still)
            old = {
                **new,
                **(old if isinstance(old, dict) else {}),
                **({own_env: new[own_env]} if own_env in new else {}),
            }
        if old != new:
            prop["default"] = old
            changed.append(name)
    return result, changed
