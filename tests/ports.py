"""For the tests that launch several processes (gloo rendezvous, accelerate, a vLLM server): a free local TCP port, and
the end of a gloo worker's process group."""

from __future__ import annotations

import os
import socket
import sys


def free_port() -> int:
    """A port on 127.0.0.1 that nothing listens on now (the OS picks it; free until someone binds it)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def end_process_group() -> None:
    """``destroy_process_group`` once every rank got here: a rank tearing down while another is still in a collective
    can abort the process at exit ("terminate called without an active exception": gloo's threads). A failed rank
    never arrives; its own error is the one to read. Called from a worker's ``finally`` with no exception propagating
    (the worker succeeded), the process then ends here with exit code 0 (``os._exit``): the last thing a worker does."""
    import torch.distributed as dist

    try:
        dist.barrier()
    except Exception:  # noqa: BLE001
        pass
    dist.destroy_process_group()
    if sys.exc_info()[0] is None:  # the worker succeeded (called from its ``finally``): leave without the teardown
        # even after the barrier, gloo's threads still aborted the interpreter's exit now and then (pytorch#190489:
        # CI of 582aaa6, test_vllm_fsdp2_push, both ranks); os._exit skips the C++ static destructors where they do
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
