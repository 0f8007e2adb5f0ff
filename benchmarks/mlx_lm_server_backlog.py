"""`mlx_lm.server` with a listen backlog that holds many clients connecting at once; mlx-lm unchanged.

`mlx_lm.server` serves with the standard library's `ThreadingHTTPServer`, which listens with
`request_queue_size = 5`: when 32 clients connect at once, the kernel drops the SYNs beyond the
backlog and those clients retry a second (then three) later, which shows as TTFT that is not the
server's. This wrapper raises the class attribute before `mlx_lm.server.main()` builds its server;
every other argument goes to `mlx_lm.server` as is.

    python benchmarks/mlx_lm_server_backlog.py [--backlog 256] --model PATH [mlx_lm.server arguments]
"""

from __future__ import annotations

import argparse
import sys
from http.server import ThreadingHTTPServer

DEFAULT_BACKLOG = 256


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--backlog", type=int, default=DEFAULT_BACKLOG)
    args, rest = parser.parse_known_args(argv)
    # socketserver.TCPServer.server_activate listens with self.request_queue_size.
    ThreadingHTTPServer.request_queue_size = args.backlog
    from mlx_lm import server

    sys.argv = ["mlx_lm.server", *rest]
    server.main()


if __name__ == "__main__":
    main()
