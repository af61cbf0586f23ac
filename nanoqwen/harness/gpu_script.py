"""What the GPU check scripts in dev/ share: a log teed to a file, torch on the engine's stream,
and parts that fail on their own.

A check script runs several independent parts (validate one kernel, validate another, time
them); one device call is scarce, so a part that raises must not hide the others' results:
`run_part` logs its traceback and records None, and the script's last lines say which parts
failed.
"""

from __future__ import annotations

import contextlib
import os
import time
import traceback
from collections.abc import Callable, Iterator


@contextlib.contextmanager
def gpu_session(out_dir: str, log_name: str) -> Iterator[tuple[object, Callable[[str], None]]]:
    """(gpu, log): a Gpu whose stream torch runs on too, so spin kernels, torch's references
    and our launches share one queue in order; log(msg) prints msg and appends it to
    out_dir/log_name. torch's float32 matmuls stay float32 (tf32 off): they are references."""
    import torch

    from ..cuda.device import Gpu

    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, log_name), "w") as fh:

        def log(msg: str) -> None:
            print(msg, flush=True)
            fh.write(msg + "\n")
            fh.flush()

        torch.backends.cuda.matmul.allow_tf32 = False
        torch.cuda.init()
        gpu = Gpu(torch.cuda.current_device())
        with torch.cuda.stream(torch.cuda.ExternalStream(int(gpu.stream.handle))):
            yield gpu, log


def run_part(name: str, results: dict, log: Callable[[str], None], fn: Callable[[], object]):
    """results[name] = fn(), or None when it raises (the traceback logged, not raised); the
    part's seconds logged either way. Returns results[name]."""
    t0 = time.time()
    try:
        results[name] = fn()
    except Exception:  # every later part should still run
        log(f"{name}: FAILED\n{traceback.format_exc()}")
        results[name] = None
    log(f"[{name}: {time.time() - t0:.1f} s]")
    return results[name]
