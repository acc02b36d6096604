"""Training checkpoints with orbax: sharded, atomic, restorable onto another mesh.

A checkpoint directory holds one orbax step directory per saved step, each with two items:

    <dir>/<step>/state   the train state, each array written by the processes holding its
                         shards (orbax's PyTree format: tensorstore, OCDBT)
    <dir>/<step>/meta    a JSON record: model config, step, data position, run settings

Atomic: orbax writes a step to `<step>.orbax-checkpoint-tmp-*` and renames it when every
item is complete, and it lists only renamed steps, so a save cut short leaves the previous
checkpoint the latest (the leftover is deleted on the next start). Saves are asynchronous:
`save` returns once the arrays are copied off the devices, and the write overlaps training.

Restoring onto another mesh or strategy is orbax's: it reads each array into the shardings
of the `like` tree it is given, the new step's state layout.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import gc
import logging
import os
import sys
import tempfile
import threading
import traceback
from typing import Any

import orbax.checkpoint as ocp

from jshard.models import DecoderConfig, GPTConfig, LlamaConfig

FAMILIES = {"GPT": GPTConfig, "Llama": LlamaConfig}  # a record's "family" -> its config


class CheckpointError(ValueError):
    """A checkpoint directory that cannot be used as asked, or a save that failed (`abandoned`:
    its writes were left running); no checkpoint written before is changed."""

    abandoned = False


# A save that fails in orbax's background threads (a full disk) reports itself from each of
# them, as log errors and tracebacks, for as long as its writes run (past the process's own
# exit): dozens to hundreds of them. A command (`jshard train`) sends what comes from any thread
# but the main one, and orbax's logs from inside a save, to this log instead of the terminal
# (`reports_to_log`), and the CheckpointError names it.
BACKGROUND_LOG = os.path.join(tempfile.gettempdir(), f"jshard-checkpoint-{os.getpid()}.log")


def _to_log(text: str) -> None:
    with open(BACKGROUND_LOG, "a") as log:
        log.write(text if text.endswith("\n") else text + "\n")


_IN_ORBAX = threading.Event()  # set while the main thread is inside a save or a wait


@contextlib.contextmanager
def _orbax_call():
    _IN_ORBAX.set()
    try:
        yield
    finally:
        _IN_ORBAX.clear()


@functools.cache
def reports_to_log() -> None:
    """For the rest of this process (once): other threads' exceptions and log records, and
    orbax's records from inside a save, to `BACKGROUND_LOG`. For commands: a library user's
    threads keep their own reporting."""
    main, excepthook, unraisable = threading.main_thread(), sys.excepthook, sys.unraisablehook

    def from_main() -> bool:
        return threading.current_thread() is main

    def on_exception(kind, value, tb):  # what C callbacks print (PyErr_Print) goes through here
        (excepthook if from_main() else lambda *e: _to_log("".join(traceback.format_exception(*e))))(kind, value, tb)

    def on_unraisable(report):  # "Exception ignored in ..." from a coroutine left behind
        if from_main() and not sys.is_finalizing():
            return unraisable(report)
        _to_log(f"{report.err_msg or 'Exception ignored in'}: {report.object!r}\n"
                + "".join(traceback.format_exception(report.exc_type, report.exc_value, report.exc_traceback)))

    def logged(record) -> bool:
        _to_log(logging.Formatter("%(levelname)s %(threadName)s %(message)s").format(record))
        return False

    class ToLog(logging.Filter):  # orbax logs through absl: its threads', and its own calls' from ours
        def filter(self, record):
            return (from_main() and not _IN_ORBAX.is_set()) or logged(record)

    sys.excepthook, sys.unraisablehook = on_exception, on_unraisable
    threading.excepthook = lambda args: _to_log("".join(traceback.format_exception(
        args.exc_type, args.exc_value, args.exc_traceback)))
    logging.getLogger("absl").addFilter(ToLog())
    # A command runs no event loop of its own: asyncio's records are orbax's, whichever thread
    # logs them ("Task exception was never retrieved", with the traceback, from the thread that
    # drops a failed write's task: the main one too, at any time after the save).
    logging.getLogger("asyncio").addFilter(logged)


class Checkpoints:
    """The checkpoints of one training run, in `directory` (created on the first save)."""

    def __init__(self, directory: str | os.PathLike, keep: int = 3):
        self.directory = os.path.abspath(directory)
        if os.path.exists(self.directory) and not os.path.isdir(self.directory):
            raise CheckpointError(f"checkpoint dir {self.directory} is a file. Fix: choose a directory.")
        self._manager = ocp.CheckpointManager(
            self.directory,
            item_handlers={"state": ocp.StandardCheckpointHandler(), "meta": ocp.JsonCheckpointHandler()},
            options=ocp.CheckpointManagerOptions(max_to_keep=keep, create=False, cleanup_tmp_directories=True),
        )
        self._writing: int | None = None  # the step whose save is in flight

    def latest_step(self) -> int | None:
        return self._manager.latest_step()

    def steps(self) -> list[int]:
        """Every step saved here, oldest first."""
        return sorted(self._manager.all_steps())

    def record(self, step: int) -> dict[str, Any]:
        """The JSON record saved with `step`; reads no arrays."""
        where = os.path.join(self.directory, str(step))
        try:
            record = self._manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore())).meta
            state = self._manager.item_metadata(step).state
        except Exception as e:  # orbax raises many kinds here; all mean the same to the user
            raise CheckpointError(self._unreadable(where, e)) from e
        if not isinstance(record, dict) or state is None:
            raise CheckpointError(self._unreadable(where, "its state or its record is missing"))
        return record

    def check(self, identity: dict[str, Any], resume: bool) -> dict[str, Any] | None:
        """Before any device work: the record to resume from, or None to start afresh.

        Refuses a directory whose latest checkpoint is of a run with another `identity`
        (another model), `resume` with nothing to resume, and starting afresh over
        checkpoints that the new run would mix with its own.
        """
        step = self.latest_step()
        if step is None:
            if resume:
                raise CheckpointError(
                    f"--resume: no checkpoint to resume in {self.directory}. Fix: drop --resume to start "
                    "afresh, or point --checkpoint-dir at a run's checkpoints."
                )
            return None
        record = self.record(step)
        differ = _differences(record, identity)
        if differ:
            shown = "; ".join(differ)
            raise CheckpointError(
                f"checkpoint dir {self.directory} holds a checkpoint (step {step}) of another model ({shown}). "
                "Fix: choose another --checkpoint-dir, or train the model it holds."
            )
        if not resume:
            raise CheckpointError(
                f"checkpoint dir {self.directory} already holds checkpoints up to step {step}; starting afresh "
                f"would mix two runs. Fix: add --resume to continue from step {step}, or choose another "
                "--checkpoint-dir."
            )
        return record

    def save(self, step: int, state: Any, record: dict[str, Any]) -> None:
        """Start saving `state` (arrays, any sharding) and `record` as `step`. The write goes on
        in the background; one that fails (a full disk, a permission) is a CheckpointError here,
        at the next save, or at `wait`, naming the step that was not written."""
        try:
            os.makedirs(self.directory, exist_ok=True)
            with _orbax_call():
                self._manager.save(step, args=ocp.args.Composite(  # waits for the save before it first
                    state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(record)), force=True)
        except Exception as e:  # orbax's and tensorstore's errors, of many kinds
            self._failed(self._writing or step, e)
        self._writing = step

    def wait(self) -> None:
        """Until the save in flight is complete (renamed into place); a CheckpointError if it failed."""
        if self._manager is None:
            return
        try:
            with _orbax_call():
                self._manager.wait_until_finished()
        except Exception as e:
            self._failed(self._writing, e)
        self._writing = None

    def _failed(self, step: int | None, why: Exception):
        """Stop writing (the save's other threads end now, not in tracebacks at exit) and say which
        step was not written and which is the latest that was."""
        self._writing, manager, self._manager = None, self._manager, None
        try:
            with _orbax_call():
                manager.close()
        except Exception:  # the same failure again
            pass
        gc.collect()  # the save's abandoned coroutines report now, to the log
        why = str(why).splitlines()[0] if str(why).strip() else type(why).__name__
        why = why.split(": ")[-1] if "os_error_code" in why or "Errno" in why else why  # the OS's reason
        latest = max((int(name) for name in os.listdir(self.directory) if name.isdigit()), default=None) \
            if os.path.isdir(self.directory) else None
        error = CheckpointError(
            f"checkpoint step {step} could not be written to {self.directory} ({why[:200]}); the latest complete "
            f"checkpoint is {f'step {latest}' if latest is not None else 'none'}. Fix: free space or give write access "
            "there (or choose another --checkpoint-dir), then --resume." + (f" orbax's own reports: {BACKGROUND_LOG}"
                                                          if os.path.exists(BACKGROUND_LOG) else ""))
        error.abandoned = True  # orbax's writes still run, and report again past the interpreter's shutdown:
        raise error  # a command stopping on this exits at once (`distributed.leave`)

    def restore(self, step: int, like: Any) -> Any:
        """The state saved as `step`, laid out as `like`: a tree of `jax.ShapeDtypeStruct`
        with shardings (any mesh, any strategy), of the structure that was saved."""
        try:
            return self._manager.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore(like))).state
        except Exception as e:  # a tree or shape mismatch, or unreadable array data
            raise CheckpointError(self._unreadable(os.path.join(self.directory, str(step)), e)) from e

    def restore_params(self, step: int, like: Any) -> Any:
        """Only `state["params"]` of `step`, laid out as `like` (as `restore`'s): orbax's partial
        restore reads no optimizer state, so a model for inference loads its own bytes only."""
        where = os.path.join(self.directory, str(step))
        item = {"params": like}
        args = ocp.args.PyTreeRestore(item, restore_args=ocp.checkpoint_utils.construct_restore_args(item),
                                      partial_restore=True)
        reader = ocp.PyTreeCheckpointer()  # the state item's own format (StandardSave writes a PyTree)
        try:
            return reader.restore(os.path.join(where, "state"), args=args)["params"]
        except Exception as e:  # as `restore`
            raise CheckpointError(self._unreadable(where, e)) from e
        finally:
            reader.close()

    def close(self) -> None:
        """Wait for a save in flight to be complete (renamed into place), then let go; after a
        failed save, nothing is left to wait for."""
        if self._manager is None:
            return
        self.wait()
        self._manager.close()
        self._manager = None

    def __enter__(self) -> Checkpoints:
        return self

    def __exit__(self, *_) -> None:
        self.close()

    @staticmethod
    def _unreadable(where: str, why) -> str:
        why = str(why).splitlines()[0] if str(why).strip() else type(why).__name__
        why = why if len(why) <= 240 else why[:240] + " ..."
        return (f"checkpoint {where} cannot be read, it is corrupt, partial or of another layout ({why}). "
                f"Fix: delete {where} to resume from the checkpoint before it, or start afresh in another "
                "--checkpoint-dir.")


def _differences(saved, wanted, path: str = "") -> list[str]:
    """'model.embed: saved 64, this run 128' for every leaf of `wanted` that `saved` does not match."""
    if isinstance(wanted, dict):
        saved = saved if isinstance(saved, dict) else {}
        return [d for key, value in wanted.items() for d in _differences(saved.get(key), value, f"{path}{key}.")]
    return [] if saved == wanted else [f"{path[:-1]}: saved {saved!r}, this run {wanted!r}"]


def model_of(record: dict, where: str) -> DecoderConfig:
    """The decoder a checkpoint's record describes: its `family`, or in a record without one
    the first family whose config has every saved field (a Llama's add kv_heads and more)."""
    saved = record.get("model")
    family = record.get("family")
    if family is None and isinstance(saved, dict):
        family = next((name for name, config in FAMILIES.items()
                       if set(saved) <= {f.name for f in dataclasses.fields(config)}), None)
    try:
        return FAMILIES[family](**saved)
    except (KeyError, TypeError, ValueError) as e:
        raise CheckpointError(f"checkpoint {where}: its record's model ({family or 'no family'}: {saved!r}) is "
                              f"not one jshard builds ({e}). Fix: point --checkpoint-dir at a run of `jshard "
                              "train`.") from None
