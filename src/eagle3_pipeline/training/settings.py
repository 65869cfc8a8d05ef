"""The `train` config section as the training loop reads it: a settings type of the training layer, built from
the validated config (its defaults are config/schema.yaml's, nowhere else)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar


@dataclass(frozen=True)
class TrainSettings:
    """The `train` config section as training uses it (no defaults here: they are config/schema.yaml's)."""
    ttt_steps: int
    step_weight_decay: float
    learning_rate: float
    warmup_steps: int
    epochs: int
    max_steps: int | None
    batch_tokens: int
    max_seq_len: int  # null in the config means data.max_seq_len: workflow_config fills it in
    weight_decay: float
    grad_clip: float
    seed: int
    checkpoint_every: int
    log_every: int
    num_workers: int
    device: str
    attention: str  # TTT attention: "flex" (fused kernel, GPU), "eager" (explicit scores); auto = flex on GPU
    compile: str | bool  # torch.compile the loss: "on", "off"; auto = on GPU
    feature_noise: float  # Gaussian noise on the aux features, relative to each row's RMS
    teacher_temperature: float  # the teacher's softmax temperature: below 1 sharpens it towards its argmax
    heldout_select_k: int  # keep the weights with the best offline tau at this draft length
    pad_multiple: int  # batch widths are rounded up to this (few shapes: compiled kernels and masks are reused)
    drafter_intermediate_size: int | None  # the drafter's MLP width; None = the target's
    head_init: str  # the drafter's lm_head at step 0: "random", or "target" (the target's rows of the draft vocab)
    off_path_weight: float  # loss weight of chain positions off the target's greedy path (1 = every chain alike)

    # keys of the section that are not the training process's (the rule's resources and inputs use them):
    # from_section(TrainSettings, section) skips these and refuses any other key no field reads
    NOT_SETTINGS: ClassVar[frozenset[str]] = frozenset({"gpus", "threads", "heldout_estimate"})
    # settings that size or report the run but leave the weights as they are: not in the resume fingerprint, nor in
    # the rule's params (changing them must not retrain)
    SIZE_ONLY: ClassVar[frozenset[str]] = frozenset({"log_every", "checkpoint_every", "num_workers"})
    # settings added after runs were trained, at the value that trains as before: left out of the rule's params and
    # the resume fingerprint at that value, so such a run neither retrains nor loses its checkpoint
    NEUTRAL: ClassVar[dict[str, object]] = {"teacher_temperature": 1.0, "head_init": "random", "off_path_weight": 1.0}

    @classmethod
    def shapes_weights(cls, key: str, value: object) -> bool:
        """Whether `key` at `value` belongs in the resume fingerprint and the rule's params."""
        return key not in cls.SIZE_ONLY and not (key in cls.NEUTRAL and cls.NEUTRAL[key] == value)
