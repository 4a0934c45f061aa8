#!/usr/bin/python
# Copyright: gpunode developers
# Apache-2.0
from __future__ import annotations

DOCUMENTATION = r"""
module: gpunode_toolkit
short_description: Install or remove nvidia-container-toolkit with gpunode toolkit install|uninstall
description:
  - Runs C(gpunode toolkit install|uninstall --json --yes); check mode adds C(--dry-run), diff mode shows the repository
    files' diffs.
options:
  state:
    description: present installs, absent uninstalls
    type: str
    default: present
    choices:
      - present
      - absent
  version:
    description: pin the four packages to this version (default the newest; an installed one is kept)
    type: str
  repo_url:
    description: a mirror of NVIDIA's repositories
    type: str
  key_file:
    description: the signing key, from a file on the target
    type: path
  key_fingerprint:
    description: trust the key with this fingerprint instead of NVIDIA's
    type: str
  experimental:
    description: also enable the experimental repository
    type: bool
    default: false
extends_documentation_fragment:
  - gpunode.gpunode.gpunode
  - ansible.builtin.action_common_attributes
attributes:
  check_mode:
    support: full
    details: 'C(--dry-run): gpunode plans, nothing is touched; C(changed) says whether the plan has something to
      do'
  diff_mode:
    support: full
    details: the repository files' diffs and the package versions before and after
author: gpunode developers (@gpunode)
"""

EXAMPLES = r"""
- gpunode.gpunode.gpunode_toolkit:
    version: 1.17.8
"""

RETURN = r"""
gpunode:
  description: gpunode's document (gpunode.toolkit-install/v1 or toolkit-uninstall/v1)
  returned: always
  type: dict
version:
  description: the installed version after the run
  returned: always
  type: str
"""

from ansible.module_utils.basic import AnsibleModule
from ansible_collections.gpunode.gpunode.plugins.module_utils.gpunode import (
    common_argument_spec,
    file_diffs,
    finish,
    run_gpunode,
)


def main():
    spec = common_argument_spec()
    spec.update(
        state={"type": "str", "default": "present", "choices": ["present", "absent"]},
        version={"type": "str"},
        repo_url={"type": "str"},
        key_file={"type": "path"},
        key_fingerprint={"type": "str", "no_log": False},  # a public key's fingerprint, not a secret
        experimental={"type": "bool", "default": False},
    )
    module = AnsibleModule(argument_spec=spec, supports_check_mode=True)
    p = module.params
    if p["state"] == "absent":
        command = ["toolkit", "uninstall"]
    else:
        command = ["toolkit", "install"]
        for name, option in (
            ("version", "--version"),
            ("repo_url", "--repo-url"),
            ("key_file", "--key-file"),
            ("key_fingerprint", "--key-fingerprint"),
        ):
            if p[name]:
                command += [option, p[name]]
        if p["experimental"]:
            command.append("--experimental")
    command.append("--yes")
    argv, rc, doc, stderr = run_gpunode(module, command)
    packages = doc.get("packages") or {}
    diff = file_diffs(doc)
    if packages:
        # Which package versions are there now, and which the run wants (install) or leaves (uninstall).
        after = {
            name: (None if p["state"] == "absent" else (doc.get("wanted") or version))
            for name, version in packages.items()
        }
        diff.append(
            {
                "before_header": "packages",
                "after_header": "packages",
                "before": "".join(f"{n} {v}\n" for n, v in sorted(packages.items())),
                "after": "".join(f"{n} {v}\n" for n, v in sorted(after.items())),
            }
        )
    verb = "would be" if doc.get("dry_run") else ("is now" if doc.get("changed") else "is already")
    state = (
        "removed" if p["state"] == "absent" else "installed (%s)" % (doc.get("wanted") or doc.get("version"))
    )
    finish(
        module,
        argv,
        rc,
        doc,
        stderr,
        msg=f"nvidia-container-toolkit {verb} {state}",
        diff=diff,
        extra={"version": doc.get("version")},
        commands=True,
    )


if __name__ == "__main__":
    main()
