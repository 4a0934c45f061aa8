#!/usr/bin/python
# Copyright: gpunode developers
# Apache-2.0
from __future__ import annotations

DOCUMENTATION = r"""
module: gpunode_dra
short_description: Serve GPUs through Dynamic Resource Allocation (DRA) with gpunode
description:
  - With I(state=classes), runs C(gpunode dra classes --apply --json) to create or update the DeviceClasses that
    select gpunode's DRA driver's devices (C(gpu.nvidia.com), serving pods that ask for C(nvidia.com/gpu), and
    C(mig.nvidia.com)), as NVIDIA's DRA driver's chart does. Check mode adds C(--dry-run); diff mode shows each
    class created (the whole object) or updated (gpunode's diff of the class in the cluster against what it
    becomes).
options:
  state:
    description:
      - what to make so; C(classes) applies the DeviceClasses through the Kubernetes API
      - required, with no default, so that the states of the DRA service to come (see the notes) add choices
        without changing what an existing task does
    type: str
    required: true
    choices:
      - classes
  driver:
    description: the DRA driver name whose devices the classes select, and after which they are named (C(--driver);
      default gpunode's, C(gpu.nvidia.com), NVIDIA's)
    type: str
  extended_resource:
    description: give the gpu class C(extendedResourceName) C(nvidia.com/gpu), so unchanged pod specs asking for
      C(nvidia.com/gpu) are served through DRA; false is C(--no-extended-resource), for clusters where the device
      plugin keeps serving C(nvidia.com/gpu)
    type: bool
    default: true
extends_documentation_fragment:
  - gpunode.gpunode.gpunode
  - ansible.builtin.action_common_attributes
  - gpunode.gpunode.gpunode.kube
attributes:
  check_mode:
    support: full
    details: 'C(--apply --dry-run): gpunode reads the classes in the cluster and compares, nothing is written;
      C(changed) says whether a class would be created or updated'
  diff_mode:
    support: full
    details: 'a class created: nothing before, the object after; a class updated: gpunode''s unified diff of its labels,
      annotations and spec in the cluster against what they become'
notes:
  - DeviceClasses are cluster-wide objects; the credentials must be allowed to write C(deviceclasses) (an
    administrator's; a node's own kubelet credentials may not, and the task then fails with the API's 403 and
    gpunode's fix). Run it once per cluster (C(run_once), or on one host), not on every node.
  - 'Labels and annotations others set on the classes are kept; C(changed) is true only when a class was created
    or updated, so a second run reports C(changed=false).'
  - 'State to come: C(present) and C(absent) will install and remove the DRA kubelet plugin service (C(gpunode dra
    install|uninstall)) once gpunode has them; I(driver) will apply to them too. I(state) has no default so that
    adding them changes no existing task.'
requirements:
  - the Kubernetes API reachable from the target with credentials that may write C(deviceclasses)
    (resource.k8s.io/v1, Kubernetes 1.34 or newer)
author: gpunode developers (@gpunode)
"""

EXAMPLES = r"""
- name: The DRA DeviceClasses, once for the cluster
  gpunode.gpunode.gpunode_dra:
    state: classes
    kubeconfig_content: "{{ lookup('file', 'admin.kubeconfig') }}"
  run_once: true
"""

RETURN = r"""
gpunode:
  description: gpunode's document (gpunode.dra-classes/v1), with C(classes) (the objects) and C(applied) (per class
    its action, create, update or unchanged, its diff, and whether this run wrote it)
  returned: always
  type: dict
applied:
  description: per class C(name) and C(action) (create, update or unchanged; in check mode, what would be done)
  returned: success
  type: list
"""

import json

from ansible.module_utils.basic import AnsibleModule
from ansible_collections.gpunode.gpunode.plugins.module_utils.gpunode import (
    Kubeconfig,
    common_argument_spec,
    finish,
    kube_args,
    kube_argument_spec,
    run_gpunode,
)


def class_diffs(document):
    """Ansible diff entries from the document alone: a class created has no before and the object gpunode
    sends (from `classes`) after; an update carries gpunode's own unified diff of what it changes."""
    objects = {(obj.get("metadata") or {}).get("name"): obj for obj in document.get("classes") or []}
    diffs = []
    for entry in document.get("applied") or []:
        name = entry.get("name")
        if entry.get("action") == "create":
            diffs.append(
                {
                    "before_header": f"deviceclass/{name}",
                    "after_header": f"deviceclass/{name}",
                    "before": "",
                    "after": json.dumps(objects.get(name), indent=2) + "\n",
                }
            )
        elif entry.get("action") == "update":
            diffs.append({"prepared": entry.get("diff") or f"deviceclass/{name}: update\n"})
    return diffs


def message(document):
    dry_run = document.get("dry_run")
    said = {
        "create": "would be created" if dry_run else "created",
        "update": "would be updated" if dry_run else "updated",
        "unchanged": "already as wanted",
    }
    parts = [
        "{} {}".format(entry.get("name"), said.get(entry.get("action"), entry.get("action")))
        for entry in document.get("applied") or []
    ]
    return "deviceclasses: " + (", ".join(parts) or "none")


def main():
    spec = common_argument_spec()
    spec.update(kube_argument_spec())
    spec.update(
        state={"type": "str", "required": True, "choices": ["classes"]},
        driver={"type": "str"},
        extended_resource={"type": "bool", "default": True},
    )
    module = AnsibleModule(
        argument_spec=spec,
        supports_check_mode=True,
        mutually_exclusive=[("kubeconfig", "kubeconfig_content")],
    )
    p = module.params
    command = ["dra", "classes", "--apply"]
    if p["driver"]:
        command += ["--driver", p["driver"]]
    if not p["extended_resource"]:
        command.append("--no-extended-resource")
    with Kubeconfig(module) as kubeconfig:
        argv, rc, doc, stderr = run_gpunode(module, command + kube_args(module, kubeconfig.path))
    applied = [{"name": a.get("name"), "action": a.get("action")} for a in doc.get("applied") or []]
    finish(
        module,
        argv,
        rc,
        doc,
        stderr,
        msg=message(doc),
        diff=class_diffs(doc),
        extra={"applied": applied},
    )


if __name__ == "__main__":
    main()
