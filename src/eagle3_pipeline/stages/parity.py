"""Parity check: before extraction, a backend's states must be the HF reference's.

The classic cause of a 10-15%-acceptance drafter is silent: aux layers off by one (HF indices vs block
numbering), or the final state taken before the final norm. Both give plausible tensors. This check runs a
few sequences through the backend and an fp32 HF reference that keeps every layer (hooks on the embeddings,
every block and the final norm), and fails with the precise cause:
- per aux layer: cosine to the claimed HF index >= threshold, and no neighbour (index +-1) closer;
- the final state: close to the post-norm state, not the pre-norm one;
- `lm_head(last)` argmax agrees with the model's own logits.
"""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from eagle3_pipeline import logs
from eagle3_pipeline.formats import reports, token_shards
from eagle3_pipeline.runtime import extraction
from eagle3_pipeline.runtime.extraction import Backend
from eagle3_pipeline.runtime.target.devices import pick_device
from eagle3_pipeline.runtime.target.loading import load_model
from eagle3_pipeline.settings import from_section

COSINE_THRESHOLD = 0.99
ARGMAX_AGREEMENT = 0.95  # bf16 backends flip near-ties against the fp32 reference; a wrong state scores far lower


class ParityError(RuntimeError):
    pass


@dataclass(frozen=True)
class Settings:
    sequences: int  # the first sequences of token shard 0
    max_tokens: int  # each cut to this many tokens
    device: str  # where the fp32 reference runs
    backend: dict[str, Any]  # the `extract` section: the backend under test, as runtime.extraction.from_config reads it
    trust_remote_code: bool


@dataclass
class Reference:
    layers: list[torch.Tensor]  # per sequence [L+1, T, H]: HF indices 0..L-1 raw, L = last block before the norm
    post_norm: list[torch.Tensor]  # per sequence [T, H]
    logits_argmax: list[torch.Tensor]  # per sequence [T]


@dataclass
class ParityReport:
    backend: str
    aux_layer_ids: list[int]
    sequences: int
    tokens: int
    aux_cosine: dict[str, dict[str, float]] = field(default_factory=dict)  # claimed id -> {index: cosine}
    last_cosine_post_norm: float = 0.0
    last_cosine_pre_norm: float = 0.0
    argmax_agreement: float = 0.0
    problems: list[str] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return not self.problems

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "passed": self.passed, "cosine_threshold": COSINE_THRESHOLD}


@torch.inference_mode()
def reference_states(model: torch.nn.Module, sequences: list[np.ndarray]) -> Reference:
    """Every layer of the HF model, one sequence at a time (no padding), by hooks."""
    base = model.get_decoder() if hasattr(model, "get_decoder") else model.model
    captured: dict[str, torch.Tensor] = {}

    def keep(name: str):
        def hook(_module, _inputs, output):
            captured[name] = (output[0] if isinstance(output, tuple) else output).float()
        return hook

    handles = [base.embed_tokens.register_forward_hook(keep("0")), base.norm.register_forward_hook(keep("norm"))]
    handles += [block.register_forward_hook(keep(str(i + 1))) for i, block in enumerate(base.layers)]
    device = next(model.parameters()).device
    layers, post_norm, argmax = [], [], []
    try:
        for ids in sequences:
            captured.clear()
            logits = model(input_ids=torch.from_numpy(ids.astype(np.int64))[None].to(device), use_cache=False).logits
            layers.append(torch.stack([captured[str(i)][0] for i in range(len(base.layers) + 1)]).cpu())
            post_norm.append(captured["norm"][0].cpu())
            argmax.append(logits[0].argmax(-1).cpu())
    finally:
        for handle in handles:
            handle.remove()
    return Reference(layers, post_norm, argmax)


def _cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    """Mean per-token cosine similarity."""
    return float(torch.nn.functional.cosine_similarity(a.float(), b.float(), dim=-1).mean())


def compare(backend: Backend, reference: Reference, sequences: list[np.ndarray], lm_head: torch.Tensor
            ) -> ParityReport:
    states = backend.extract(sequences)
    info = backend.info
    num_layers = reference.layers[0].shape[0] - 1
    report = ParityReport(info.name, list(info.aux_layer_ids), len(sequences), int(sum(len(s) for s in sequences)))
    for slot, claimed in enumerate(info.aux_layer_ids):
        candidates = [i for i in (claimed - 1, claimed, claimed + 1) if 0 <= i <= num_layers]
        cosines = {i: min(_cosine(state.aux[:, slot], ref[i]) for state, ref in zip(states, reference.layers,
                                                                                      strict=True))
                   for i in candidates}
        report.aux_cosine[str(claimed)] = {str(i): round(c, 6) for i, c in cosines.items()}
        best = max(cosines, key=cosines.get)
        if best != claimed:
            report.problems.append(
                f"aux layer {slot} is labelled HF index {claimed} but matches HF index {best} "
                f"(cosine {cosines[best]:.4f} vs {cosines[claimed]:.4f}): layer id off by {best - claimed:+d}. "
                "HF indices count the embeddings as 0; SGLang's ids are HF index - 1")
        elif cosines[claimed] < COSINE_THRESHOLD:
            report.problems.append(f"aux layer {slot} (HF index {claimed}): cosine {cosines[claimed]:.4f} < "
                                   f"{COSINE_THRESHOLD} (dtype, quantisation or a different model?)")
    pre_norm = [ref[num_layers] for ref in reference.layers]
    report.last_cosine_post_norm = min(_cosine(s.last, r) for s, r in zip(states, reference.post_norm, strict=True))
    report.last_cosine_pre_norm = min(_cosine(s.last, r) for s, r in zip(states, pre_norm, strict=True))
    if report.last_cosine_post_norm < COSINE_THRESHOLD:
        if report.last_cosine_pre_norm > report.last_cosine_post_norm:
            report.problems.append(
                f"the final state is taken BEFORE the final norm (cosine to pre-norm {report.last_cosine_pre_norm:.4f},"
                f" to post-norm {report.last_cosine_post_norm:.4f}); the teacher (lm_head) needs it after the norm")
        else:
            report.problems.append(f"the final state does not match the model's (cosine to post-norm "
                                   f"{report.last_cosine_post_norm:.4f} < {COSINE_THRESHOLD})")
    head = lm_head.float().cpu()
    agree = total = 0
    for state, expected in zip(states, reference.logits_argmax, strict=True):
        predicted = (state.last.float() @ head.T).argmax(-1)
        agree += int((predicted == expected).sum())
        total += len(expected)
    report.argmax_agreement = agree / max(total, 1)
    if report.argmax_agreement < ARGMAX_AGREEMENT:
        report.problems.append(f"argmax of lm_head(last) agrees with the model's own logits on only "
                               f"{100 * report.argmax_agreement:.1f}% of tokens (need {100 * ARGMAX_AGREEMENT:.0f}%)")
    return report


def check(backend: Backend, model: torch.nn.Module, sequences: list[np.ndarray], log: logging.Logger
          ) -> ParityReport:
    reference = reference_states(model, sequences)
    report = compare(backend, reference, sequences, model.get_output_embeddings().weight.detach())
    for claimed, cosines in report.aux_cosine.items():
        log.info("aux HF index %s: cosine by HF index %s", claimed, cosines)
    log.info("final state: cosine to post-norm %.5f, to pre-norm %.5f; lm_head argmax agreement %.4f",
             report.last_cosine_post_norm, report.last_cosine_pre_norm, report.argmax_agreement)
    return report


def run(tokens: Path, target_dir: Path, output: Path, settings: Settings, log_path: str,
        log: logging.Logger) -> ParityReport:
    """The `parity` rule: raise ParityError (naming the causes) unless the backend matches the reference."""
    shard = token_shards.read(tokens)
    sequences = [shard.sequence(i)[0][: settings.max_tokens] for i in range(min(settings.sequences, len(shard)))]
    backend = extraction.from_config(settings.backend, target_dir, settings.trust_remote_code)
    reference = load_model(target_dir, device=pick_device(settings.device), dtype=torch.float32,
                                  trust_remote_code=settings.trust_remote_code)
    report = check(backend, reference, sequences, log)
    if not report.passed:
        log.error("parity check FAILED for backend %s:\n  %s", report.backend, "\n  ".join(report.problems))
        raise ParityError(f"backend {report.backend} disagrees with the HF reference "
                          f"(see {log_path}):\n  " + "\n  ".join(report.problems))
    reports.write(output, report.as_dict())
    log.info("parity check passed on %d sequences (%d tokens)", report.sequences, report.tokens)
    return report


def run_from_snakemake(snakemake: Any) -> None:
    log = logs.setup(snakemake.log[0])
    torch.set_num_threads(snakemake.threads)
    params = snakemake.params
    settings = from_section(Settings, params.parity, backend=snakemake.config["extract"],
                            trust_remote_code=params.trust_remote_code)
    run(Path(snakemake.input.tokens), Path(snakemake.input.target), Path(snakemake.output[0]), settings,
        snakemake.log[0], log)
