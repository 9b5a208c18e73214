"""A plain TCP forwarder on 127.0.0.1, for tests of who can read or stand in
for a job's store: a squatter on a meeting point, a relay between ranks."""

import socket
import threading


def relay(listen_port, target_port, seen=None):
    """Forwards 127.0.0.1:listen_port (0: a port the OS picks) to
    target_port, both ways, appending every chunk it passes to ``seen``
    when given; returns its listener (close it)."""
    listener = socket.create_server(("127.0.0.1", listen_port))

    def pump(src, dst):
        try:
            while data := src.recv(65536):
                if seen is not None:
                    seen.append(data)
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for sock in (src, dst):
                try:
                    sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def forward():
        while True:
            try:
                client, _ = listener.accept()
            except OSError:
                return
            upstream = socket.create_connection(("127.0.0.1", target_port), timeout=5)
            upstream.settimeout(None)
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=pump, args=(a, b), daemon=True).start()
    threading.Thread(target=forward, daemon=True).start()
    return listener
