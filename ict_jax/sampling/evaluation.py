"""pass@k evaluation (docs/method.md §6).

    def generate_fn(prompts: list[str], n: int) -> list[list[str]]: ...   # n responses per prompt
    with RewardPool() as pool:
        res = evaluate(generate_fn, {"gsm8k_test": ds}, pool, n=4, ks=(1, 4),
                       json_path="run/eval.json", samples_path="run/eval_samples.jsonl")
    res["average"]["pass@1"]

pass@k is the unbiased estimator of Chen et al. (2021) from n >= k samples of which c are correct,
averaged over a benchmark's problems; P@1 equals the mean accuracy over all n samples. The average row
is the unweighted mean over benchmarks (the paper's 7-benchmark average). ``evaluate`` does not sample:
``generate_fn`` owns the model, the chat template and the sampling settings (docs/method.md §6 defaults in
``EVAL_DEFAULTS``: n = 4, k in {1, 4}, temperature 0.6, top-p 0.95). docs/evaluation.md.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from ict_jax.config import RewardSection, eval_settings
from ict_jax.heartbeat import Heartbeat, duration
from ict_jax.rewards.pool import RewardPool

__all__ = ["EVAL_DEFAULTS", "pass_at_k", "standard_error", "aggregate", "format_table", "evaluate",
           "evaluate_benchmarks", "truncated_of"]

_DEFAULTS = eval_settings()
#: docs/method.md §6: samples per problem, the k reported, and the sampling settings of the eval generate_fn;
#: read from the config tree's defaults (``data.eval_n``, ``data.eval_k``, ``data.eval_temperature``,
#: ``data.eval_top_p``: :data:`ict_jax.config.EVAL_KEYS`), never written here.
EVAL_DEFAULTS: dict[str, Any] = {"n": _DEFAULTS["n"], "ks": _DEFAULTS["k"], "temperature": _DEFAULTS["temperature"],
                                 "top_p": _DEFAULTS["top_p"]}


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from ``n`` samples with ``c`` correct: the probability that a uniformly drawn
    k-subset holds at least one correct sample,

        1 - C(n - c, k) / C(n, k) = 1 - prod_{i = n-c+1}^{n} (1 - k / i),

    the product form never forms the (huge) binomials. 1.0 when n - c < k."""
    if not (1 <= k <= n) or not (0 <= c <= n):
        raise ValueError(f"pass_at_k: need 1 <= k <= n and 0 <= c <= n, got n={n}, c={c}, k={k}")
    if n - c < k:
        return 1.0
    return float(1.0 - np.prod(1.0 - k / np.arange(n - c + 1, n + 1, dtype=np.float64)))


def standard_error(values: Sequence[float]) -> float | None:
    """The standard error of the mean of ``values``: their sample sd (ddof 1) / sqrt(len); None with fewer
    than 2 values."""
    if len(values) < 2:
        return None
    return float(np.std(np.asarray(values, np.float64), ddof=1) / np.sqrt(len(values)))


def aggregate(correct: Mapping[str, Sequence[Sequence[bool]]], ks: Sequence[int] = EVAL_DEFAULTS["ks"]) -> dict:
    """Per-benchmark and average pass@k, with their standard errors. ``correct[benchmark][problem]`` lists
    the correctness of that problem's samples (n may differ between problems, but every n must be >= max(ks)).

    Returns ``{"benchmarks": {name: {"problems", "samples", "pass@k"..., "se": {"pass@k"...}}},
    "average": {"pass@k"..., "se": {"pass@k"...}}}`` with fractions in [0, 1]; the average is the
    unweighted mean over benchmarks with problems. ``se``: the standard error of each pass@k over the
    benchmark's problems, i.e. the sample sd (ddof 1) of the per-problem pass@k estimates (for pass@1: each
    problem's correct / n) divided by sqrt(problems), the problems taken as a sample of the benchmark's
    (the n samples' own noise is inside each problem's value); None with fewer than 2 problems. The
    average's: sqrt(sum of the benchmarks' se^2) / benchmarks (independent benchmarks); None when a
    benchmark's is."""
    out: dict[str, Any] = {"benchmarks": {}, "average": {}}
    for name, rows in correct.items():
        ns = [len(r) for r in rows]
        if rows and min(ns) < max(ks):
            raise ValueError(f"aggregate: {name}: a problem has {min(ns)} samples < k={max(ks)}")
        entry: dict[str, Any] = {"problems": len(rows), "samples": int(sum(ns))}
        se: dict[str, float | None] = {}
        for k in ks:
            vals = [pass_at_k(len(r), int(sum(map(bool, r))), k) for r in rows]
            entry[f"pass@{k}"] = float(np.mean(vals)) if vals else float("nan")
            se[f"pass@{k}"] = standard_error(vals)
        entry["se"] = se
        out["benchmarks"][name] = entry
    scored = [b for b in out["benchmarks"].values() if b["problems"]]
    avg_se: dict[str, float | None] = {}
    for k in ks:
        key = f"pass@{k}"
        out["average"][key] = float(np.mean([b[key] for b in scored])) if scored else float("nan")
        ses = [b["se"][key] for b in scored]
        avg_se[key] = (float(np.sqrt(np.sum(np.square(ses))) / len(ses))
                       if ses and all(x is not None for x in ses) else None)
    out["average"]["se"] = avg_se
    return out


def _cell(entry: Mapping[str, Any], col: str) -> str:
    """``0.379 ± 0.049`` (pass@k ± its standard error), or ``0.379`` when there is none."""
    se = (entry.get("se") or {}).get(col)
    return f"{entry[col]:.3f}" + (f" ± {se:.3f}" if se is not None else "")


def format_table(results: Mapping[str, Any], ks: Sequence[int] | None = None) -> str:
    """The per-benchmark + average table of :func:`aggregate` / :func:`evaluate` results: pass@k as
    fractions with three decimals, the one convention of every table (eval, train, compare, docs), each
    ± its standard error over problems (:func:`aggregate`'s ``se``) where there is one."""
    ks = list(ks or [int(key[5:]) for key in results["average"] if key.startswith("pass@")])
    names = list(results["benchmarks"])
    w = max([len("benchmark"), len("average")] + [len(n) for n in names])
    cols = [f"pass@{k}" for k in ks]
    rows = [(name, results["benchmarks"][name]["problems"], results["benchmarks"][name]) for name in names]
    rows.append(("average", sum(b["problems"] for b in results["benchmarks"].values()), results["average"]))
    cells = [[_cell(entry, c) for c in cols] for _, _, entry in rows]
    cw = [max([8] + [len(r[j]) for r in cells]) for j in range(len(cols))]
    lines = [f"{'benchmark':<{w}}  {'problems':>8}  " + "  ".join(f"{c:>{cw[j]}}" for j, c in enumerate(cols))]
    for (name, problems, _), cs in zip(rows, cells):
        lines.append(f"{name:<{w}}  {problems:>8d}  " + "  ".join(f"{x:>{cw[j]}}" for j, x in enumerate(cs)))
    return "\n".join(lines)


class Progress:
    """Problems done: a tqdm bar on a terminal; redirected (a log file, CI, ``nohup``), a compact line
    about every fifth of the problems (``eval 52/256 problems  ETA 1m10s``), like the trainer's lines:
    never the bar's carriage-return frames in a log. Lines go to stderr.

    A sampler call of a real model on a CPU takes minutes, so a heartbeat (:class:`ict_jax.heartbeat.Heartbeat`)
    adds a line whenever ``heartbeat_s`` seconds (default ``$ICT_JAX_HEARTBEAT_S``, else 30) pass without
    one: ``eval 16/64 problems  elapsed 4m10s  ETA 12m30s  (gsm8k_test: sampling problems 17-32 of 64)``
    (:meth:`phase` names the work); on a terminal it refreshes the bar's clock instead.

    ``heartbeat``: a running heartbeat to speak through instead of one of its own (a command's, which has
    spoken since its first second: :meth:`ict_jax.heartbeat.Heartbeat.lend`; its clock goes on, so no gap
    opens between the command's lines and these).

    ``listener(done, total, phase)``: called whenever the problems done or the phase change, also when
    ``enabled`` is False: a caller with progress output of its own (a training run's heartbeat) shows it there."""

    LINES = 5

    def __init__(self, total: int, *, enabled: bool = True, stream: Any = None, heartbeat_s: float | None = None,
                 listener: Callable[[int, int, str | None], None] | None = None, heartbeat: Heartbeat | None = None):
        self.total, self.done, self.stream = int(total), 0, stream or sys.stderr
        self.listener = listener
        self._bar = None
        self._every = 0
        self._phase: str | None = None
        self._t0 = time.monotonic()
        self._beat: Heartbeat | None = None
        self._give_back: Callable[[], None] | None = None
        if enabled and getattr(self.stream, "isatty", lambda: False)():
            from tqdm.auto import tqdm  # imported only when used

            self._bar = tqdm(total=self.total, desc="eval", unit="problem", file=self.stream)
        elif enabled:
            self._every = max(1, -(-max(1, self.total) // self.LINES))
        if enabled and heartbeat is not None:
            self._beat, self._give_back = heartbeat, heartbeat.lend(self._heartbeat, self.status_line)
        elif enabled:
            self._beat = Heartbeat(self._heartbeat, interval=heartbeat_s, status=self.status_line).__enter__()

    def status_line(self) -> str:
        """``eval D/N problems  elapsed E  ETA R  (phase)``: the ETA from the rate so far, once a problem is done."""
        elapsed = time.monotonic() - self._t0
        line = f"eval {self.done}/{self.total} problems  elapsed {duration(elapsed)}"
        if 0 < self.done < self.total:
            line += f"  ETA {duration(elapsed / self.done * (self.total - self.done))}"
        return line + (f"  ({self._phase})" if self._phase else "")

    def _heartbeat(self, line: str) -> None:
        if self._bar is not None:
            self._bar.refresh()  # the bar's elapsed time moves on; no line between its frames
        else:
            print(line, file=self.stream, flush=True)

    def phase(self, text: str | None) -> None:
        """What runs now, shown in the heartbeat's lines (``gsm8k_test: sampling problems 1-16 of 64``)."""
        self._phase = text
        self._tell()

    def _tell(self) -> None:
        if self.listener is not None:
            self.listener(self.done, self.total, self._phase)

    def update(self, n: int) -> None:
        before, self.done = self.done, self.done + int(n)
        self._tell()
        if self._bar is not None:
            self._bar.update(n)
        elif self._every and (self.done // self._every > before // self._every or self.done == self.total):
            rate = (time.monotonic() - self._t0) / max(1, self.done)
            eta = f"  ETA {duration(rate * (self.total - self.done))}" if self.done < self.total else ""
            print(f"eval {self.done}/{self.total} problems{eta}", file=self.stream, flush=True)
            if self._beat is not None:
                self._beat.said()

    def close(self) -> None:
        if self._give_back is not None:
            self._give_back()
        elif self._beat is not None:
            self._beat.__exit__()
        self._beat = self._give_back = None
        if self._bar is not None:
            self._bar.close()


def _as_benchmarks(datasets: Any) -> list[tuple[str, str, Sequence[Any]]]:
    """``{name: Dataset}``, ``{name: (scorer, examples)}`` or a list of Datasets -> (name, scorer, examples)."""
    items = datasets.items() if isinstance(datasets, Mapping) else [(getattr(d, "name", None), d) for d in datasets]
    out = []
    for name, ds in items:
        if isinstance(ds, tuple):
            scorer, examples = ds
        else:
            scorer, examples = getattr(ds, "scorer", None), ds
        if name is None or scorer is None:
            raise ValueError("evaluate: each dataset needs a name and a scorer "
                             "(a Dataset, or name -> (scorer, examples))")
        out.append((str(name), str(scorer), examples))
    return out


def _jsonable(x: Any) -> Any:
    try:
        json.dumps(x)
        return x
    except (TypeError, ValueError):
        return str(x)


def truncated_of(response: Any) -> bool | None:
    """Whether a response of ``generate_fn`` was cut at the length limit: its ``truncated`` attribute (a
    :class:`~ict_jax.sampling.text_generation.Response`), None for a plain string (not known)."""
    t = getattr(response, "truncated", None)
    return None if t is None else bool(t)


def _write_samples(file: Any, name: str, index: int, ex: Any, responses: Sequence[str], checks: Sequence[Any]) -> None:
    """One JSONL line per sample of problem ``index`` of benchmark ``name`` (:func:`evaluate`'s samples file)."""
    for j, c in enumerate(checks):
        rec = {"benchmark": name, "index": index, "sample": j, "prompt": ex.prompt, "response": str(responses[j]),
               "answer": c.answer, "gold": _jsonable(ex.answer), "correct": c.correct, "reward": c.reward,
               "status": c.status, "truncated": truncated_of(responses[j])}
        file.write(json.dumps(rec, ensure_ascii=False) + "\n")


def _open_samples(samples_path: str | os.PathLike | None) -> Any:
    """The samples file of :func:`evaluate`, opened for writing (its folder made); None without a path."""
    if samples_path is None:
        return None
    os.makedirs(os.path.dirname(os.path.abspath(samples_path)), exist_ok=True)
    return open(samples_path, "w", encoding="utf-8")


def _default_pool() -> RewardPool:
    """A reward pool with rl.reward's defaults (config.RewardSection: workers, time limit)."""
    defaults = RewardSection()
    return RewardPool(defaults.workers, time_limit=defaults.time_limit)


def evaluate(generate_fn: Callable[[list[str], int], Sequence[Sequence[str]]], datasets: Any, pool: Any = None, *,
             n: int = EVAL_DEFAULTS["n"], ks: Sequence[int] = EVAL_DEFAULTS["ks"], batch_size: int = 8,
             limit: int | None = None, json_path: str | os.PathLike | None = None,
             samples_path: str | os.PathLike | None = None, settings: Mapping[str, Any] | None = None,
             progress: bool = True, print_table: bool = True,
             listener: Callable[[int, int, str | None], None] | None = None,
             heartbeat: Heartbeat | None = None) -> dict:
    """Sample ``n`` responses per problem, score them, and report pass@k per benchmark and on average.

    ``generate_fn(prompts, n)`` gets up to ``batch_size`` prompts (``Example.prompt``) and returns ``n``
    responses for each, in order. Scoring of a batch runs on ``pool`` (a :class:`RewardPool`; None = a
    temporary 2-worker pool) while the next batch is generated. ``limit``: first problems per benchmark.
    Writes the results as JSON (``json_path``: the :func:`aggregate` dict plus ``n``, ``ks``,
    ``settings``, per-benchmark ``no_answer`` (the fraction of samples with no extractable answer),
    ``truncated`` (the fraction cut at the length limit, from each response's ``truncated``; None when
    ``generate_fn`` returns plain strings, which do not say), ``timeouts`` and ``seconds``) and one JSONL
    line per sample (``samples_path``: benchmark, index, sample, prompt, response, answer (extracted), gold,
    correct, reward, status, truncated); prints the table (:func:`format_table`); returns the results dict.
    ``progress``: lines (or a bar) on stderr (:class:`Progress`), through ``heartbeat`` when given (the
    caller's running one); ``listener(done, total, phase)`` hears the problems done and what is sampled or
    scored, with or without them (a training run's heartbeat)."""
    ks = tuple(int(k) for k in ks)
    if n < 1 or not ks or min(ks) < 1 or max(ks) > n:
        raise ValueError(f"evaluate: need 1 <= k <= n for every k, got n={n}, ks={ks}")
    benches = [(name, scorer, list(ex)[:limit] if limit is not None else list(ex))
               for name, scorer, ex in _as_benchmarks(datasets)]
    own_pool = pool is None
    pool = _default_pool() if own_pool else pool
    correct: dict[str, list[list[bool]]] = {}
    extra: dict[str, dict[str, Any]] = {}
    sample_file = _open_samples(samples_path)
    bar = Progress(sum(len(ex) for _, _, ex in benches), enabled=progress, listener=listener, heartbeat=heartbeat)
    try:
        for name, scorer, examples in benches:
            t0 = time.monotonic()
            rows: list[list[bool]] = []
            statuses: list[str] = []
            cut: list[bool | None] = []  # truncated_of of every sample
            inflight: list[tuple[int, list, list[list[str]], Any]] = []

            def collect(item: tuple[int, list, list[list[str]], Any]) -> None:
                start, chunk, responses, fut = item
                bar.phase(f"{name}: scoring problems {start + 1}-{start + len(chunk)} of {len(examples)}")
                checks = fut.result()
                bar.phase(None)
                for p, ex in enumerate(chunk):
                    row = checks[p * n:(p + 1) * n]
                    rows.append([c.correct for c in row])
                    statuses.extend(c.status for c in row)
                    cut.extend(truncated_of(r) for r in responses[p])
                    if sample_file is not None:
                        _write_samples(sample_file, name, start + p, ex, responses[p], row)
                bar.update(len(chunk))

            for start in range(0, len(examples), batch_size):
                chunk = examples[start:start + batch_size]
                bar.phase(f"{name}: sampling problems {start + 1}-{start + len(chunk)} of {len(examples)}, "
                          f"{n} responses each")
                responses = [list(r) for r in generate_fn([ex.prompt for ex in chunk], n)]
                bar.phase(None)
                if len(responses) != len(chunk) or any(len(r) != n for r in responses):
                    raise ValueError(f"evaluate: {name}: generate_fn returned {[len(r) for r in responses]} "
                                     f"responses for {len(chunk)} prompts, expected {n} each")
                flat = [str(r) for rs in responses for r in rs]  # plain text to the reward workers
                fut = pool.check_async(scorer, flat, [ex.answer for ex in chunk for _ in range(n)],
                                       [ex.meta for ex in chunk for _ in range(n)])
                inflight.append((start, chunk, responses, fut))
                if len(inflight) > 1:  # score batch b while generating batch b + 1
                    collect(inflight.pop(0))
            for item in inflight:
                collect(item)
            correct[name] = rows
            extra[name] = _sample_figures(statuses, cut, time.monotonic() - t0)
    finally:
        bar.close()
        if sample_file is not None:
            sample_file.close()
        if own_pool:
            pool.close()
    return _results(correct, extra, n, ks, settings, print_table, json_path)


def _sample_figures(statuses: Sequence[str], cut: Sequence[bool | None], seconds: float) -> dict[str, Any]:
    """A benchmark's figures beside pass@k from its samples' check statuses and :func:`truncated_of`:
    ``no_answer`` and ``truncated`` (fractions of the samples; ``truncated`` None unless every sample says),
    ``timeouts`` (a count) and ``seconds``."""
    total = max(1, len(statuses))
    known = bool(cut) and all(c is not None for c in cut)
    return {"no_answer": sum(s == "no_answer" for s in statuses) / total,
            "truncated": sum(map(bool, cut)) / total if known else None,
            "timeouts": sum(s == "timeout" for s in statuses), "seconds": seconds}


def _results(correct: Mapping[str, list[list[bool]]], extra: Mapping[str, dict[str, Any]], n: int,
             ks: tuple[int, ...], settings: Mapping[str, Any] | None, print_table: bool,
             json_path: str | os.PathLike | None) -> dict:
    """:func:`evaluate`'s results: :func:`aggregate` with each benchmark's extra figures and the settings;
    the table printed, the JSON written."""
    results = aggregate(correct, ks)
    for name, e in extra.items():
        results["benchmarks"][name].update(e)
    results.update({"n": n, "ks": list(ks), "settings": {k: _jsonable(v) for k, v in (settings or {}).items()}})
    if print_table:
        print(format_table(results, ks), flush=True)
    if json_path is not None:
        os.makedirs(os.path.dirname(os.path.abspath(json_path)), exist_ok=True)
        with open(json_path, "w", encoding="utf-8") as f:
            json.dump(results, f, indent=2)
    return results


#: The package-level name of :func:`evaluate` (``ict_jax.sampling.evaluation`` itself is this submodule).
evaluate_benchmarks = evaluate
