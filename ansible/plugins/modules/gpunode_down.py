#!/usr/bin/python
# Copyright: gpunode developers
# Apache-2.0
from __future__ import annotations

DOCUMENTATION = r"""
module: gpunode_down
short_description: Undo gpunode up on the target with gpunode down
description:
  - Runs C(gpunode down --json --yes) (plugin service, node capacity and labels, runtime configuration, and with
    I(toolkit) the toolkit); check mode adds C(--dry-run); diff mode shows each step that changes something.
options:
  toolkit:
    description: also remove nvidia-container-toolkit and its repository files
    type: bool
    default: false
  node:
    description: node name to withdraw from
    type: str
extends_documentation_fragment:
  - gpunode.gpunode.gpunode
  - ansible.builtin.action_common_attributes
  - gpunode.gpunode.gpunode.kube
attributes:
  check_mode:
    support: full
    details: 'C(--dry-run): gpunode plans, nothing is touched; C(changed) says whether the plan has something to
      undo'
  diff_mode:
    support: full
    details: each step that changes something, with gpunode's files, diffs and commands
author: gpunode developers (@gpunode)
"""

EXAMPLES = r"""
- gpunode.gpunode.gpunode_down:
    toolkit: true
"""

RETURN = r"""
gpunode:
  description: gpunode's document (gpunode.down/v1) with its steps
  returned: always
  type: dict
steps:
  description: name and status of each step
  returned: always
  type: list
"""

from ansible.module_utils.basic import AnsibleModule
from ansible_collections.gpunode.gpunode.plugins.module_utils.gpunode import (
    Kubeconfig,
    common_argument_spec,
    finish,
    kube_args,
    kube_argument_spec,
    run_gpunode,
    step_diffs,
)


def main():
    spec = common_argument_spec()
    spec.update(kube_argument_spec())
    spec.update(toolkit={"type": "bool", "default": False}, node={"type": "str"})
    module = AnsibleModule(
        argument_spec=spec,
        supports_check_mode=True,
        mutually_exclusive=[("kubeconfig", "kubeconfig_content")],
    )
    p = module.params
    command = ["down"]
    if p["toolkit"]:
        command.append("--toolkit")
    if p["node"]:
        command += ["--node", p["node"]]
    command.append("--yes")
    with Kubeconfig(module) as kubeconfig:
        argv, rc, doc, stderr = run_gpunode(module, command + kube_args(module, kubeconfig.path))
    steps = [{"name": s.get("name"), "status": s.get("status")} for s in doc.get("steps") or []]
    pending = [s["name"] for s in steps if s["status"] in ("to do", "done now")]
    if doc.get("dry_run"):
        msg = "would undo: {}".format(", ".join(pending)) if pending else "nothing to undo"
    else:
        msg = "undone: {}".format(", ".join(pending)) if pending else "nothing to undo"
    finish(module, argv, rc, doc, stderr, msg=msg, diff=step_diffs(doc), extra={"steps": steps})


if __name__ == "__main__":
    main()
