# Copyright: gpunode developers
# Apache-2.0
"""What every gpunode module shares: finding gpunode, running it with --json, and turning its one JSON
document (docs/json.md) into the module's result.

The modules never parse gpunode's human output: `changed`, the diffs and the error all come from the
document, so a module reports exactly what gpunode did (false on a second run, because gpunode itself
reports nothing to change).
"""

from __future__ import annotations

import json
import os
import tempfile

# Where install.sh puts the command (its link, and the virtualenv behind it), after PATH.
SEARCH_DIRS = ["/usr/local/bin", "/opt/gpunode/bin"]


def common_argument_spec():
    return {
        "gpunode_path": {"type": "path"},
        "root": {"type": "path"},
    }


def kube_argument_spec():
    """The API options of node/up/down. The kubeconfig itself (content) is a secret: no_log keeps it out
    of every log and result. A kubeconfig path names where the secret is, not the secret, so it is shown
    (an operator must be able to see which file a failing run used)."""
    return {
        "kubeconfig": {"type": "path"},
        "kubeconfig_content": {"type": "str", "no_log": True},
        "context": {"type": "str"},
        "server": {"type": "str"},
        "request_timeout": {"type": "str"},
    }


def find_gpunode(module):
    path = module.params.get("gpunode_path")
    if path:
        if not (os.path.isfile(path) and os.access(path, os.X_OK)):
            module.fail_json(msg=f"gpunode_path {path} is not an executable file", rc=None)
        return path
    found = module.get_bin_path("gpunode", required=False, opt_dirs=SEARCH_DIRS)
    if not found:
        module.fail_json(
            msg="gpunode is not installed on this host (not on PATH, nor in {})".format(
                ", ".join(SEARCH_DIRS)
            ),
            fix="install it with ./install.sh from the gpunode checkout, or set gpunode_path",
            rc=None,
        )
    return found


class ContentFile:
    """A parameter's text (kubeconfig_content, a plugin config_content) written to a private temp file on
    the target for the length of one gpunode run, so gpunode gets a path, never the text as an argument."""

    def __init__(self, module, param, prefix):
        self.module = module
        self.param = param
        self.prefix = prefix
        self.path = None

    def __enter__(self):
        content = self.module.params.get(self.param)
        if content:
            # mkstemp makes it 0600: only root (the module's user) can read it.
            fd, self.path = tempfile.mkstemp(prefix=self.prefix)
            with os.fdopen(fd, "w") as handle:
                handle.write(content)
        return self

    def __exit__(self, *exc):
        if self.path:
            os.unlink(self.path)
        return False


def Kubeconfig(module):  # named like the class it returns: `with Kubeconfig(module) as kubeconfig`
    return ContentFile(module, "kubeconfig_content", "gpunode-kubeconfig-")


def kube_args(module, kubeconfig_file=None):
    params = module.params
    args = []
    if kubeconfig_file:
        args += ["--kubeconfig", kubeconfig_file]
    elif params.get("kubeconfig"):
        args += ["--kubeconfig", params["kubeconfig"]]
    for name, option in (
        ("context", "--context"),
        ("server", "--server"),
        ("request_timeout", "--request-timeout"),
    ):
        if params.get(name):
            args += [option, params[name]]
    return args


def run_gpunode(module, command, *, changes=True):
    """Run `gpunode [--root R] COMMAND... --json [--dry-run]`; return (argv, rc, document, stderr).

    `command` is an argument list: no shell, so a value can never become a second command. In check mode
    a command that changes something gets --dry-run (gpunode's plan: changed is false, nothing touched);
    a read-only command simply runs. Fails the module when no document came back.
    """
    argv = [find_gpunode(module)]
    if module.params.get("root"):
        argv += ["--root", module.params["root"]]
    argv += [*list(command), "--json"]
    if changes and module.check_mode:
        argv.append("--dry-run")
    # NO_COLOR: no terminal escapes in the messages a result carries. A UTF-8 locale: paths and messages
    # that are not ASCII survive the way through run_command.
    rc, stdout, stderr = module.run_command(
        argv, check_rc=False, environ_update={"NO_COLOR": "1", "LANG": "C.UTF-8"}
    )
    try:
        document = json.loads(stdout)
    except ValueError:
        document = None
    if not isinstance(document, dict) or "schema" not in document:
        module.fail_json(
            msg=f"gpunode printed no JSON document (exit status {rc}): {(stderr or stdout).strip()[-2000:]}",
            rc=rc,
            cmd=argv,
            stderr=stderr,
        )
    return argv, rc, document, stderr


def would_change(document, *, commands=False):
    """Whether a plan (a --dry-run document) changes something: a file it writes or removes, a step still
    to do, a patch for the Node; with `commands`, any command it would run (toolkit: the package manager's,
    which it plans only when packages are missing or at another version)."""
    if any(f.get("action") not in (None, "unchanged") for f in document.get("files") or []):
        return True
    if document.get("remove") or document.get("status_patch") or document.get("node_patch"):
        return True
    if any(s.get("status") == "to do" for s in document.get("steps") or []):
        return True
    return bool(commands and document.get("commands"))


def finish(
    module, argv, rc, document, stderr, *, msg, diff=None, extra=None, fail_unless=None, commands=False
):
    """exit_json/fail_json with what every module returns: changed, msg, rc, the command line, the document
    under `gpunode`, and on failure gpunode's error message and fix.

    changed is gpunode's own, except for a plan: gpunode's --dry-run documents say changed=false (nothing
    was changed), while Ansible's check mode reports changed=true for what *would* change.
    """
    changed = bool(document.get("changed"))
    if document.get("dry_run") and not document.get("error"):
        changed = would_change(document, commands=commands)
    result = {
        "changed": changed,
        "rc": rc,
        "cmd": argv,
        "gpunode": document,
    }
    if extra:
        result.update(extra)
    if diff is not None and module._diff:
        result["diff"] = diff
    error = document.get("error")
    if error:
        result.update(
            msg=error.get("message") or "gpunode failed",
            fix=error.get("fix"),
            exit_code=error.get("exit_code", rc),
            stderr=stderr,
        )
        module.fail_json(**result)
    if fail_unless is not None:
        result.update(msg=fail_unless, stderr=stderr)
        module.fail_json(**result)
    # A non-zero status with error null is a finding (doctor: unhealthy), not a failure: the caller
    # decides with fail_unless whether it fails the task. Ansible fails any result whose rc is not 0
    # unless it says failed=false itself.
    result.update(msg=msg, failed=False)
    module.exit_json(**result)


def file_diffs(document):
    """Ansible diff entries for the files a document lists: gpunode's own unified diffs (configure-runtime,
    toolkit) as `prepared`, and whole file contents (plugin install) as before/after."""
    diffs = []
    for entry in document.get("files") or []:
        action = entry.get("action")
        if action in (None, "unchanged"):
            continue
        path = entry.get("path", "")
        if entry.get("diff"):
            diffs.append({"prepared": entry["diff"]})
        elif "content" in entry:
            # plugin install: a new file has no before; a replaced one's old content is not in the
            # document, so the header says so instead of showing a wrong "before".
            before = "" if action == "create" else f"(previous content of {path})\n"
            diffs.append(
                {"before_header": path, "after_header": path, "before": before, "after": entry["content"]}
            )
        else:
            diffs.append({"prepared": f"{path}: {action}\n"})
    for path in document.get("remove") or []:
        diffs.append(
            {"before_header": path, "after_header": f"{path} (removed)", "before": f"{path}\n", "after": ""}
        )
    return diffs


def step_diffs(document):
    """up/down: each step that changes something (or would), with the files, diffs and commands gpunode
    listed for it."""
    diffs = []
    for step in document.get("steps") or []:
        if step.get("status") not in ("to do", "done now"):
            continue
        lines = ["# {}: {} ({})".format(step.get("name"), step.get("summary"), step.get("status"))]
        lines += step.get("details") or []
        diffs.append({"prepared": "\n".join(lines) + "\n"})
    return diffs
