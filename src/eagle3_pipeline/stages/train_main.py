"""One training process: `python -m eagle3_pipeline.stages.train_main ARGS.json` (also under torchrun)."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from eagle3_pipeline import logs
from eagle3_pipeline.formats import drafter_weights, hidden_store, metrics, zarr_io
from eagle3_pipeline.stages.train import settings_from_config, summary, train

# Bad data, not a bug: one line naming store, array and chunk (or what is wrong), not a traceback.
DATA_ERRORS = (hidden_store.InvalidStore, zarr_io.CorruptChunk)


def data_error_line(error: Exception) -> str:
    """The error's own line; a DataLoader worker's error arrives with the worker's traceback prepended and
    its own `module.Class: message` line last."""
    last = str(error).strip().splitlines()[-1]
    prefix = f"{type(error).__module__}.{type(error).__name__}: "
    return last.removeprefix(prefix)


def run(args: dict) -> None:
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    log = logs.setup(args["log"] if rank == 0 else None, name="train",
                     history=Path(args["state_dir"]) / "train.log" if rank == 0 else None)
    if world > 1:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        if torch.cuda.is_available():
            torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        dist.init_process_group(backend)
    try:
        settings = settings_from_config(args["settings"])
        try:
            model = train([Path(p) for p in args["stores"]], Path(args["target"]), Path(args["vocab"]),
                          Path(args["state_dir"]), settings,
                          heldout_paths=[Path(p) for p in args.get("heldout", [])])
        except DATA_ERRORS as error:
            log.error("training stopped: %s", data_error_line(error))
            raise SystemExit(1) from None
        if rank == 0:
            weights = {k: v.contiguous().cpu() for k, v in model.trainable_state_dict().items()}
            drafter_weights.write_trained(Path(args["weights"]), weights, model.config.as_dict())
            result = summary(Path(args["state_dir"]), settings)
            metrics.write_summary(Path(args["summary"]), result)
            log.info("done: %s", result)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


if __name__ == "__main__":
    run(json.loads(Path(sys.argv[1]).read_text()))
