"""The reward worker pool: every check in a forkserver/spawn worker process under a hard time limit.

    with RewardPool(num_workers=2) as pool:                      # forkserver workers, warm on return
        r = pool.score("math", responses, golds)                 # float32 [B], in order
        fut = pool.score_async("gsm8k", responses, golds)        # overlap with device work
        checks = pool.check("mc", responses, golds, metas)       # [RewardCheck(reward, correct, answer, status)]

The checks themselves (:func:`~ict_jax.rewards.checks.check_text`, :class:`~ict_jax.rewards.checks.RewardSpec`,
:class:`~ict_jax.rewards.checks.RewardCheck`) are pure functions in :mod:`ict_jax.rewards.checks`.
Rules and limits: docs/rewards.md.
"""

from __future__ import annotations

import collections
import importlib
import math
import multiprocessing as mp
import os
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future
from multiprocessing.connection import wait as mp_wait
from multiprocessing.reduction import ForkingPickler
from typing import Any

import numpy as np

from ict_jax.rewards.checks import RewardCheck, RewardSpec, check_text, math_equal, response_tail, reward_kinds

__all__ = ["RewardPool", "RewardFunctionError", "UnguardedScriptError", "import_user_module", "load_function",
           "load_plugins"]


# ---- Worker processes ----
class RewardFunctionError(ValueError):
    """A custom reward function (``"package.module:function"``) that cannot be loaded in a worker."""


def import_user_module(module_name: str, search_dir: str | None = None, *, what: str) -> Any:
    """The user's module ``module_name``, imported (``search_dir``, the caller's working directory, is
    searched first, as ``python -m`` does). Raises :class:`RewardFunctionError` (a ValueError) whose one
    line starts with ``what`` and names the module and what went wrong. The one import of a user's module:
    a reward function's (:func:`load_function`) and a plugin's (:func:`load_plugins`)."""
    if search_dir and search_dir not in sys.path:
        sys.path.insert(0, search_dir)
    try:
        return importlib.import_module(module_name)
    except Exception as e:  # noqa: BLE001 - ImportError, or whatever the module raises on import
        raise RewardFunctionError(f"{what}: cannot import {module_name!r} ({type(e).__name__}: {e})") from None


def load_plugins(modules: Sequence[str], search_dir: str | None = None) -> None:
    """Import each plugin module (``plugins: [module, ...]``): importing one registers its selectors, loss
    aggregations and reward kinds. Importing twice is a no-op (Python's module cache). Raises
    :class:`RewardFunctionError` (one line naming ``plugins`` and the module)."""
    for name in modules:
        import_user_module(name, search_dir, what=f"plugins: {name!r}")


def load_function(spec: str, search_dir: str | None = None) -> Callable:
    """The function named by ``"package.module:function"``, imported here (call it in a worker process,
    never in the trainer). ``search_dir`` (the caller's working directory) is searched first, as
    ``python -m`` does. Raises :class:`RewardFunctionError` naming the spec and what is wrong."""
    module_name, sep, attr = str(spec).partition(":")
    if not sep or not module_name or not attr:
        raise RewardFunctionError(f"reward function {spec!r}: expected package.module:function")
    module = import_user_module(module_name, search_dir, what=f"reward function {spec!r}")
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise RewardFunctionError(f"reward function {spec!r}: module {module_name!r} has no function {attr!r}")
    return fn


def _run_check(kind, response, gold, meta, spec, checkers) -> RewardCheck:
    fn = checkers.get(kind)
    if fn is None:
        return check_text(kind, response, gold, meta, spec)
    out = fn(response, gold, meta)
    if isinstance(out, RewardCheck):
        return out
    if isinstance(out, (int, float, np.integer, np.floating)) and math.isfinite(float(out)):
        return RewardCheck(float(out), float(out) >= spec.correct, None)
    # a non-number or a non-finite number: the check failed (scored `wrong`, status names the problem)
    return RewardCheck(spec.wrong, False, None, f"error: returned {type(out).__name__} {out!r:.40}")


def _worker_main(conn, spec: RewardSpec, checkers: dict, mem_limit_mb: int | None, search_dir: str | None = None,
                 plugins: tuple[str, ...] = ()) -> None:
    import signal

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C goes to the parent, which closes the pool
    if mem_limit_mb:
        import resource

        limit = int(mem_limit_mb) << 20
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    math_equal("1", "1")  # import and warm math-verify before saying ready (off the first deadline)
    try:  # a no-op when the forkserver preloaded it; else its ~0.7 s import stays off the deadlines
        import reasoning_gym  # noqa: F401
    except ImportError:
        pass
    try:  # plugins (their reward kinds) and custom reward functions are imported here, in the worker
        load_plugins(plugins, search_dir)
        checkers = {k: load_function(v, search_dir) if isinstance(v, str) else v for k, v in checkers.items()}
    except RewardFunctionError as e:
        conn.send(("error", str(e)))
        return
    conn.send(("ready", os.getpid()))
    while True:
        try:
            task = conn.recv()
        except (EOFError, OSError):
            return
        if task is None:
            return
        try:
            res = _run_check(*task, spec, checkers)
        except BaseException as e:  # noqa: BLE001 - MemoryError, RecursionError, a checker's bug...
            res = RewardCheck(spec.wrong, False, None, f"error: {type(e).__name__}")
        conn.send((res.reward, res.correct, res.answer, res.status))


#: Exit code of a worker process whose start-up re-ran the user's script up to a RewardPool (a script
#: without ``if __name__ == "__main__":``): the parent turns it into :func:`unguarded_script_message`.
EXIT_REIMPORTED_MAIN = 86


class UnguardedScriptError(RuntimeError):
    """The workers could not start because they re-run the user's script, which creates the pool at its
    top level (no ``if __name__ == "__main__":``)."""


def _starting_child_process() -> bool:
    """True while this process is a spawn / forkserver child re-importing the parent's main module (the
    state in which multiprocessing itself refuses to start processes: ``_inheriting``)."""
    return bool(getattr(mp.current_process(), "_inheriting", False))


def unguarded_script_message(pid: int | None = None) -> str:
    """Why a worker died at start-up when the parent's script has no ``if __name__ == "__main__":``."""
    main = sys.modules.get("__main__")
    script = getattr(main, "__file__", None) or "your script"
    who = "a reward worker" if pid is None else f"reward worker {pid}"
    return (f"{who} re-ran {script} while starting and reached RewardPool(...) again: worker processes "
            "(forkserver/spawn) import the main script anew, so a script that creates a RewardPool must do so "
            "under `if __name__ == \"__main__\":` (docs/rewards.md)")


class _Worker:
    def __init__(self, ctx, spec, checkers, mem_limit_mb, search_dir=None, plugins=()):
        self.conn, child = ctx.Pipe(duplex=True)
        self.proc = ctx.Process(target=_worker_main, args=(child, spec, checkers, mem_limit_mb, search_dir, plugins),
                                daemon=True, name="ict_jax-reward")
        self.proc.start()
        child.close()
        self.state, self.task, self.deadline = "starting", None, time.monotonic()

    def stop(self, kill: bool) -> None:
        try:
            if kill:
                self.proc.kill()
            else:
                self.conn.send(None)
        except (OSError, ValueError):
            pass
        self.proc.join(timeout=None if kill else 2.0)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join()
        self.conn.close()


class _Batch:
    def __init__(self, n: int):
        self.results: list[RewardCheck | None] = [None] * n
        self.remaining = n
        self.future: Future = Future()


class RewardPool:
    """``num_workers`` checker processes (``context`` "forkserver" or "spawn"; never fork) behind one
    dispatcher thread. Each check gets ``time_limit`` seconds of wall clock from when a worker starts
    it; an overrunning worker is SIGKILLed, reaped and replaced, and the response scores
    ``spec.wrong`` with status "timeout". Workers run under an address-space limit of
    ``mem_limit_mb`` (None = none). ``checkers`` adds kinds: picklable top-level functions
    ``fn(response, gold, meta) -> RewardCheck | float``, or ``"package.module:function"`` strings imported
    in the workers only (a function that cannot be loaded: :class:`RewardFunctionError` from the
    constructor). ``plugins``: modules every worker imports first (``plugins: [module, ...]``: the reward
    kinds they register). The constructor returns when every worker is warm.
    Thread-safe; use as a context manager or call :meth:`close`."""

    # time_limit's default is rl.reward.time_limit's (config.RewardSection): rewards imports nothing of
    # ict_jax (the workers import it alone), so the number is pinned by a test, not imported
    def __init__(self, num_workers: int = 2, *, time_limit: float = 5.0, spec: RewardSpec | None = None,
                 context: str = "forkserver", mem_limit_mb: int | None = 2048,
                 checkers: Mapping[str, Callable] | None = None, start_timeout: float = 120.0,
                 plugins: Sequence[str] = ()):
        if _starting_child_process():  # a worker re-running the user's unguarded script: stop here, silently;
            os._exit(EXIT_REIMPORTED_MAIN)  # the parent names the problem (UnguardedScriptError)
        if context not in ("forkserver", "spawn"):
            raise ValueError(f"RewardPool: context must be 'forkserver' or 'spawn' (never fork), got {context!r}")
        if num_workers < 1 or time_limit <= 0:
            raise ValueError(f"RewardPool: need num_workers >= 1 and time_limit > 0, got {num_workers}, {time_limit}")
        self.spec, self.time_limit, self.start_timeout = spec or RewardSpec(), float(time_limit), start_timeout
        self._ctx = mp.get_context(context)
        if context == "forkserver":  # workers fork from a server that has these imported already
            import importlib.util

            gym = ["reasoning_gym"] if importlib.util.find_spec("reasoning_gym") else []
            mods = ["ict_jax.rewards.pool", "math_verify", *gym]
            self._ctx.set_forkserver_preload(mods)
        # a checker is a picklable top-level function, or "package.module:function", imported in the
        # workers only (from the caller's working directory first)
        self._args = (self.spec, dict(checkers or {}), mem_limit_mb, os.getcwd(), tuple(plugins))
        self.restarts = 0  # workers killed (timeout) or lost (crash) and replaced
        self._lock = threading.Lock()
        self._pending: collections.deque = collections.deque()
        self._closing = self._woken = False
        self._error: BaseException | None = None
        self._wake_r, self._wake_w = self._ctx.Pipe(duplex=False)
        t0 = time.monotonic()
        self._workers = [_Worker(self._ctx, *self._args) for _ in range(num_workers)]
        self._thread = threading.Thread(target=self._loop, name="ict_jax-reward-dispatch", daemon=True)
        self._ready = threading.Event()
        self._thread.start()
        if not self._ready.wait(start_timeout + 5) or self._error is not None:
            self.close()
            if isinstance(self._error, RewardFunctionError):  # the user's function: a one-line user error
                raise RewardFunctionError(str(self._error))
            if isinstance(self._error, UnguardedScriptError):  # the message says it all
                raise UnguardedScriptError(str(self._error))
            raise RuntimeError(f"RewardPool: workers failed to start: {self._error}")
        self.startup_seconds = time.monotonic() - t0

    # ---- public API ----
    def check_async(self, kind: str | Sequence[str], responses: Sequence[str], golds: Sequence[Any],
                    metas: Sequence[Mapping[str, Any] | None] | None = None) -> Future:
        """Dispatch all checks now; a Future of ``list[RewardCheck]`` in input order. ``kind`` is one kind
        for the batch or one per response."""
        n = len(responses)
        kinds = [kind] * n if isinstance(kind, str) else list(kind)
        metas = [None] * n if metas is None else list(metas)
        if not (len(kinds) == len(golds) == len(metas) == n):
            raise ValueError(f"RewardPool: {n} responses but {len(golds)} golds, {len(metas)} metas, "
                             f"{len(kinds)} kinds")
        for k in set(kinds):
            if k not in reward_kinds() and k not in self._args[1]:
                raise ValueError(f"unknown reward kind {k!r}; expected one of {reward_kinds() + tuple(self._args[1])}")
        batch = _Batch(n)
        if n == 0:
            batch.future.set_result([])
            return batch.future
        cap = self.spec.max_response_chars
        # pickled here, in the caller: an unpicklable meta raises to the caller and never reaches the pool
        tasks = [(batch, i, ForkingPickler.dumps((kinds[i], response_tail(str(responses[i]), cap), golds[i], metas[i])))
                 for i in range(n)]
        with self._lock:
            if self._closing or self._error is not None:
                raise RuntimeError(f"RewardPool is closed{f': {self._error}' if self._error else ''}")
            self._pending.extend(tasks)
            if not self._woken:  # at most one wake byte in flight: the pipe never fills
                self._woken = True
                self._wake_w.send_bytes(b"x")
        return batch.future

    def check(self, kind, responses, golds, metas=None) -> list[RewardCheck]:
        """:meth:`check_async` and wait."""
        return self.check_async(kind, responses, golds, metas).result()

    def score_async(self, kind, responses, golds, metas=None) -> Future:
        """Dispatch all checks now; a Future of the rewards, float32 ``[len(responses)]``."""
        out: Future = Future()

        def done(f: Future) -> None:
            if f.exception() is not None:
                out.set_exception(f.exception())
            else:
                out.set_result(np.array([c.reward for c in f.result()], np.float32))

        self.check_async(kind, responses, golds, metas).add_done_callback(done)
        return out

    def score(self, kind, responses, golds, metas=None) -> np.ndarray:
        """Rewards of a batch in input order, float32 ``[len(responses)]`` (one call, checks run
        concurrently on the workers)."""
        return self.score_async(kind, responses, golds, metas).result()

    def worker_pids(self) -> list[int]:
        return [w.proc.pid for w in self._workers]

    def close(self) -> None:
        """Fail pending checks, stop and reap every worker. Idempotent."""
        with self._lock:
            self._closing = True
        try:
            self._wake_w.send_bytes(b"x")
        except (OSError, ValueError):
            pass
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join()

    def __enter__(self) -> "RewardPool":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---- dispatcher thread ----
    def _finish(self, w: _Worker, check: RewardCheck) -> None:
        batch, i = w.task
        w.task, w.state = None, "idle"
        batch.results[i] = check
        batch.remaining -= 1
        if batch.remaining == 0:
            batch.future.set_result(batch.results)

    def _replace(self, w: _Worker, check: RewardCheck) -> None:
        """Kill and reap ``w``, count it, then resolve its check and start a fresh worker."""
        w.stop(kill=True)
        # the replacement is in place before the caller's future resolves: whoever sees the result
        # also sees the new worker (and the restart count)
        self._workers[self._workers.index(w)] = _Worker(self._ctx, *self._args)
        self.restarts += 1
        self._finish(w, check)

    def _loop(self) -> None:
        try:
            self._serve()
        except BaseException as e:  # noqa: BLE001 - surface to the callers rather than hang them
            self._error = e
            self._ready.set()
        finally:
            with self._lock:
                self._closing = True
                pending, self._pending = list(self._pending), collections.deque()
            err = RuntimeError(f"RewardPool closed{f': {self._error}' if self._error else ''}")
            for w in self._workers:
                if w.task is not None:
                    pending.append((*w.task, None))
                w.stop(kill=w.state != "idle")
            for batch, _, _ in pending:
                if not batch.future.done():
                    batch.future.set_exception(err)
            self._wake_r.close()
            self._wake_w.close()

    def _serve(self) -> None:
        spec = self.spec
        while True:
            with self._lock:
                if self._closing:
                    return
                self._woken = False
                for w in self._workers:
                    if w.state == "idle" and self._pending:
                        batch, i, task = self._pending.popleft()
                        w.task, w.state, w.deadline = (batch, i), "busy", time.monotonic() + self.time_limit
                        w.conn.send_bytes(task)
            if not self._ready.is_set() and all(w.state != "starting" for w in self._workers):
                self._ready.set()
            waiting = [w for w in self._workers if w.state != "idle"]
            timeout = None
            if waiting:
                timeout = max(0.0, min(w.deadline if w.state == "busy" else w.deadline + self.start_timeout
                                       for w in waiting) - time.monotonic())
            ready = mp_wait([w.conn for w in waiting] + [self._wake_r], timeout)
            if self._wake_r in ready:
                while self._wake_r.poll():
                    self._wake_r.recv_bytes()
            for w in list(waiting):
                if w.conn not in ready:
                    continue
                try:
                    msg = w.conn.recv()
                except (EOFError, OSError):  # the worker died (segfault, OOM killer, ...)
                    if w.state == "starting":
                        w.proc.join(timeout=5.0)  # its exit code says why
                        if w.proc.exitcode == EXIT_REIMPORTED_MAIN:
                            raise UnguardedScriptError(unguarded_script_message(w.proc.pid)) from None
                        raise RuntimeError(f"reward worker {w.proc.pid} died during start-up "
                                           f"(exit code {w.proc.exitcode})") from None
                    self._replace(w, RewardCheck(spec.wrong, False, None, "error: worker died"))
                    continue
                if w.state == "starting":
                    if msg[0] == "error":  # a custom reward function failed to load
                        raise RewardFunctionError(msg[1])
                    w.state = "idle"
                else:
                    self._finish(w, RewardCheck(*msg))
            now = time.monotonic()
            for w in list(self._workers):
                if w.state == "busy" and now >= w.deadline:
                    self._replace(w, RewardCheck(spec.wrong, False, None, "timeout"))
                elif w.state == "starting" and now >= w.deadline + self.start_timeout:
                    raise RuntimeError(f"reward worker {w.proc.pid} not ready after {self.start_timeout} s")
