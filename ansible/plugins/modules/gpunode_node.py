#!/usr/bin/python
# Copyright: gpunode developers
# Apache-2.0
from __future__ import annotations

DOCUMENTATION = r"""
module: gpunode_node
short_description: Advertise or withdraw this node's GPUs through the Kubernetes API
description:
  - Runs C(gpunode node advertise|withdraw --json); check mode adds C(--dry-run) (gpunode reads the Node and prints
    the patches); diff mode shows the capacity and labels before and after.
options:
  state:
    description: advertised sets capacity and labels, withdrawn removes what gpunode advertised
    type: str
    default: advertised
    choices:
      - advertised
      - withdrawn
  node:
    description: the Node's name (default gpunode's, the kubelet's or host name)
    type: str
  resource:
    description: extended resource name
    type: str
  count:
    description: capacity to advertise (default the GPUs NVML reports)
    type: int
  labels:
    description: set the GPU feature discovery labels
    type: bool
  capacity:
    description: patch the extended-resource capacity
    type: bool
extends_documentation_fragment:
  - gpunode.gpunode.gpunode
  - ansible.builtin.action_common_attributes
  - gpunode.gpunode.gpunode.kube
attributes:
  check_mode:
    support: full
    details: 'C(--dry-run): gpunode reads the Node and plans the patches, none is sent'
  diff_mode:
    support: full
    details: the capacity and labels before and after
author: gpunode developers (@gpunode)
"""

EXAMPLES = r"""
- gpunode.gpunode.gpunode_node:
    kubeconfig_content: "{{ lookup('file', 'admin.kubeconfig') }}"
"""

RETURN = r"""
gpunode:
  description: gpunode's document (gpunode.node-advertise/v1 or node-withdraw/v1)
  returned: always
  type: dict
"""

from ansible.module_utils.basic import AnsibleModule
from ansible_collections.gpunode.gpunode.plugins.module_utils.gpunode import (
    Kubeconfig,
    common_argument_spec,
    finish,
    kube_args,
    kube_argument_spec,
    run_gpunode,
)


def main():
    spec = common_argument_spec()
    spec.update(kube_argument_spec())
    spec.update(
        state={"type": "str", "default": "advertised", "choices": ["advertised", "withdrawn"]},
        node={"type": "str"},
        resource={"type": "str"},
        count={"type": "int"},
        labels={"type": "bool"},
        capacity={"type": "bool"},
    )
    module = AnsibleModule(
        argument_spec=spec,
        supports_check_mode=True,
        mutually_exclusive=[("kubeconfig", "kubeconfig_content")],
    )
    p = module.params
    command = ["node", "withdraw" if p["state"] == "withdrawn" else "advertise"]
    if p["node"]:
        command += ["--node", p["node"]]
    if p["resource"]:
        command += ["--resource", p["resource"]]
    if p["state"] == "advertised":
        if p["count"] is not None:
            command += ["--count", str(p["count"])]
        for name in ("labels", "capacity"):
            if p[name] is not None:
                command.append(f"--{name}" if p[name] else f"--no-{name}")
    with Kubeconfig(module) as kubeconfig:
        argv, rc, doc, stderr = run_gpunode(module, command + kube_args(module, kubeconfig.path))
    resource = doc.get("resource") or p["resource"] or "nvidia.com/gpu"
    before = {"capacity": {resource: doc.get("capacity_before")}}
    after = {
        "capacity": {resource: doc.get("count")} if p["state"] == "advertised" else {},
        "labels_set": doc.get("labels_set") or {},
        "labels_removed": doc.get("labels_removed") or [],
    }
    verb = "would be" if doc.get("dry_run") else ("is now" if doc.get("changed") else "is already")
    msg = "node {} {} {}".format(doc.get("node"), verb, p["state"])
    finish(module, argv, rc, doc, stderr, msg=msg, diff={"before": before, "after": after})


if __name__ == "__main__":
    main()
