"""An HTTP server answering like stock SGLang (the shapes in tests/data/sglang/), with states computed by the
real HF model the way SGLang computes them: the aux server captures the input of decoder block `id + 1`
(= HF index `id + 1`) for each SGLang layer id, the final server returns the state after the final norm.
`final="pre_norm"` plays a final server that returns the last block's raw output instead."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import numpy as np
import torch

from eagle3_pipeline.stages import parity

from .conftest import send_json

DATA = Path(__file__).parent / "data" / "sglang"


def server_info(kind: str, **changes) -> dict:
    info = json.loads((DATA / f"server_info_{kind}.json").read_text())
    info.pop("_comment")
    return {**info, **changes}


class RecordedSGLang:
    def __init__(self, model: torch.nn.Module, info: dict, sglang_layer_ids: list[int] | None = None,
                 final: str = "post_norm"):
        self.requests = 0
        owner = self

        def states(ids: list[int]) -> list:
            reference = parity.reference_states(model, [np.asarray(ids)])
            layers = reference.layers[0]
            if sglang_layer_ids is not None:
                rows = torch.cat([layers[i + 1] for i in sglang_layer_ids], dim=-1)
            elif final == "post_norm":
                rows = reference.post_norm[0]
            else:
                rows = layers[-1]
            return rows.to(torch.bfloat16).float().tolist()

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_GET(self):
                if self.path == "/get_server_info":
                    return send_json(self, 200, info)
                self.send_error(404)

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                owner.requests += 1
                assert body["return_hidden_states"] is True and body["sampling_params"]["max_new_tokens"] == 1
                items = [{"text": "x", "meta_info": {"id": str(i), "prompt_tokens": len(ids), "completion_tokens": 1,
                                                     "cached_tokens": 0, "finish_reason": {"type": "length"},
                                                     "hidden_states": [states(ids), [0.0]]}}
                         for i, ids in enumerate(body["input_ids"])]
                send_json(self, 200, items)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self):
        self.server.shutdown()
