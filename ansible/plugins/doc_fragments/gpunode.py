# Copyright: gpunode developers
# Apache-2.0
from __future__ import annotations


class ModuleDocFragment:
    """What every gpunode module documents alike: each runs the gpunode command on the target and reads its
    --json document, so the options that find and point that command, what the target needs, and how the
    result is read are the same text in all of them (a module's own option or attribute of the same name
    still wins over the fragment's, as Ansible merges fragments).

    A module lists this fragment before ansible.builtin.action_common_attributes: Ansible merges fragments in
    order and what is already there wins, and that one says `support: N/A` for platform."""

    DOCUMENTATION = r"""
options:
  gpunode_path:
    description: the gpunode command; default PATH, then /usr/local/bin and /opt/gpunode/bin
    type: path
  root:
    description: gpunode's C(--root)
    type: path
attributes:
  platform:
    support: full
    platforms: posix
    details: Linux targets where gpunode runs (Debian, Ubuntu, RHEL and compatible, SUSE)
requirements:
  - gpunode on the target (C(./install.sh) from the gpunode checkout), found on PATH, in /usr/local/bin or
    /opt/gpunode/bin, or given as I(gpunode_path)
  - root on the target (C(become)) for anything but check mode, as gpunode itself requires
notes:
  - The module reads gpunode's one C(--json) document (docs/json.md), never its text; C(changed) is
    gpunode's own, so a second run with the same arguments reports C(changed=false) and writes nothing.
  - On failure the result carries gpunode's C(msg), C(fix) and C(exit_code), and the whole document under
    C(gpunode).
"""

    # The modules that talk to the Kubernetes API (up, down, node): how they reach it, as gpunode's own flags.
    KUBE = r"""
options:
  kubeconfig:
    description: 'kubeconfig file on the target (default gpunode''s search: $KUBECONFIG, ~/.kube/config,
      kubelet.conf, k3s/RKE2''s, in-cluster)'
    type: path
  kubeconfig_content:
    description: 'the kubeconfig itself (a secret: never logged or returned); written for the run to a file
      private to root (/run/gpunode-ansible, under root with I(root)) and removed'
    type: str
  context:
    description: kubeconfig context
    type: str
  server:
    description: API server URL overriding the kubeconfig's
    type: str
  request_timeout:
    description: 'per-request timeout, as kubectl: 30, 10s, 1m'
    type: str
"""
