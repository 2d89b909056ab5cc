"""Ports handed out by hiradix.testing: a server's port keeps the ports SGLang derives from it
under DP attention (port+233 .. port+239) free and reserved, so that no store, router or nccl
port picked later lands on them (a CI run lost the PD/DP module to 'Address already in use')."""

import socket

import pytest

from hiradix.testing.server import SERVER_DERIVED_PORT_OFFSETS, _port_is_free, pick_free_port, pick_server_port

BLOCKED = (233, 240, 241)  # offsets from the base port that the test listens on


def _free_base() -> int:
    """A base port LOW, below the kernel's ephemeral range and above DEFAULT_PORT_RANGE (nothing
    else in this process picks there), whose 10 candidates and their derived windows are free."""
    for low in range(30000, 32500, 50):
        if all(_port_is_free(p) for p in range(low, low + 10 + SERVER_DERIVED_PORT_OFFSETS[-1])):
            return low
    raise AssertionError("no free window of ports in 30000-32700 on this machine")


def _listen(port: int) -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", port))
    sock.listen()
    return sock


def test_server_port_skips_candidates_whose_derived_ports_are_taken_and_reserves_its_own():
    low = _free_base()
    # Listening sockets on derived ports only: low+233 is low's dist-init port, low+240 and
    # low+241 fall in the windows of low+1 .. low+8; low+9's window (low+242 ..) stays free.
    blocked = [_listen(low + offset) for offset in BLOCKED]
    try:
        port = pick_server_port((low, low + 9))
    finally:
        for sock in blocked:
            sock.close()
    assert port == low + 9
    window = (port + SERVER_DERIVED_PORT_OFFSETS[0], port + SERVER_DERIVED_PORT_OFFSETS[-1])
    assert window == (port + 233, port + 239)
    with pytest.raises(RuntimeError, match="no free TCP port"):
        pick_free_port(window)
    with pytest.raises(RuntimeError, match="no free TCP port"):
        pick_server_port((port, port))
