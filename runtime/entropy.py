"""Randomness, injected: the ids, nonces and random draws a service makes come from an
`Entropy`, as its time comes from a `Clock` (runtime.clock).

A real service draws from the operating system (`SYSTEM`: `secrets`, unguessable). A simulated
cluster gives each node a `SeededEntropy` made from the run's seed, so the same seed draws the
same machine ids, epochs and placement samples every time and a failing run replays exactly.
Key material and AEAD nonces are not drawn here: they must stay unpredictable in every run.
"""

from __future__ import annotations

import random
import secrets
from typing import Protocol


class Entropy(Protocol):
    def token_hex(self, nbytes: int) -> str:
        """`nbytes` random bytes as 2 * nbytes hex digits: ids, epochs, lease nonces."""
        ...

    def rng(self) -> random.Random:
        """A generator of its own for random draws (placement samples, probe order)."""
        ...


class SystemEntropy:
    """The operating system's randomness: what every real service uses."""

    def token_hex(self, nbytes: int) -> str:
        return secrets.token_hex(nbytes)

    def rng(self) -> random.Random:
        return random.Random()  # seeded from os.urandom


class SeededEntropy:
    """A reproducible stream: the same seed gives the same values in the same order, in every
    process and on every Python run (a str seed is hashed with SHA-512, not `hash()`).

    `child(name)` is a stream of its own, fixed by the seed and the name alone, so one node's
    draws do not shift when another node draws more or less.
    """

    def __init__(self, seed: int | str) -> None:
        self.seed = seed
        self._random = random.Random(seed)

    def token_hex(self, nbytes: int) -> str:
        return self._random.randbytes(nbytes).hex()

    def rng(self) -> random.Random:
        return random.Random(self._random.getrandbits(64))

    def child(self, name: str) -> SeededEntropy:
        return SeededEntropy(f"{self.seed}/{name}")


SYSTEM: Entropy = SystemEntropy()
