#!/usr/bin/env bash
# Install gpunode into its own virtualenv and put `gpunode` on PATH. Safe to run again: it reuses the
# virtualenv, upgrades gpunode in place and leaves everything else alone.
set -euo pipefail

MIN_PYTHON="3.10"
PREFIX="/opt/gpunode"
BIN_DIR="/usr/local/bin"
DEV=0
LINK=1
APT=1
UNINSTALL=0
COMPLETION=1
# Shell completion goes where each shell looks, under this root (a packaging or test root; default /).
COMPLETION_ROOT="${GPUNODE_COMPLETION_ROOT:-/}"
PYTHON="${PYTHON:-}"
SRC_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
# Debian packages the test suite needs installed (the README's "Tests" section): the tools it calls and the
# libraries the test bed's daemons link against (runc: libseccomp2, dockerd 20.10: libdevmapper1.02.1). None
# of them is a container runtime or starts a service. The daemons themselves (containerd, runc, dockerd) are
# never installed: tests/testbed.py unpacks them into .testbed/ in the checkout.
DEV_DEBIAN_PACKAGES=(gcc libc6-dev systemd-container gnupg dpkg-dev openssl acl libseccomp2 libdevmapper1.02.1)

usage() {
    cat <<EOF
Usage: ./install.sh [options]

Installs gpunode into a virtualenv (default $PREFIX) and links $BIN_DIR/gpunode to it.

Options:
  --prefix DIR     virtualenv to install into (default: $PREFIX)
  --bin-dir DIR    where to link the gpunode command (default: $BIN_DIR)
  --no-link        do not create the link (e.g. a development virtualenv); no shell completion either
  --no-completion  do not install the completion scripts for bash, zsh and fish, which otherwise go to
                   /usr/share/bash-completion/completions/gpunode,
                   /usr/local/share/zsh/site-functions/_gpunode and
                   /usr/share/fish/vendor_completions.d/gpunode.fish
                   (under \$GPUNODE_COMPLETION_ROOT when set)
  --dev            also install the test dependencies: Debian packages (${DEV_DEBIAN_PACKAGES[*]})
                   and the [dev] extras; gpunode is installed editable from this checkout. The daemons
                   the tests run (containerd 1.6, 1.7, 2.x, runc, dockerd 20.10, 26, 28) are downloaded
                   with a private apt configuration and unpacked into .testbed/ in the checkout: not
                   installed, no service enabled or started, the host's own runtime left alone
  --no-apt         with --dev: neither install Debian packages nor fetch the test bed's daemons
                   (then: python -m tests.testbed fetch)
  --python PATH    the Python interpreter to use (default: the first of /usr/bin/python3,
                   python3.13 .. python3.10, python3 that is at least $MIN_PYTHON)
  --uninstall      remove the link, the completion scripts (and the directories install.sh made for
                   them, once empty) and the virtualenv, and nothing else;
                   refused while the device plugin service is installed (run 'gpunode down' first)
  -h, --help       show this help
EOF
}

say() { printf 'install.sh: %s\n' "$*"; }
die() {
    printf 'install.sh: error: %s\n' "$1" >&2
    [ $# -gt 1 ] && printf '  fix: %s\n' "$2" >&2
    exit 1
}

while [ $# -gt 0 ]; do
    case "$1" in
        --prefix) [ $# -ge 2 ] || die "--prefix needs a directory"; PREFIX="$2"; shift 2 ;;
        --prefix=*) PREFIX="${1#*=}"; shift ;;
        --bin-dir) [ $# -ge 2 ] || die "--bin-dir needs a directory"; BIN_DIR="$2"; shift 2 ;;
        --bin-dir=*) BIN_DIR="${1#*=}"; shift ;;
        --python) [ $# -ge 2 ] || die "--python needs a path"; PYTHON="$2"; shift 2 ;;
        --python=*) PYTHON="${1#*=}"; shift ;;
        --no-link) LINK=0; shift ;;
        --no-completion) COMPLETION=0; shift ;;
        --dev) DEV=1; shift ;;
        --no-apt) APT=0; shift ;;
        --uninstall) UNINSTALL=1; shift ;;
        -h|--help) usage; exit 0 ;;
        *) usage >&2; die "unknown option: $1" "see ./install.sh --help" ;;
    esac
done

case "$PREFIX" in /*) ;; *) PREFIX="$PWD/$PREFIX" ;; esac
case "$BIN_DIR" in /*) ;; *) BIN_DIR="$PWD/$BIN_DIR" ;; esac
LINK_PATH="$BIN_DIR/gpunode"
# shell:path of each completion script, where bash-completion, zsh (Debian's and most distributions' fpath)
# and fish look for a command's completion.
COMPLETION_ROOT="${COMPLETION_ROOT%/}"
COMPLETIONS=(
    "bash:$COMPLETION_ROOT/usr/share/bash-completion/completions/gpunode"
    "zsh:$COMPLETION_ROOT/usr/local/share/zsh/site-functions/_gpunode"
    "fish:$COMPLETION_ROOT/usr/share/fish/vendor_completions.d/gpunode.fish"
)

is_root() { [ "$(id -u)" -eq 0 ]; }

# The nearest existing directory at or above $1 must be writable for us to create $1.
writable() {
    local dir="$1"
    while [ ! -e "$dir" ]; do dir="$(dirname "$dir")"; done
    [ -w "$dir" ]
}

require_root_for() {
    is_root && return 0
    die "installing $1 needs root" "run it with sudo: sudo ./install.sh $(printf '%q ' "${ORIGINAL_ARGS[@]}")"
}
ORIGINAL_ARGS=("$@")

# The device plugin's unit runs this virtualenv's gpunode: removing it first would leave systemd restarting a
# program that is gone, and the node's runtime configuration and labels in place with no tool to undo them.
PLUGIN_UNIT="${GPUNODE_SYSTEMD_DIR:-/etc/systemd/system}/gpunode-device-plugin.service"

# The completion directories install.sh made itself (each level that was missing, deepest first), kept in the
# virtualenv: --uninstall removes them once empty, and never a directory that was there before.
CREATED_DIRS="$PREFIX/.gpunode-created-dirs"

if [ "$UNINSTALL" -eq 1 ]; then
    if [ -e "$PLUGIN_UNIT" ] || [ -L "$PLUGIN_UNIT" ]; then
        die "the gpunode device plugin service is still installed ($PLUGIN_UNIT); removing gpunode now would leave it running a program that is gone" \
            "undo what gpunode did first: gpunode down --dry-run, then gpunode down (add --toolkit to remove the toolkit too), then ./install.sh --uninstall again"
    fi
    if [ -L "$LINK_PATH" ] && [ "$(readlink "$LINK_PATH")" = "$PREFIX/bin/gpunode" ]; then
        writable "$BIN_DIR" || require_root_for "$LINK_PATH"
        rm -f "$LINK_PATH"
        say "removed $LINK_PATH"
    fi
    for entry in "${COMPLETIONS[@]}"; do
        path="${entry#*:}"
        # Only a script gpunode generated: it names gpunode's completion variable.
        if [ -f "$path" ] && grep -q _GPUNODE_COMPLETE "$path" 2>/dev/null; then
            writable "$(dirname "$path")" || require_root_for "$path"
            rm -f "$path"
            say "removed $path"
        fi
    done
    if [ -f "$CREATED_DIRS" ]; then
        while IFS= read -r dir; do
            # rmdir removes only an empty directory: another program's file in it keeps it.
            if [ -n "$dir" ] && [ -d "$dir" ] && [ ! -L "$dir" ] && rmdir "$dir" 2>/dev/null; then
                say "removed the empty directory $dir"
            fi
        done < <(sort -ru "$CREATED_DIRS")  # reversed: a directory's children before it
    fi
    if [ -x "$PREFIX/bin/python" ] && [ -f "$PREFIX/pyvenv.cfg" ]; then
        writable "$(dirname "$PREFIX")" || require_root_for "$PREFIX"
        rm -rf "$PREFIX"
        say "removed $PREFIX"
    fi
    say "gpunode is uninstalled (files it wrote elsewhere, such as backups, are kept)"
    exit 0
fi

# --- root ----------------------------------------------------------------------------------------
writable "$PREFIX" || require_root_for "$PREFIX"
if [ "$LINK" -eq 1 ]; then writable "$BIN_DIR" || require_root_for "$LINK_PATH"; fi
if [ "$LINK" -eq 1 ] && [ "$COMPLETION" -eq 1 ] && [ -d "$COMPLETION_ROOT/" ]; then
    for entry in "${COMPLETIONS[@]}"; do
        writable "$(dirname "${entry#*:}")" || require_root_for "the shell completion (${entry#*:}; or use --no-completion)"
    done
fi
if [ "$DEV" -eq 1 ] && [ "$APT" -eq 1 ]; then
    missing_debs=()
    for pkg in "${DEV_DEBIAN_PACKAGES[@]}"; do
        dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed" || missing_debs+=("$pkg")
    done
    if [ "${#missing_debs[@]}" -gt 0 ]; then
        command -v apt-get >/dev/null || die "the test dependencies are Debian packages (${missing_debs[*]}) and this system has no apt-get" "install them with your package manager, then run ./install.sh --dev --no-apt"
        require_root_for "Debian packages (${missing_debs[*]})"
        say "installing Debian packages: ${missing_debs[*]}"
        export DEBIAN_FRONTEND=noninteractive
        apt-get update -q || die "apt-get update failed" "check the network and /etc/apt/sources.list"
        apt-get install -y -q --no-install-recommends "${missing_debs[@]}" \
            || die "apt-get could not install: ${missing_debs[*]}" "see apt-get's message above"
    fi
fi

# --- Python --------------------------------------------------------------------------------------
version_ok() {
    "$1" -c "import sys; sys.exit(0 if sys.version_info >= tuple(map(int, '$MIN_PYTHON'.split('.'))) else 1)" 2>/dev/null
}
if [ -n "$PYTHON" ]; then
    command -v "$PYTHON" >/dev/null || die "--python $PYTHON: no such interpreter"
    if ! version_ok "$PYTHON"; then
        found="$("$PYTHON" -c 'import sys; print("%d.%d" % sys.version_info[:2])' 2>/dev/null || echo unknown)"
        die "gpunode needs Python >= $MIN_PYTHON, but $PYTHON is $found" "install a newer Python (e.g. apt install python3.11) and pass --python /usr/bin/python3.11"
    fi
else
    for candidate in /usr/bin/python3 python3.13 python3.12 python3.11 python3.10 python3; do
        if command -v "$candidate" >/dev/null && version_ok "$candidate"; then PYTHON="$(command -v "$candidate")"; break; fi
    done
    if [ -z "$PYTHON" ]; then
        found="$(python3 -c 'import sys; print("%d.%d" % sys.version_info[:2])' 2>/dev/null || echo none)"
        die "gpunode needs Python >= $MIN_PYTHON; the newest python3 here is $found" "install python3.10 or newer (e.g. apt install python3.11, dnf install python3.11) and pass --python PATH"
    fi
fi

# --- virtualenv ----------------------------------------------------------------------------------
if [ -x "$PREFIX/bin/python" ] && "$PREFIX/bin/python" -c 'import sys' 2>/dev/null; then
    say "reusing the virtualenv in $PREFIX"
else
    [ -e "$PREFIX" ] && [ ! -f "$PREFIX/pyvenv.cfg" ] && [ -n "$(ls -A "$PREFIX" 2>/dev/null)" ] \
        && die "$PREFIX exists and is not a virtualenv; refusing to touch it" "choose another --prefix, or remove $PREFIX"
    say "creating a virtualenv in $PREFIX with $PYTHON"
    venv_err="$(mktemp)"
    trap 'rm -f "$venv_err"' EXIT
    if ! "$PYTHON" -m venv --clear "$PREFIX" 2>"$venv_err"; then
        if command -v apt-get >/dev/null && is_root; then
            pyver="$("$PYTHON" -c 'import sys; print("%d.%d" % sys.version_info[:2])')"
            say "the venv module is missing; installing python${pyver}-venv"
            DEBIAN_FRONTEND=noninteractive apt-get install -y -q "python${pyver}-venv" \
                || die "could not install python${pyver}-venv" "apt-get install python${pyver}-venv"
            "$PYTHON" -m venv --clear "$PREFIX" || die "could not create a virtualenv in $PREFIX"
        else
            cat "$venv_err" >&2
            die "could not create a virtualenv with $PYTHON" "install the venv module (Debian/Ubuntu: apt install python3-venv)"
        fi
    fi
fi

# --- gpunode -------------------------------------------------------------------------------------
pip_install() {
    "$PREFIX/bin/python" -m pip install --disable-pip-version-check -q "$@" \
        || die "pip could not install gpunode's Python packages (see pip's message above)" "check access to PyPI, or point pip at a mirror with PIP_INDEX_URL=..."
}
if [ "$DEV" -eq 1 ]; then
    say "installing gpunode (editable, with test dependencies) from $SRC_DIR"
    pip_install -e "$SRC_DIR[dev]"
    if [ "$APT" -eq 1 ]; then
        # The daemons the tests run (containerd 1.6 / 1.7 / 2.x, runc, dockerd 20.10 / 26 / 28): unpacked from
        # Debian packages into .testbed/ in the checkout, never installed (tests/testbed.py).
        say "fetching the test bed's daemons into $SRC_DIR/.testbed"
        (cd "$SRC_DIR" && "$PREFIX/bin/python" -m tests.testbed fetch) \
            || die "could not fetch the test bed's Debian packages" "check that deb.debian.org is reachable, then run ./install.sh --dev again"
    fi
else
    say "installing gpunode from $SRC_DIR"
    pip_install --upgrade "$SRC_DIR"
    # The build `gpunode --version` names: $GPUNODE_BUILD, else the checkout's commit (git is asked here,
    # once, never when gpunode starts); -I: the installed gpunode, not the one in the current directory.
    build="${GPUNODE_BUILD:-}"
    if [ -z "$build" ] && [ -e "$SRC_DIR/.git" ] && command -v git >/dev/null; then
        build="$(git -C "$SRC_DIR" describe --always --dirty --abbrev=12 2>/dev/null || true)"
    fi
    if [ -n "$build" ]; then
        "$PREFIX/bin/python" -I -m gpunode.buildinfo stamp "$build" >/dev/null \
            || die "could not write gpunode's build stamp" "check that $PREFIX is writable, then run ./install.sh again"
    fi
fi

if [ "$LINK" -eq 1 ]; then
    if [ -e "$LINK_PATH" ] && [ ! -L "$LINK_PATH" ]; then
        die "$LINK_PATH exists and is not a link made by install.sh; refusing to replace it" "remove it, or use --bin-dir / --no-link"
    fi
    mkdir -p "$BIN_DIR"
    ln -sfn "$PREFIX/bin/gpunode" "$LINK_PATH"
    say "linked $LINK_PATH -> $PREFIX/bin/gpunode"
fi

# --- shell completion ----------------------------------------------------------------------------
# With the link: a development virtualenv (--no-link) leaves the system's shells alone. Each script is
# written whole (temp file, then rename) and asks gpunode itself for candidates, so it never goes stale.
if [ "$LINK" -eq 1 ] && [ "$COMPLETION" -eq 1 ]; then
    if [ ! -d "$COMPLETION_ROOT/" ]; then
        say "no shell completion: $COMPLETION_ROOT/ does not exist"
    else
        for entry in "${COMPLETIONS[@]}"; do
            shell="${entry%%:*}" path="${entry#*:}"
            writable "$(dirname "$path")" || require_root_for "$path"
            dir="$(dirname "$path")"
            while [ ! -d "$dir" ]; do
                printf '%s\n' "$dir" >>"$CREATED_DIRS"
                dir="$(dirname "$dir")"
            done
            mkdir -p "$(dirname "$path")"
            tmp="$(mktemp "$(dirname "$path")/.gpunode-completion.XXXXXX")"
            if "$PREFIX/bin/gpunode" completion "$shell" >"$tmp"; then
                chmod 644 "$tmp"
                mv -f "$tmp" "$path"
                say "installed $shell completion: $path"
            else
                rm -f "$tmp"
                die "could not generate the $shell completion script" "run $PREFIX/bin/gpunode completion $shell to see why; or use --no-completion"
            fi
        done
    fi
fi

say "$("$PREFIX/bin/gpunode" --version) is installed in $PREFIX; run: gpunode doctor"
