#!/usr/bin/python
# Copyright: gpunode developers
# Apache-2.0
from __future__ import annotations

DOCUMENTATION = r"""
module: gpunode_up
short_description: Make the target a working GPU node with gpunode up
description:
  - Runs C(gpunode up --json --yes) (preflight, toolkit, container runtime, device plugin, labels); check mode adds
    C(--dry-run) and returns the plan; diff mode shows each step that changes something with its files, diffs and
    commands.
options:
  toolkit_version:
    description: pin nvidia-container-toolkit
    type: str
  repo_url:
    description: mirror of NVIDIA's repositories
    type: str
  key_file:
    description: the repositories' signing key, from a file on the target
    type: path
  key_fingerprint:
    description: trust this key instead of NVIDIA's
    type: str
  runtime:
    description: container runtime to configure
    type: str
    choices:
      - docker
      - containerd
      - crio
  plugin_config:
    description: device plugin config on the target to install
    type: path
  labels:
    description: set the GPU labels (needs API credentials)
    type: bool
  node:
    description: node name for the labels
    type: str
  cdi:
    description: also turn CDI on and keep gpunode's CDI spec current
    type: bool
    default: false
extends_documentation_fragment:
  - gpunode.gpunode.gpunode
  - ansible.builtin.action_common_attributes
  - gpunode.gpunode.gpunode.kube
attributes:
  check_mode:
    support: full
    details: 'C(--dry-run): gpunode plans, nothing is touched; C(changed) says whether the plan has something to
      do'
  diff_mode:
    support: full
    details: each step that changes something, with gpunode's files, diffs and commands
author: gpunode developers (@gpunode)
"""

EXAMPLES = r"""
- gpunode.gpunode.gpunode_up:
    runtime: containerd
    toolkit_version: 1.17.8
"""

RETURN = r"""
gpunode:
  description: gpunode's document (gpunode.up/v1) with its steps
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
    spec.update(
        toolkit_version={"type": "str"},
        repo_url={"type": "str"},
        key_file={"type": "path"},
        key_fingerprint={"type": "str", "no_log": False},  # a public key's fingerprint, not a secret
        runtime={"type": "str", "choices": ["docker", "containerd", "crio"]},
        plugin_config={"type": "path"},
        labels={"type": "bool"},
        node={"type": "str"},
        cdi={"type": "bool", "default": False},
    )
    module = AnsibleModule(
        argument_spec=spec,
        supports_check_mode=True,
        mutually_exclusive=[("kubeconfig", "kubeconfig_content")],
    )
    p = module.params
    command = ["up"]
    for name, option in (
        ("toolkit_version", "--toolkit-version"),
        ("repo_url", "--repo-url"),
        ("key_file", "--key-file"),
        ("key_fingerprint", "--key-fingerprint"),
        ("runtime", "--runtime"),
        ("plugin_config", "--plugin-config"),
        ("node", "--node"),
    ):
        if p[name]:
            command += [option, p[name]]
    if p["labels"] is not None:
        command.append("--labels" if p["labels"] else "--no-labels")
    if p["cdi"]:
        command.append("--cdi")
    command.append("--yes")
    with Kubeconfig(module) as kubeconfig:
        argv, rc, doc, stderr = run_gpunode(module, command + kube_args(module, kubeconfig.path))
    steps = [{"name": s.get("name"), "status": s.get("status")} for s in doc.get("steps") or []]
    pending = [s["name"] for s in steps if s["status"] in ("to do", "done now")]
    if doc.get("dry_run"):
        msg = "would do: {}".format(", ".join(pending)) if pending else "nothing to do"
    else:
        msg = "done: {}".format(", ".join(pending)) if pending else "already a GPU node: nothing to do"
    finish(module, argv, rc, doc, stderr, msg=msg, diff=step_diffs(doc), extra={"steps": steps})


if __name__ == "__main__":
    main()
