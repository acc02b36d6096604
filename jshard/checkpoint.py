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

import dataclasses
import os
from typing import Any

import orbax.checkpoint as ocp

from jshard.models import DecoderConfig, GPTConfig, LlamaConfig

FAMILIES = {"GPT": GPTConfig, "Llama": LlamaConfig}  # a record's "family" -> its config


class CheckpointError(ValueError):
    """A checkpoint directory that cannot be used as asked; nothing in it was changed."""


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
        """Start saving `state` (arrays, any sharding) and `record` as `step`."""
        os.makedirs(self.directory, exist_ok=True)
        self._manager.save(step, args=ocp.args.Composite(
            state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(record)), force=True)

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
        """Wait for a save in flight to be complete (renamed into place)."""
        self._manager.wait_until_finished()
        self._manager.close()

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
