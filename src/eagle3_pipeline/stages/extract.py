"""The extract job: one token shard -> one hidden-state store, resumable after a kill."""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from eagle3_pipeline import logs
from eagle3_pipeline.drafter.batches import pack_greedy
from eagle3_pipeline.formats import hidden_store, token_shards
from eagle3_pipeline.formats.hidden_store import storage_order
from eagle3_pipeline.formats.target_dir import read_identity
from eagle3_pipeline.logs import Progress
from eagle3_pipeline.runtime import extraction
from eagle3_pipeline.runtime.extraction import Backend, finite_rows
from eagle3_pipeline.settings import from_section, setting


class NonFiniteActivations(ValueError):
    pass


@dataclass(frozen=True)
class Settings:
    token_budget: int  # padded tokens per forward batch
    writer_threads: int
    # raw bytes per zarr shard file (the unit of writing and of resume)
    store_shard_bytes: int = setting(key="store_shard_mb", convert=lambda mib: mib << 20)
    backend: dict[str, Any]  # the `extract` section as runtime.extraction.from_config reads it
    trust_remote_code: bool
    store_dtype: str  # how the store keeps the states (formats/hidden_store/rows.py)


@dataclass
class Batch:
    sequences: list[int]  # indices into the store's (length-sorted) order
    start_row: int
    end_row: int


def plan_batches(sorted_lengths: np.ndarray, token_budget: int) -> list[Batch]:
    """Greedy batches of consecutive sequences whose padded size (count x longest) fits the budget: the
    training schedule's packer, over unpadded lengths."""
    lengths = sorted_lengths.tolist()
    batches, row = [], 0
    for members in pack_greedy(lengths, token_budget):
        rows = sum(lengths[j] for j in members)
        batches.append(Batch(members, row, row + rows))
        row += rows
    return batches


def reorder(shard: token_shards.TokenShard, order: np.ndarray) -> dict[str, Any]:
    lengths = shard.lengths()[order]
    offsets = np.zeros(len(order) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    pieces = [shard.sequence(int(j)) for j in order]
    return {
        "input_ids": np.concatenate([ids for ids, _ in pieces]),
        "loss_mask": np.concatenate([mask for _, mask in pieces]),
        "seq_offsets": offsets,
        "sample_ids": [shard.sample_ids[int(j)] for j in order],
    }


def check_finite(finite: torch.Tensor, batch: Batch, offsets: np.ndarray, sample_ids: list[str],
                 shard_path: Path) -> None:
    bad_rows = ~finite
    if not bad_rows.any():
        return
    first_bad = batch.start_row + int(torch.nonzero(bad_rows)[0])
    j = int(np.searchsorted(offsets, first_bad, side="right") - 1)
    raise NonFiniteActivations(
        f"{shard_path}: NaN/Inf activations for sample {sample_ids[j]!r} (token {first_bad - offsets[j]}); "
        "check the target's dtype (fp16 overflows are common) and the input")


def extract_shard(backend: Backend, token_shard_path: Path, output: Path, token_budget: int,
                  writer_threads: int, metadata: dict[str, Any], log: logging.Logger,
                  store_shard_bytes: int = hidden_store.SHARD_BYTES, store_dtype: str = "bfloat16"
                  ) -> dict[str, Any]:
    shard = token_shards.read(token_shard_path)
    order = storage_order(shard.lengths())
    sequences = reorder(shard, order)
    num_tokens = int(sequences["seq_offsets"][-1])
    info = backend.info
    store_metadata = {**metadata, **info.as_attrs(), "num_sequences": len(order),
                      "template_hash": shard.attrs.get("template_hash"), "token_shard": token_shard_path.name}
    writer = hidden_store.StoreWriter(output, num_tokens, info.hidden_size, store_metadata, sequences,
                                      writer_threads, store_shard_bytes, store_dtype)
    batches = plan_batches(np.diff(sequences["seq_offsets"]), token_budget)
    todo = [b for b in batches if b.end_row > writer.rows_written]
    if writer.rows_written:
        log.info("resuming %s: %d of %d rows already written; %d of %d batches left", output,
                 writer.rows_written, num_tokens, len(todo), len(batches))
    log.info("extracting %d sequences, %d tokens in %d batches (budget %d tokens), backend %s, aux layers %s, "
             "stored as %s", len(order), num_tokens, len(batches), token_budget, info.name,
             list(info.aux_layer_ids), store_dtype)
    encode = functools.partial(hidden_store.encode, store_dtype=store_dtype)
    progress = Progress(log, f"extract {token_shard_path.name}", len(todo),
                        total_tokens=sum(b.end_row - b.start_row for b in todo))
    in_flight = None
    try:
        for batch in todo:
            ids = [sequences["input_ids"][sequences["seq_offsets"][j]:sequences["seq_offsets"][j + 1]]
                   for j in batch.sequences]
            result = _launch(backend, ids, encode)
            if in_flight is not None:
                _drain(in_flight, writer, sequences, token_shard_path, progress)
            in_flight = (batch, result)
        if in_flight is not None:
            _drain(in_flight, writer, sequences, token_shard_path, progress)
    except BaseException:
        writer.abort()
        raise
    progress.finish()
    writer.finish({"batches": len(batches), "token_budget": token_budget})
    return hidden_store.validate(output)


def _launch(backend: Backend, ids: list[np.ndarray], encode: Callable[..., dict[str, torch.Tensor]]
            ) -> tuple[dict[str, torch.Tensor], torch.Tensor, Any]:
    """The batch's rows as the store keeps them, a per-row finite flag, and an event to wait on (or None)."""
    if hasattr(backend, "extract_packed"):
        return backend.extract_packed(ids, encode)  # encoded on the device, copied to the host asynchronously
    states = backend.extract(ids)  # backends without async copies (e.g. SGLang: the states arrive on the host)
    aux, last = torch.cat([s.aux for s in states]), torch.cat([s.last for s in states])
    return encode(aux, last), finite_rows(aux, last), None


def _drain(in_flight, writer: hidden_store.StoreWriter, sequences: dict[str, Any], shard_path: Path,
           progress: Progress) -> None:
    batch, (rows, finite, event) = in_flight
    if event is not None:
        event.synchronize()
    check_finite(finite, batch, sequences["seq_offsets"], sequences["sample_ids"], shard_path)
    skip = max(0, writer.buffer_start + writer.buffered - batch.start_row)  # rows already durable (resume)
    writer.append({name: array[skip:] for name, array in rows.items()})
    progress.update(1, batch.end_row - batch.start_row)


def run(tokens: Path, target_dir: Path, output: Path, settings: Settings, log: logging.Logger) -> dict[str, Any]:
    backend = extraction.from_config(settings.backend, target_dir, settings.trust_remote_code)
    identity = read_identity(target_dir)
    attrs = extract_shard(
        backend, tokens, output, settings.token_budget, settings.writer_threads,
        {"target_hash": identity["content_hash"], "target_revision": identity["source"].get("revision"),
         "device": str(backend.device)},
        log,
        store_shard_bytes=settings.store_shard_bytes, store_dtype=settings.store_dtype,
    )
    log.info("store complete: %d sequences, %d tokens", attrs["num_sequences"], attrs["num_tokens"])
    return attrs


def run_from_snakemake(snakemake: Any) -> None:
    log = logs.setup(snakemake.log[0])
    torch.set_num_threads(snakemake.threads)
    section = snakemake.config["extract"]  # the whole section: its params are only the rerun trigger
    settings = from_section(Settings, section, backend=section, trust_remote_code=snakemake.params.trust_remote_code)
    run(Path(snakemake.input.tokens), Path(snakemake.input.target), Path(snakemake.output[0]), settings, log)
