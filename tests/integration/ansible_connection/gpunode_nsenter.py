"""An Ansible connection into a machine on this host: every command runs in all the namespaces of the
machine's PID 1 (`nsenter -t PID -a`), so it sees that machine's root, mounts, processes and systemd, as
sshd inside it would give it. Files go in and out through the same nsenter (`cat`), never through the
host's view of the machine, so mounts inside it (the checkout's binds) are honoured.

For the fleet test (tests/integration/test_ansible_fleet.py), where the machines are systemd-nspawn
containers with private networks: no sshd, no addresses, no outside network. Inventory::

    node1 ansible_connection=gpunode_nsenter ansible_host=<PID of the machine's PID 1 on this host>

Ansible finds it through ANSIBLE_CONNECTION_PLUGINS=<this directory>.
"""

from __future__ import annotations

import subprocess
from typing import Any

from ansible.errors import AnsibleConnectionFailure, AnsibleError
from ansible.plugins.connection import ConnectionBase

DOCUMENTATION = """
name: gpunode_nsenter
short_description: run commands in a local machine's namespaces with nsenter
description:
  - Runs each command with C(nsenter -t PID -a) in the namespaces of a process on this host (the PID 1 of
    a systemd-nspawn machine); files are copied in and out through C(cat) in the same namespaces.
options:
  remote_addr:
    description: the PID (on this host) of the machine's PID 1
    default: inventory_hostname
    vars:
      - name: ansible_host
  path:
    description: PATH of the commands run inside (a clean environment, not the controller's)
    default: /usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin
    vars:
      - name: ansible_nsenter_path
"""

TIMEOUT = 600  # one module run (a containerd restart included) on a loaded 2-core machine


class Connection(ConnectionBase):  # type: ignore[misc]  # ansible-core ships no type information
    transport = "gpunode_nsenter"
    has_pipelining = True  # the module goes to the interpreter's stdin: no temp file per task
    has_tty = False
    default_user = "root"
    _connected: bool  # set by ConnectionBase
    _pid: str

    def _connect(self) -> Connection:
        if not self._connected:
            pid = str(self.get_option("remote_addr"))
            if not pid.isdigit():
                raise AnsibleConnectionFailure(f"ansible_host must be a PID (the machine's PID 1): {pid!r}")
            try:
                with open(f"/proc/{pid}/comm") as comm:
                    comm.read()
            except OSError as error:
                raise AnsibleConnectionFailure(f"no process {pid} on this host: {error}") from error
            self._pid = pid
            self._connected = True
        return self

    def _nsenter(self, argv: list[str]) -> list[str]:
        return ["nsenter", "-t", self._pid, "-a", "--", *argv]

    def _env(self) -> dict[str, str]:
        return {"PATH": str(self.get_option("path")), "LANG": "C.UTF-8", "HOME": "/root"}

    def exec_command(self, cmd: str, in_data: bytes | None = None, sudoable: bool = True) -> Any:
        super().exec_command(cmd, in_data=in_data, sudoable=sudoable)
        self._connect()
        process = subprocess.run(
            self._nsenter(["/bin/sh", "-c", cmd]),
            input=in_data,
            capture_output=True,
            env=self._env(),
            timeout=TIMEOUT,
            check=False,
        )
        return process.returncode, process.stdout, process.stderr

    def put_file(self, in_path: str, out_path: str) -> None:
        super().put_file(in_path, out_path)
        self._connect()
        with open(in_path, "rb") as source:
            process = subprocess.run(
                self._nsenter(["/bin/sh", "-c", 'cat > "$1"', "sh", out_path]),
                stdin=source,
                capture_output=True,
                env=self._env(),
                timeout=TIMEOUT,
                check=False,
            )
        if process.returncode != 0:
            raise AnsibleError(f"could not write {out_path}: {process.stderr.decode(errors='replace')}")

    def fetch_file(self, in_path: str, out_path: str) -> None:
        super().fetch_file(in_path, out_path)
        self._connect()
        with open(out_path, "wb") as target:
            process = subprocess.run(
                self._nsenter(["cat", "--", in_path]),
                stdout=target,
                stderr=subprocess.PIPE,
                env=self._env(),
                timeout=TIMEOUT,
                check=False,
            )
        if process.returncode != 0:
            raise AnsibleError(f"could not read {in_path}: {process.stderr.decode(errors='replace')}")

    def close(self) -> None:
        self._connected = False
