"""The API's watch on a client's socket (app/api.py), on real connected sockets: a hang-up ends the
request at once; data from the client, or the request's own end, stops the watch and ends nothing."""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator

import pytest

from app.api import CLIENT_WATCH_SECONDS, _watch


class Watched:
    """What the watch needs of a Generation: whether it ended, and how to end it."""

    def __init__(self) -> None:
        self.ended = False
        self.left = threading.Event()

    def client_left(self) -> None:
        self.left.set()


@pytest.fixture()
def connection() -> Iterator[tuple[socket.socket, socket.socket]]:
    """(server side, client side) of a real TCP connection on the loopback interface."""
    with socket.create_server(("127.0.0.1", 0)) as listener:
        client = socket.create_connection(listener.getsockname())
        server, _ = listener.accept()
    yield server, client
    server.close()
    client.close()


def watch(server: socket.socket, watched: Watched) -> threading.Thread:
    thread = threading.Thread(target=_watch, args=(server, watched), daemon=True)
    thread.start()
    return thread


def test_a_hang_up_ends_the_request_at_once(connection) -> None:  # type: ignore[no-untyped-def]
    server, client = connection
    watched = Watched()
    thread = watch(server, watched)
    client.close()
    assert watched.left.wait(5)
    thread.join(5)
    assert not thread.is_alive()


def test_data_from_the_client_is_not_a_hang_up_and_is_left_unread(connection) -> None:  # type: ignore[no-untyped-def]
    server, client = connection
    watched = Watched()
    thread = watch(server, watched)
    client.sendall(b"GET /health HTTP/1.1\r\n\r\n")
    thread.join(5)
    assert not thread.is_alive() and not watched.left.is_set()
    assert server.recv(4) == b"GET "  # the next request on a kept-alive connection is intact


def test_the_watch_ends_with_its_request(connection) -> None:  # type: ignore[no-untyped-def]
    server, client = connection
    watched = Watched()
    thread = watch(server, watched)
    watched.ended = True
    thread.join(CLIENT_WATCH_SECONDS + 5)
    assert not thread.is_alive()
    client.close()
    assert not watched.left.is_set()
