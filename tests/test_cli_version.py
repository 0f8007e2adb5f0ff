import subprocess
import sys

from provider import __version__


def test_version_flag_prints_the_installed_version():
    out = subprocess.run(
        [sys.executable, "-m", "provider.cli", "--version"], capture_output=True, text=True, check=True
    )
    assert out.stdout.strip() == f"darkbloom-provider {__version__}"
    assert __version__ != "0.0.0+local"
