"""The Darkbloom provider agent: the only package that does I/O."""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("darkbloom-provider")
except PackageNotFoundError:  # running from a source tree that was not installed
    __version__ = "0.0.0+local"
