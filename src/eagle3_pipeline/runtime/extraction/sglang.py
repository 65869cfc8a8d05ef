"""SGLang backend: stock SGLang servers (>= 0.5.23) return the hidden states; we never patch them.

Contract (from SGLang's server arguments and its `/generate` API; see docs/design.md):
- The aux server is started with
  `--enable-return-hidden-states --enable-return-aux-hidden-states --speculative-algorithm EAGLE3
   --return-aux-hidden-state-layer-ids <SGLang ids> --chunked-prefill-size -1 --disable-radix-cache`.
  SGLang numbers aux layers by decoder-block output (HF index - 1); the conversion lives in
  `extraction.sglang_layer_ids` and nowhere else.
- In that mode it does not return the final state, so a second server on the same weights, started with
  `--enable-return-hidden-states --chunked-prefill-size -1 --disable-radix-cache` (no aux flags), returns
  the final hidden state after the final norm (what the LM head reads).
- Request: `POST /generate {"input_ids": [[...], ...], "sampling_params": {"max_new_tokens": 1,
  "temperature": 0}, "return_hidden_states": true}` - many sequences per request (JSON is slow).
- Response: a list with one object per sequence; `meta_info.hidden_states[0]` is the prefill: one row per
  prompt token, `3*H` wide on the aux server (the three layers concatenated in id order), `H` on the final
  server. Later entries are decode steps and are ignored.
`/get_server_info` is checked before any work so a server started with the wrong flags fails at once with the
flag to fix, not hours later as a 15%-acceptance drafter.
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from typing import Any

import numpy as np
import torch

from eagle3_pipeline.runtime.extraction import BackendInfo, HiddenStates, check_aux_layer_ids, sglang_layer_ids


class SGLangError(RuntimeError):
    pass


def _request(url: str, payload: Any | None, timeout_s: float, retries: int) -> Any:
    data = None if payload is None else json.dumps(payload).encode()
    for attempt in range(retries + 1):
        request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"},
                                         method="GET" if data is None else "POST")
        try:
            with urllib.request.urlopen(request, timeout=timeout_s) as response:
                return json.loads(response.read())
        except urllib.error.HTTPError as exc:
            if exc.code < 500 or attempt == retries:
                raise SGLangError(f"{url}: HTTP {exc.code}: {exc.read()[:300].decode(errors='replace')}") from exc
        except (urllib.error.URLError, TimeoutError, ConnectionError) as exc:
            if attempt == retries:
                raise SGLangError(f"{url}: {type(exc).__name__}: {exc} (is the server up?)") from exc
        time.sleep(min(30.0, 2.0 ** attempt))
    raise AssertionError("unreachable")


def check_server_flags(info: dict[str, Any], url: str, aux_ids_sglang: list[int] | None) -> list[str]:
    """Problems with how a server was started; `aux_ids_sglang` None means the final-state server."""
    problems = []
    if not info.get("enable_return_hidden_states"):
        problems.append("start it with --enable-return-hidden-states")
    if info.get("chunked_prefill_size") not in (-1, None):
        problems.append(f"chunked_prefill_size is {info.get('chunked_prefill_size')}: start it with "
                        "--chunked-prefill-size -1 (chunked prefill returns partial states)")
    if not info.get("disable_radix_cache"):
        problems.append("start it with --disable-radix-cache (cached prefixes return no hidden states)")
    aux_on = bool(info.get("enable_return_aux_hidden_states"))
    if aux_ids_sglang is None:
        if aux_on:
            problems.append("this is the final-state server but it returns aux states: start it without "
                            "--enable-return-aux-hidden-states")
    else:
        if not aux_on:
            problems.append("start it with --enable-return-aux-hidden-states --speculative-algorithm EAGLE3")
        served = info.get("return_aux_hidden_state_layer_ids")
        if served is not None and list(served) != list(aux_ids_sglang):
            problems.append(f"--return-aux-hidden-state-layer-ids is {list(served)}, expected {aux_ids_sglang} "
                            "(SGLang numbers block outputs: HF index - 1)")
    return [f"{url}: {problem}" for problem in problems]


def prefill_states(item: dict[str, Any], length: int, width: int, url: str, row: int) -> np.ndarray:
    """The prefill rows of one response item as float32 [length, width]."""
    try:
        states = item["meta_info"]["hidden_states"]
    except (KeyError, TypeError) as exc:
        raise SGLangError(f"{url}: response item {row} has no meta_info.hidden_states "
                          "(was return_hidden_states accepted?)") from exc
    if not states:
        raise SGLangError(f"{url}: response item {row}: empty hidden_states")
    prefill = np.asarray(states[0], dtype=np.float32)
    if prefill.ndim == 1 and prefill.size == length * width:
        prefill = prefill.reshape(length, width)
    if prefill.shape != (length, width):
        raise SGLangError(f"{url}: response item {row}: prefill hidden states have shape {prefill.shape}, expected "
                          f"({length}, {width}) - a prefix cache hit or chunked prefill returns fewer rows")
    return prefill


class SGLangBackend:
    def __init__(self, aux_url: str, final_url: str, aux_layer_ids: list[int], num_layers: int, hidden_size: int,
                 timeout_s: float = 600.0, retries: int = 3, check_flags: bool = True):
        self.aux_url, self.final_url = aux_url.rstrip("/"), final_url.rstrip("/")
        self.hf_ids = check_aux_layer_ids(aux_layer_ids, num_layers)
        self.hidden_size, self.timeout_s, self.retries = hidden_size, timeout_s, retries
        version = "unknown"
        if check_flags:
            aux_info = _request(self.aux_url + "/get_server_info", None, timeout_s, retries)
            final_info = _request(self.final_url + "/get_server_info", None, timeout_s, retries)
            problems = (check_server_flags(aux_info, self.aux_url, sglang_layer_ids(self.hf_ids))
                        + check_server_flags(final_info, self.final_url, None))
            if problems:
                raise SGLangError("SGLang servers are not set up for extraction:\n  " + "\n  ".join(problems))
            version = str(aux_info.get("version", "unknown"))
        self.info = BackendInfo("sglang", version, tuple(self.hf_ids), hidden_size, num_layers)
        self.device = torch.device("cpu")

    def _generate(self, url: str, batch: list[np.ndarray], width: int) -> list[np.ndarray]:
        payload = {"input_ids": [ids.astype(np.int64).tolist() for ids in batch],
                   "sampling_params": {"max_new_tokens": 1, "temperature": 0.0},
                   "return_hidden_states": True}
        items = _request(url + "/generate", payload, self.timeout_s, self.retries)
        if isinstance(items, dict):
            items = [items]
        if len(items) != len(batch):
            raise SGLangError(f"{url}: {len(items)} response items for {len(batch)} sequences")
        return [prefill_states(item, len(ids), width, url, row)
                for row, (item, ids) in enumerate(zip(items, batch, strict=True))]

    def extract(self, batch: list[np.ndarray]) -> list[HiddenStates]:
        hidden = self.hidden_size
        aux = self._generate(self.aux_url, batch, 3 * hidden)
        last = self._generate(self.final_url, batch, hidden)
        return [HiddenStates(torch.from_numpy(a).view(len(a), 3, hidden).to(torch.bfloat16),
                             torch.from_numpy(f).to(torch.bfloat16)) for a, f in zip(aux, last, strict=True)]


def launch_commands(model_path: str, hf_ids: list[int], tensor_parallel: int = 1, aux_port: int = 30000,
                    final_port: int = 30001) -> list[str]:
    """The two server commands this backend expects (layer ids converted from HF indices here, once)."""
    common = (f"python -m sglang.launch_server --model-path {model_path} --tp {tensor_parallel} "
              "--enable-return-hidden-states --chunked-prefill-size -1 --disable-radix-cache --host 0.0.0.0")
    ids = " ".join(str(i) for i in sglang_layer_ids(hf_ids))
    return [f"{common} --port {aux_port} --enable-return-aux-hidden-states --speculative-algorithm EAGLE3 "
            f"--return-aux-hidden-state-layer-ids {ids}",
            f"{common} --port {final_port}"]


def main(argv: list[str] | None = None) -> None:
    import argparse
    from pathlib import Path

    from eagle3_pipeline.runtime.extraction import default_aux_layer_ids

    parser = argparse.ArgumentParser(description="Print the SGLang launch commands for the sglang backend.")
    parser.add_argument("--model-path", required=True, help="HF directory or hub id the servers load")
    parser.add_argument("--num-layers", type=int, help="decoder blocks (default: read config.json in --model-path)")
    parser.add_argument("--aux-layer-ids", type=int, nargs=3, help="HF indices (default [2, L//2, L-3])")
    parser.add_argument("--tp", type=int, default=1)
    args = parser.parse_args(argv)
    num_layers = args.num_layers
    if num_layers is None:
        from eagle3_pipeline.formats.target_dir import read_config

        config = read_config(Path(args.model_path))
        if config is None:
            raise SystemExit(f"{args.model_path}: no config.json; pass --num-layers")
        num_layers = config.get("text_config", config)["num_hidden_layers"]
    ids = check_aux_layer_ids(args.aux_layer_ids or default_aux_layer_ids(num_layers), num_layers)
    print("\n".join(launch_commands(args.model_path, ids, args.tp)))


if __name__ == "__main__":
    main()
