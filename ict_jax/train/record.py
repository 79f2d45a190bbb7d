"""The record of a run directory: what was trained, with which settings, and what came out.

    <run_dir>/config.json      the resolved config (Config.to_dict()); on --resume only the keys of
                               RESUME_ALLOWED may differ from it (train.steps only upward)
    <run_dir>/resumes.jsonl    one line per --resume: when, from which phase and step, which keys changed
    <run_dir>/summary.json     the sections of the run as they finish (status, sft, eval_after_sft,
                               final, eval_final, ...); "status": "finished" once the run is complete
    <run_dir>/metrics.jsonl    one row per (phase, step): ict_jax.train.logs.RunLogger

A resumed run keeps every section that an earlier invocation wrote; a finished run resumed without a
raised ``train.steps`` does nothing. docs/checkpoints.md ("Resume").
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any, Sequence

from ict_jax.config import Config, ConfigError, from_dict
from ict_jax.config_load import load_config
from ict_jax.outputs import check_not_held

SFT_MODEL = "sft_model"  # <run_dir>/sft_model: the finished SFT warm start (a Hugging Face directory)

#: Keys that may differ on --resume: they cannot change what is trained (logging, evaluation and
#: checkpoint cadence, the number of reward processes, the response buckets and where the samplers gather
#: FSDP weights: cost, not values beyond float rounding). ``train.steps`` may only go up, and only when
#: the learning-rate schedule does not depend on it. A trailing ``.*`` matches a whole section.
RESUME_ALLOWED = ("run_dir", "train.eval_every", "train.save_every", "train.keep", "train.sft_save_every",
                  "train.memory_check", "rl.reward.workers", "rollout.min_response_bucket", "rollout.gather_weights",
                  "data.eval_batch", "logging.*")


def flatten(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """``{"a": {"b": 1}}`` -> ``{"a.b": 1}`` (lists stay values)."""
    out: dict[str, Any] = {}
    for k, v in tree.items():
        key = f"{prefix}.{k}" if prefix else k
        if isinstance(v, dict):
            out.update(flatten(v, key))
        else:
            out[key] = v
    return out


def _allowed(key: str) -> bool:
    return any(key == a or (a.endswith(".*") and key.startswith(a[:-1])) for a in RESUME_ALLOWED)


def config_changes(old: Config, new: Config) -> dict[str, tuple[Any, Any]]:
    """``{dotted key: (old value, new value)}`` for every key that differs."""
    a, b = flatten(old.to_dict()), flatten(new.to_dict())
    return {k: (a.get(k), b.get(k)) for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)}


def read_config(run_dir: str | Path) -> Config | None:
    """The config recorded in ``<run_dir>/config.json`` (None when there is none)."""
    path = Path(run_dir) / "config.json"
    if not path.is_file():
        return None
    try:
        return from_dict(json.loads(path.read_text()))
    except (json.JSONDecodeError, ConfigError) as e:
        raise ConfigError(f"--resume: {path} is not a config this version can read ({e})") from None


def resume_config(run_dir: str | Path, overrides: Sequence[str] = ()) -> Config:
    """The config that continues the run in ``run_dir``: its recorded ``config.json`` with ``overrides``
    (``key=value``) on top, so that the overrides are the only changes the resume rules
    (:func:`check_resume`) see. ``ict-jax train --resume run_dir=R`` without ``--config``."""
    check_not_held(run_dir, "run_dir")  # a run that starts there has no config.json yet: name its process
    path = Path(run_dir) / "config.json"
    if not path.is_file():
        raise ConfigError(f"--resume: {str(path)!r} does not exist: no run is recorded in run_dir {str(run_dir)!r} "
                          "(name a config with --config to start one)")
    recorded = read_config(run_dir)  # a config this version can read, or one line saying why not
    return load_config(None, overrides, base=recorded.to_dict())


def check_resume(old: Config, new: Config) -> dict[str, tuple[Any, Any]]:
    """The changes of a resumed run's config, when every one is allowed; else a one-line ConfigError
    naming the keys that would change the trajectory of the run."""
    changes = config_changes(old, new)
    refused = [k for k in changes if not _allowed(k) and k != "train.steps"]
    if "train.steps" in changes:
        before, after = changes["train.steps"]
        o = old.optim
        total = before * old.train.mini_batches
        if after < before:
            refused.append("train.steps (only upward)")
        elif o.schedule != "constant":
            refused.append(f"train.steps (the {o.schedule} learning-rate schedule depends on it)")
        elif o.lr_warmup_steps > total:
            refused.append(f"train.steps (the learning-rate warm-up, optim.lr_warmup_steps={o.lr_warmup_steps}, "
                           f"is longer than the {total} updates it was cut to)")
    if refused:
        shown = ", ".join(k if " " in k else f"{k} ({changes[k][0]!r} -> {changes[k][1]!r})" for k in refused)
        raise ConfigError(f"--resume: {shown} would change how the run trains; a resumed run keeps those settings "
                          f"(may change: {', '.join(RESUME_ALLOWED[1:])}, train.steps upward). Start a new run_dir "
                          "for other settings")
    return changes


def record_resume(run_dir: str | Path, changes: dict[str, tuple[Any, Any]], *, phase: str, step: int) -> dict:
    """Append one line to ``<run_dir>/resumes.jsonl``; returns it."""
    entry = {"time": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "phase": phase, "step": int(step),
             "changes": {k: list(v) for k, v in changes.items() if k != "run_dir"}}
    with open(Path(run_dir) / "resumes.jsonl", "a", encoding="utf-8") as f:
        f.write(json.dumps(entry) + "\n")
    return entry


def read_resumes(run_dir: str | Path) -> list[dict]:
    path = Path(run_dir) / "resumes.jsonl"
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def read_summary(run_dir: str | Path) -> dict[str, Any] | None:
    """``<run_dir>/summary.json`` (None when there is none)."""
    path = Path(run_dir) / "summary.json"
    if not path.is_file():
        return None
    return json.loads(path.read_text())


def run_finished(run_dir: str | Path) -> bool:
    """The run's summary says it finished (a summary without a status, from before there was one,
    counts as finished)."""
    try:
        summary = read_summary(run_dir)
    except (OSError, json.JSONDecodeError):
        return False
    return summary is not None and summary.get("status", "finished") == "finished"


def write_summary(run_dir: str | Path, summary: dict[str, Any]) -> Path:
    """Write ``summary`` to ``<run_dir>/summary.json`` atomically (a crash leaves the old one)."""
    path = Path(run_dir) / "summary.json"
    tmp = path.with_name(".summary.json.tmp")
    tmp.write_text(json.dumps(summary, indent=2, default=str))
    os.replace(tmp, path)
    return path
