#!/usr/bin/python
# Copyright: gpunode developers
# Apache-2.0
from __future__ import annotations

DOCUMENTATION = r"""
module: gpunode_runtime
short_description: Add the NVIDIA runtime to containerd, docker or CRI-O with gpunode configure-runtime
description:
  - Runs C(gpunode configure-runtime ... --json --yes) on the target and reports what gpunode's document says.
  - Check mode runs it with C(--dry-run); diff mode shows gpunode's unified diff of every file.
options:
  runtime:
    description: docker, containerd or crio. Default, gpunode's choice (the one kubelet uses).
    type: str
    choices:
      - docker
      - containerd
      - crio
  state:
    description: C(present) configures, C(reverted) puts back the file as it was (C(--revert)), C(absent) takes
      the runtime out of configuration gpunode did not write (C(--remove)). Where there is nothing to undo (no change
      of gpunode's to revert, no nvidia runtime to remove), the wanted state is there, so the task is ok with C(changed=false).
    type: str
    default: present
    choices:
      - present
      - reverted
      - absent
  config:
    description: the configuration file (C(--config))
    type: path
  set_as_default:
    description: make it the default runtime
    type: bool
    default: false
  cdi:
    description: enable CDI where the runtime supports it
    type: bool
    default: false
  runtime_path:
    description: the nvidia-container-runtime binary
    type: path
  runtime_name:
    description: the runtime's name (default nvidia)
    type: str
  drop_in:
    description: containerd/CRI-O drop-in file to write
    type: path
  in_place:
    description: edit the main file itself
    type: bool
    default: false
  restart:
    description: restart the runtime and check it came back; default gpunode's (on, unless config points elsewhere)
    type: bool
  root:
    description: gpunode's C(--root) (an image or chroot)
    type: path
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
    details: gpunode's unified diff of every file it writes
author: gpunode developers (@gpunode)
"""

EXAMPLES = r"""
- name: NVIDIA runtime in containerd
  gpunode.gpunode.gpunode_runtime:
    runtime: containerd
    set_as_default: true
"""

RETURN = r"""
gpunode:
  description: gpunode's JSON document (schema gpunode.configure-runtime/v1)
  returned: always
  type: dict
rc:
  description: gpunode's exit status
  returned: always
  type: int
cmd:
  description: the argument list gpunode ran with
  returned: always
  type: list
fix:
  description: gpunode's fix for the error
  returned: failure
  type: str
restart_pending:
  description: the runtime still has to be restarted for the change to take effect
  returned: always
  type: bool
"""

from ansible.module_utils.basic import AnsibleModule
from ansible_collections.gpunode.gpunode.plugins.module_utils.gpunode import (
    common_argument_spec,
    file_diffs,
    finish,
    run_gpunode,
)

# gpunode's --revert and --remove end with exit status 6 (not found) and a message ending like this when
# there is nothing to undo; other exit-6 errors (a --config file that does not exist) end otherwise. The
# document has no field of its own for it, so the message is what tells them apart.
NOTHING_TO_UNDO = (": nothing to revert", ": nothing to remove")


def nothing_to_undo(document):
    error = document.get("error") or {}
    message = error.get("message") or ""
    return error.get("exit_code") == 6 and message.endswith(NOTHING_TO_UNDO)


def main():
    spec = common_argument_spec()
    spec.update(
        runtime={"type": "str", "choices": ["docker", "containerd", "crio"]},
        state={"type": "str", "default": "present", "choices": ["present", "reverted", "absent"]},
        config={"type": "path"},
        set_as_default={"type": "bool", "default": False},
        cdi={"type": "bool", "default": False},
        runtime_path={"type": "path"},
        runtime_name={"type": "str"},
        drop_in={"type": "path"},
        in_place={"type": "bool", "default": False},
        restart={"type": "bool"},
    )
    module = AnsibleModule(
        argument_spec=spec, supports_check_mode=True, mutually_exclusive=[("drop_in", "in_place")]
    )
    p = module.params
    command = ["configure-runtime"]
    if p["runtime"]:
        command.append(p["runtime"])
    if p["state"] == "reverted":
        command.append("--revert")
    elif p["state"] == "absent":
        command.append("--remove")
    for name, option in (
        ("config", "--config"),
        ("runtime_path", "--runtime-path"),
        ("runtime_name", "--runtime-name"),
        ("drop_in", "--drop-in"),
    ):
        if p[name]:
            command += [option, p[name]]
    for name, option in (
        ("set_as_default", "--set-as-default"),
        ("cdi", "--cdi"),
        ("in_place", "--in-place"),
    ):
        if p[name]:
            command.append(option)
    if p["restart"] is not None:
        command.append("--restart" if p["restart"] else "--no-restart")
    # --yes: the restart is what a play asks for; under --json gpunode would refuse to ask instead.
    command.append("--yes")
    argv, rc, doc, stderr = run_gpunode(module, command)
    if p["state"] in ("reverted", "absent") and nothing_to_undo(doc):
        # The wanted state (no change of gpunode's, no nvidia runtime) is already there: that is ok, not a
        # failure, and nothing changed. gpunode's document is returned as it is.
        module.exit_json(
            changed=False,
            failed=False,
            rc=rc,
            cmd=argv,
            gpunode=doc,
            restart_pending=False,
            msg="already {}: {}".format(p["state"], doc["error"]["message"]),
        )
    files = [f["path"] for f in doc.get("files") or [] if f.get("action") != "unchanged"]
    if doc.get("dry_run"):
        msg = "would change {}".format(", ".join(files)) if files else "nothing to change"
    elif doc.get("changed"):
        msg = "changed {}".format(", ".join(files)) if files else "changed"
    else:
        msg = "%s is already configured" % (doc.get("runtime") or "the runtime")
    finish(
        module,
        argv,
        rc,
        doc,
        stderr,
        msg=msg,
        diff=file_diffs(doc),
        extra={"restart_pending": bool(doc.get("restart_pending"))},
    )


if __name__ == "__main__":
    main()
