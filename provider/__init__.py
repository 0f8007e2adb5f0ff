"""The Darkbloom provider agent: the only package that does I/O."""

import os
from importlib.metadata import PackageNotFoundError, version

# transformers (the tokenizers mlx-lm loads) prints "[transformers] PyTorch was not found ..." on
# first use, straight to stderr. MLX serving never uses PyTorch, so that advice is only noise in
# a terminal and in the service log. An operator who sets the variable keeps their own value.
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")

try:
    __version__ = version("darkbloom-provider")
except PackageNotFoundError:  # running from a source tree that was not installed
    __version__ = "0.0.0+local"
