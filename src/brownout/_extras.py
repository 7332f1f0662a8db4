"""The error for an optional dependency that is not installed.

Each integration and exporter needs a package that brownout installs only with an extra
(``brownout[grpc]``, ``brownout[prometheus]``...). Without it, importing the module fails with
``No module named 'grpc'``, which does not say what to install; this error names the extra.
"""

from __future__ import annotations

__all__ = ["missing_extra"]


def missing_extra(module: str, extra: str, error: ModuleNotFoundError) -> ModuleNotFoundError:
    """The `ModuleNotFoundError` to raise from ``module`` when ``error`` (a failed import of
    one of its third-party dependencies) means the ``extra`` is not installed."""
    package = (error.name or "a missing").split(".")[0]
    return ModuleNotFoundError(
        f"{module} needs the {package} package, which comes with brownout's "
        f"{extra!r} extra: pip install 'brownout[{extra}]'",
        name=error.name,
    )
