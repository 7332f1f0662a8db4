"""Fitting a process's open-file limit to the sockets it must hold (the lab's generator and
demo servers).

A stock soft ``RLIMIT_NOFILE`` (1024 on Linux, 256 on macOS) is below what a 10x flood needs:
the generator's pool alone may hold 1,024 connections, and the demo front accepts them all
and holds its own to the dependency besides. Running out is counted as the wrong thing
(``errors`` at the generator, refused connections at the server), so each process raises its
soft limit as far as the hard limit allows before it starts.
"""

from __future__ import annotations

import contextlib
import os

__all__ = ["fit_fd_limit"]

_FD_MARGIN = 64
"""Descriptors kept free beyond the pool's connections (the pipe, the loop, admin calls)."""


def fit_fd_limit(connections: int) -> int:
    """Raise the soft ``RLIMIT_NOFILE`` so ``connections`` sockets fit; return how many fit.

    A stock soft limit (1024 on Linux, 256 on macOS) is below a 1024-connection pool: connects
    would fail with EMFILE, and the generator's own shortage count as server ``errors``. When
    the hard limit forbids enough, the pool shrinks instead: requests wait for a connection and
    expire unsent, which is what ``timeouts_unsent`` means (the generator's own limit).
    """
    try:
        import resource
    except ImportError:  # pragma: no cover - Windows
        return connections
    try:
        in_use = len(os.listdir("/dev/fd"))
    except OSError:  # pragma: no cover
        in_use = _FD_MARGIN
    need = in_use + connections + _FD_MARGIN
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < need:
        target = need if hard == resource.RLIM_INFINITY else min(need, hard)
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    if soft == resource.RLIM_INFINITY:
        return connections
    return max(1, min(connections, soft - in_use - _FD_MARGIN))
