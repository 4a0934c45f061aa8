"""A bare grpcio DevicePlugin server: the floor the plugin's Allocate is measured against (plugin_ab.py).

Usage: python bench/bare_server.py SOCKET_PATH [--plugin-options]   (serves until SIGTERM; prints "ready")

It answers Allocate with the same message the plugin answers for the envvar strategy (NVIDIA_VISIBLE_DEVICES =
the requested IDs, comma-separated), built from the request with nothing checked, logged or looked up; and
GetDevicePluginOptions with an empty message. The server is built as the plugin builds its own: grpcio's
sync server with a 16-worker thread pool, the same generated stubs, on a unix socket. What remains
between the two is the plugin's own work per call.
"""

from __future__ import annotations

import signal
import sys
import threading
from concurrent import futures
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import grpc

from gpunode.plugin.api import deviceplugin_pb2 as pb
from gpunode.plugin.api import deviceplugin_pb2_grpc

pb_grpc: Any = deviceplugin_pb2_grpc
VISIBLE = "NVIDIA_VISIBLE_DEVICES"


class Bare(deviceplugin_pb2_grpc.DevicePluginServicer):
    def GetDevicePluginOptions(
        self, request: pb.Empty, context: grpc.ServicerContext
    ) -> pb.DevicePluginOptions:
        return pb.DevicePluginOptions()

    def Allocate(self, request: pb.AllocateRequest, context: grpc.ServicerContext) -> pb.AllocateResponse:
        return pb.AllocateResponse(
            container_responses=[
                pb.ContainerAllocateResponse(envs={VISIBLE: ",".join(c.devices_ids)})
                for c in request.container_requests
            ]
        )


def main() -> None:
    path = sys.argv[1]
    # --plugin-options: the server options the plugin sets (gpunode/plugin/server.py), to tell their cost
    # from the handler's.
    like_plugin = "--plugin-options" in sys.argv[2:]
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=16),
        options=[("grpc.so_reuseport", 0), ("grpc.max_receive_message_length", 4 * 1024 * 1024)]
        if like_plugin
        else None,
        maximum_concurrent_rpcs=256 if like_plugin else None,
    )
    pb_grpc.add_DevicePluginServicer_to_server(Bare(), server)
    if server.add_insecure_port(f"unix://{path}") == 0:
        raise SystemExit(f"cannot listen on {path}")
    server.start()
    done = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: done.set())
    print("ready", flush=True)
    done.wait()
    server.stop(0.5).wait(2.0)


if __name__ == "__main__":
    main()
