"""Where the offline acceptance estimate and decoded tau part: the training's unrolled chain, replayed on the text the
target itself wrote in a tau pass.

For every EAGLE-3 chain trace of an evaluation JSON, the prompt plus the target's greedy reply is run through the
target once (aux features and final states, as extraction computes them) and the drafter is unrolled over it as the
offline estimate unrolls it (training-time-test attention, the chain fed the text's tokens). Then:

- replayed rounds: starting where decoding starts (the token after the prompt), each round accepts the chain length
  at its first position and moves on past it and its bonus token, as greedy verification does. On the target's own
  text these rounds must be the decoded ones, round for round: that checks that training unrolls the drafter as a
  server runs it (positions, attention over the real and the drafted rows, the features' alignment);
- every position: the estimate's own average over all positions of the same text (what the training log reports,
  but on the target's text instead of the data's). Its distance to the replayed tau is what drafting only at the
  start of each round costs: rounds start just after a rejection, where the drafter was wrong a token earlier.

    python benchmarks/estimate_vs_decode.py results/cpu-on-path-control --prompt-set held-out --k 4

CPU, fp32: decoding's and this replay's float sums are computed in different orders, so a near tie may rarely round
the other way (the count of rounds that differ is printed)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import torch

from eagle3_pipeline.drafter.objective import target_argmax
from eagle3_pipeline.drafter.offline_acceptance import accepted_lengths
from eagle3_pipeline.prompts import load_prompts
from eagle3_pipeline.runtime.drafting import load_served_for
from eagle3_pipeline.runtime.extraction.hf import HFBackend
from eagle3_pipeline.runtime.speculative import encode_prompts
from eagle3_pipeline.runtime.target.loading import load_tokenizer


def chain_lengths(drafter, backend: HFBackend, lm_head: torch.Tensor, ids: list[int], steps: int) -> np.ndarray:
    """The unrolled chain's accepted length at every position t (drafting x[t+2] from feature t), as the estimate
    counts it; positions whose chain would run past the text count what fits."""
    aux, last, _ = backend.forward([np.asarray(ids)])
    length = len(ids)
    batch = {"input_ids": torch.tensor([ids]), "valid": torch.ones(1, length, dtype=torch.bool),
             "loss_mask": torch.ones(1, length, dtype=torch.bool), "aux": aux.flatten(-2), "last": last}
    greedy = target_argmax(last, lm_head)
    lengths = np.zeros(length, dtype=int)
    accepted, _ = accepted_lengths(drafter, batch, greedy, steps)
    lengths[: max(length - 2, 0)] = accepted.numpy()
    return lengths


def replay(lengths: np.ndarray, prompt_length: int, generated: int, k: int) -> list[int]:
    """Greedy verification's rounds over the text: the first drafts from the last prompt row, each round accepts the
    chain length at its start (at most k) and skips its bonus token, until the text's tokens are produced (decoding
    cuts its last round's tokens at the same count; that round's chain runs past the text, so it is not compared)."""
    rounds, produced, t = [], 1, prompt_length - 1  # the prefill wrote the first token
    while produced < generated:
        accepted = int(min(lengths[t], k))
        rounds.append(accepted)
        produced += accepted + 1
        t += accepted + 1
    return rounds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run", type=Path, help="a run's results directory (target/, serving/drafter/, evaluation/)")
    parser.add_argument("--prompt-set", default="held-out")
    parser.add_argument("--k", type=int, default=4)
    args = parser.parse_args()
    evaluation = json.loads((args.run / "evaluation" / f"{args.prompt_set}.json").read_text())
    traces = [t for t in evaluation["traces"] if t["method"] == f"eagle3@k={args.k}"]
    target_dir = args.run / "target"
    drafter = load_served_for(target_dir, args.run / "serving" / "drafter", torch.float32)
    backend = HFBackend.from_directory(target_dir, device="cpu", dtype="float32",
                                       aux_layer_ids=list(drafter.config.aux_layer_ids))
    lm_head = backend.model.get_output_embeddings().weight.detach()
    prompt_ids = dict(encode_prompts(load_tokenizer(target_dir), load_prompts(Path(evaluation["prompt_file"]), None)))
    decoded, replayed, positions, differing = [], [], [], 0
    for trace in traces:
        ids = prompt_ids[trace["prompt_id"]]
        lengths = chain_lengths(drafter, backend, lm_head, ids + trace["tokens"], args.k)
        rounds = replay(lengths, len(ids), len(trace["tokens"]), args.k)
        differing += sum(a != b for a, b in zip(rounds[:-1], trace["accepted"][:-1], strict=False))
        differing += len(rounds) != len(trace["accepted"])
        decoded += trace["accepted"]
        replayed += rounds
        last_draftable = len(ids) + len(trace["tokens"]) - 2  # a chain from t drafts x[t+2] onwards
        positions += list(np.minimum(lengths[len(ids) - 1: last_draftable], args.k))
    tau = {"decoded": 1 + np.mean(decoded), "replayed": 1 + np.mean(replayed), "every position": 1 + np.mean(positions)}
    print(f"{args.run.name} {args.prompt_set}, chain k={args.k}: {len(traces)} prompts, {len(decoded)} decoded rounds, "
          f"{differing} replayed rounds differ (the last of each prompt not compared)")
    for name, value in tau.items():
        print(f"  tau {name:>15}: {value:.3f}")


if __name__ == "__main__":
    main()
