#!/usr/bin/python
# Copyright: gpunode developers
# Apache-2.0
from __future__ import annotations

DOCUMENTATION = r"""
module: gpunode_doctor
short_description: gpunode doctor's checks and verdict as facts
description:
  - Runs C(gpunode doctor --json) (read-only, also in check mode) and sets the fact C(gpunode_doctor) with C(healthy),
    C(counts) and C(checks) (id, status, summary, detail, fix).
  - An unhealthy node is a finding, not a failure, unless I(fail_on_unhealthy) is set; then the task fails and names
    the failed checks and their fixes.
options:
  fail_on_unhealthy:
    description: fail the task when a check failed
    type: bool
    default: false
extends_documentation_fragment:
  - gpunode.gpunode.gpunode
  - ansible.builtin.action_common_attributes
attributes:
  check_mode:
    support: full
    details: 'runs as in a normal run: doctor only reads'
  diff_mode:
    support: none
    details: 'read-only: it reports, and changes nothing to show'
author: gpunode developers (@gpunode)
"""

EXAMPLES = r"""
- gpunode.gpunode.gpunode_doctor:
- ansible.builtin.debug:
    msg: "{{ gpunode_doctor.checks | selectattr('status', 'eq', 'fail') | map(attribute='id') | list }}"
"""

RETURN = r"""
ansible_facts:
  description: C(gpunode_doctor) with healthy, counts and checks
  returned: always
  type: dict
failed_checks:
  description: ids of the checks that failed
  returned: always
  type: list
rc:
  description: gpunode's exit status (1 when unhealthy)
  returned: always
  type: int
"""

from ansible.module_utils.basic import AnsibleModule
from ansible_collections.gpunode.gpunode.plugins.module_utils.gpunode import (
    common_argument_spec,
    finish,
    run_gpunode,
)


def main():
    spec = common_argument_spec()
    spec.update(fail_on_unhealthy={"type": "bool", "default": False})
    module = AnsibleModule(argument_spec=spec, supports_check_mode=True)
    argv, rc, doc, stderr = run_gpunode(module, ["doctor"], changes=False)
    checks = doc.get("checks") or []
    failed = [c["id"] for c in checks if c.get("status") == "fail"]
    counts = doc.get("counts") or {}
    verdict = "healthy" if doc.get("healthy") else "unhealthy"
    msg = "{}: {}".format(
        verdict, ", ".join(f"{counts.get(k, 0)} {k}" for k in ("ok", "warn", "fail", "skip"))
    )
    facts = {"gpunode_doctor": {"healthy": doc.get("healthy"), "counts": counts, "checks": checks}}
    fail_unless = None
    if module.params["fail_on_unhealthy"] and not doc.get("healthy") and not doc.get("error"):
        fail_unless = "gpunode doctor: unhealthy; failed: " + "; ".join(
            "{} ({}){}".format(c["id"], c.get("summary"), " fix: {}".format(c["fix"]) if c.get("fix") else "")
            for c in checks
            if c.get("status") == "fail"
        )
    finish(
        module,
        argv,
        rc,
        doc,
        stderr,
        msg=msg,
        fail_unless=fail_unless,
        extra={"ansible_facts": facts, "failed_checks": failed, "healthy": doc.get("healthy")},
    )


if __name__ == "__main__":
    main()
