"""Every reader of outside input, fuzzed (issue 23): whatever the bytes, the reader answers or raises its
own error (a GpunodeError: an exit code and a message), never another exception (exit 70) or a hang.

Deterministic (derandomize: the same examples on every run) and bounded (a modest max_examples, no
deadline: a loaded machine must not fail a test for being slow).

The signing-key reader comes first: gpunode/toolkit/keys.py is a hand-written OpenPGP packet parser that
decides what apt will trust. It stays (rather than `gpg --show-keys`): apt needs only gpgv, and minimal
nodes have no gpg. Fuzzing found two crashes, both fixed: armor with a non-ASCII byte (UnicodeEncodeError)
and a v4 key packet over 64 KiB (OverflowError in the fingerprint's 2-byte length). Its work is linear in
the input, which the 1 MiB download and file limit bound.
"""

from __future__ import annotations

import base64
import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gpunode.errors import GpunodeError
from gpunode.host import Host
from gpunode.toolkit import keys

FUZZ = settings(
    derandomize=True,
    max_examples=300,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)


def _reads_or_refuses(call: object) -> None:
    try:
        call()  # type: ignore[operator]
    except GpunodeError as err:
        assert err.message and len(err.message) < 2000


# -- the signing key -------------------------------------------------------------------------------------


def _packet(tag: int, body: bytes, form: int) -> bytes:
    """One OpenPGP packet with a header of each kind the parser reads (and some it must refuse)."""
    n = len(body)
    if form == 0:  # new format, the length in 1, 2 or 5 octets as it fits
        if n < 192:
            head = bytes([n])
        elif n < 8384:
            head = bytes([((n - 192) >> 8) + 192, (n - 192) & 0xFF])
        else:
            head = b"\xff" + n.to_bytes(4, "big")
        return bytes([0xC0 | (tag & 0x3F)]) + head + body
    if form == 1:  # old format, a 4-octet length
        return bytes([0x80 | ((tag & 0x0F) << 2) | 2]) + n.to_bytes(4, "big") + body
    return bytes([0x80 | ((tag & 0x0F) << 2) | 3]) + body  # old format, indeterminate: refused


packets = st.lists(
    st.builds(
        _packet,
        st.sampled_from([2, 5, 6, 7, 13, 14, 17, 63]),
        st.one_of(
            st.binary(max_size=64),
            st.builds(lambda v, b: bytes([v]) + b, st.sampled_from([3, 4, 5, 6]), st.binary(max_size=64)),
        ),
        st.integers(0, 2),
    ),
    max_size=5,
).map(b"".join)


def _armor(data: bytes, junk: str) -> bytes:
    body = base64.b64encode(data).decode()
    return (
        f"-----BEGIN PGP PUBLIC KEY BLOCK-----\n{junk}\n\n{body}\n-----END PGP PUBLIC KEY BLOCK-----\n"
    ).encode("utf-8", "surrogatepass")


@FUZZ
@given(
    st.one_of(
        st.binary(max_size=300),
        packets,
        st.builds(lambda p, cut: p[:cut], packets, st.integers(0, 200)),  # cut short anywhere
        st.builds(_armor, packets, st.text(max_size=20)),
        st.builds(lambda a, b: a + b, st.builds(_armor, packets, st.just("")), st.binary(max_size=40)),
    )
)
def test_fuzz_signing_key(data: bytes) -> None:
    _reads_or_refuses(lambda: keys.parse_key(data, "key"))


def test_the_crashes_fuzzing_found_in_the_key_reader() -> None:
    with pytest.raises(keys.SigningKeyError):  # was UnicodeEncodeError
        keys.parse_key(b"-----BEGIN PGP PUBLIC KEY BLOCK-----\n\xff\n-----END PGP PUBLIC KEY BLOCK-----", "k")
    big_v4 = _packet(6, b"\x04" + b"\x00" * 70_000, 0)
    with pytest.raises(keys.SigningKeyError, match="over 64 KiB"):  # was OverflowError
        keys.parse_key(big_v4, "k")


# -- daemon.json, containerd / CRI-O TOML, NVIDIA's config, kubeconfig, records, status -------------------

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=10),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=20,
)
texts = st.one_of(
    st.text(max_size=300),
    json_values.map(json.dumps),
    st.builds(lambda n, s: "[" * n + s + "]" * n, st.integers(0, 3000), st.text(max_size=5)),
    st.builds(lambda d: "x = " + "9" * d, st.integers(4290, 4400)),
)


@FUZZ
@given(texts)
def test_fuzz_daemon_json(text: str) -> None:
    from gpunode.runtimes.docker import parse_daemon_json

    _reads_or_refuses(lambda: parse_daemon_json(text, "/etc/docker/daemon.json"))


toml_texts = st.one_of(
    texts,
    st.builds(
        lambda key, value: (
            f'version = 2\n[plugins."io.containerd.grpc.v1.cri".containerd]\n{key} = {value}\n'
        ),
        st.sampled_from(["default_runtime_name", "snapshotter", "x"]),
        st.sampled_from(['"nvidia"', "1", "[1, [2, [3]]]", "{a = 1}", '"\\ud800"', "1979-05-27", "inf"]),
    ),
    st.builds(lambda n: "a = " + "[" * n + "]" * n, st.integers(0, 3000)),
)


@FUZZ
@given(toml_texts)
def test_fuzz_runtime_toml(text: str) -> None:
    from gpunode.runtimes.edits import read_toml

    _reads_or_refuses(lambda: read_toml(text, "/etc/containerd/config.toml"))


yaml_texts = st.one_of(
    texts,
    st.builds(
        lambda key, value: f"version: v1\nflags:\n  {key}: {value}\n",
        st.sampled_from(["migStrategy", "plugin", "failOnInitError", "gfd"]),
        st.sampled_from(["none", "&a [*a]", "{a: 1, a: 2}", "[" * 200, "1" * 4400, "!!binary x", "*x"]),
    ),
    st.builds(
        lambda levels: "".join(f"a{n}: &a{n} [*a{n - 1}, *a{n - 1}]\n" for n in range(1, levels)),
        st.integers(1, 40),
    ).map(lambda t: "a0: &a0 [1]\n" + t),
)


@FUZZ
@given(yaml_texts)
def test_fuzz_nvidia_config(tmp_path_factory: pytest.TempPathFactory, text: str) -> None:
    from gpunode.plugin.config import read_config_file

    root = tmp_path_factory.mktemp("nv")
    (root / "config.yaml").write_text(text, encoding="utf-8", errors="surrogatepass")
    _reads_or_refuses(lambda: read_config_file(Host(root=root, env={}), "/config.yaml", required=True))


@FUZZ
@given(yaml_texts)
def test_fuzz_kubeconfig(tmp_path_factory: pytest.TempPathFactory, text: str) -> None:
    from gpunode.kube import resolve_credentials

    root = tmp_path_factory.mktemp("kc")
    (root / "kubeconfig").write_text(text, encoding="utf-8", errors="surrogatepass")
    host = Host(root=root, env={"KUBECONFIG": "/kubeconfig", "HOME": "/root"}, euid=0)
    _reads_or_refuses(lambda: resolve_credentials(host))


@FUZZ
@given(texts)
def test_fuzz_records_and_status(tmp_path_factory: pytest.TempPathFactory, text: str) -> None:
    from gpunode import kubelet, paths
    from gpunode.plugin import statusfile
    from gpunode.runtimes import records

    root = tmp_path_factory.mktemp("st")
    for path in (paths.PLUGIN_STATUS_FILE, records.RECORDS, kubelet.KUBELET_CHECKPOINT):
        local = root / path.lstrip("/")
        local.parent.mkdir(parents=True, exist_ok=True)
        local.write_text(text, encoding="utf-8", errors="surrogatepass")
    host = Host(root=root, env={})
    _reads_or_refuses(lambda: records.load(host))
    kubelet.registered_resources(host)
    statusfile.find(host, flag=paths.PLUGIN_STATUS_FILE, env={}, unit="u", unit_properties={})
