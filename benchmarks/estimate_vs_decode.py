"""Where the offline acceptance estimate and decoded tau part: the training's unrolled chain, replayed on the text the
target itself wrote in a tau pass.

For every EAGLE-3 chain trace of an evaluation JSON, the prompt plus the target's greedy reply is run through the
target once (aux features and final states, as extraction computes them) and the drafter is unrolled over it as the
offline estimate unrolls it (training-time-test attention, the chain fed the text's tokens). Then:

- the check: at the first position of each decoded verify step (a round: drafts, then one target forward), the
  unrolled chain's accepted length must be the decoded one. On the target's own text that holds if training unrolls
  the drafter as the tau pass decodes it (positions, attention over the real and the drafted rows, the features'
  alignment); the rounds that differ are counted;
- replayed tau: greedy verification's rounds replayed from where decoding starts (the token after the prompt), each
  accepting the chain length at its first position and moving past those tokens and the bonus token;
- every position: the estimate's average over every reply position from where decoding first drafts (as the
  training log's estimate averages, but on the target's text instead of the data's). Its distance to the replayed
  tau is what drafting only at the start of each round costs: a round mostly starts just after a token the drafter
  got wrong.

    python benchmarks/estimate_vs_decode.py results/cpu-on-path-control --prompt-set held-out --k 4

Pass --multi-turn when the tau pass ran with `evaluate.multi_turn` (the prompts are encoded as it encoded them).
CPU, fp32: decoding's and this replay's float sums are computed in different orders, so a near tie may rarely round
the other way."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import torch

from eagle3_pipeline.drafter.batches import collate
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
    sequence = {"input_ids": torch.tensor(ids), "loss_mask": torch.ones(length, dtype=torch.bool),
                "aux_hidden_states": aux[0], "last_hidden_states": last[0]}
    batch = collate([sequence], max_seq_len=length)  # the batch training's estimate reads
    greedy = target_argmax(batch["last"], lm_head)
    lengths = np.zeros(length, dtype=int)
    accepted, _ = accepted_lengths(drafter, batch, greedy, steps)
    lengths[: max(length - 2, 0)] = accepted.numpy()
    return lengths


def replay(lengths: np.ndarray, prompt_length: int, generated: int) -> list[int]:
    """Greedy verification's rounds over the text: the first drafts from the last prompt row, each round accepts the
    chain length at its start and skips its bonus token, until the text's tokens are produced (decoding cuts its last
    round's tokens at the same count)."""
    rounds, produced, t = [], 1, prompt_length - 1  # the prefill wrote the first token
    while produced < generated:
        rounds.append(int(lengths[t]))
        produced += rounds[-1] + 1
        t += rounds[-1] + 1
    return rounds


def differing_rounds(lengths: np.ndarray, prompt_length: int, accepted: list[int]) -> int:
    """Decoded rounds whose accepted length is not the unrolled chain's at the round's first position. The last round
    is left out: its chain may run past the text's end (64 tokens or the end of sequence)."""
    differing, t = 0, prompt_length - 1
    for decoded in accepted[:-1]:
        differing += int(lengths[t]) != decoded
        t += decoded + 1
    return differing


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run", type=Path, help="a run's results directory (target/, serving/drafter/, evaluation/)")
    parser.add_argument("--prompt-set", default="held-out")
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--multi-turn", action="store_true", help="the tau pass ran with evaluate.multi_turn")
    args = parser.parse_args()
    evaluation = json.loads((args.run / "evaluation" / f"{args.prompt_set}.json").read_text())
    traces = [t for t in evaluation["traces"] if t["method"] == f"eagle3@k={args.k}"]
    if not traces:
        raise SystemExit(f"{args.run}/evaluation/{args.prompt_set}.json has no eagle3@k={args.k} traces")
    target_dir = args.run / "target"
    drafter = load_served_for(target_dir, args.run / "serving" / "drafter", torch.float32)
    backend = HFBackend.from_directory(target_dir, device="cpu", dtype="float32",
                                       aux_layer_ids=list(drafter.config.aux_layer_ids))
    lm_head = backend.model.get_output_embeddings().weight.detach()
    prompts = load_prompts(Path(evaluation["prompt_file"]), None, args.multi_turn)
    prompt_ids = dict(encode_prompts(load_tokenizer(target_dir), prompts))
    decoded, replayed, every_position, differing = [], [], [], 0
    for trace in traces:
        ids = prompt_ids[trace["prompt_id"]]
        lengths = chain_lengths(drafter, backend, lm_head, ids + trace["tokens"], args.k)  # at most k each
        differing += differing_rounds(lengths, len(ids), trace["accepted"])
        decoded += trace["accepted"]
        replayed += replay(lengths, len(ids), len(trace["tokens"]))
        draft_end = len(ids) + len(trace["tokens"]) - 2  # a chain from t drafts x[t+2] onwards
        every_position += list(lengths[len(ids) - 1: draft_end])
    tau = {"decoded": 1 + np.mean(decoded), "replayed": 1 + np.mean(replayed),
           "every position": 1 + np.mean(every_position)}
    print(f"{args.run.name} {args.prompt_set}, chain k={args.k}: {len(traces)} prompts, {len(decoded)} decoded rounds; "
          f"{differing} of {len(decoded) - len(traces)} compared rounds differ (not the last of each prompt)")
    for name, value in tau.items():
        print(f"  tau {name:>15}: {value:.3f}")


if __name__ == "__main__":
    main()
