"""The token shard format: `tokens/shard-{i:05d}.zarr` (zarr v3 group).

Arrays (token-major, concatenated over sequences):
    input_ids   int32  [N_tok]
    loss_mask   uint8  [N_tok]   1 on assistant-produced tokens
    seq_offsets int64  [N+1]     sequence j is input_ids[seq_offsets[j]:seq_offsets[j+1]]
    sample_ids  string [N]
Attrs: format, schema_version, complete (written last), num_sequences, num_tokens, num_loss_tokens,
template_hash, target_hash, max_seq_len, and the tokenize stage's counts.
Every chunk ends with a crc32c of its compressed bytes (schema version 2; version 1 is refused).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import zarr

from eagle3_pipeline.formats import zarr_io
from eagle3_pipeline.formats.atomic import atomic_dir
from eagle3_pipeline.tokenization import TokenizedConversation

FORMAT = "eagle3-token-shard"
SCHEMA_VERSION = 2  # 2: a crc32c on every chunk
ARRAYS = ("input_ids", "loss_mask", "seq_offsets", "sample_ids")
BYTES_PER_TOKEN = 4 + 1  # input_ids int32 + loss_mask uint8, before compression


class InvalidTokenShard(ValueError):
    pass


@dataclass
class TokenShard:
    input_ids: np.ndarray
    loss_mask: np.ndarray
    seq_offsets: np.ndarray
    sample_ids: list[str]
    attrs: dict[str, Any]

    def __len__(self) -> int:
        return len(self.sample_ids)

    def sequence(self, j: int) -> tuple[np.ndarray, np.ndarray]:
        start, end = self.seq_offsets[j], self.seq_offsets[j + 1]
        return self.input_ids[start:end], self.loss_mask[start:end]

    def lengths(self) -> np.ndarray:
        return np.diff(self.seq_offsets)


def write(path: Path, sequences: list[TokenizedConversation], attrs: dict[str, Any]) -> None:
    """Build the shard in a `.partial` sibling and rename it into place when complete."""
    lengths = np.asarray([len(s.input_ids) for s in sequences], dtype=np.int64)
    offsets = np.zeros(len(sequences) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    input_ids = np.concatenate([s.input_ids for s in sequences]) if sequences else np.zeros(0, np.int32)
    loss_mask = np.concatenate([s.loss_mask for s in sequences]) if sequences else np.zeros(0, np.uint8)
    with atomic_dir(path) as partial:
        group = zarr.open_group(str(partial), mode="w")
        zarr_io.write_array(group, "input_ids", input_ids.astype(np.int32))
        zarr_io.write_array(group, "loss_mask", loss_mask.astype(np.uint8))
        zarr_io.write_array(group, "seq_offsets", offsets)
        zarr_io.write_strings(group, "sample_ids", [s.sample_id for s in sequences])
        group.attrs.update({
            **attrs,
            "format": FORMAT,
            "schema_version": SCHEMA_VERSION,
            "num_sequences": len(sequences),
            "num_tokens": int(offsets[-1]),
            "num_loss_tokens": int(loss_mask.sum()),
        })
        group.attrs["complete"] = True  # last: a store without it was interrupted


def read(path: Path) -> TokenShard:
    validate(path)
    group = zarr_io.open_readonly(path)
    arrays = {name: zarr_io.read_rows(path, name, group[name], 0, group[name].shape[0])
              for name in ("input_ids", "loss_mask", "seq_offsets", "sample_ids")}
    return TokenShard(
        input_ids=arrays["input_ids"],
        loss_mask=arrays["loss_mask"],
        seq_offsets=arrays["seq_offsets"],
        sample_ids=[str(s) for s in arrays["sample_ids"]],
        attrs=dict(group.attrs),
    )


def read_attrs(path: Path) -> dict[str, Any]:
    return zarr_io.attrs(path)


def validate(path: Path) -> dict[str, Any]:
    group, attrs = zarr_io.open_complete(path, FORMAT, "token shard", InvalidTokenShard, SCHEMA_VERSION,
                                         job="tokenize")
    missing = [name for name in ARRAYS if name not in group]
    if missing:
        raise InvalidTokenShard(f"{path}: arrays {missing} missing; rerun its tokenize job")
    try:
        offsets = zarr_io.read_rows(path, "seq_offsets", group["seq_offsets"], 0, group["seq_offsets"].shape[0])
    except zarr_io.CorruptChunk as exc:
        raise InvalidTokenShard(str(exc)) from exc
    problems = []
    if len(offsets) != attrs["num_sequences"] + 1 or group["sample_ids"].shape[0] != attrs["num_sequences"]:
        problems.append("sequence count disagrees with attrs")
    if offsets[-1] != attrs["num_tokens"] or group["input_ids"].shape[0] != attrs["num_tokens"]:
        problems.append("token count disagrees with attrs")
    if group["loss_mask"].shape != group["input_ids"].shape:
        problems.append("loss_mask and input_ids differ in length")
    if np.any(np.diff(offsets) < 0):
        problems.append("seq_offsets are not increasing")
    if problems:
        raise InvalidTokenShard(f"{path}: " + "; ".join(problems))
    return attrs


def identity(path: Path) -> str:
    """A content hash of a complete shard (attrs and every array): what a hidden store extracted from it holds
    follows from it, the target and the extract settings."""
    import hashlib
    import json

    shard = read(path)
    digest = hashlib.sha256(json.dumps(shard.attrs, sort_keys=True, default=str).encode())
    for array in (shard.input_ids, shard.loss_mask, shard.seq_offsets):
        digest.update(np.ascontiguousarray(array))
    digest.update("\0".join(shard.sample_ids).encode())
    return digest.hexdigest()
