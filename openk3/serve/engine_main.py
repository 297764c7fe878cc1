"""The engine process's entry point: `python -m openk3.serve.engine_main INBOX_FD OUTBOX_FD`, started by
`process.EngineProcess` (a module of its own, so that `-m` does not run `process` a second time as __main__)."""

import logging
import os
import sys

from openk3.serve.process import child_main

if __name__ == "__main__":
    child_main(int(sys.argv[1]), int(sys.argv[2]))
    # Done (told to stop, or the parent is gone): exit without the interpreter's teardown, which takes ~1.5 s with
    # torch loaded, and the server's shutdown waits for this process. Nothing is left to write but the log.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
