"""Build the notebooks: convert each jupytext source (``notebooks/NN_*.py``, the reviewed source of truth)
to a notebook, execute it in a fresh Jupyter kernel and write ``notebooks/NN_*.ipynb`` with its outputs
(text, tables, figures).

    python notebooks/build.py                     # what the committed .ipynb show (see docs/notebooks.md)
    python notebooks/build.py --run-dir runs/demo # the same on a demo run you already trained
    python notebooks/build.py --fast --out /tmp/nb   # mechanics only, about a minute (the e2e test)

By default notebook 01 samples the real Qwen2.5-Coder-0.5B-Instruct when its parts are installed
(docs/models.md; a few minutes on 2 CPU cores), and the embedded demo (``ict-jax train --config
configs/demo.yaml``: SFT warm start + 400 ICT RL steps, ~5 min alone on 2 CPU cores) is trained into
``notebooks/_build/demo_run`` unless a finished run is already there: 02 plots its metrics, and 01
samples from its final checkpoint when the real model is not installed. ``--run-dir`` gives both
notebooks that run instead. ``--fast`` trains nothing: 01 runs on a tiny random model and 02 trains its own few-step demo
(the notebooks' own defaults). Figures and other files the notebooks write (PNGs, notebook 01's
inspector page) go to ``notebooks/_build/<notebook>/`` (``--work``; not in git). Needs the ``notebooks``
extra: ``pip install -e ".[notebooks]"``.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
SOURCES = sorted(p for p in HERE.glob("[0-9][0-9]_*.py"))
MAX_BYTES = 2_000_000  # a notebook must stay readable on the web
REAL = "qwen2.5-coder-0.5b-instruct"  # notebook 01's model in the default build when its parts are installed


def train_demo(run_dir: Path, timeout: float) -> None:
    """The README's demo command into ``run_dir`` (reused when it holds a finished run)."""
    if (run_dir / "summary.json").is_file():
        print(f"demo run: reusing {run_dir} (delete it to retrain)", flush=True)
        return
    if run_dir.exists():
        shutil.rmtree(run_dir)  # an unfinished earlier attempt
    cmd = [sys.executable, "-m", "ict_jax.cli", "train", "--config", str(ROOT / "configs" / "demo.yaml"),
           "--no-progress", f"run_dir={run_dir}"]
    print("demo run:", " ".join(cmd), flush=True)
    t0 = time.perf_counter()
    subprocess.run(cmd, check=True, timeout=timeout, env=_env())
    print(f"demo run: done in {time.perf_counter() - t0:.0f} s", flush=True)


def _env() -> dict[str, str]:
    """The demo's and the kernels' environment: this checkout first on the import path."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    return env


def source_sha256(src: Path) -> str:
    return hashlib.sha256(src.read_bytes()).hexdigest()


def _for_kernel(path: Path) -> str:
    """A path as the kernel (running in notebooks/) sees it: relative when inside notebooks/, so the
    outputs do not show this machine's folders."""
    path = path.resolve()
    return os.path.relpath(path, HERE) if path.is_relative_to(HERE) else str(path)


def build(src: Path, out_dir: Path, work: Path, params: dict[str, str], timeout: float, mode: str):
    """Execute one source notebook with ``params`` as its ICT_NB_* environment and write it with its
    outputs to ``out_dir``; returns the executed notebook."""
    import jupytext
    import nbformat
    from nbclient import NotebookClient

    nb = jupytext.read(src)
    files = work / src.stem  # what the notebook writes: its figures, ...
    if files.exists():
        shutil.rmtree(files)
    files.parent.mkdir(parents=True, exist_ok=True)
    # the kernel runs in notebooks/ with this environment: the notebooks read their parameters from ICT_NB_*;
    # figures are shown inline (and saved as PNGs), whatever backend the caller's environment names
    env = {k: v for k, v in _env().items() if not k.startswith("ICT_NB_") and k != "MPLBACKEND"}
    env.update(params, ICT_NB_OUT=_for_kernel(files))
    t0 = time.perf_counter()
    NotebookClient(nb, timeout=timeout, kernel_name="python3", record_timing=False,
                   resources={"metadata": {"path": str(HERE)}}).execute(env=env)
    wall = time.perf_counter() - t0
    nb.metadata.pop("jupytext", None)  # a plain notebook; the .py next to it is the source (jupytext header)
    # which source it was built from: tests/test_notebooks.py checks that the committed .ipynb is current
    nb.metadata["ict_jax"] = {"source": src.name, "source_sha256": source_sha256(src), "mode": mode}
    out = out_dir / f"{src.stem}.ipynb"
    nbformat.write(nb, out)
    size = out.stat().st_size
    print(f"{out}: {len(nb.cells)} cells, {size / 1e3:.0f} kB, executed in {wall:.0f} s", flush=True)
    if size > MAX_BYTES:
        raise SystemExit(f"{out}: {size / 1e6:.1f} MB, over the {MAX_BYTES / 1e6:.0f} MB a notebook may weigh")
    return nb


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--run-dir", help="a finished demo run to read instead of training one")
    ap.add_argument("--fast", action="store_true", help="train nothing: a tiny random model and a few-step demo")
    ap.add_argument("--out", default=str(HERE), help="where the .ipynb files go (default: notebooks/)")
    ap.add_argument("--work", default=str(HERE / "_build"),
                    help="where the notebooks' own files and the demo run go (default: notebooks/_build/)")
    ap.add_argument("--only", default="", help="comma-separated notebook name prefixes, e.g. 01")
    ap.add_argument("--timeout", type=float, default=1800, help="seconds a cell (and the demo training) may take")
    args = ap.parse_args(argv)
    # with the `tpu` extra (libtpu) on a machine without a TPU, every kernel would print libtpu's warnings
    # into the notebooks' outputs: JAX_PLATFORMS=cpu then, as the command line does (docs/tpu.md)
    from ict_jax.cli.main import skip_absent_tpu

    skip_absent_tpu()
    if args.fast and args.run_dir:
        ap.error("--fast and --run-dir exclude each other")
    out_dir, work = Path(args.out), Path(args.work)
    out_dir.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    mode = "fast" if args.fast else ("run-dir" if args.run_dir else "demo")
    only = [p for p in args.only.split(",") if p]
    selected = [src for src in SOURCES if not only or any(src.stem.startswith(p) for p in only)]
    # the default build: notebook 01 on the real Qwen2.5-Coder-0.5B-Instruct when its parts are installed
    from ict_jax.model.packaged import parts_missing

    real = mode == "demo" and parts_missing(REAL) is None
    needs_run = {"01": mode != "fast" and not real, "02": mode != "fast"}
    run = Path(args.run_dir).resolve() if args.run_dir else work.resolve() / "demo_run"
    if any(needs_run.get(src.stem[:2]) for src in selected):
        if not args.run_dir:
            train_demo(run, args.timeout)
        if not (run / "metrics.jsonl").is_file():
            raise SystemExit(f"--run-dir {run}: no metrics.jsonl (not a run directory)")
    if args.fast:
        nb01: dict[str, str] = {"ICT_NB_MODEL": ""}
    elif real:
        nb01 = {"ICT_NB_MODEL": REAL}  # a word problem through its chat template (the notebook's defaults for it)
    else:
        nb01 = {"ICT_NB_MODEL": _for_kernel(run), "ICT_NB_PROMPT": "95="}  # the demo's task: N as a sum
    params = {"01": nb01, "02": {"ICT_NB_RUN_DIR": "" if args.fast else _for_kernel(run)}}
    for src in selected:
        build(src, out_dir, work, params.get(src.stem[:2], {}), args.timeout,
              "real" if real and src.stem.startswith("01") else mode)
    print(f"built in {time.perf_counter() - t0:.0f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
