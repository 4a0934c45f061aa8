#!/usr/bin/python
# Copyright: gpunode developers
# Apache-2.0
from __future__ import annotations

DOCUMENTATION = r"""
module: gpunode_plugin
short_description: Install or uninstall gpunode's device plugin service
description:
  - Runs C(gpunode plugin install|uninstall --json); check mode adds C(--dry-run); diff mode shows the unit and
    config files written and the files removed.
options:
  state:
    description: present installs (and starts) the service, absent stops and removes it
    type: str
    default: present
    choices:
      - present
      - absent
  config:
    description: a plugin config on the target to install as /etc/gpunode/plugin.toml (gpunode's TOML or NVIDIA's
      device-plugin config)
    type: path
  config_content:
    description: 'the plugin config''s text instead (e.g. from a template): given to gpunode as the file /run/gpunode-ansible/config_content
      (under I(root) with root), so check mode plans with it and a second run changes nothing'
    type: str
  start:
    description: start the service now (false installs and enables it only)
    type: bool
    default: true
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
    details: 'the unit and config files: their real text on the target before, and what gpunode writes; a removed
      file''s text'
author: gpunode developers (@gpunode)
"""

EXAMPLES = r"""
- gpunode.gpunode.gpunode_plugin:
    config: /etc/gpunode/plugin-src.toml
"""

RETURN = r"""
gpunode:
  description: gpunode's document (gpunode.plugin-install/v1 or plugin-uninstall/v1)
  returned: always
  type: dict
"""

from ansible.module_utils.basic import AnsibleModule
from ansible_collections.gpunode.gpunode.plugins.module_utils.gpunode import (
    ContentFile,
    common_argument_spec,
    file_diffs,
    finish,
    read_files,
    run_gpunode,
)

# Every file plugin install writes and plugin uninstall removes (gpunode/systemd/service.py): read before the
# run, they are the diff's real "before".
FILES = (
    "/etc/systemd/system/gpunode-device-plugin.service",
    "/etc/gpunode/plugin.toml",
    "/etc/systemd/system/gpunode-doctor-metrics.service",
    "/etc/systemd/system/gpunode-doctor-metrics.timer",
)


def main():
    spec = common_argument_spec()
    spec.update(
        state={"type": "str", "default": "present", "choices": ["present", "absent"]},
        config={"type": "path"},
        config_content={"type": "str"},
        start={"type": "bool", "default": True},
    )
    module = AnsibleModule(
        argument_spec=spec, supports_check_mode=True, mutually_exclusive=[("config", "config_content")]
    )
    p = module.params
    if p["state"] == "absent":
        command = ["plugin", "uninstall"]
    else:
        command = ["plugin", "install"]
        if not p["start"]:
            command.append("--no-start")
    before = read_files(module, FILES) if module._diff else {}
    with ContentFile(module, "config_content") as content:
        config = content.path or p["config"]
        if p["state"] == "present" and config:
            command += ["--config", config]
        argv, rc, doc, stderr = run_gpunode(module, command)
    verb = "would be" if doc.get("dry_run") else ("is now" if doc.get("changed") else "is already")
    msg = "the device plugin service {} {}".format(verb, "removed" if p["state"] == "absent" else "installed")
    finish(module, argv, rc, doc, stderr, msg=msg, diff=file_diffs(doc, before))


if __name__ == "__main__":
    main()
