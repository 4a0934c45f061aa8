"""Plan the changes to Docker's daemon.json that add the nvidia runtime (merged into the user's file)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from gpunode.errors import ConfigError, UsageError
from gpunode.host import Host
from gpunode.runtimes import docker, probe
from gpunode.runtimes.edits import Editor, JsonFormat
from gpunode.runtimes.plan import ConfigureOptions, FileChange, RuntimePlan

UNIT = "docker.service"
# The newest dockerd gpunode is tested with (26 and 28): what a file is judged by when R has no dockerd.
NEWEST_DOCKERD = (28, 0)
SOCKET = "/var/run/docker.sock"

# daemon.json directives dockerd 20.10-22 knows: its flags, under their plural names where a flag takes a
# list, plus the file-only keys. dockerd refuses to start on any other top-level key. Releases from 23 on
# add keys and can judge a file themselves (`dockerd --validate`), so for them gpunode asks dockerd.
KNOWN_DIRECTIVES = frozenset(
    [
        "allow-nondistributable-artifacts",
        "api-cors-header",
        "authorization-plugins",
        "bip",
        "bridge",
        "builder",
        "cgroup-parent",
        "cluster-advertise",
        "cluster-store",
        "cluster-store-opts",
        "containerd",
        "containerd-namespace",
        "containerd-plugins-namespace",
        "cpu-rt-period",
        "cpu-rt-runtime",
        "cri-containerd",
        "data-root",
        "debug",
        "default-address-pools",
        "default-cgroupns-mode",
        "default-gateway",
        "default-gateway-v6",
        "default-ipc-mode",
        "default-runtime",
        "default-shm-size",
        "default-ulimits",
        "deprecated-key-path",
        "disable-legacy-registry",
        "dns",
        "dns-opts",
        "dns-search",
        "exec-opts",
        "exec-root",
        "experimental",
        "features",
        "fixed-cidr",
        "fixed-cidr-v6",
        "graph",
        "group",
        "host-gateway-ip",
        "hosts",
        "icc",
        "init",
        "init-path",
        "insecure-registries",
        "ip",
        "ip-forward",
        "ip-masq",
        "ip6tables",
        "iptables",
        "ipv6",
        "labels",
        "live-restore",
        "log-driver",
        "log-format",
        "log-level",
        "log-opts",
        "max-concurrent-downloads",
        "max-concurrent-uploads",
        "max-download-attempts",
        "metrics-addr",
        "mtu",
        "network-control-plane-mtu",
        "no-new-privileges",
        "node-generic-resources",
        "oom-score-adjust",
        "pidfile",
        "raw-logs",
        "registry-mirrors",
        "rootless",
        "runtimes",
        "seccomp-profile",
        "selinux-enabled",
        "shutdown-timeout",
        "storage-driver",
        "storage-opts",
        "swarm-default-advertise-addr",
        "tls",
        "tlscacert",
        "tlscert",
        "tlskey",
        "tlsverify",
        "userland-proxy",
        "userland-proxy-path",
        "userns-remap",
    ]
)


def plan_docker(host: Host, opts: ConfigureOptions) -> RuntimePlan:
    if opts.drop_in is not None:
        raise UsageError("dockerd has no drop-in directory: --drop-in is for containerd and CRI-O")
    if opts.runtime_name == docker.BUILTIN_DEFAULT_RUNTIME:
        raise UsageError(
            'the runtime cannot be called "runc": dockerd reserves that name', "choose another --runtime-name"
        )
    path = opts.config or docker.DAEMON_JSON
    fmt = JsonFormat()
    text = host.read_text_if_exists(path)
    doc = fmt.parse(text or "", path)
    bom, body = docker.split_bom(text or "")
    messages: list[str] = []
    _refuse_what_dockerd_refuses(host, text, doc, path, opts, messages=messages)

    editor = Editor(fmt, doc)
    entry = docker.configured_runtimes(doc, path).get(opts.runtime_name)
    if entry is None:
        # Only what dockerd reads: `path` (its `runtimeArgs` would be the arguments; nvidia-ctk's `"args": []`
        # is a key dockerd ignores, so gpunode does not write it).
        editor.set(("runtimes", opts.runtime_name), {"path": opts.runtime_path})
    else:
        _refuse_shim_entry(entry, path, opts)
        # The entry's own keys (runtimeArgs, anything else) stay: only the binary is gpunode's.
        editor.set(("runtimes", opts.runtime_name, "path"), opts.runtime_path)
    if opts.set_as_default:
        editor.set(("default-runtime",), opts.runtime_name)
    if opts.cdi:
        # Merged into `features`: replacing that object would drop the user's other feature flags.
        editor.set(("features", "cdi"), True)
        messages.append("CDI in dockerd needs Docker 25 or later; older releases ignore features.cdi")
    blank = text is not None and not body.strip()
    if blank:
        messages.append(f"{path} was empty, which dockerd before 23.0 refuses; gpunode writes a valid file")
    # A BOM reaching this point is one the installed dockerd reads: it stays, as the user's editor put it.
    after = bom + fmt.render(doc, body) if editor.edits or blank else text
    change = FileChange(path, text, after, tuple(editor.edits))
    return RuntimePlan(
        runtime="docker",
        changes=(change,),
        messages=tuple(messages),
        unit=UNIT,
        socket=SOCKET,
        standard_location=docker.is_daemon_json(host, opts.config),
        expect=(opts.runtime_name, opts.set_as_default),
    )


def _refuse_what_dockerd_refuses(
    host: Host,
    text: str | None,
    doc: Mapping[str, Any],
    path: str,
    opts: ConfigureOptions,
    *,
    messages: list[str],
) -> None:
    """A file dockerd would not start with is the user's to fix: gpunode does not guess what was meant.

    Two problems gpunode repairs itself: an empty file, and a default runtime that is the one being added.
    """
    bom, body = docker.split_bom(text or "")
    # Which dockerd reads the file decides about a BOM and about shim keys next to a path; it is asked only
    # then (one process fewer on the common path).
    runtimes = docker.configured_runtimes(doc, path)
    unknown_keys = [key for key in doc if key not in KNOWN_DIRECTIVES]
    dockerd = docker.installed_dockerd_version(host) if bom or docker.path_and_shim(runtimes) else None
    if docker.dockerd_unknown_under_root(host) and (bom or docker.path_and_shim(runtimes) or unknown_keys):
        # No dockerd in R to ask: judged as the newest dockerd gpunode knows, so that a file a current
        # dockerd takes (a BOM, keys 20.10 lacks) is not refused on a guess; the operator is told.
        dockerd = NEWEST_DOCKERD
        messages.append(
            f"dockerd's version is unknown ({probe.NOT_RUN}; {probe.locate(host, 'dockerd').where}): "
            f"{path} was judged as dockerd "
            f"{NEWEST_DOCKERD[0]} reads it (a byte order mark kept, keys not checked by "
            "`dockerd --validate`); "
            "dockerd 20.10-22 would refuse a BOM or keys they do not know"
        )
    # An empty file is one gpunode repairs, so it is judged as {} (with the BOM it had, if any).
    problems = docker.startup_problems(text if text and body.strip() else bom + "{}", doc, path, dockerd)
    default = docker.default_runtime(doc, path)
    problems = [p for p in problems if not (default == opts.runtime_name and f'"{default}"' in p)]
    docker.cdi_enabled(doc, path)  # raises on a `features` that is not an object
    if unknown_keys and not host.commands_reach_root:
        if not docker.dockerd_unknown_under_root(host):  # else said just above
            messages.append(
                f"{path}'s key(s) {', '.join(unknown_keys)} were not checked by `dockerd --validate` "
                f"({probe.NOT_RUN}): a dockerd that does not know them refuses to start"
            )
    elif unknown_keys and not _dockerd_accepts(host, path):
        problems.append(
            f"{path} has key(s) dockerd does not know: {', '.join(unknown_keys)}; dockerd refuses to start "
            "with it"
        )
    if problems:
        fix = f"correct {path} first (gpunode left it untouched), then run the command again"
        if docker.bom_problem(text or "", path, dockerd) is not None:
            # GNU sed reads \xHH in a regular expression: this takes exactly the three bytes away.
            rest = ", correct the rest as said" if len(problems) > 1 else ""
            fix = (
                f"remove the byte order mark (the file's first 3 bytes): sed -i '1s/^\\xEF\\xBB\\xBF//' "
                f"{path} (or save it as UTF-8 without BOM){rest}, then run the command again"
            )
        raise ConfigError("; ".join(problems), fix)


def _refuse_shim_entry(entry: Mapping[str, Any], path: str, opts: ConfigureOptions) -> None:
    """An entry that is a containerd shim (runtimeType / options) cannot take a path: a dockerd that knows
    those keys (seen with 26 and 28) refuses to start on both, so gpunode would write a file it will not
    take. 20.10 ignores the keys, but the entry does not run a binary there either: refused for all."""
    shim = [key for key in docker.SHIM_RUNTIME_KEYS if key in entry]
    if shim and not entry.get("path"):
        name = opts.runtime_name
        raise ConfigError(
            f"{path}: runtimes.{name} is a containerd shim ({' and '.join(shim)}), and dockerd refuses to "
            f"start on a runtime with both those keys and a path; gpunode left the file untouched",
            f"remove runtimes.{name} from {path} (gpunode then adds its own), or choose another "
            "--runtime-name",
        )


def _dockerd_accepts(host: Host, path: str) -> bool:
    """Ask dockerd itself (23 and later have --validate) whether it accepts the file's keys: under --root,
    R's own dockerd (gpunode.runtimes.probe)."""
    from gpunode.runtimes import probe

    if host.commands_reach_root and host.which("dockerd") is None:
        return False
    result, _ = probe.run(host, "dockerd", ["--validate", "--config-file", str(host.path(path))], timeout=15)
    return result is not None and result.ok
