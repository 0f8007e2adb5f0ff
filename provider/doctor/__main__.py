"""`python -m provider.doctor [flags]`: `darkbloom-provider doctor [flags]`."""

import sys

from provider.cli import main

if __name__ == "__main__":
    sys.exit(main(["doctor", *sys.argv[1:]]))
