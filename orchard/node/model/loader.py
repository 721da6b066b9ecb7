"""Load a model with mlx-lm's own loader, refuse what the paged engine cannot serve, fingerprint it.

The engine runs mlx-lm's model classes unchanged and only replaces their KV cache and
attention call (see `orchard.node.model.runner`). That works for architectures whose every layer
is causal attention over the whole context or over a sliding window that mlx-lm's model
applies (the kernels apply the same window per layer); linear attention or state-space
layers would silently compute something else over a paged pool, so they are refused here,
at load, with the reason. A window the config states but mlx-lm's class ignores (Gemma 2,
Mistral 7B v0.1) caps the context at that window instead: up to it, windowed and full
attention agree, so the engine, mlx-lm and the model as trained all compute the same. What a model is decides, not its name:
the config and the model's structure are checked before any weights are read
(`orchard.node.model.capability`), and a traced forward pass of the loaded model after.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

from orchard.kvcache.geometry import DTYPE_SIZES, KVGeometry
from orchard.node.model.layers import attention_layers, final_norm, text_config, text_model, text_stack

DEMO_MODEL_NAME = "orchard-demo"
#: Used when a config states no maximum position.
DEFAULT_MAX_CONTEXT = 4096


class ModelNotFound(FileNotFoundError):
    """Neither a local model folder nor a hub id that could be fetched."""


class UnsupportedModel(ValueError):
    """The model's architecture or attention layout cannot run over the paged pool."""

    def __init__(self, model_type: str, reason: str):
        super().__init__(f"unsupported model (model_type={model_type!r}): {reason}")
        self.model_type = model_type
        self.reason = reason


@dataclass
class LoadedModel:
    """A loaded mlx-lm model with everything the engine derives from it."""

    name: str
    path: Path
    model: Any  # mlx_lm.models.<type>.Model
    tokenizer: Any  # mlx_lm.tokenizer_utils.TokenizerWrapper
    config: dict
    model_type: str
    fingerprint: str
    eos_token_ids: frozenset[int] = field(default_factory=frozenset)
    max_context_length: int = DEFAULT_MAX_CONTEXT

    @property
    def num_layers(self) -> int:
        """Layers that keep KV in the pool: a hybrid model's state layers keep theirs in the state pool."""
        return len(attention_layers(self.model))

    @cached_property
    def kv_layout(self):
        """KV heads and key and value head dims, as the layers store them (`orchard.node.model.capability.KVLayout`)."""
        from orchard.node.model.capability import stored_kv_layout

        return stored_kv_layout(self.model)

    @property
    def num_kv_heads(self) -> int:
        return self.kv_layout.num_kv_heads

    @property
    def head_dim(self) -> int:
        """The keys' head dim."""
        return self.kv_layout.key_head_dim

    @property
    def value_head_dim(self) -> int:
        return self.kv_layout.value_head_dim

    @property
    def dtype(self) -> str:
        """The activations' dtype: the final norm is never quantized, so its weight tells."""
        return str(final_norm(text_stack(self.model)).weight.dtype).removeprefix("mlx.core.")

    @property
    def vocab_size(self) -> int:
        return int(self.model.args.vocab_size)

    def geometry(self, block_size: int, dtype: str | None = None) -> KVGeometry:
        """The KV pool layout for this model; the dtype follows the weights unless given."""
        return KVGeometry(
            model_fingerprint=self.fingerprint,
            num_layers=self.num_layers,
            num_kv_heads=self.num_kv_heads,
            head_dim=self.head_dim,
            block_size=block_size,
            dtype=dtype or self.dtype,
            value_head_dim=self.value_head_dim,
        )


# ---------------------------------------------------------------- validation


def unsupported_reason(config: dict) -> str | None:
    """Why the paged engine cannot serve a model with this config, or None when it can.

    Needs no weights: the config's own fields, then the structure of mlx-lm's model for it.
    """
    return _config_reason(text_config(config)) or _structure_reason(config)


#: layer types a config may name: the kernels apply each layer's window (node.model.capability.layer_windows)
PAGED_LAYER_TYPES = frozenset({"full_attention", "sliding_attention", "linear_attention"})


def _config_reason(config: dict) -> str | None:
    if config.get("model_file"):
        return "custom model code (model_file) is not supported"
    if config.get("attention_chunk_size"):
        return ("chunked local attention (attention_chunk_size, Llama 4): its layers attend within fixed chunks "
                "of the context, which the paged kernels do not cut")
    layer_types = set(config.get("layer_types") or ["full_attention"])
    if not layer_types <= PAGED_LAYER_TYPES:
        return f"layer types {sorted(layer_types)} (only full, sliding-window and Gated DeltaNet linear attention are served)"
    return None


def _stated_window(config: dict) -> int | None:
    """The sliding window a config states; Qwen-style configs carry one that applies only when `use_sliding_window` is on."""
    if not config.get("use_sliding_window", True):
        return None
    window = config.get("sliding_window")
    return None if window is None else int(window)


def _structure_reason(config: dict) -> str | None:
    """Build mlx-lm's model for `config` without weights (its arrays stay lazy) and inspect it."""
    from mlx_lm.utils import _get_classes

    from orchard.node.model.capability import architecture_reason
    from orchard.node.model.state_layers import state_layer_indices

    try:
        model_class, args_class = _get_classes(config)
    except ValueError as error:
        return f"mlx-lm has no model class for it ({error})"
    try:
        skeleton = model_class(args_class.from_dict(config))
    except Exception as error:  # a config mlx-lm's own classes cannot build
        return f"mlx-lm cannot build it from this config ({type(error).__name__}: {error})"
    model = text_model(skeleton)
    if (reason := architecture_reason(model)) is not None:
        return reason
    if "linear_attention" in (text_config(config).get("layer_types") or []) and not state_layer_indices(model):
        return "its layer_types name linear_attention layers, which mlx-lm's class for it does not build"
    return None


def check_supported(config: dict) -> None:
    if (reason := unsupported_reason(config)) is not None:
        raise UnsupportedModel(str(config.get("model_type")), reason)


def loaded_reason(loaded: LoadedModel) -> str | None:
    """Why a loaded model cannot run over the pool: its dtype, then its ropes and layers (which
    also decide its KV layout: `LoadedModel.kv_layout`)."""
    from orchard.node.model.capability import paging_reason

    try:
        dtype = loaded.dtype
    except AttributeError as error:  # norms named unlike the families the pool is laid out for
        return f"its KV dtype cannot be read ({error})"
    if dtype not in DTYPE_SIZES:
        return f"activation dtype {dtype} has no KV pool layout"
    try:
        return paging_reason(loaded.model)
    except AttributeError as error:  # attention named unlike the families the pool is laid out for
        return f"its KV layout cannot be read ({error})"


# ---------------------------------------------------------------- loading


def resolve_model_path(model: str | None, *, config_only: bool = False) -> tuple[str, Path]:
    """(served name, local folder): None means the demo model, created in the cache if missing.

    A hub id is fetched with mlx-lm's own download; `config_only` fetches just the JSON
    files, so an unsupported model is refused before gigabytes of weights arrive.
    """
    if model is None:
        from orchard.node.model.demo import default_demo_model_path

        return DEMO_MODEL_NAME, default_demo_model_path()
    local = Path(model).expanduser()
    if local.exists():
        return model, local
    from mlx_lm.utils import _download

    try:
        return model, Path(_download(model, allow_patterns=["*.json"] if config_only else None))
    except Exception as error:  # validation, network and auth errors all mean the same here
        raise ModelNotFound(f"model {model!r} is not a local folder and could not be fetched from the hub: {error}") from error


def read_config(path: Path) -> dict:
    config_file = path / "config.json"
    if not config_file.exists():
        raise FileNotFoundError(f"no config.json in {path}")
    return json.loads(config_file.read_text(encoding="utf-8"))


def load_model(model: str | None = None) -> LoadedModel:
    """Load `model` (local path or hub id; None for the demo model) after checking it is servable."""
    from mlx_lm.utils import load

    from orchard.node.model.fingerprint import model_fingerprint as checkpoint_fingerprint

    _, config_path = resolve_model_path(model, config_only=True)
    check_supported(read_config(config_path))
    name, path = resolve_model_path(model)
    mlx_model, tokenizer, config = load(str(path), return_config=True)
    mlx_model = text_model(mlx_model)  # a multimodal wrapper's text model; the engine serves text
    evaluate_held_arrays(mlx_model)
    loaded = LoadedModel(
        name=name,
        path=path,
        model=mlx_model,
        tokenizer=tokenizer,
        config=config,
        model_type=config["model_type"],
        fingerprint=checkpoint_fingerprint(path),
        eos_token_ids=frozenset(int(t) for t in tokenizer.eos_token_ids),
        max_context_length=served_context_length(text_config(config), mlx_model),
    )
    if (reason := loaded_reason(loaded)) is not None:
        raise UnsupportedModel(config["model_type"], reason)
    return loaded


def served_context_length(config: dict, model) -> int:
    """The config's maximum position (some ModelArgs classes, qwen2_moe, drop the field), or a
    shorter window the config states for a model none of whose layers mlx-lm windows."""
    from orchard.node.model.capability import layer_windows

    stated = int(config.get("max_position_embeddings") or getattr(model.args, "max_position_embeddings", None)
                 or DEFAULT_MAX_CONTEXT)
    window = _stated_window(config)
    if window is None or any(w is not None for w in layer_windows(model)):
        return stated  # no window, or mlx-lm windows these layers and the kernels apply the same windows
    return min(stated, window)


def held_arrays(model) -> list:
    """Every array a model holds: its parameters and the private ones `parameters()` skips
    (rope frequencies such as `_freqs`, masks, sink logits), wherever a module keeps them."""
    import mlx.core as mx
    from mlx.utils import tree_flatten

    leaves = [value for _, value in tree_flatten(model)]
    for module in model.modules():
        leaves.extend(vars(module).values())  # arrays set past Module's own attribute handling
    return [leaf for leaf in leaves if isinstance(leaf, mx.array)]


def evaluate_held_arrays(model) -> None:
    """Compute every array the model holds, in the calling thread.

    Modules may build arrays lazily at construction (Llama 3, yarn and longrope rope
    frequencies). A lazy array can only be evaluated in the thread whose stream created
    it, so a model loaded in one thread and stepped in another (the engine's) would fail
    at its first step.
    """
    import mlx.core as mx

    mx.eval(held_arrays(model))
