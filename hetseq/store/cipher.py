"""The AEAD cipher that seals every frame of the store's channel after its
handshake (channel.py): ChaCha20-Poly1305 from the ``cryptography``
package. An HMAC alone kept frames from being forged but let anyone on the
path read them, and the store holds the job's identity, its hosts, PIDs,
gloo addresses and its status (docs/security.md).

``cryptography`` is imported only when a job has a secret: it is an extra
(``pip install 'hetseq[secret]'``), some machines lack it, and a job without
a secret must not need it. Where it is missing and a secret is set the job
stops with one line (exit 2); it never falls back to authentication only.
"""

import sys

from hetseq.base.errors import UserError

KEY = 32                  # ChaCha20-Poly1305's key
TAG = 16                  # its tag, after each frame's ciphertext
INSTALL = "pip install cryptography"


def aead():
    """The ChaCha20Poly1305 class and its InvalidTag; UserError (exit 2)
    naming the install when the package cannot be imported."""
    try:
        from cryptography.exceptions import InvalidTag
        from cryptography.hazmat.primitives.ciphers.aead import ChaCha20Poly1305
    except ImportError as err:
        raise UserError(f"a job secret seals the store's traffic with ChaCha20-Poly1305 from "
                        f"the 'cryptography' package, which {sys.executable} cannot import "
                        f"({err}): {INSTALL} (or pip install 'hetseq[secret]') on every node "
                        "of the job and where hetseq-status runs, or run the job without a "
                        "secret") from None
    return ChaCha20Poly1305, InvalidTag


class Seal:
    """One direction of one connection: ``key`` is used for that direction
    only (channel._session_keys: from the stretched secret and both ends'
    nonces, so no two connections share it), and frame ``seq`` is sealed
    with nonce ``seq``, so a frame replayed, reordered or moved to another
    connection fails to open. ``header`` (the frame's length) is
    authenticated with it."""

    def __init__(self, key: bytes):
        cls, self._invalid = aead()
        self._aead = cls(key)

    @staticmethod
    def _nonce(seq: int) -> bytes:
        return b"\0\0\0\0" + seq.to_bytes(8, "big")

    def seal(self, seq: int, header: bytes, data: bytes) -> bytes:
        """``data`` encrypted, then its TAG bytes."""
        return self._aead.encrypt(self._nonce(seq), data, header)

    def open(self, seq: int, header: bytes, sealed: bytes) -> bytes | None:
        """The data of frame ``seq``; None when it fails authentication."""
        try:
            return self._aead.decrypt(self._nonce(seq), sealed, header)
        except self._invalid:
            return None

    def __repr__(self):
        return "Seal(<elided>)"
