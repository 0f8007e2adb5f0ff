"""The chat-template renderer's child process (see provider/models/renderer.py): a fresh interpreter
started as a script (``python -P this_file REQ REP LIFELINE MEMORY``), so it imports nothing of the
agent and shares no state with it.

It renders with transformers' own ``render_jinja_template`` (what ``apply_chat_template`` calls) and
answers one message per request, led by one status byte:

    S        ready (imports done)               X   could not start
    R text   rendered (UTF-8, surrogates kept)   E   the template raised for these messages
    M        the memory bound: a MemoryError under the address-space limit, or a rendered prompt
             longer than the request's ``max_chars``

Nothing it writes carries template or prompt text except an ``R`` answer; its stdout and stderr go
nowhere. It exits when the agent goes (the lifeline pipe's other end closes), even mid-render.
"""

from __future__ import annotations

import os
import pickle
import resource
import signal
import sys
import threading


def _follow_parent(lifeline: int) -> None:
    """Exit as soon as the parent's end of the lifeline closes (the parent exited or was killed)."""
    def watch() -> None:
        try:
            os.read(lifeline, 1)
        finally:
            os._exit(0)

    threading.Thread(target=watch, name="lifeline", daemon=True).start()


def _limit(memory_bytes: int) -> None:
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))  # a core file would hold prompts
    if memory_bytes > 0:
        try:
            resource.setrlimit(resource.RLIMIT_AS, (memory_bytes, memory_bytes))
        except (ValueError, OSError):  # not enforceable here (macOS): the parent watches the RSS
            pass


def _render(request: bytes, render_jinja_template) -> bytes:
    source, variables, messages, add_generation_prompt, extra, max_chars = pickle.loads(request)
    extra = dict(extra)
    tools, documents = extra.pop("tools", None), extra.pop("documents", None)
    chat = [{k: v for k, v in m.items() if v is not None} for m in messages]  # as apply_chat_template
    rendered, _ = render_jinja_template(conversations=[chat], tools=tools, documents=documents,
                                        chat_template=source, add_generation_prompt=add_generation_prompt,
                                        **{**variables, **extra})
    text = rendered[0]
    if len(text) > max_chars:
        return b"M"
    return b"R" + text.encode("utf-8", "surrogatepass")


def main(argv: list[str]) -> int:
    from multiprocessing.connection import Connection

    req_fd, rep_fd, lifeline, memory_bytes = (int(a) for a in argv[1:5])
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the agent decides when this process stops
    _follow_parent(lifeline)
    _limit(memory_bytes)
    requests, replies = Connection(req_fd, writable=False), Connection(rep_fd, readable=False)
    try:
        from transformers.utils.chat_template_utils import render_jinja_template
    except Exception:  # an edge: the agent reports the renderer unavailable
        replies.send_bytes(b"X")
        return 1
    replies.send_bytes(b"S")
    while True:
        try:
            request = requests.recv_bytes()
        except EOFError:
            return 0
        try:
            answer = _render(request, render_jinja_template)
        except MemoryError:
            answer = b"M"
        except Exception:  # the template's own failure, whatever it raised: a client error
            answer = b"E"
        del request
        replies.send_bytes(answer)
        if answer == b"M":
            return 0  # a fresh process for the next render: nothing of this one's heap is kept


if __name__ == "__main__":
    for name in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ[name] = "1"  # numpy comes with transformers: no thread pools, no per-thread buffers
    sys.exit(main(sys.argv))
