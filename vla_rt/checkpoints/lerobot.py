"""Read and write LeRobot π0 and π0.5 (`pi05`) checkpoints: `model.safetensors` + `config.json`, plus norm stats where LeRobot keeps them.

Key names and the tensors deliberately ignored are documented in `lerobot_names`. Norm stats come from LeRobot's
processor files (`policy_preprocessor.json` / `policy_postprocessor.json` naming `*_normalizer_processor.safetensors`
/ `*_unnormalizer_processor.safetensors` with `observation.state.{mean,std,q01,q99}` and `action.*`) or, in
checkpoints from before the processors, from `normalize_inputs.buffer_*` / `unnormalize_outputs.buffer_*` tensors in
model.safetensors. They become openpi-style stats keyed `state` and `actions`. LeRobot's own z-score uses eps 1e-8
and no eps when un-normalising, openpi uses 1e-6 in both; vla-rt applies openpi's formulas (relative differences
~1e-6).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file
from tqdm import tqdm

from vla_rt.arguments import LIMITS
from vla_rt.checkpoints import lerobot_names as names
from vla_rt.checkpoints.common import LoadedCheckpoint, check_shapes, describe_dims, safetensors_shapes
from vla_rt.checkpoints.files import load_safetensors, open_safetensors, read_json
from vla_rt.checkpoints.norm_stats import NormStats
from vla_rt.checkpoints.streaming import read_safetensors
from vla_rt.config import Pi0Config
from vla_rt.errors import CheckpointError, NormStatsError
from vla_rt.model.weights import infer_config, validate_weights

MODEL_FILE = "model.safetensors"
CONFIG_FILE = "config.json"
FEATURE_TO_KEY = {"observation.state": "state", "action": "actions"}
# Tensors infer_config reads; when one is missing the dims cannot be known, so say that first.
_ANCHORS = (
    "vision.pos_embed",
    "vision.patch_embed.weight",
    "vision.blocks.0.mlp.fc1.weight",
    "llm.embed_tokens.weight",
    "llm.layers.0.q_proj.weight",
    "llm.layers.0.k_proj.weight",
    "llm.layers.0.gate_proj.weight",
    "expert.layers.0.q_proj.weight",
    "expert.layers.0.k_proj.weight",
    "expert.layers.0.gate_proj.weight",
    "action_in_proj.weight",
)


def is_lerobot_dir(path: Path) -> bool:
    return path.is_dir() and (path / MODEL_FILE).is_file() and (path / CONFIG_FILE).is_file()


def missing_lerobot_file(path: Path) -> str | None:
    """The one of model.safetensors / config.json that a dir holding the other lacks (a partial download), else None."""
    if not path.is_dir():
        return None
    has_model, has_config = (path / MODEL_FILE).is_file(), (path / CONFIG_FILE).is_file()
    if has_model == has_config:
        return None
    return CONFIG_FILE if has_model else MODEL_FILE


def _read(file: Path, keys: list[str]) -> dict[str, torch.Tensor]:
    with open_safetensors(file) as f:
        return {k: f.get_tensor(k) for k in keys}


def _stats_from_flat(flat: dict[str, torch.Tensor], source: str) -> dict[str, NormStats]:
    """`{feature}.{stat}` tensors -> openpi-style stats for state and actions (other features ignored)."""
    grouped: dict[str, dict[str, torch.Tensor]] = {}
    for key, t in flat.items():
        feature, _, stat = key.rpartition(".")
        if feature in FEATURE_TO_KEY and stat in ("mean", "std", "q01", "q99"):
            grouped.setdefault(FEATURE_TO_KEY[feature], {})[stat] = t
    out = {}
    for key, stats in grouped.items():
        if "mean" in stats and "std" in stats:
            try:
                out[key] = NormStats(**{s: t.double().flatten().numpy() for s, t in stats.items()})
            except NormStatsError as e:
                raise e.within(f"norm_stats[{key!r}]", source) from None
    return out


def _processor_stats(folder: Path) -> tuple[dict[str, NormStats], list[str]]:
    flat: dict[str, torch.Tensor] = {}
    used = []
    for pipeline in ("policy_postprocessor.json", "policy_preprocessor.json"):  # later files win: inputs' stats
        file = folder / pipeline
        if not file.is_file():
            _refuse_orphan_state_files(file)
            continue
        pipeline_json = read_json(file)
        steps = pipeline_json.get("steps", []) if isinstance(pipeline_json, dict) else None
        if not isinstance(steps, list) or not all(isinstance(step, dict) for step in steps):
            raise CheckpointError(file, "expected a JSON object whose 'steps' is a list of objects")
        for i, step in enumerate(steps):
            state_file = step.get("state_file")
            if step.get("registry_name") in ("normalizer_processor", "unnormalizer_processor") and state_file:
                # LeRobot's own loader fails on a missing state file; skipping it would run the robot unnormalised
                if not isinstance(state_file, str) or not (folder / state_file).is_file():
                    found = repr(state_file)
                    if isinstance(state_file, str):
                        found += ", which " + ("is not a file" if (folder / state_file).exists() else "does not exist")
                    raise CheckpointError(
                        file, f"steps[{i}].state_file: expected the name of a safetensors file beside it, found {found}"
                    )
                flat.update(load_safetensors(folder / state_file))
                used.append(state_file)
    return _stats_from_flat(flat, str(folder)), used


def _refuse_orphan_state_files(pipeline: Path) -> None:
    """A processor state file whose pipeline JSON is gone (a partial copy or download) holds norm stats that only the
    JSON names: loading without them would run the robot in normalised units without a word."""
    prefix = pipeline.name.removesuffix(".json")
    orphans = sorted(p.name for p in pipeline.parent.glob(f"{prefix}_step_*.safetensors"))
    if orphans:
        raise CheckpointError(
            pipeline, f"missing, but {orphans} beside it hold norm stats that only it names (copy the whole dir)"
        )


def _buffer_stats(file: Path, keys: list[str], source: str) -> dict[str, NormStats]:
    """Old LeRobot: `normalize_inputs.buffer_observation_state.mean` -> feature `observation.state`."""
    flat = {}
    for key, t in _read(file, keys).items():
        for prefix in names.NORM_BUFFER_PREFIXES:
            if key.startswith(prefix + "buffer_"):
                feature, _, stat = key[len(prefix + "buffer_") :].rpartition(".")
                flat[f"{feature.replace('_', '.')}.{stat}"] = t
    return _stats_from_flat(flat, source)


def _resolve(path: Path) -> tuple[Path, Path | None]:
    if path.is_file():
        config = path.parent / CONFIG_FILE
        return path, config if config.is_file() else None
    if (path / MODEL_FILE).is_file():
        return path / MODEL_FILE, (path / CONFIG_FILE) if (path / CONFIG_FILE).is_file() else None
    raise CheckpointError(f"{path}: not a LeRobot checkpoint: no {MODEL_FILE} there")


def _config_overrides(config: dict, source: str, pi05: bool) -> dict:
    """Non-shape settings from config.json; refuses configs of other policies, or of the other model."""
    kind = config.get("type")
    if kind not in (None, "pi0", "pi05"):
        raise CheckpointError(
            f"{source}: config.json is for LeRobot policy type {kind!r}; vla-rt reads 'pi0' and 'pi05'"
        )
    if kind is not None and (kind == "pi05") != pi05:
        found = "π0.5 (adaptive-norm dense weights)" if pi05 else "π0 (RMSNorm weights, no adaptive-norm dense)"
        raise CheckpointError(f"{source}: config.json says type {kind!r} but the tensors are {found}")
    overrides = {}
    # at most what a model can be built for: a typo'd chunk_size of 500000 loaded, then allocated GBs of noise
    for key, setting, most in (("chunk_size", "chunk", LIMITS["chunk"][1]),
                               ("tokenizer_max_length", "max_token_len", LIMITS["prompt_len"][1])):  # fmt: skip
        value = config.get(key)
        if value is None:
            continue
        if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= most:
            raise CheckpointError(
                source, f"config.json {key} is {value!r}, expected a positive integer (at most {most})"
            )
        overrides[setting] = value
    return overrides


def _relative_actions(config: dict, source: str) -> bool:
    """LeRobot's `use_relative_actions` (π0 / π0.5 configs since 2026): true means the model was trained on actions
    as offsets from the state, which only LeRobot's processors turn back into positions."""
    value = config.get("use_relative_actions", False)
    if not isinstance(value, bool):
        raise CheckpointError(source, f"config.json use_relative_actions is {value!r}, expected true or false")
    return value


def _quantile_mode(config: dict, source: str) -> tuple[bool | None, list[str]]:
    mapping = config.get("normalization_mapping")
    if mapping is None:
        mapping = {}
    elif not isinstance(mapping, dict):
        raise CheckpointError(source, f"config.json normalization_mapping is {mapping!r}, expected an object mapping "
                                      "feature types (STATE, ACTION) to normalisation modes")  # fmt: skip
    for key in ("STATE", "ACTION"):
        if key in mapping and not isinstance(mapping[key], str):
            raise CheckpointError(source, f"config.json normalization_mapping.{key} is {mapping[key]!r}, expected a "
                                          "mode name such as 'MEAN_STD' or 'QUANTILES'")  # fmt: skip
    modes = {mapping[k] for k in ("STATE", "ACTION") if k in mapping}
    if not modes:
        return None, []
    if modes <= {"MEAN_STD"}:
        return False, []
    if modes <= {"QUANTILES"}:
        return True, []
    return None, [f"LeRobot normalisation modes {sorted(map(str, modes))} are not openpi's z-score/quantile modes"]


def load_lerobot(
    path: str | Path,
    dtype: torch.dtype | None = torch.float32,
    *,
    shapes_only: bool = False,
    progress: bool = False,
    device: torch.device | str | None = None,
) -> LoadedCheckpoint:
    """Reads a LeRobot π0 / π0.5 checkpoint (its dir, or its model.safetensors) into canonical weights.

    Tensors are read one at a time straight to `device` (default: the CPU), see `streaming`.

    Dims come from tensor shapes; config.json only supplies the chunk length and prompt length defaults.
    """
    model_file, config_file = _resolve(Path(path))
    source = str(model_file.parent if Path(path).is_dir() else model_file)
    config = read_json(config_file) if config_file else {}
    if not isinstance(config, dict):
        raise CheckpointError(
            config_file, f"expected a JSON object (LeRobot's config.json), found a {type(config).__name__}"
        )
    raw = safetensors_shapes(model_file)
    pi05 = names.is_pi05_file(raw)
    overrides = _config_overrides(config, source, pi05)

    buffers = {k for k in raw if k.startswith(names.NORM_BUFFER_PREFIXES)}
    tensors: dict[str, torch.Tensor] = {}
    origin: dict[str, str] = {}
    for key in sorted(set(raw) - buffers):
        norm = names.normalize_key(key, pi05)
        if norm in origin:
            raise CheckpointError(f"{source}: keys {origin[norm]!r} and {key!r} name the same tensor {norm!r}")
        origin[norm] = key
        tensors[norm] = raw[key]
    renamed = sorted(k for k, raw_key in origin.items() if k != raw_key and k != "model." + raw_key)

    ignored = {k for k in tensors if names.is_ignored(k)}
    embed_key = names.to_lerobot("llm.embed_tokens.weight")
    if embed_key not in tensors and names.LM_HEAD in tensors:
        embed_key = names.LM_HEAD  # the hub layout: the tied table is stored under the LM head's name
    elif names.LM_HEAD in tensors:
        ignored.add(names.LM_HEAD)  # tied duplicate of embed_tokens; π0 computes no logits

    canonical: dict[str, str] = {}  # canonical name -> LeRobot key
    for key in tensors:
        name = "llm.embed_tokens.weight" if key == embed_key else names.to_canonical(key)
        if name is not None and key not in ignored:
            canonical[name] = key
    missing_anchors = [names.to_lerobot(a) for a in _ANCHORS if a not in canonical]
    if missing_anchors:
        raise CheckpointError(f"{source}: cannot infer model dimensions: missing tensors {missing_anchors}")
    cfg = infer_config({n: tensors[k] for n, k in canonical.items()}, **overrides)

    expected = names.lerobot_shapes(cfg)
    expected[embed_key] = expected.pop(names.to_lerobot("llm.embed_tokens.weight"))
    extra_expected = {
        names.EXPERT_LM_HEAD: (cfg.vocab_size, cfg.expert.width),
        names.LM_HEAD: (cfg.vocab_size, cfg.llm.width),
    }
    for key in ignored:
        if key in extra_expected:
            expected[key] = extra_expected[key]
    found = {k: tuple(t.shape) for k, t in tensors.items() if not any(p.match(k) for p in names.IGNORED_PATTERNS)}
    layout_note = (
        f"\n(keys shown in LeRobot's hub layout; this file uses older names, e.g. {origin[renamed[0]]!r})"
        if renamed
        else ""
    )
    check_shapes(found, expected, source, describe_dims(cfg) + layout_note)
    # the small files first (read even with shapes_only, for `info`): a bad one fails before minutes of weight reads
    norm_stats, files = _processor_stats(model_file.parent)
    quantiles, mode_notes = _quantile_mode(config, source)
    relative = _relative_actions(config, source)

    weights = {}
    by_file_key = {origin[key]: name for name, key in sorted(canonical.items())}
    if shapes_only:
        weights = {name: tensors[key].to(dtype or tensors[key].dtype) for name, key in canonical.items()}
    else:
        keys = tqdm(list(by_file_key), desc="reading LeRobot", unit="tensor", disable=not progress)
        for key, t in read_safetensors(model_file, keys, dtype=dtype, device=device):
            weights[by_file_key[key]] = t
    validate_weights(weights, cfg, source)

    notes = [f"ignored LeRobot tensors not used by {cfg.model_name}: {sorted(ignored)}"] if ignored else []
    if norm_stats:
        notes.append(f"norm stats from {files}")
    elif buffers:
        norm_stats = _buffer_stats(model_file, sorted(buffers), source)
        notes.append("norm stats from normalisation buffers in model.safetensors")
    notes += mode_notes
    if relative:
        notes.append("use_relative_actions: actions are offsets from the state (LeRobot's processors add it back; "
                     "vla-rt's own policy refuses the model, the LeRobot plugin runs it)")  # fmt: skip
    return LoadedCheckpoint(
        weights, cfg, source, norm_stats or None, "lerobot", notes=notes, use_quantile_norm=quantiles,
        relative_actions=relative,
    )  # fmt: skip


def save_lerobot(
    weights: dict[str, torch.Tensor],
    cfg: Pi0Config,
    path: str | Path,
    *,
    norm_stats: dict[str, NormStats] | None = None,
    embedding_under_lm_head: bool = True,
) -> Path:
    """Writes a LeRobot π0 / π0.5 checkpoint dir in the hub layout (for tests and interchange).

    As on the hub, the embedding table is stored once under the PaliGemma LM head's name (set
    `embedding_under_lm_head=False` for the `embed_tokens` name) and the expert's unused LM head is present (zeros).
    Norm stats go to LeRobot's processor files.
    """
    validate_weights(weights, cfg, "weights to save")
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    tensors = {names.to_lerobot(n): t.detach().cpu().contiguous() for n, t in weights.items()}
    if embedding_under_lm_head:
        tensors[names.LM_HEAD] = tensors.pop(names.to_lerobot("llm.embed_tokens.weight"))
    embed_dtype = weights["llm.embed_tokens.weight"].dtype
    tensors[names.EXPERT_LM_HEAD] = torch.zeros(cfg.vocab_size, cfg.expert.width, dtype=embed_dtype)
    save_file(tensors, out / MODEL_FILE, metadata={"format": "pt"})
    (out / CONFIG_FILE).write_text(json.dumps(_lerobot_config(cfg), indent=2))
    if norm_stats is not None:
        _save_processor_stats(out, norm_stats)
    return out


def _variant(g) -> str:
    known = {(2048, 16384): "gemma_2b", (1024, 4096): "gemma_300m"}
    return known.get((g.width, g.mlp_dim), "custom")  # LeRobot knows only the two; dims are in the tensors anyway


def _lerobot_config(cfg: Pi0Config) -> dict:
    mode = "QUANTILES" if cfg.pi05 else "MEAN_STD"  # LeRobot's defaults: PI05Config quantiles, PI0Config z-score
    return {
        "type": "pi05" if cfg.pi05 else "pi0",
        "paligemma_variant": _variant(cfg.llm),
        "action_expert_variant": _variant(cfg.expert),
        "chunk_size": cfg.chunk,
        "n_action_steps": cfg.chunk,
        "max_state_dim": cfg.action_dim,
        "max_action_dim": cfg.action_dim,
        "tokenizer_max_length": cfg.max_token_len,
        "image_resolution": [cfg.vision.image_size, cfg.vision.image_size],
        "normalization_mapping": {"VISUAL": "IDENTITY", "STATE": mode, "ACTION": mode},
    }


def _save_processor_stats(out: Path, stats: dict[str, NormStats]) -> None:
    flat = {}
    for feature, key in FEATURE_TO_KEY.items():
        if key in stats:
            for stat, value in stats[key].to_json().items():
                flat[f"{feature}.{stat}"] = torch.tensor(value, dtype=torch.float32)
    for pipeline, step in (
        ("policy_preprocessor", "normalizer_processor"),
        ("policy_postprocessor", "unnormalizer_processor"),
    ):
        state_file = f"{pipeline}_step_0_{step}.safetensors"
        save_file(flat, out / state_file)
        entry = {"registry_name": step, "config": {"eps": 1e-8}, "state_file": state_file}
        (out / f"{pipeline}.json").write_text(json.dumps({"name": pipeline, "steps": [entry]}, indent=2))
