"""A stand-in for NVIDIA's `nvidia-cuda-mps-control`, behaving as the real one does where gpunode uses it.

- `-d` starts the control daemon in the background and returns at once (status 0); the daemon listens on
  `$CUDA_MPS_PIPE_DIRECTORY/control` (default /tmp/nvidia-mps) and logs to
  `$CUDA_MPS_LOG_DIRECTORY/control.log` (default /var/log/nvidia-mps) with the real daemon's first lines.
  A second `-d` on a directory whose daemon answers says so and exits 1. `-f` runs it in the foreground.
- Without arguments it is the control client: every line on stdin is a command sent to the daemon, and
  its answer is printed; with no daemon answering it prints "Cannot find MPS control daemon process" and
  exits 1.
- Commands: get/set_default_active_thread_percentage, get/set_default_device_pinned_mem_limit (the device
  ordinal must be one of the CUDA_VISIBLE_DEVICES the daemon was started with), get_server_list, quit.
  Anything else is answered "Unrecognized command" (status 1).
- The daemon writes its PID to `nvidia-cuda-mps-control.pid` in the pipe directory, as the real one does.
- Like an MPS server, the daemon creates a file in /dev/shm (`mps-standin.<pid>`): a test sees which
  /dev/shm the daemon had.

The real protocol between client and daemon is NVIDIA's own; this one is a line over a unix socket.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import socket
import sys


def _dirs() -> tuple[str, str]:
    pipe = os.environ.get("CUDA_MPS_PIPE_DIRECTORY") or "/tmp/nvidia-mps"
    log = os.environ.get("CUDA_MPS_LOG_DIRECTORY") or "/var/log/nvidia-mps"
    return pipe, log


def _answers(path: str) -> bool:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        try:
            sock.connect(path)
        except OSError:
            return False
    return True


class Daemon:
    def __init__(self, pipe: str, log: str) -> None:
        self.pipe = pipe
        self.log_path = os.path.join(log, "control.log")
        visible = os.environ.get("CUDA_VISIBLE_DEVICES", "")
        self.devices = len([v for v in visible.split(",") if v]) if visible else 8
        self.threads = 100.0
        self.limits: dict[int, str] = {}

    def log(self, text: str) -> None:
        stamp = datetime.datetime.now().strftime("%Y-%m-%d %H:%M:%S.%f")[:-3]
        with open(self.log_path, "a", encoding="utf-8") as f:
            f.write(f"[{stamp} Control {os.getpid():5d}] {text}\n")

    def answer(self, line: str) -> tuple[str, bool]:
        """(reply, quit)"""
        words = line.split()
        if not words:
            return "", False
        cmd, args = words[0], words[1:]
        if cmd == "get_default_active_thread_percentage" and not args:
            return f"{self.threads:.1f}", False
        if cmd == "set_default_active_thread_percentage" and len(args) == 1:
            try:
                value = float(args[0])
            except ValueError:
                return "Invalid percentage", False
            if not 0 < value <= 100:
                return "Invalid percentage", False
            self.threads = value
            return f"{value:.1f}", False
        if cmd in ("set_default_device_pinned_mem_limit", "get_default_device_pinned_mem_limit"):
            want = 2 if cmd.startswith("set") else 1
            if len(args) != want or not args[0].isdigit() or int(args[0]) >= self.devices:
                return "Invalid device", False
            if want == 1:
                return self.limits.get(int(args[0]), "none"), False
            limit = args[1]
            if not (limit[:-1].isdigit() and limit[-1] in "MG"):
                return "Invalid memory limit", False
            self.limits[int(args[0])] = limit
            return "", False
        if cmd == "get_server_list" and not args:
            return "", False
        if cmd == "quit":
            return "", True
        return "Unrecognized command", False

    def serve(self) -> None:
        os.makedirs(self.pipe, exist_ok=True)
        path = os.path.join(self.pipe, "control")
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
        server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        server.bind(path)
        server.listen(16)
        with open(os.path.join(self.pipe, "nvidia-cuda-mps-control.pid"), "w", encoding="utf-8") as f:
            f.write(f"{os.getpid()}\n")
        self.log(f"Starting control daemon using socket {path}")
        self.log(f"To connect CUDA applications to this daemon, set env CUDA_MPS_PIPE_DIRECTORY={self.pipe}")
        with contextlib.suppress(OSError), open(f"/dev/shm/mps-standin.{os.getpid()}", "w") as f:
            f.write("stand-in MPS\n")
        while True:
            conn, _ = server.accept()
            with conn:
                self.log("Accepting connection...")
                data = b""
                while not data.endswith(b"\n"):
                    chunk = conn.recv(4096)
                    if not chunk:
                        break
                    data += chunk
                line = data.decode("utf-8", "replace").strip()
                if not line:
                    self.log("User did not send valid credentials")
                    continue
                self.log(f"Cmd:{line}")
                reply, stop = self.answer(line)
                status = "1" if reply.startswith(("Invalid", "Unrecognized")) else "0"
                conn.sendall(f"{status}\n{reply}\n".encode())
                if stop:
                    self.log("Exit")
                    server.close()
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(path)
                    return


def daemonize_and_serve(daemon: Daemon) -> None:
    if os.fork() > 0:
        return  # the caller's process: back at once, as the real -d
    os.setsid()
    if os.fork() > 0:
        os._exit(0)
    devnull = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(devnull, fd)
    try:
        daemon.serve()
    finally:
        os._exit(0)


def client() -> int:
    pipe, _ = _dirs()
    path = os.path.join(pipe, "control")
    status = 0
    for line in sys.stdin:
        if not line.strip():
            continue
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            try:
                sock.connect(path)
            except OSError:
                print("Cannot find MPS control daemon process")
                return 1
            sock.sendall(line.strip().encode() + b"\n")
            reply = b""
            while chunk := sock.recv(4096):
                reply += chunk
        code, _, text = reply.decode().partition("\n")
        text = text.rstrip("\n")
        if text:
            print(text)
        if code != "0":
            status = 1
    return status


def main(argv: list[str]) -> int:
    pipe, log = _dirs()
    if not argv:
        return client()
    if argv[0] not in ("-d", "-f") or len(argv) > 1:
        print(f"Unrecognized option {argv[0]}", file=sys.stderr)
        return 1
    if _answers(os.path.join(pipe, "control")):
        print("An instance of this daemon is already running", file=sys.stderr)
        return 1
    os.makedirs(log, exist_ok=True)
    daemon = Daemon(pipe, log)
    if argv[0] == "-f":
        daemon.serve()
    else:
        daemonize_and_serve(daemon)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
