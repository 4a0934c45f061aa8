"""A minimal CRI `runtime.v1.RuntimeService` client, compiled from `runtime_v1.proto` at test time.

The generated module is loaded by path rather than checked in, so grpcio-tools (a dev dependency) is the only
thing that has to match the installed protobuf. grpc and the generated messages carry no type information:
they are typed as Any on purpose.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import subprocess
import sys
import time
from pathlib import Path
from types import ModuleType, TracebackType
from typing import Any

PROTO = Path(__file__).resolve().parent / "runtime_v1.proto"
SERVICE = "RuntimeService"


def compile_runtime_api(out_dir: Path) -> ModuleType:
    """Compile the CRI subset with grpcio-tools into out_dir and import the messages module."""
    out_dir.mkdir(parents=True, exist_ok=True)
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "grpc_tools.protoc",
            f"--proto_path={PROTO.parent}",
            f"--python_out={out_dir}",
            str(PROTO),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, f"protoc failed:\n{result.stderr}"
    name = f"{PROTO.stem}_pb2"
    spec = importlib.util.spec_from_file_location(name, out_dir / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _grpc() -> Any:
    # grpc has no type stubs; importing it by name keeps mypy strict without a per-module override.
    return importlib.import_module("grpc")


class RuntimeService:
    """Unary calls to `runtime.v1.RuntimeService` over containerd's unix socket.

    Method paths come from the compiled service descriptor, so a typo in a method name fails loudly here
    instead of as an UNIMPLEMENTED answer from containerd.
    """

    def __init__(self, api: ModuleType, socket: Path, timeout: float = 30.0) -> None:
        self.api: Any = api
        self.timeout = timeout
        self._channel: Any = _grpc().insecure_channel(f"unix://{socket}")
        self._methods: Any = api.DESCRIPTOR.services_by_name[SERVICE].methods_by_name

    def __enter__(self) -> RuntimeService:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def close(self) -> None:
        self._channel.close()

    def call(self, method: str, request: Any) -> Any:
        descriptor = self._methods[method]
        response_class = getattr(self.api, descriptor.output_type.name)
        rpc = self._channel.unary_unary(
            f"/{descriptor.containing_service.full_name}/{method}",
            request_serializer=lambda message: message.SerializeToString(),
            response_deserializer=response_class.FromString,
        )
        return rpc(request, timeout=self.timeout)

    def wait_ready(self, timeout: float = 30.0) -> Any:
        """Return the Version answer once the CRI plugin serves requests.

        containerd accepts connections before the CRI plugin has finished recovering its state, and
        until then answers every CRI call with "server is not initialized yet".
        """
        deadline = time.monotonic() + timeout
        while True:
            try:
                return self.call("Version", self.api.VersionRequest(version="v1"))
            except _grpc().RpcError as err:
                if "not initialized" not in (err.details() or "") or time.monotonic() > deadline:
                    raise
            time.sleep(0.02)

    def status(self, verbose: bool = False) -> Any:
        return self.call("Status", self.api.StatusRequest(verbose=verbose))

    def run_pod_sandbox(self, config: Any, runtime_handler: str = "") -> str:
        request = self.api.RunPodSandboxRequest(config=config, runtime_handler=runtime_handler)
        return str(self.call("RunPodSandbox", request).pod_sandbox_id)

    def stop_pod_sandbox(self, sandbox_id: str) -> None:
        self.call("StopPodSandbox", self.api.StopPodSandboxRequest(pod_sandbox_id=sandbox_id))

    def remove_pod_sandbox(self, sandbox_id: str) -> None:
        self.call("RemovePodSandbox", self.api.RemovePodSandboxRequest(pod_sandbox_id=sandbox_id))


def cri_status(api: ModuleType, socket: Path) -> dict[str, Any]:
    """The CRI plugin's effective config as `crictl info` shows it: the "config" entry of a verbose Status."""
    with RuntimeService(api, socket) as cri:
        cri.wait_ready()
        info = dict(cri.status(verbose=True).info)
    assert "config" in info, f"no config in the CRI status info (keys: {sorted(info)})"
    config = json.loads(info["config"])
    assert isinstance(config, dict)
    return config
