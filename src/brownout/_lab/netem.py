"""Whether `tc netem` (real packet loss, delay and reordering in the kernel) can be used here,
found by trying it in a throwaway network namespace: nothing on the host is changed.

`brownout proxy --netem-check` prints the answer; docs/proxy.md gives the commands.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

__all__ = ["NetemStatus", "netem_status"]

PROBE = "ip link set lo up && tc qdisc add dev lo root netem delay 1ms loss 1%"


@dataclass(frozen=True)
class NetemStatus:
    usable: bool
    how: str
    """The ``unshare`` options that worked ("--net" as root, "--user --map-root-user --net"
    without), or "" when none did."""
    detail: str


def netem_status(
    run: Callable[..., subprocess.CompletedProcess[Any]] = subprocess.run,
    which: Callable[[str], str | None] = shutil.which,
    euid: int | None = None,
) -> NetemStatus:
    """Try netem on the loopback of a new network namespace (a user namespace too when not
    root); ``run``, ``which`` and ``euid`` are for tests."""
    missing = [tool for tool in ("tc", "ip", "unshare") if which(tool) is None]
    if missing:
        return NetemStatus(False, "", f"not found: {', '.join(missing)} (iproute2, util-linux)")
    uid = os.geteuid() if euid is None else euid
    attempts = [["--net"]] if uid == 0 else []
    attempts.append(["--user", "--map-root-user", "--net"])
    errors = []
    for options in attempts:
        try:
            done = run(
                ["unshare", *options, "sh", "-c", PROBE],
                capture_output=True,
                text=True,
                timeout=10,
                check=False,
            )
        except (OSError, subprocess.TimeoutExpired) as e:
            errors.append(f"unshare {' '.join(options)}: {e}")
            continue
        if done.returncode == 0:
            return NetemStatus(
                True, " ".join(options), f"netem works in `unshare {' '.join(options)}`"
            )
        message = (done.stderr or done.stdout or "").strip().splitlines()
        reason = message[-1] if message else f"exit status {done.returncode}"
        if "qdisc kind is unknown" in reason:
            reason += " (the kernel has no netem: module sch_netem is not loaded or not built)"
        errors.append(f"unshare {' '.join(options)}: {reason}")
    return NetemStatus(False, "", "; ".join(errors))
