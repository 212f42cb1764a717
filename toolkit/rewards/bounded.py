"""Reward function calls with a time limit (`reward.functions[].timeout_s`). A function that stalls (a judge
waiting on a network call, a sandbox that never returns) holds the scorer's main thread while its heartbeat
goes on, so nothing restarts it and the run fails only at `transport.step_timeout_s` (30 min by default)
with a message that does not name the function. A function given a limit runs in a thread of its own and
the scorer waits for each call at most that long. Python cannot stop a thread: a call past its limit is
left to run in its (daemon) thread, which does not hold the process at exit, and a later call gets a new
thread. Without a limit a function is called in the scorer's main thread, as it must be where it sets
signal handlers (math_verify's own timeouts use SIGALRM: "signal only works in main thread")."""

from __future__ import annotations

import queue
import threading
from typing import Callable


class CallTimeout(Exception):
    pass


def bounded(function: Callable, timeout_s: float | None) -> Callable:
    """`function`, its calls limited to `timeout_s` (in a thread of their own); unlimited: itself."""
    return function if timeout_s is None else BoundedCalls(function, timeout_s)


class BoundedCalls:
    """`calls(**kwargs)` is `function(**kwargs)`, run in this object's thread and waited for at most
    `timeout_s`: its value, its exception (SystemExit too) raised here, or CallTimeout."""

    def __init__(self, function: Callable, timeout_s: float):
        self.function, self.timeout_s = function, timeout_s
        self._calls: queue.SimpleQueue | None = None  # (to the thread; None: no thread, or one left stuck)
        self._results: queue.SimpleQueue | None = None

    def __call__(self, **kwargs):
        if self._calls is None:
            self._calls, self._results = queue.SimpleQueue(), queue.SimpleQueue()
            threading.Thread(target=self._serve, args=(self._calls, self._results), daemon=True,
                             name=f"reward {getattr(self.function, '__name__', 'function')}").start()
        self._calls.put(kwargs)
        try:
            ok, value = self._results.get(timeout=self.timeout_s)
        except queue.Empty:
            self._calls = self._results = None  # (its thread is still in the call: leave it to it)
            raise CallTimeout(f"no result within {self.timeout_s:g} s") from None
        if ok:
            return value
        raise value

    def _serve(self, calls: queue.SimpleQueue, results: queue.SimpleQueue) -> None:
        while True:  # (idle between calls; a daemon thread, it ends with the process)
            kwargs = calls.get()
            try:
                results.put((True, self.function(**kwargs)))
            except BaseException as e:  # (handed to the caller, which raises it: SystemExit included)
                results.put((False, e))
