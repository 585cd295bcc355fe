"""Telling autograd's device threads, running a blocked thread's backward, from real concurrency.

On CUDA, autograd runs the backward on a per-device worker thread while the thread that
called ``backward()`` waits inside the engine. A node's backward scope then starts on the
worker thread; if the waiting thread is itself inside a scope (``with
fp32_precision_scope(p): loss.backward()``), that is nesting, not two threads changing the
flags at once: the waiting thread runs nothing until the backward is over.
"""

from __future__ import annotations

import sys
import threading

import torch

from fp32scope._compat import ENGINE_RUN_BACKWARD

__all__ = ["runs_backward_for"]

_graph_task_id = torch._C._current_graph_task_id

# Every backward()/grad() call blocks in this function's frame while the engine runs.
_ENGINE_CODE = None if ENGINE_RUN_BACKWARD is None else ENGINE_RUN_BACKWARD.__code__


def runs_backward_for(owner: int) -> bool:
    """Whether this thread is an autograd worker running a backward that thread ``owner`` waits on.

    True only on a thread that Python did not start (autograd's device threads are C++
    threads), while it runs a graph task, and while ``owner`` is blocked in autograd's
    engine call. A Python thread is never let in, so two Python threads running scoped
    code at once are always refused.
    """
    if _ENGINE_CODE is None or _graph_task_id() == -1:
        return False
    if not isinstance(threading.current_thread(), threading._DummyThread):
        return False
    frame = sys._current_frames().get(owner)
    return frame is not None and frame.f_code is _ENGINE_CODE
