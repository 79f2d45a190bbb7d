"""Training checkpoints with orbax: the checkpoint I/O of a run (a run directory read as a model is
``train.model_source.resolve_model``'s; its export ``train.export``'s).

Layout (docs/checkpoints.md). The trainer keeps its checkpoints in ``<run_dir>/checkpoints``::

    <run_dir>/checkpoints/<step>/params/      the policy parameters (an nnx.State of nnx.Param), own item
    <run_dir>/checkpoints/<step>/opt/         {"opt_state": optax state, "step": int32, "rng": uint32[2]}
    <run_dir>/checkpoints/<step>/meta/metadata  JSON: data position, config, "model_config", tokenizer, metrics
    <run_dir>/checkpoints/<step>.orbax-checkpoint-tmp*/   a save in progress (or one a crash interrupted)

``<step>`` is the caller's step number (the trainer uses rollout batches done). Orbax writes every save
into a temporary directory and renames it to ``<step>`` only when every item is complete, so a crash at
any moment leaves the earlier checkpoints intact; :meth:`Checkpointer.latest_step` only sees renamed
(finished) steps, and opening a :class:`Checkpointer` for writing deletes stale temporary directories.
The ``graphdef`` of a :class:`~ict_jax.TrainState` is not saved: it comes from the restore template.
"""

from __future__ import annotations

import dataclasses
import errno
import gc
import logging
import os
import shutil
import sys
from pathlib import Path
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
from flax import nnx

from ict_jax.model.qwen2 import Qwen2
from ict_jax.rl.state import TrainState, make_optimizer, opt_state_shardings, split_trainable
from ict_jax.sharding import replicated, state_shardings
from ict_jax.train.checkpoint_errors import CheckpointWriteError, OrbaxLogCapture, QuietEventLoopTracebacks, write_error

FORMAT = 1  # meta["format"]: bump when the saved items change
_ITEMS = ("params", "opt", "meta")


# ------------------------------------------------------------------------------------------------
# Helpers
# ------------------------------------------------------------------------------------------------
def _jsonable(x: Any, where: str = "meta") -> Any:
    """``x`` as plain JSON types (dataclasses, numpy / JAX scalars and small arrays, paths, tuples)."""
    if x is None or isinstance(x, (bool, int, float, str)):
        return x  # NaN / inf round-trip through Python's json
    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        return _jsonable(x.to_dict() if hasattr(x, "to_dict") else dataclasses.asdict(x), where)
    if isinstance(x, dict):
        return {str(k): _jsonable(v, f"{where}[{k!r}]") for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v, f"{where}[{i}]") for i, v in enumerate(x)]
    if isinstance(x, Path):
        return str(x)
    if isinstance(x, (np.ndarray, np.generic, jax.Array)):
        return _jsonable(np.asarray(jax.device_get(x)).tolist(), where)
    raise TypeError(f"checkpoint {where}: {type(x).__name__} is not JSON-able")


def _default_sharding() -> jax.sharding.Sharding:
    return jax.sharding.SingleDeviceSharding(jax.devices()[0])


def abstract_tree(tree: Any) -> Any:
    """Each leaf (a jax.Array or ShapeDtypeStruct) as a ShapeDtypeStruct carrying its sharding."""
    def one(a: Any) -> jax.ShapeDtypeStruct:
        sh = getattr(a, "sharding", None) or _default_sharding()
        return jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sh)

    return jax.tree.map(one, tree)


def abstract_train_state(config: Any, model_config: Any, *, mesh: jax.sharding.Mesh | None = None,
                         tx: Any = None) -> TrainState:
    """A restore template: the :class:`~ict_jax.TrainState` that ``init_train_state(config,
    init_model(model_config, mesh=mesh), tx=tx)`` would build, as ShapeDtypeStructs with the same
    shardings (rule table on ``mesh``, else the default device); nothing is allocated. With LoRA
    (``model_config.lora``) its ``params`` are the adapters and ``frozen`` the base, as
    ``rl.state.split_trainable`` splits the model."""
    graphdef, params, frozen = abstract_params(model_config, mesh)
    opt_state = abstract_opt_state(tx or make_optimizer(config), params)
    rep = _default_sharding() if mesh is None else replicated(mesh)
    key = jax.eval_shape(lambda: jax.random.PRNGKey(0))
    return TrainState(params=params, opt_state=opt_state, step=jax.ShapeDtypeStruct((), np.int32, sharding=rep),
                      rng=jax.ShapeDtypeStruct(key.shape, key.dtype, sharding=rep), graphdef=graphdef, frozen=frozen)


def abstract_opt_state(tx: Any, params: Any) -> Any:
    """``tx.init(params)`` as ShapeDtypeStructs placed as ``rl.state.init_opt_state`` places it (moments
    sharded as their parameter, counts replicated); ``params``: arrays or ShapeDtypeStructs. Nothing is
    allocated."""
    opt_sh = opt_state_shardings(tx, params)
    opt_shapes = jax.eval_shape(tx.init, params)
    if opt_sh is None:
        return abstract_tree(opt_shapes)
    return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), opt_shapes, opt_sh)


def abstract_params(model_config: Any, mesh: jax.sharding.Mesh | None) -> tuple[Any, Any, Any]:
    """(graphdef, trainable, frozen): ``rl.state.split_trainable`` of the model as nnx.States over
    ShapeDtypeStructs with the model's shardings (``frozen`` None without LoRA): the restore template of a
    checkpoint's ``params`` item."""
    abstract = nnx.eval_shape(lambda: Qwen2(model_config, rngs=nnx.Rngs(0)))
    graphdef, params, frozen = split_trainable(abstract)
    is_var = lambda x: isinstance(x, nnx.Variable)  # noqa: E731

    def placed(state: Any) -> Any:
        shardings = (jax.tree.map(lambda v: _default_sharding(), state, is_leaf=is_var) if mesh is None
                     else state_shardings(state, mesh))
        return jax.tree.map(lambda v, s: v.replace(jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=s)),
                            state, shardings, is_leaf=is_var)

    return graphdef, placed(params), None if frozen is None else placed(frozen)


def _shapes(tree: Any) -> dict[tuple[str, ...], tuple[int, ...]]:
    """{key path as names: shape} of a tree of arrays, ShapeDtypeStructs or orbax array metadata."""
    def name(k: Any) -> str:
        for attr in ("key", "name", "idx"):
            if hasattr(k, attr):
                return str(getattr(k, attr))
        return str(k)

    flat, _ = jax.tree_util.tree_flatten_with_path(tree)
    return {tuple(name(k) for k in path): tuple(getattr(leaf, "shape", ())) for path, leaf in flat}


def _tree_bytes(folder: Path) -> int:
    """Bytes of the files under ``folder``."""
    total = 0
    for root, _dirs, files in os.walk(folder):
        for name in files:
            try:
                total += os.path.getsize(os.path.join(root, name))
            except OSError:
                pass
    return total


def resolve_checkpoint_dir(directory: str | Path, step: int | None = None) -> tuple[Path, int | None]:
    """(the folder holding ``<step>/`` directories, step) for a run dir, its ``checkpoints/`` folder
    or one step's directory; FileNotFoundError when it does not exist."""
    p = Path(directory)
    if not p.is_dir():
        raise FileNotFoundError(f"checkpoint directory {str(p)!r} does not exist")
    if (p / "checkpoints").is_dir():
        p = p / "checkpoints"
    elif p.name.isdigit() and (p / "params").is_dir():  # one step's directory
        if step is not None and step != int(p.name):
            raise ValueError(f"{p} is the checkpoint of step {p.name}, but step {step} was asked for")
        return p.parent, int(p.name)
    return p, step


def checkpoint_run_dir(folder: Path) -> Path:
    """The run directory of a folder of checkpoints (``<run_dir>/checkpoints`` or ``checkpoints_sft``;
    any other folder is taken as its own run directory)."""
    return folder.parent if folder.name in ("checkpoints", "checkpoints_sft") else folder


# ------------------------------------------------------------------------------------------------
# Checkpointer
# ------------------------------------------------------------------------------------------------
class Checkpointer:
    """Saves and restores :class:`~ict_jax.TrainState` + JSON metadata under ``directory/<step>/``.

    ``keep``: the last K finished checkpoints are kept. ``async_save``: :meth:`save` returns once the
    arrays are copied off the devices (the state may then be donated or changed); the files are written
    in the background; the next save, :meth:`wait` and :meth:`close` wait for it. ``read_only`` opens
    an existing directory without creating or cleaning anything. Multi-host: every process calls
    :meth:`save` and :meth:`restore` (orbax writes each array shard once and only the primary process
    writes the JSON metadata).
    """

    def __init__(self, directory: str | Path, *, keep: int = 3, async_save: bool = True, read_only: bool = False):
        if not isinstance(keep, int) or keep < 1:
            raise ValueError(f"Checkpointer: keep must be a positive integer, got {keep!r}")
        self.directory = Path(directory).absolute()
        if read_only and not self.directory.is_dir():
            raise FileNotFoundError(f"checkpoint directory {str(self.directory)!r} does not exist")
        # read-only: the options orbax would otherwise "correct" with a WARNING line each
        options = ocp.CheckpointManagerOptions(
            max_to_keep=None if read_only else keep, enable_async_checkpointing=async_save, create=not read_only,
            cleanup_tmp_directories=not read_only, read_only=read_only,
            **({"save_interval_steps": 0} if read_only else {}))
        handlers = {"params": ocp.StandardCheckpointHandler(), "opt": ocp.StandardCheckpointHandler(),
                    "meta": ocp.JsonCheckpointHandler()}
        absl_log = logging.getLogger("absl")  # "Given directory is read only": what read_only asks for
        level = absl_log.level
        if read_only:
            absl_log.setLevel(logging.ERROR)
        try:
            self._mgr = ocp.CheckpointManager(self.directory, options=options, item_handlers=handlers)
        finally:
            absl_log.setLevel(level)
        # a failed background save: orbax's log records go to the details log, the user gets one line
        self._capture = None if read_only else OrbaxLogCapture(self.directory).install()
        self._quiet = None if read_only else QuietEventLoopTracebacks(sys.stderr, self._capture).install()
        self._pending_step: int | None = None  # the step of a save that may still be writing
        self._write_failed = False

    def _failed(self, exc: BaseException, step: int | None) -> CheckpointWriteError:
        """The one-line error of a failed save; orbax's other background writes are let finish first
        (their errors go to the details log too) so that nothing of the failed save is left running."""
        self._pending_step = None
        self._write_failed = True
        for _ in range(3):  # each wait re-raises the next error still pending
            try:
                self._mgr.wait_until_finished()
                break
            except (OSError, ValueError, RuntimeError):
                continue
        gc.collect()  # coroutines of the aborted save end now, not as noise at interpreter exit
        return write_error(exc, step=step, directory=self.directory, intact=self.latest_step(),
                           capture=self._capture)

    # -- queries (finished checkpoints only: read from disk) ----------------------------------------
    def all_steps(self) -> list[int]:
        """Steps whose save finished (renamed from its temporary directory), ascending."""
        return sorted(ocp.path.step.checkpoint_steps(self.directory)) if self.directory.is_dir() else []

    def latest_step(self) -> int | None:
        steps = self.all_steps()
        return steps[-1] if steps else None

    def resolve_step(self, step: int | None) -> int:
        """``step`` if a finished checkpoint of it exists, the latest finished step for None; else
        FileNotFoundError naming the steps there are."""
        steps = self.all_steps()
        if step is None:
            if not steps:
                raise FileNotFoundError(f"no finished checkpoint in {str(self.directory)!r}")
            return steps[-1]
        if step not in steps:
            have = ", ".join(map(str, steps)) or "none"
            raise FileNotFoundError(f"no finished checkpoint of step {step} in {str(self.directory)!r} "
                                    f"(finished steps: {have})")
        return step

    # -- save / restore ------------------------------------------------------------------------------
    def save(self, step: int, state: TrainState, meta: dict[str, Any] | None = None) -> None:
        """Save ``state`` (params, opt_state, step, rng) and ``meta`` as checkpoint ``step``.

        ``meta`` must be JSON-able (dataclasses such as Config and ModelConfig are converted);
        ``meta["model_config"]`` is filled from the state when absent; ``meta["step"]`` is ``step``.
        """
        step = int(step)
        if step < 0:
            raise ValueError(f"Checkpointer.save: step must be >= 0, got {step}")
        meta = dict(meta or {})
        if meta.get("model_config") is None and state.graphdef is not None:
            meta["model_config"] = state.model().config
        meta = _jsonable({**meta, "step": step, "format": FORMAT})
        if (self.directory / str(step)).exists():
            raise FileExistsError(f"a checkpoint of step {step} already exists in {str(self.directory)!r}")
        self._check_space(step)
        previous = self._pending_step
        try:  # orbax first waits for the previous save: its failure surfaces here, as that step's
            self._mgr.save(step, force=True, args=ocp.args.Composite(
                params=ocp.args.StandardSave(state.params),
                opt=ocp.args.StandardSave({"opt_state": state.opt_state, "step": state.step, "rng": state.rng}),
                meta=ocp.args.JsonSave(meta)))
        except (OSError, ValueError, RuntimeError) as e:
            raise self._failed(e, previous if previous is not None else step) from None
        self._pending_step = step

    def _check_space(self, step: int) -> None:
        """Before anything is written: the disk must have room for one more checkpoint as large as the
        last finished one (orbax compresses, so its size on disk is the estimate; 5 % margin). A full
        disk is then refused at the save itself, with nothing half-written; the first save of a
        folder is not estimated (a failure is still caught and reported by :meth:`check` / :meth:`wait`)."""
        last = self.latest_step()
        if last is None or self._pending_step is not None:
            return
        need = int(_tree_bytes(self.directory / str(last)) * 1.05)
        try:
            free = shutil.disk_usage(self.directory).free
        except OSError:
            return
        if free < need:
            raise self._failed(OSError(errno.ENOSPC, f"No space left on device ({free / 2**20:.1f} MiB free, "
                                              f"about {need / 2**20:.1f} MiB needed; nothing was written)"), step)

    def restore(self, template: TrainState, step: int | None = None) -> tuple[TrainState, dict[str, Any]]:
        """(the TrainState of checkpoint ``step`` (default: the latest finished one), its meta).

        ``template``: a TrainState of the same structure, concrete (``init_train_state``) or abstract
        (:func:`abstract_train_state`); every array is restored with the template's sharding and dtype,
        and the template's ``graphdef`` and ``frozen`` base (a LoRA state's, which is not saved) are kept.
        """
        step = self.resolve_step(step)
        opt_t = {"opt_state": template.opt_state, "step": template.step, "rng": template.rng}
        self._check_fits(step, {"params": template.params, "opt": opt_t})
        try:
            r = self._mgr.restore(step, args=ocp.args.Composite(
                params=ocp.args.StandardRestore(abstract_tree(template.params)),
                opt=ocp.args.StandardRestore(abstract_tree(opt_t)), meta=ocp.args.JsonRestore()))
        except (ValueError, KeyError, TypeError) as e:
            why = str(e).splitlines()[0] if str(e) else type(e).__name__
            raise ValueError(f"checkpoint of step {step} in {self.directory} does not fit the restore template "
                             f"(another model or optimizer?): {why}") from e
        state = TrainState(params=r.params, opt_state=r.opt["opt_state"], step=r.opt["step"], rng=r.opt["rng"],
                           graphdef=template.graphdef, frozen=template.frozen)
        return state, dict(r.meta)

    def restore_params(self, template_params: Any, step: int | None = None) -> Any:
        """Only the ``params`` item of checkpoint ``step``, with the template's shardings."""
        step = self.resolve_step(step)
        self._check_fits(step, {"params": template_params})
        r = self._mgr.restore(step, args=ocp.args.Composite(
            params=ocp.args.StandardRestore(abstract_tree(template_params))))
        return r.params

    def _check_fits(self, step: int, items: dict[str, Any]) -> None:
        """ValueError naming the first array whose path or shape differs between checkpoint and template."""
        saved = self._mgr.item_metadata(step)
        for name, template in items.items():
            have, want = _shapes(saved[name]), _shapes(template)
            for key in sorted(set(have) | set(want)):
                if have.get(key) != want.get(key):
                    what = ("is missing from the checkpoint" if key not in have else
                            "is not in the template" if key not in want else
                            f"has shape {have[key]} in the checkpoint but {want[key]} in the template")
                    raise ValueError(f"checkpoint of step {step} in {self.directory} does not fit the restore "
                                     f"template (another model or optimizer?): {name}/{'/'.join(key)} {what}")

    def restore_meta(self, step: int | None = None) -> dict[str, Any]:
        step = self.resolve_step(step)
        return dict(self._mgr.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore())).meta)

    # -- lifecycle -----------------------------------------------------------------------------------
    def wait(self) -> None:
        """Block until a background save has finished (and old checkpoints are pruned). A save that
        failed raises :class:`~ict_jax.train.checkpoint_errors.CheckpointWriteError` (one line, the
        details in a log file)."""
        try:
            self._mgr.wait_until_finished()
        except (OSError, ValueError, RuntimeError) as e:
            raise self._failed(e, self._pending_step) from None
        self._pending_step = None

    def check(self) -> None:
        """Without waiting: raise :class:`~ict_jax.train.checkpoint_errors.CheckpointWriteError` if a
        background save has failed since the last call (the trainer calls it after every step, so a
        full disk stops the run at once rather than at the next save)."""
        if self._pending_step is None:
            return
        try:
            self._mgr.check_for_errors()
        except (OSError, ValueError, RuntimeError) as e:
            raise self._failed(e, self._pending_step) from None
        if not self._mgr.is_saving_in_progress():
            self.wait()  # finished: returns at once, or raises the failure it ended with

    def close(self) -> None:
        try:
            self._mgr.close()
        except (OSError, ValueError, RuntimeError) as e:
            raise self._failed(e, self._pending_step) from None
        finally:
            if self._capture is not None:
                self._capture.remove()
            if self._quiet is not None:  # after a failed save, stray tensorstore callbacks may come any time
                self._quiet.flush() if self._write_failed else self._quiet.remove()

    def __enter__(self) -> "Checkpointer":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
