"""Run a command in a network namespace that has only a loopback interface, with one TCP port of it
forwarded to a Unix socket outside: the command reaches the edgemoe server and nothing else.

Run as ``unshare --net --map-root-user python3 loopback_only.py --port PORT --uds PATH -- CMD ...``
(``unshare`` makes the namespace; this script brings ``lo`` up, listens on ``127.0.0.1:PORT`` and
relays each connection to the server's Unix socket ``PATH``, then runs ``CMD`` and exits with its
status). Any other connection the command tries fails at once (no route, no DNS server).
"""

from __future__ import annotations

import argparse
import fcntl
import socket
import struct
import subprocess
import sys
import threading

SIOCGIFFLAGS, SIOCSIFFLAGS, IFF_UP = 0x8913, 0x8914, 0x1


def loopback_up() -> None:
    """Set ``lo`` up (a new network namespace starts with it down); ioctl as in ``ip link set lo up``."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        ifreq = struct.pack("16sH14s", b"lo", 0, b"")
        flags = struct.unpack("16sH14s", fcntl.ioctl(s, SIOCGIFFLAGS, ifreq))[1]
        fcntl.ioctl(s, SIOCSIFFLAGS, struct.pack("16sH14s", b"lo", flags | IFF_UP, b""))


def _pipe(src: socket.socket, dst: socket.socket) -> None:
    try:
        while data := src.recv(65536):
            dst.sendall(data)
    except OSError:
        pass
    finally:
        for s in (src, dst):
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass


def relay(listener: socket.socket, uds: str) -> None:
    """Accept TCP connections forever; relay each to a new connection to the Unix socket ``uds``."""
    while True:
        client, _ = listener.accept()
        upstream = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        upstream.connect(uds)
        for a, b in ((client, upstream), (upstream, client)):
            threading.Thread(target=_pipe, args=(a, b), daemon=True).start()


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--uds", required=True)
    parser.add_argument("command", nargs=argparse.REMAINDER)
    args = parser.parse_args()
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    loopback_up()
    listener = socket.create_server(("127.0.0.1", args.port))
    threading.Thread(target=relay, args=(listener, args.uds), daemon=True).start()
    return subprocess.run(command, check=False).returncode


if __name__ == "__main__":
    sys.exit(main())
