"""Ports handed out by hiradix.testing: a server's port keeps the ports SGLang derives from it
under DP attention (port+233 .. port+239) free and reserved, so that no store, router or nccl
port picked later lands on them (a CI run lost the PD/DP module to 'Address already in use')."""

import socket

import pytest

from hiradix.testing.server import SERVER_DERIVED_PORT_OFFSETS, pick_free_port, pick_server_port

LOW = 30400  # below the kernel's ephemeral range, above DEFAULT_PORT_RANGE: nothing else picks here


def _listen(port: int) -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.bind(("127.0.0.1", port))
    except OSError:
        sock.close()
        pytest.skip(f"port {port} is taken on this machine")
    sock.listen()
    return sock


def test_server_port_skips_candidates_whose_derived_ports_are_taken_and_reserves_its_own():
    # Listening sockets on derived ports only: LOW+233 is LOW's dist-init port, LOW+240 and
    # LOW+241 fall in the windows of LOW+1 .. LOW+8; LOW+9's window (LOW+242 ..) stays free.
    blocked = [_listen(LOW + offset) for offset in (233, 240, 241)]
    try:
        port = pick_server_port((LOW, LOW + 9))
    finally:
        for sock in blocked:
            sock.close()
    assert port == LOW + 9
    window = (port + SERVER_DERIVED_PORT_OFFSETS[0], port + SERVER_DERIVED_PORT_OFFSETS[-1])
    assert window == (port + 233, port + 239)
    with pytest.raises(RuntimeError, match="no free TCP port"):
        pick_free_port(window)
    with pytest.raises(RuntimeError, match="no free TCP port"):
        pick_server_port((port, port))
