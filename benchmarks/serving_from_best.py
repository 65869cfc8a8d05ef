"""A serving directory from a training run's best epoch so far (`train_state/best.safetensors`), exported as the
`export` rule exports the trained drafter, so that a tau pass can run on any machine
(docs/guides/reruns-and-recovery.md). `device_run.sh single` runs it when a session's last call ends in training
and brings back the weights as best-part-*; the same script gives them their config.json here:

    cat best-part-* > best.safetensors
    python benchmarks/serving_from_best.py best.safetensors results/<run>/target results/<run>/serving/drafter

The weights hold the exported tensors with d2t and t2d, not the drafter's config: that comes from the target's
config, as training built it, with the draft vocabulary's size and the MLP's width read off the tensors and the
aux layers extraction chooses by default (`--aux-layer-ids` for a run that set extract.aux_layer_ids).
"""

from __future__ import annotations

import argparse
from dataclasses import replace
from pathlib import Path

from eagle3_pipeline.drafter.model import Drafter, DrafterConfig
from eagle3_pipeline.formats import drafter_weights
from eagle3_pipeline.runtime.extraction import default_aux_layer_ids
from eagle3_pipeline.runtime.target.loading import load_config
from eagle3_pipeline.stages.export import export


def drafter_from_best(best: Path, target_dir: Path, aux_layer_ids: list[int] | None) -> Drafter:
    weights = drafter_weights.read_weights(best)
    target = load_config(target_dir)
    layers = aux_layer_ids or default_aux_layer_ids(target.num_hidden_layers)
    config = replace(DrafterConfig.from_target(target, len(weights["d2t"]), layers),
                     intermediate_size=weights["midlayer.mlp.up_proj.weight"].shape[0])  # any MLP width
    model = Drafter(config)
    missing, unexpected = model.load_state_dict(weights, strict=False)  # bf16 copies cast to the fp32 parameters
    if unexpected or any(not key.startswith("embed_tokens.") for key in missing):
        raise SystemExit(f"{best}: does not fit the drafter built from {target_dir}: missing {missing}, "
                         f"unexpected {unexpected}")
    return model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("best", type=Path, help="best.safetensors (fp32 or the bf16 copy)")
    parser.add_argument("target", type=Path, help="the run's target directory (results/<run>/target)")
    parser.add_argument("out", type=Path, help="the serving directory to write (results/<run>/serving/drafter)")
    parser.add_argument("--aux-layer-ids", type=int, nargs=3, help="the run's extract.aux_layer_ids, if it set them")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    args = parser.parse_args()
    recorded = drafter_weights.validate(args.best, metadata_keys=())  # exported parts, joined, record no step
    export(drafter_from_best(args.best, args.target, args.aux_layer_ids), args.out, args.dtype)
    print(f"{args.out}: the weights of step {recorded.get('step', '?')} (held-out tau {recorded.get('tau', '?')})")


if __name__ == "__main__":
    main()
