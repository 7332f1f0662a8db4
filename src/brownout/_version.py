"""The installed version, read once from the package metadata (written in pyproject.toml)."""

from importlib import metadata

__all__ = ["VERSION"]

try:
    VERSION = metadata.version("brownout")
except metadata.PackageNotFoundError:  # a source tree on sys.path, never installed
    VERSION = "0+unknown"
