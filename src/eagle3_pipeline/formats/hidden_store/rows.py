"""How a hidden-state store keeps its rows: the store dtypes, their arrays, and the row codec.

`bfloat16` keeps the states' bf16 bits as uint16 (lossless: the extraction's own precision).
`float8_e4m3fn` keeps fp8 e4m3 bits as uint8 plus one float32 scale per row of every token (absmax / 448 for
each aux layer's vector and for the final state). Measured on SmolLM2's states of ShareGPT text
(`benchmarks/bench_store_codec.py`): a scale per row has 13 % less error than one scale per token (mean
relative L2 error 0.021 vs 0.025, worst 0.034 vs 0.056) and compresses 5 % better; the store takes 0.61x the
bytes of bf16 per token. fp8 bits are close to incompressible (sign 1 bit, exponent 2.9, mantissa 3.0 bits of
entropy per value), so no lossless codec takes them much further. Encoding and decoding are torch ops on
whatever device the rows are on: extraction encodes on the GPU before the device-to-host copy (half the bytes
to copy), training decodes on the GPU after the host-to-device copy.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

STORE_DTYPES = ("bfloat16", "float8_e4m3fn")
FP8_MAX = 448.0  # the largest finite float8_e4m3fn value
SCALE_SUFFIX = "_scales"
# raw / stored bytes of the hidden arrays (Blosc zstd-1 and the per-chunk crc32c), measured on SmolLM2's states of
# ShareGPT conversations (`benchmarks/bench_store_codec.py`); the disk plan's default per store dtype
EXPECTED_COMPRESSION = {"bfloat16": 1.4, "float8_e4m3fn": 1.16}


@dataclass(frozen=True)
class ArraySpec:
    """One per-token array of a store: its numpy dtype, the shape of one token's row and the Blosc shuffle."""
    name: str
    dtype: str
    row_shape: tuple[int, ...]
    shuffle: str

    @property
    def itemsize(self) -> int:
        return {"uint16": 2, "uint8": 1, "float32": 4}[self.dtype]

    def row_bytes(self) -> int:
        count = 1
        for dim in self.row_shape:
            count *= dim
        return count * self.itemsize


def hidden_arrays(store_dtype: str, hidden_size: int) -> list[ArraySpec]:
    """The arrays that hold a store's hidden states, in the order they are written."""
    shapes = {"aux_hidden_states": (3, hidden_size), "last_hidden_states": (hidden_size,)}
    if store_dtype == "bfloat16":
        return [ArraySpec(name, "uint16", shape, "shuffle") for name, shape in shapes.items()]
    if store_dtype == "float8_e4m3fn":
        # no shuffle: byte shuffle is a no-op at typesize 1, and bit shuffle measured 7 % larger
        return [spec for name, shape in shapes.items()
                for spec in (ArraySpec(name, "uint8", shape, "noshuffle"),
                             ArraySpec(name.replace("_hidden_states", SCALE_SUFFIX), "float32", shape[:-1],
                                       "shuffle"))]
    raise ValueError(f"unknown store dtype {store_dtype!r}; choose one of {', '.join(STORE_DTYPES)}")


def raw_row_bytes(store_dtype: str, hidden_size: int) -> int:
    """Bytes of one token's hidden rows before compression (values and scales)."""
    return sum(spec.row_bytes() for spec in hidden_arrays(store_dtype, hidden_size))


def encode(aux: torch.Tensor, last: torch.Tensor, store_dtype: str) -> dict[str, torch.Tensor]:
    """aux [N,3,H] and last [N,H] (any float dtype, any device) as the store's arrays, on the same device."""
    if store_dtype == "bfloat16":
        return {"aux_hidden_states": _bf16_bits(aux), "last_hidden_states": _bf16_bits(last)}
    aux_bits, aux_scales = _fp8_with_scales(aux)
    last_bits, last_scales = _fp8_with_scales(last)
    return {"aux_hidden_states": aux_bits, "aux_scales": aux_scales,
            "last_hidden_states": last_bits, "last_scales": last_scales}


def decode(values: torch.Tensor, scales: torch.Tensor | None) -> torch.Tensor:
    """bf16 states from stored bits: uint16 bf16 bits (scales None), or uint8 fp8 bits times their row scales
    (`scales` has the shape of `values` less its last dim)."""
    import torch

    if scales is None:
        return values.view(torch.bfloat16)
    return (values.view(torch.float8_e4m3fn).float() * scales.unsqueeze(-1)).to(torch.bfloat16)


def _bf16_bits(states: torch.Tensor) -> torch.Tensor:
    import torch

    return states.to(torch.bfloat16).contiguous().view(torch.uint16)


def _fp8_with_scales(states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    import torch

    states = states.float()
    amax = states.abs().amax(dim=-1)
    scales = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))  # an all-zero row keeps scale 1
    scaled = (states / scales.unsqueeze(-1)).clamp(-FP8_MAX, FP8_MAX)
    return scaled.to(torch.float8_e4m3fn).view(torch.uint8), scales.contiguous()
