# Copyright: gpunode developers
# Apache-2.0
"""What every gpunode module shares: finding gpunode, running it with --json, and turning its one JSON
document (docs/json.md) into the module's result.

The modules never parse gpunode's human output: `changed`, the diffs and the error all come from the
document, so a module reports exactly what gpunode did (false on a second run, because gpunode itself
reports nothing to change).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import stat

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


# Where a parameter's text (config_content, kubeconfig_content) is put for one gpunode run: a directory
# only root may write in (/run), at a name that does not change from run to run. Not a random temp name:
# gpunode names the file it was given in what it writes (the header of a plugin.toml translated from
# NVIDIA's YAML), so a random name would rewrite that file on every run. Under `root` it is made inside the
# root, because gpunode reads every path under --root.
CONTENT_DIR = "/run/gpunode-ansible"


class ContentFile:
    """A parameter's text written to CONTENT_DIR/<param> (mode 0600, in a 0700 directory) for the length of
    one gpunode run, so gpunode gets a path, never the text as an argument.

    The directory is locked (flock) while the file exists, so two runs on one host take turns rather than
    overwrite each other's file; the last one out removes the directory.
    """

    def __init__(self, module, param):
        self.module = module
        self.param = param
        self.path = None  # the host path gpunode is given (inside --root)
        self._dir_fd = None
        self._directory = None

    def __enter__(self):
        content = self.module.params.get(self.param)
        if not content:
            return self
        root = self.module.params.get("root") or "/"
        run_dir = os.path.join(root, "run")
        # gpunode resolves links inside the root; Python would follow an absolute link out of it. Only a
        # plain directory is used, so both mean the same place.
        if not os.path.isdir(run_dir) or os.path.realpath(run_dir) != os.path.join(
            os.path.realpath(root), "run"
        ):
            self.module.fail_json(
                msg=f"{self.param}: {run_dir} is not a directory (or is a link); the text is given to "
                "gpunode as a file there",
                fix=f"create the directory {run_dir} (mode 0755, owned by root), or put the text in a file "
                "inside the root and give its path instead",
                rc=None,
            )
        self._directory = os.path.join(run_dir, os.path.basename(CONTENT_DIR))
        self._dir_fd = self._lock_directory()
        # O_NOFOLLOW: a link left in our private directory is refused, never written through.
        fd = os.open(
            self.param, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600, dir_fd=self._dir_fd
        )
        with os.fdopen(fd, "w") as handle:
            handle.write(content)
        self.path = f"{CONTENT_DIR}/{self.param}"
        return self

    def _lock_directory(self):
        directory = self._directory
        while True:
            with contextlib.suppress(FileExistsError):
                os.mkdir(directory, 0o700)
            try:
                fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
            except OSError as error:
                self.module.fail_json(
                    msg=f"{self.param}: {directory} cannot be used: {error.strerror}",
                    fix=f"remove {directory} (gpunode's Ansible modules make it, private to root, for a run)",
                    rc=None,
                )
            fcntl.flock(fd, fcntl.LOCK_EX)
            held = os.fstat(fd)
            try:
                now = os.lstat(directory)
            except FileNotFoundError:
                now = None
            if now is not None and (now.st_dev, now.st_ino) == (held.st_dev, held.st_ino):
                break
            # The run before us removed the directory while we waited for its lock: make it again.
            os.close(fd)
        if held.st_uid != os.geteuid() or stat.S_IMODE(held.st_mode) & 0o077:
            os.close(fd)
            self.module.fail_json(
                msg=f"{self.param}: {directory} is not private to this user (owner uid {held.st_uid}, "
                f"mode {stat.S_IMODE(held.st_mode):04o}): another user could read or replace the text "
                "given to gpunode",
                fix=f"remove {directory} (gpunode's Ansible modules make it, private to root, for one run)",
                rc=None,
            )
        return fd

    def __exit__(self, *exc):
        if self._dir_fd is None:
            return False
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.param, dir_fd=self._dir_fd)
        # Empty now, unless another run of ours waits for the lock: it notices and makes it again.
        with contextlib.suppress(OSError):
            os.rmdir(self._directory)
        os.close(self._dir_fd)  # releases the lock
        self._dir_fd = None
        return False


def Kubeconfig(module):  # named like the class it returns: `with Kubeconfig(module) as kubeconfig`
    return ContentFile(module, "kubeconfig_content")


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
    to do, a patch for the Node, an API object to create or update (dra classes); with `commands`, any
    command it would run (toolkit: the package manager's, which it plans only when packages are missing or
    at another version)."""
    if any(f.get("action") not in (None, "unchanged") for f in document.get("files") or []):
        return True
    if document.get("remove") or document.get("status_patch") or document.get("node_patch"):
        return True
    if any(s.get("status") == "to do" for s in document.get("steps") or []):
        return True
    # dra classes: a DeviceClass to create or update.
    if any(a.get("action") not in (None, "unchanged") for a in document.get("applied") or []):
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


def _inside_root(root, path):
    """The local path of host `path` under `root`, with every link resolved inside the root as gpunode
    resolves it (an absolute link target means the root's own file, not this machine's)."""
    real_root = os.path.realpath(root)
    parts = [p for p in path.split("/") if p]
    current = real_root
    hops = 0
    while parts:
        part = parts.pop(0)
        if part == "..":
            current = os.path.dirname(current) if current != real_root else real_root
            continue
        if part == ".":
            continue
        candidate = os.path.join(current, part)
        if os.path.islink(candidate):
            hops += 1
            if hops > 40:
                return None
            target = os.readlink(candidate)
            if target.startswith("/"):
                current = real_root
            parts = [p for p in target.split("/") if p] + parts
            continue
        current = candidate
    return current


def read_files(module, paths):
    """{path: text or None} for host paths as they are now (under `root`): the "before" of a diff, read
    before gpunode runs. None for a file that is not there or cannot be read as text."""
    root = module.params.get("root") or "/"
    texts = {}
    for path in paths:
        local = _inside_root(root, path)
        try:
            with open(local, encoding="utf-8") as handle:
                texts[path] = handle.read()
        except (OSError, TypeError, UnicodeDecodeError):
            texts[path] = None
    return texts


def file_diffs(document, before=None):
    """Ansible diff entries for the files a document lists: gpunode's own unified diffs (configure-runtime,
    toolkit) as `prepared`; whole contents (plugin install, uninstall) as before/after, the before being the
    file as `before` (read_files, taken before the run) found it."""
    before = before or {}
    diffs = []
    for entry in document.get("files") or []:
        action = entry.get("action")
        if action in (None, "unchanged"):
            continue
        path = entry.get("path", "")
        if entry.get("diff"):
            diffs.append({"prepared": entry["diff"]})
        elif "content" in entry:
            diffs.append(
                {
                    "before_header": path,
                    "after_header": path,
                    "before": before.get(path) or "",
                    "after": entry["content"],
                }
            )
        else:
            diffs.append({"prepared": f"{path}: {action}\n"})
    for path in document.get("remove") or []:
        diffs.append(
            {
                "before_header": path,
                "after_header": f"{path} (removed)",
                "before": before.get(path) or "",
                "after": "",
            }
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
