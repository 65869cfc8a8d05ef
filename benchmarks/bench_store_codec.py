"""Store dtypes on real activations: bytes per token and error of fp8 stores against bf16 stores of the same states,
measured in one run.

Reads the states of an existing bf16 hidden-state store (default: the embedded default's first shard, written by
`make run`), writes them again through the real store writer as bf16 (the baseline) and as fp8 with a scale per row
(the store's choice), and measures one scale per token (the alternative) beside it, then prints bytes per token and
their ratio to bf16, the time to encode and write against bf16's, and the relative L2 error per vector (mean, by
row, worst).

    .venv/bin/python benchmarks/bench_store_codec.py [--store results/smollm2-default/hidden/shard-00000.zarr]
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from eagle3_pipeline.formats import hidden_store, zarr_io
from eagle3_pipeline.formats.hidden_store.rows import FP8_MAX

ROWS = ("aux layer 1", "aux layer 2", "aux layer 3", "final")


def read_states(path: Path, max_tokens: int) -> tuple[torch.Tensor, torch.Tensor, dict]:
    store = hidden_store.HiddenStore(path)
    if store.store_dtype != "bfloat16":
        raise SystemExit(f"{path}: a {store.store_dtype} store; this benchmark starts from bf16 states")
    tokens = min(max_tokens, int(store.seq_offsets[-1]))
    sequences = int(np.searchsorted(store.seq_offsets, tokens, side="right")) - 1
    tokens = int(store.seq_offsets[sequences])  # whole sequences only
    aux, last = (torch.cat([store.sequence(j)[name] for j in range(sequences)])
                 for name in ("aux_hidden_states", "last_hidden_states"))
    return aux, last, {"input_ids": store.input_ids[:tokens], "loss_mask": store.loss_mask[:tokens],
                       "seq_offsets": store.seq_offsets[:sequences + 1],
                       "sample_ids": [f"s{j}" for j in range(sequences)]}


def write(out: Path, aux: torch.Tensor, last: torch.Tensor, sequences: dict, store_dtype: str) -> tuple[int, float]:
    """Bytes of the hidden arrays on disk and seconds spent encoding and writing them (on this CPU)."""
    writer = hidden_store.StoreWriter(out, len(aux), aux.shape[-1], {"num_sequences": len(sequences["sample_ids"])},
                                      sequences, store_dtype=store_dtype)
    start = time.perf_counter()
    writer.append(hidden_store.encode(aux, last, store_dtype))
    writer.finish({})
    seconds = time.perf_counter() - start
    names = [spec.name for spec in hidden_store.hidden_arrays(store_dtype, aux.shape[-1])]
    return sum(zarr_io.directory_bytes(out / name) for name in names), seconds


def errors(decoded: torch.Tensor, states: torch.Tensor) -> torch.Tensor:
    """Relative L2 error of every vector: [N, 4] (3 aux rows and the final state)."""
    diff = (decoded.float() - states.float()).norm(dim=-1)
    return diff / states.float().norm(dim=-1).clamp(min=1e-12)


def per_token_scale(states: torch.Tensor) -> torch.Tensor:
    """fp8 with one scale per token across its four vectors (the alternative to a scale per row), decoded."""
    scale = (states.float().abs().flatten(1).amax(1) / FP8_MAX).clamp(min=1e-30)[:, None, None]
    return ((states.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).float() * scale).bfloat16()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--store", type=Path, default=Path("results/smollm2-default/hidden/shard-00000.zarr"))
    parser.add_argument("--max-tokens", type=int, default=40_000)
    args = parser.parse_args()
    aux, last, sequences = read_states(args.store, args.max_tokens)
    states = torch.cat([aux, last[:, None]], dim=1)
    tokens = len(aux)
    print(f"{args.store}: {tokens:,} tokens of hidden size {aux.shape[-1]}")
    with tempfile.TemporaryDirectory() as tmp:
        sizes = {dtype: write(Path(tmp) / f"{dtype}.zarr", aux, last, sequences, dtype)
                 for dtype in hidden_store.STORE_DTYPES}
    encoded = hidden_store.encode(aux, last, "float8_e4m3fn")
    per_row = torch.cat([hidden_store.decode(encoded["aux_hidden_states"], encoded["aux_scales"]),
                         hidden_store.decode(encoded["last_hidden_states"], encoded["last_scales"])[:, None]], dim=1)
    baseline_bytes, baseline_s = sizes["bfloat16"]
    print(f"{'store dtype':<34} {'B/token':>8} {'vs bf16':>8} {'write time vs bf16':>18}")
    for dtype, (size, seconds) in sizes.items():
        print(f"{dtype:<34} {size / tokens:>8.0f} {size / baseline_bytes:>7.3f}x {seconds / baseline_s:>17.2f}x")
    print(f"\n{'fp8 scale':<16} {'mean error':>10} " + " ".join(f"{name:>12}" for name in ROWS) + f" {'worst':>8}")
    for name, decoded in (("per row (store)", per_row), ("per token", per_token_scale(states))):
        error = errors(decoded, states)
        print(f"{name:<16} {error.mean():>10.4f} " + " ".join(f"{e:>12.4f}" for e in error.mean(0).tolist())
              + f" {error.max():>8.4f}")


if __name__ == "__main__":
    main()
