"""`python -m minivllm.worker FD`: one tensor-parallel rank (see `minivllm.worker.worker`)."""

import os
import sys
from multiprocessing.connection import Connection

from minivllm.worker.worker import run_worker

status = run_worker(Connection(int(sys.argv[1])))
sys.stdout.flush()
sys.stderr.flush()
os._exit(status)  # the group is already torn down; skip the interpreter's slow module teardown
