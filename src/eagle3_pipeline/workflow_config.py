"""Parse-time checks of the config that the JSON schema cannot express (paths, model depth, ...); errors name the
config key, so a bad config fails before any job runs."""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from eagle3_pipeline import assets
from eagle3_pipeline.config_schema import ConfigError
from eagle3_pipeline.runtime import methods

HUB_LOOKUP_TIMEOUT_S = 5.0


@dataclass
class Settings:
    data_inputs: list[str]
    target_source: str
    warnings: list[str]
    chat_template_file: str | None = None


def _looks_like_path(value: str) -> bool:
    return value.startswith(("/", ".", "~")) or value.endswith((".gguf", ".json", ".jsonl")) \
        or value.count("/") != 1


def resolve_input(key: str, value: str, must_be_file: bool = False) -> str:
    try:
        path = assets.resolve(value)
    except assets.MissingAsset as exc:
        raise ConfigError(f"config key {key}: {exc}") from exc
    if not path.exists():
        raise ConfigError(f"config key {key}: {value!r} does not exist")
    if must_be_file and not path.is_file():
        raise ConfigError(f"config key {key}: {value!r} is a directory, not a JSON/JSONL file; "
                          f"list the files in it instead")
    return str(path)


def hub_id_problem(model_id: str, revision: str | None) -> tuple[str, bool] | None:
    """Why `model_id` cannot serve as a hub id, and whether that is certain; None when it can.

    The local HF cache answers first; the hub is asked once, with a short timeout, only when
    HF_HUB_OFFLINE is unset (transformers would otherwise retry for about a minute in the target job)."""
    from huggingface_hub import model_info, try_to_load_from_cache
    from huggingface_hub.errors import GatedRepoError, RepositoryNotFoundError, RevisionNotFoundError

    if isinstance(try_to_load_from_cache(model_id, "config.json", revision=revision), str):
        return None
    if os.environ.get("HF_HUB_OFFLINE", "").lower() not in ("", "0", "false", "no", "off"):
        return "not a local path and not in the local Hugging Face cache (HF_HUB_OFFLINE is set)", False
    try:
        model_info(model_id, revision=revision, timeout=HUB_LOOKUP_TIMEOUT_S)
    except GatedRepoError:
        return None  # it exists; access is the target job's business (HF token)
    except (RepositoryNotFoundError, RevisionNotFoundError):
        return "not a local path, and the hub has no such model", True
    except Exception as exc:  # noqa: BLE001 - any network failure means the same thing here
        reason = str(exc).splitlines()[0][:120] if str(exc) else type(exc).__name__
        return f"not a local path, not in the local Hugging Face cache, and the hub lookup failed ({reason})", False
    return None


def check_target_source(target: dict[str, Any], dry_run: bool, materialised: bool, warnings: list[str]) -> str:
    source = target["source"]
    first_part = Path(source).expanduser().parts[0] if source else ""
    if assets.is_alias(source) or _looks_like_path(source) or Path(first_part).exists():
        target_source = resolve_input("target.source", source)
        gguf_file = target.get("gguf_file")
        if gguf_file and not (Path(target_source) / gguf_file).is_file():
            raise ConfigError(f"config key target.gguf_file: {gguf_file!r} not found in {target_source}")
        return target_source
    # a hub id: the target job will need it from the cache or the hub
    if not materialised and (problem := hub_id_problem(source, target.get("revision"))):
        message = f"config key target.source: {source!r} is {problem[0]}"
        if problem[1] or not dry_run:
            raise ConfigError(message)
        warnings.append(message + " (a real run stops here)")
    return source


def check(config: dict[str, Any], dry_run: bool = False, target_materialised: bool = False) -> Settings:
    warnings: list[str] = []
    target_source = check_target_source(config["target"], dry_run, target_materialised, warnings)
    data = config["data"]
    inputs = [resolve_input(f"data.inputs[{i}]", value, must_be_file=True) for i, value in enumerate(data["inputs"])]
    if data.get("weights") is not None:
        if len(data["weights"]) != len(inputs):
            raise ConfigError(f"config key data.weights: {len(data['weights'])} weights for {len(inputs)} inputs")
        names = [Path(p).name for p in inputs]
        if len(set(names)) != len(names):  # conversations record their source by file name
            raise ConfigError("config key data.weights: inputs need distinct file names to be weighted")
    if data.get("train_conversations") is not None and data["train_conversations"] < data["num_shards"]:
        raise ConfigError(f"config key data.train_conversations: {data['train_conversations']} is fewer "
                          f"than data.num_shards ({data['num_shards']})")
    check_regenerate(config.get("regenerate") or {}, data["max_seq_len"], warnings)
    link_max_seq_len(config)
    link_selection_conversations(config["data"])
    for i, tree in enumerate((config.get("evaluate") or {}).get("tree") or []):
        if problem := methods.tree_setting_problem(tree["num_steps"], tree["topk"], tree["num_draft_tokens"]):
            raise ConfigError(f"config key evaluate.tree[{i}]: {problem}")
    extract, sglang = config.get("extract") or {}, (config.get("extract") or {}).get("sglang") or {}
    if extract.get("backend") == "sglang" and (unset := [k for k in ("aux_url", "final_url") if not sglang.get(k)]):
        raise ConfigError(f"config key extract.sglang.{unset[0]}: required when extract.backend is 'sglang'")
    check_engine_check(config, warnings)
    return Settings(data_inputs=inputs, target_source=target_source, warnings=warnings,
                    chat_template_file=check_chat_template(config["target"].get("chat_template")))


def check_regenerate(regenerate: dict[str, Any], max_seq_len: int, warnings: list[str]) -> None:
    """Samples; room for a history; the engine's needs (a server's URL; vLLM: CUDA, said now if missing)."""
    if regenerate.get("samples", 1) > 1 and regenerate.get("temperature", 0.0) == 0:
        raise ConfigError(f"config key regenerate.samples: {regenerate['samples']} samples need "
                          "regenerate.temperature > 0 (greedy samples would be identical)")
    if not regenerate.get("enabled"):
        return
    engine, device, context = regenerate.get("engine"), regenerate.get("device", "auto"), \
        regenerate.get("max_context_tokens") or max_seq_len
    if regenerate.get("max_new_tokens", 0) >= context:  # every turn would be cut: nothing regenerated
        raise ConfigError(f"config key regenerate.max_new_tokens: {regenerate['max_new_tokens']} leaves no room for a "
                          f"history within regenerate.max_context_tokens ({context}; null = data.max_seq_len)")
    if engine == "openai" and not (regenerate.get("server") or {}).get("url"):
        raise ConfigError("config key regenerate.server.url: required when regenerate.engine is 'openai'")
    if engine == "vllm" and device != "auto" and not device.startswith("cuda"):
        raise ConfigError(f"config key regenerate.device: {device!r}, but engine 'vllm' runs on CUDA GPUs")
    if engine == "vllm" and regenerate.get("temperature", 0.0) > 2:
        raise ConfigError(f"config key regenerate.temperature: {regenerate['temperature']}; vLLM samples up to 2")
    if engine == "vllm" and importlib.util.find_spec("vllm") is None:
        warnings.append("regenerate.engine 'vllm': the vllm package is not installed in this environment; the "
                        "regenerate jobs need it (envs/vllm.yaml under --software-deployment-method conda)")


def check_engine_check(config: dict[str, Any], warnings: list[str]) -> None:
    """Draft lengths among the tau pass's (their traces are compared); a missing vLLM said now, not after training."""
    engine, evaluated = config.get("engine_check") or {}, (config.get("evaluate") or {}).get("draft_lengths") or []
    if unknown := sorted(set(engine.get("draft_lengths") or []) - set(evaluated)):
        raise ConfigError(f"config key engine_check.draft_lengths: {unknown} are not among evaluate.draft_lengths "
                          f"{evaluated} (the check compares with the tau pass's traces)")
    if engine.get("enabled") and importlib.util.find_spec("vllm") is None:
        warnings.append("engine_check.enabled: the vllm package is not installed in this environment; the "
                        "engine_check job needs it (envs/vllm.yaml under --software-deployment-method conda)")


def chosen_sets(config: dict[str, Any], key: str, evaluated: list[str]) -> list[str]:
    """The prompt sets a stage after the tau pass decodes: those named at the dotted config `key` (names of
    evaluate.prompts; engine_check.prompts, evaluate.timing.prompt_sets), every evaluated set where it is null."""
    wanted: Any = config
    for part in key.split("."):
        wanted = (wanted or {}).get(part)
    if wanted is not None and (unknown := [name for name in wanted if name not in evaluated]):
        raise ConfigError(f"config key {key}: {unknown} are not prompt sets of evaluate.prompts (there: {evaluated})")
    return list(evaluated if wanted is None else wanted)


def link_max_seq_len(config: dict[str, Any]) -> None:
    """train.max_seq_len follows data.max_seq_len when null (filled in here, so the training snapshot and the
    train stage see the effective value); set, it may only cut further: the stores hold nothing longer."""
    data_len, train = config["data"]["max_seq_len"], config.get("train")
    if train is None:
        return
    if train.get("max_seq_len") is None:
        train["max_seq_len"] = data_len
    elif train["max_seq_len"] > data_len:
        raise ConfigError(f"config key train.max_seq_len: {train['max_seq_len']} is more than data.max_seq_len "
                          f"({data_len}), the longest sequence the stores hold; lower it or leave it null")


def link_selection_conversations(data: dict[str, Any]) -> None:
    """data.selection_conversations follows data.eval_conversations when null (filled in here, so ingest, the
    rules and the disk plan read one number): both held-out sets the same size, the selection set the size the
    estimate had when it read the evaluation set."""
    if data.get("selection_conversations") is None:  # a validated config has both keys
        data["selection_conversations"] = data.get("eval_conversations")


# GGUF architecture names of the supported families (Mistral GGUFs say "llama"); the full check of the rope
# settings runs on config.json once the target is materialised (parse time again, and the target job itself).
GGUF_FAMILIES = ("llama", "qwen2", "qwen3", "qwen3moe", "gemma2", "gemma3", "phi3")


def check_target_family(target_dir: Path, target: dict[str, Any], target_source: str) -> None:
    """Stop before any job when no served drafter can be trained for the target, with what and why.

    Reads what is local: the materialised target's or the source directory's config.json (or the HF cache),
    else a GGUF file's architecture; a hub id not yet fetched is checked by the target job."""
    from eagle3_pipeline import target_shape
    from eagle3_pipeline.families import target_support_problem

    config = target_shape.target_config(target_dir, target_source, target.get("revision"))
    if config is not None:
        problem = target_support_problem(config)
    else:
        problem = _gguf_family_problem(target_source, target.get("gguf_file"))
    if problem:
        raise ConfigError(f"config key target.source: {target['source']!r}: {problem}")


def _gguf_family_problem(source: str, gguf_file: str | None) -> str | None:
    from eagle3_pipeline import target_shape

    gguf = target_shape.gguf_path(source, gguf_file)
    if gguf is None:
        return None
    architecture = bytes(target_shape.gguf_reader(gguf).fields["general.architecture"].parts[-1]).decode()
    if architecture not in GGUF_FAMILIES:
        return (f"GGUF architecture {architecture!r} is not a supported target family "
                f"({', '.join(GGUF_FAMILIES)})")
    return None


def check_chat_template(setting: str | None) -> str | None:
    """The template file to track as an input (None for a built-in name or no setting); it must parse."""
    import jinja2

    from eagle3_pipeline.tokenization import BUILTIN_CHAT_TEMPLATES, chat_template_text

    if setting is None:
        return None
    if setting not in BUILTIN_CHAT_TEMPLATES:
        path = Path(setting).expanduser()
        if not path.is_file():
            raise ConfigError(f"config key target.chat_template: {setting!r} is neither a file nor a built-in "
                              f"template ({', '.join(BUILTIN_CHAT_TEMPLATES)})")
    try:
        jinja2.Environment().parse(chat_template_text(setting))
    except jinja2.TemplateSyntaxError as exc:
        raise ConfigError(f"config key target.chat_template: {setting} line {exc.lineno}: {exc.message}") from exc
    return None if setting in BUILTIN_CHAT_TEMPLATES else str(Path(setting).expanduser())
