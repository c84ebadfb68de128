"""llama.cpp's RPC backend: lend this machine's compute to another, and load a target across
machines (``ggml-rpc.h``; llama.cpp's ``tools/rpc``).

An RPC server (:func:`serve_rpc`, ``smcspec rpc-server``) runs ggml's server loop on its CPU
(or GPU) device; a client registers each ``HOST:PORT`` (:func:`rpc_devices`) and llama.cpp
places model layers on those devices as on GPUs (``n_gpu_layers``). The protocol has no
authentication: run servers on trusted networks only.

Faults: llama.cpp's client aborts the process (``GGML_ABORT``, SIGABRT) when a server cannot
be reached at registration or stops answering mid-forward (``ggml-rpc.cpp``,
``RPC_STATUS_ASSERT``) and waits forever on a peer that never answers; it does not return
an error. :func:`check_reachable` therefore does the protocol's HELLO exchange with every
server first, with a timeout, so that a wrong address, another protocol, a silent listener
or another protocol version is a clear error instead of an abort or a hang; a server lost
later ends the process. ``smcspec serve`` sees that abort first
(:mod:`smcspec.backends.llamacpp.faults`): its requests get errors, then it exits with 1.
"""

from __future__ import annotations

import ctypes
import socket
import struct
import time
from pathlib import Path

from smcspec.errors import ConfigError, RpcServerError

DEVICE_CPU, DEVICE_GPU, DEVICE_IGPU = 0, 1, 2  # enum ggml_backend_dev_type
DEFAULT_PORT = 50052  # llama.cpp's rpc-server default
_LIBS: dict[str, ctypes.CDLL] = {}


def parse_endpoints(spec: str | list[str] | tuple[str, ...]) -> tuple[str, ...]:
    """``"HOST:PORT[,HOST:PORT...]"`` (or a list) as a tuple of endpoints.

    Raises:
        ConfigError: an empty list, a missing host, or a port outside 1-65535.
    """
    parts = spec.split(",") if isinstance(spec, str) else list(spec)
    out = []
    for part in (p.strip() for p in parts):
        host, sep, port = part.rpartition(":")
        if not sep or not host or not port.isdigit() or not 1 <= int(port) <= 65535:
            raise ConfigError(f"RPC server {part!r} must be HOST:PORT (port 1-65535)")
        out.append(f"{host}:{int(port)}")
    if not out:
        raise ConfigError("--rpc needs at least one HOST:PORT")
    return tuple(out)


# The handshake of the RPC protocol that llama-cpp-python 0.3.36's llama.cpp speaks
# (ggml/include/ggml-rpc.h, ggml/src/ggml-rpc/ggml-rpc.cpp): a request is the command byte,
# its payload size (uint64, little-endian) and the payload; a response is its size and its
# payload. HELLO (14, pinned by a static_assert there) carries 24 bytes of transport
# capabilities (all zero: plain TCP) and is answered by major, minor, patch, one byte of
# padding and the server's 24 capability bytes. The client refuses another major version, or
# a newer minor one.
RPC_CMD_HELLO = 14
RPC_CONN_CAPS_SIZE = 24
RPC_PROTO_VERSION = (7, 0, 0)
HANDSHAKE_TIMEOUT_S = 3.0


def check_reachable(endpoint: str, timeout_s: float = HANDSHAKE_TIMEOUT_S) -> tuple[int, int, int]:
    """Do the RPC protocol's HELLO exchange with ``endpoint`` within ``timeout_s`` seconds
    in all, and return the server's protocol version ``(major, minor, patch)``.

    llama.cpp's own client aborts the process (SIGABRT) when the peer is not an RPC server
    and hangs forever on one that never answers; this check runs first, so that each of
    those is a clear error instead.

    Raises:
        RpcServerError: the connection is refused or times out, the peer does not answer the
            handshake within ``timeout_s`` (a silent listener, or a server busy with another
            client: llama.cpp's serves one at a time), answers something that is not the
            handshake (another protocol, such as HTTP), or speaks another protocol version.
    """
    host, _, port = endpoint.rpartition(":")
    deadline = time.monotonic() + timeout_s
    try:
        sock = socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s)
    except OSError as exc:
        raise RpcServerError(
            f"cannot reach the RPC server {endpoint} ({exc}); start it with "
            f"`smcspec rpc-server --host HOST --port PORT` on that machine"
        ) from None
    head = body = b""
    try:
        with sock:
            hello = struct.pack("<BQ", RPC_CMD_HELLO, RPC_CONN_CAPS_SIZE)
            sock.sendall(hello + bytes(RPC_CONN_CAPS_SIZE))
            head = _recv_exactly(sock, 8, deadline)
            if len(head) == 8 and struct.unpack("<Q", head)[0] == 4 + RPC_CONN_CAPS_SIZE:
                body = _recv_exactly(sock, 4 + RPC_CONN_CAPS_SIZE, deadline)
    except TimeoutError:
        raise RpcServerError(
            f"the RPC server {endpoint} did not answer the handshake within {timeout_s:g} s: "
            "is it a llama.cpp RPC server (`smcspec rpc-server`), and not busy with another "
            "client?"
        ) from None
    except OSError:  # reset by a peer that refused the bytes: another protocol
        pass
    if len(body) != 4 + RPC_CONN_CAPS_SIZE:
        seen = (head + body)[:16]
        raise RpcServerError(
            f"{endpoint} did not answer as a llama.cpp RPC server (it sent {seen!r}); "
            "check the address and port"
        )
    version = (body[0], body[1], body[2])
    if version[0] != RPC_PROTO_VERSION[0] or version[1] > RPC_PROTO_VERSION[1]:
        mine = ".".join(map(str, RPC_PROTO_VERSION))
        raise RpcServerError(
            f"the RPC server {endpoint} speaks protocol {'.'.join(map(str, version))}, this "
            f"build {mine}: run the same llama.cpp version on both sides "
            "(`smcspec rpc-server` from the same smcspec setup)"
        )
    return version


def _recv_exactly(sock: socket.socket, n: int, deadline: float) -> bytes:
    """Up to ``n`` bytes from ``sock``: fewer only if the peer closed the connection.
    Raises ``TimeoutError`` past ``deadline`` (``time.monotonic()``)."""
    out = b""
    while len(out) < n:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError
        sock.settimeout(left)
        chunk = sock.recv(n - len(out))
        if not chunk:
            break
        out += chunk
    return out


def ggml_library() -> ctypes.CDLL:
    """libggml of the installed llama-cpp-python build (loaded by llama_cpp already)."""
    if "ggml" not in _LIBS:
        from smcspec.backends.llamacpp.lib import library

        llama_cpp = library()
        libdir = Path(llama_cpp.__file__).parent / "lib"
        names = sorted(libdir.glob("libggml.so*")) + sorted(libdir.glob("libggml.dylib"))
        names += sorted(libdir.glob("ggml.dll"))
        if not names:
            raise ConfigError(f"libggml not found in {libdir}")
        lib = ctypes.CDLL(str(names[0]))
        vp, cp, sz = ctypes.c_void_p, ctypes.c_char_p, ctypes.c_size_t
        for name, args, res in (
            ("ggml_backend_reg_by_name", [cp], vp),
            ("ggml_backend_reg_get_proc_address", [vp, cp], vp),
            ("ggml_backend_reg_dev_count", [vp], sz),
            ("ggml_backend_reg_dev_get", [vp, sz], vp),
            ("ggml_backend_dev_count", [], sz),
            ("ggml_backend_dev_get", [sz], vp),
            ("ggml_backend_dev_type", [vp], ctypes.c_int),
            ("ggml_backend_dev_by_type", [ctypes.c_int], vp),
            ("ggml_backend_dev_name", [vp], cp),
        ):
            fn = getattr(lib, name)
            fn.argtypes, fn.restype = args, res
        _LIBS["ggml"] = lib
    return _LIBS["ggml"]


def _rpc_function(name: str, restype, argtypes):
    lib = ggml_library()
    reg = lib.ggml_backend_reg_by_name(b"RPC")
    if not reg:
        raise ConfigError(
            "this llama-cpp-python build has no RPC backend; rebuild it with "
            "`bash scripts/setup.sh` (its builds turn GGML_RPC on)"
        )
    addr = lib.ggml_backend_reg_get_proc_address(reg, name.encode())
    if not addr:
        raise ConfigError(f"the RPC backend of this build lacks {name}")
    return ctypes.CFUNCTYPE(restype, *argtypes)(addr)


def supports_rpc() -> bool:
    """Whether the installed llama.cpp build has the RPC backend."""
    try:
        return bool(ggml_library().ggml_backend_reg_by_name(b"RPC"))
    except ConfigError:
        return False


def local_gpus() -> list[int]:
    """The GPU devices (discrete or integrated) of this process's llama.cpp build
    (``ggml_backend_dev_t`` handles; none on a CPU build). RPC devices are not local."""
    lib = ggml_library()
    devs = (lib.ggml_backend_dev_get(i) for i in range(lib.ggml_backend_dev_count()))
    out = []
    for d in devs:
        name = lib.ggml_backend_dev_name(d).decode()
        if lib.ggml_backend_dev_type(d) in (DEVICE_GPU, DEVICE_IGPU) and not name.startswith("RPC"):
            out.append(d)
    return out


def gpu_devices() -> list[str]:
    """Names of the local GPU devices the llama.cpp build sees (see :func:`local_gpus`)."""
    lib = ggml_library()
    return [lib.ggml_backend_dev_name(d).decode() for d in local_gpus()]


def rpc_devices(endpoints: tuple[str, ...], local: list[int] | None = None) -> ctypes.Array:
    """A NULL-terminated ``ggml_backend_dev_t[]``: every device of every server, then the
    ``local`` GPU devices (llama.cpp's own order: RPC first, to send less over the network),
    for ``llama_model_params.devices`` (keep the array alive as long as the model).

    Raises:
        RpcServerError: a server that cannot be reached or does not answer the handshake.
        ConfigError: a build without RPC.
    """
    for ep in endpoints:
        check_reachable(ep)
    add_server = _rpc_function("ggml_backend_rpc_add_server", ctypes.c_void_p, [ctypes.c_char_p])
    lib = ggml_library()
    devices: list[int] = []
    for ep in endpoints:
        reg = add_server(ep.encode())
        devices += [lib.ggml_backend_reg_dev_get(reg, i) for i in
                    range(lib.ggml_backend_reg_dev_count(reg))]  # fmt: skip
    devices += list(local or [])
    return (ctypes.c_void_p * (len(devices) + 1))(*devices, None)


def listen_address(host: str, port: int) -> str:
    """The IPv4 address llama.cpp's RPC server is to listen on for ``host`` (an address, or
    a name such as ``localhost``, resolved here: llama.cpp takes dotted IPv4 addresses only),
    after checking that ``host:port`` can be bound now (the socket is closed again).

    Raises:
        ConfigError: ``host`` does not resolve to an IPv4 address.
        RpcServerError: ``host:port`` cannot be bound (the port is in use, the address is
            not this machine's, a privileged port).
    """
    try:
        infos = socket.getaddrinfo(host, port, socket.AF_INET, socket.SOCK_STREAM)
    except (OSError, UnicodeError) as exc:
        raise ConfigError(
            f"--host {host!r} is not an IPv4 address or a name of one ({exc}); llama.cpp's RPC "
            "server listens on IPv4 only"
        ) from None
    address = infos[0][4][0]
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as llama.cpp binds
        try:
            probe.bind((address, port))
        except OSError as exc:
            raise RpcServerError(
                f"cannot listen on {host}:{port} ({exc.strerror or exc}): another process "
                "holds the port, or the address is not this machine's"
            ) from None
    return address


def serve_rpc(host: str, port: int, threads: int, cache_dir: str | None = None) -> None:
    """Serve this machine's GPUs (or its CPU when it has none) to RPC clients on
    ``host:port``; blocks until the process is stopped. llama.cpp's ``rpc-server`` does the
    same.

    Raises:
        ConfigError: a build without RPC, a host that is no IPv4 address or name of one.
        RpcServerError: ``host:port`` cannot be bound (:func:`listen_address`), or
            llama.cpp's server loop returned: it returns only when it could not listen or
            accept (its message is printed above), having served nothing more.
    """
    address = listen_address(host, port)
    start = _rpc_function(
        "ggml_backend_rpc_start_server",
        None,
        [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_size_t, ctypes.c_size_t, ctypes.c_void_p],
    )
    devs = local_gpus() or [ggml_library().ggml_backend_dev_by_type(DEVICE_CPU)]
    arr = (ctypes.c_void_p * len(devs))(*devs)
    cache = cache_dir.encode() if cache_dir else None
    start(
        f"{address}:{port}".encode(), cache, threads, len(devs), ctypes.cast(arr, ctypes.c_void_p)
    )
    raise RpcServerError(
        f"llama.cpp's RPC server on {host}:{port} stopped: it could not listen on the port or "
        "accept a connection"
    )
