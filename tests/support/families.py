"""The MoE families of the installed transformers, found by structure, and a tiny model of each.

A *family* is a transformers model directory whose modeling module mentions experts and whose tiny
model (built from its own config class, sizes shrunk generically: no download, no per-family sizes)
holds an experts-like module (:func:`epmoe.ep.recognize.experts_like_modules`). A new family in a
future transformers is picked up without editing anything here.

Used by ``test_families.py`` (the coverage test), ``families_workers.py`` (its ranks) and
``tests/models/families_table.py`` (the families table of docs/models.md).
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import pathlib
import re

import experts_variants
import torch

from epmoe.ep.recognize import experts_like_modules

VOCAB = 128
INPUT_VOCAB = 64  # input ids are drawn below this; special token ids are moved above it
NUM_EXPERTS = 4  # divisible by 2 and 4 (EP 2 and EP 4)
TOP_K = 2
LAYER_TRIES = (2, 4, 8)  # fewest layers first; more where the first layers are dense

_SIZES = (  # (pattern on the attribute name, value) for integer sizes, first match wins
    (r"(^|_)vocab_size($|_)", VOCAB),
    (r"num_nextn_predict_layers|num_kv_shared_layers|num_mtp", 0),
    (r"topk_group|n_group|num_expert_group|n_groups$", 1),
    (r"(per_tok|top_?k|topk$|moe_topk|experts_per|^moe_k$)", TOP_K),
    (r"^(n_)?shared_experts?$|num_shared_experts|n_shared_experts|shared_expert_num|zero_expert_num", 1),
    (r"expert.*(layer|period|offset|freq|step|interval|start)", "keep"),
    (r"expert", NUM_EXPERTS),
    (r"intermediate|ffn_hidden|ffn_dim|moe_dim|d_ff$", 32),
    (r"lora_rank", 16),
    (r"rope_head_dim|nope_head_dim", 16),
    (r"head_dim|v_head_dim|d_kv|key_head_dim|value_head_dim", 16),
    (r"kv_heads|key_value_heads|num_key_heads|kv_n_heads", 2),
    (r"heads", 4),
    (r"^(hidden_size|d_model|n_embd|hidden_dim|embed_dim|dim)$", 64),
    (r"hidden_size|_size_per_layer|latent_size", 32),
    (r"(num_hidden_layers|n_layers|num_layers)$", "layers"),  # the layer count being tried
    (r"first_k_dense|dense_replace|moe_layer_start|first_dense|num_dense_layers", 1),
    (r"features$", 16),
    (r"sliding_window|attention_chunk_size|window_size", 8),
    (r"max_position_embeddings|max_seq_len", 256),
    (r"state_size|d_state|conv_kernel|d_conv", 4),
    (r"mamba_num_heads|mamba_n_heads", 4),
    (r"mamba_head_dim|mamba_d_head", 16),
    (r"chunk_size$", 8),
    (r"budget", 32),
    (r"compress_ratio", 4),
)

# What the generic sizes get wrong for a family, set after them: fields its default config lacks
# (a released checkpoint's config.json sets them) and sizes tied together in ways the names do not
# say (rotary dims of partial-rotary attention, Mamba heads). A new family whose tiny model cannot be
# built or run fails the coverage test until it gets an entry here.
CONFIG_FIXES = {
    "dbrx": {"attn_config.rope_theta": 10000.0, "attn_config.clip_qkv": 8.0},
    "qwen4_exp": {"indexer_kv_heads": 1},  # its indexer pools one key head
    "lfm2_moe": {"layer_types": ["conv", "full_attention"]},
    "deepseek_ocr2": {"text_config.mlp_layer_types": ["dense", "sparse"]},
    "mistral4": {"head_dim": 32},  # qk_rope_head_dim = head_dim * partial_rotary_factor 0.5
    "dots3_note": {"head_dim": 64},  # qk_rope_head_dim = head_dim * partial_rotary_factor 0.25
    "granitemoehybrid": {"mamba_n_heads": 8},
    "longcat_flash": {"expert_ffn_hidden_size": 32},  # the expert width
    "glm4v_moe": {
        "text_config.rope_parameters": {
            "rope_theta": 10000.0,
            "partial_rotary_factor": 0.5,
            "rope_type": "default",
            "mrope_section": [2, 1, 1],
        }
    },
    "ernie4_5_vl_moe": {
        "text_config.rope_parameters": {"rope_theta": 500000.0, "rope_type": "default", "mrope_section": [2, 2, 4]}
    },
}


def _dbrx_square_experts(config, module) -> None:
    """transformers 5.6's DBRX reads the hidden states as ``ffn_hidden_size`` wide (its router and
    experts; later releases read ``d_model``): its tiny model runs there only with the two equal."""
    if module.DbrxRouter(config.ffn_config).layer.in_features != config.d_model:
        config.ffn_config.ffn_hidden_size = config.d_model


# What a release's own modeling code needs beyond CONFIG_FIXES, decided by what that code does (not by
# its version number): ``{directory: fix(config, modeling module)}``, run after CONFIG_FIXES.
RELEASE_FIXES = {"dbrx": _dbrx_square_experts}


@dataclasses.dataclass
class Family:
    """One MoE family: its model directory, the model type and class built, and how to call it."""

    name: str  # the transformers model directory (``transformers.models.<name>``)
    model_type: str
    model_class: str
    layers: int  # decoder layers of the tiny model
    keep_fp32: bool = False  # the family's own forward needs its float32 modules kept so (its router...)
    variant: str = ""  # an experts class made for the purpose installed in it (experts_variants.py)

    @property
    def key(self) -> str:
        """The name results are kept under: the directory, ``+variant`` for a made experts class."""
        return f"{self.name}+{self.variant}" if self.variant else self.name


def _transformers_root() -> pathlib.Path:
    import transformers

    return pathlib.Path(transformers.__file__).parent / "models"


def candidate_directories() -> list[str]:
    """Model directories of the installed transformers whose modeling module mentions experts."""
    root = _transformers_root()
    found = []
    for path in sorted(root.glob("*/modeling_*.py")):
        if re.search(r"expert", path.read_text(), re.IGNORECASE):
            found.append(path.parent.name)
    return sorted(set(found))


def experts_classes(directory: str) -> list[str]:
    """The experts-like classes ``directory``'s modeling module defines: classes transformers'
    ``@use_experts_implementation`` decorated (they carry ``_apply_gate``), or named as experts or as a
    mixture of experts / attention (``...Experts``, ``...MoE``, ``...MoA``), shared experts aside."""
    module = importlib.import_module(f"transformers.models.{directory}.modeling_{directory}")
    names = []
    for name, cls in vars(module).items():
        if not (isinstance(cls, type) and issubclass(cls, torch.nn.Module) and cls.__module__ == module.__name__):
            continue
        if "_apply_gate" in vars(cls) or (re.search(r"(Experts?|MoE|Moe|MoA)$", name) and "Shared" not in name):
            names.append(name)
    return names


def _model_classes(directory: str) -> list[tuple[str, str]]:
    """``(model_type, class name)`` pairs of ``directory`` to try, causal LMs first, then base models,
    backbones, and image-text-to-text models last (transformers 5.6 maps Qwen3-Omni-MoE's thinker only
    there); only classes built from that model type's own config class."""
    from transformers.models.auto import configuration_auto, modeling_auto

    mappings = [
        getattr(modeling_auto, name)
        for name in (
            "MODEL_FOR_CAUSAL_LM_MAPPING_NAMES",
            "MODEL_MAPPING_NAMES",
            "MODEL_FOR_BACKBONE_MAPPING_NAMES",
            "MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES",
        )
    ]
    pairs = []
    for mapping in mappings:
        for model_type, class_name in mapping.items():
            if configuration_auto.model_type_to_module_name(model_type) != directory:
                continue
            for name in [class_name] if isinstance(class_name, str) else class_name:
                pairs.append((model_type, name))
    module = importlib.import_module(f"transformers.models.{directory}.modeling_{directory}")
    usable = []
    for model_type, class_name in pairs:
        cls = getattr(module, class_name, None)
        config_cls = (
            configuration_auto.CONFIG_MAPPING[model_type]
            if model_type in (configuration_auto.CONFIG_MAPPING_NAMES)
            else None
        )
        if cls is not None and config_cls is not None and getattr(cls, "config_class", None) is config_cls:
            usable.append((model_type, class_name))
    return list(dict.fromkeys(usable))


def _shrink(config, layers: int) -> None:
    """Shrink every size of ``config`` and its sub-configs in place (see ``_SIZES``); switch on the
    MoE flags (``is_moe``, ``enable_moe_block``...) and fill MoE sizes left ``None``."""
    from transformers import PretrainedConfig

    heads, kv_heads = (vars(config).get(k) for k in ("num_attention_heads", "num_key_value_heads"))
    for key, value in list(vars(config).items()):
        if key.startswith("_"):
            continue
        if isinstance(value, PretrainedConfig):
            _shrink(value, layers)
        elif isinstance(value, bool):
            if not value and re.search(r"moe|expert", key) and key.startswith(("enable", "use", "is_")):
                setattr(config, key, True)
        elif value is None and re.search(r"expert|moe|top_?k|per_tok|group|head_dim|heads|budget|ratio$|window", key):
            new = _size_for(key, 1 << 30, layers)
            if new is not None:
                setattr(config, key, new)
        elif isinstance(value, int) and value > 0:
            if re.search(r"token_id|token_index", key):
                if value >= INPUT_VOCAB:
                    setattr(config, key, INPUT_VOCAB + (value % (VOCAB - INPUT_VOCAB)))
                continue
            new = _size_for(key, value, layers)
            if new is not None:
                setattr(config, key, new)
        elif (
            isinstance(value, list)
            and value
            and all(type(v) is int for v in value)
            and not re.search(r"layers?$|layer_ids|indexes|indices", key)
        ):
            setattr(config, key, [_size_for(key, v, layers) or v for v in value])
    if isinstance(heads, int) and kv_heads == heads:  # multi-head (MLA...) attention stays so
        config.num_key_value_heads = vars(config)["num_attention_heads"]
    if {"qk_head_dim", "qk_nope_head_dim", "qk_rope_head_dim"} <= vars(config).keys():  # MLA: the sum
        config.qk_head_dim = config.qk_nope_head_dim + config.qk_rope_head_dim  # (5.6's attention reads it)
    _trim_layer_lists(config, layers)


def _size_for(key: str, value: int, layers: int) -> int | None:
    """The tiny model's value of the integer ``key`` (now ``value``), or ``None`` to keep it."""
    for pattern, new in _SIZES:
        if re.search(pattern, key):
            if new == "keep":
                return None
            if new == "layers":
                return layers
            if re.search(r"per_tok|top|group|moe_k$", key):
                return min(new, value)
            return new if new < value or re.search(r"expert", key) else None
    return None


def _trim_layer_lists(config, layers: int) -> None:
    """Per-layer lists (``layer_types``, heads per layer...: as long as the original depth) cut to
    ``layers`` entries, one of each kind first; layer-index lists (``mlp_only_layers``...) keep the
    indices below ``layers``."""
    depth = max(
        (len(v) for k, v in vars(config).items() if isinstance(v, list) and re.search(r"layer_types$", k)), default=0
    )
    for key, value in list(vars(config).items()):
        if key.startswith("_") or not isinstance(value, list) or not value:
            continue
        if depth and len(value) == depth or re.search(r"block_type|pattern|types$", key):
            if len(value) > layers:
                seen = set()
                firsts = [i for i, v in enumerate(value) if str(v) not in seen and not seen.add(str(v))]
                keep = sorted((firsts + [i for i in range(len(value)) if i not in firsts])[:layers])
                setattr(
                    config,
                    key,
                    [_size_for(key, value[i], layers) or value[i] if type(value[i]) is int else value[i] for i in keep],
                )
        elif all(type(v) is int for v in value) and re.search(r"layers?$|layer_ids|indexes", key):
            setattr(config, key, [v for v in value if v < layers])


@functools.cache
def families() -> tuple[Family | str, ...]:
    """Every MoE family of the installed transformers: a directory defining experts-like classes
    (:func:`experts_classes`), as the :class:`Family` whose tiny model holds them, or as the
    directory's name alone where no tiny model of it could be built with experts in it."""
    out = []
    for directory in candidate_directories():
        try:
            if not experts_classes(directory):
                continue
        except ImportError:
            continue
        out.append(_find_family(directory) or directory)
    return tuple(out)


def _find_family(directory: str) -> Family | None:
    for model_type, class_name in _model_classes(directory):
        for layers in LAYER_TRIES:
            family = Family(directory, model_type, class_name, layers)
            try:
                model = build(family)
            except Exception:  # noqa: BLE001 - a config these generic sizes do not fit: try the next
                continue
            if experts_like_modules(model):
                return family if _runs(family, model) else dataclasses.replace(family, keep_fp32=True)
    return None


def _runs(family: Family, model: torch.nn.Module) -> bool:
    """Whether the family's tiny fp64 model runs as it is, rather than failing on a float32 / float64
    mismatch (some compute parts in float32 and need those weights kept in float32, as transformers
    keeps them at half precision)."""
    try:
        with torch.no_grad():
            model(**inputs(family, 0, 4))
    except RuntimeError as error:
        return "dtype" not in str(error)  # a mismatch of float32 and float64 operands
    except Exception:  # noqa: BLE001 - inputs this model does not take (encoder-decoder, pixels): as it is
        return True
    return True


def build(family: Family, *, dtype: torch.dtype = torch.float64, seed: int = 0) -> torch.nn.Module:
    """The tiny model of ``family``, in ``dtype``, the same weights for the same ``seed``: transformers'
    eager experts as the reference, every dropout off, evaluation-free (training mode)."""
    from transformers.models.auto import configuration_auto

    config = configuration_auto.CONFIG_MAPPING[family.model_type]()
    _shrink(config, family.layers)
    for path, value in CONFIG_FIXES.get(family.name, {}).items():
        *parents, leaf = path.split(".")
        target = config
        for parent in parents:
            target = getattr(target, parent)
        setattr(target, leaf, value)
    module = importlib.import_module(f"transformers.models.{family.name}.modeling_{family.name}")
    if family.name in RELEASE_FIXES:
        RELEASE_FIXES[family.name](config, module)
    config._experts_implementation = "eager"
    for sub in _sub_configs(config):
        sub._experts_implementation = "eager"
        sub._attn_implementation = "eager"
    config._attn_implementation = "eager"
    config.use_cache = False  # hybrid (Mamba, linear attention) caches need a generation loop
    for sub in _sub_configs(config):
        sub.use_cache = False
    state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    try:
        model = getattr(module, family.model_class)(config)
    finally:
        torch.random.set_rng_state(state)
    _no_dropout(model)
    model = model.to(dtype)
    if family.variant:
        experts_variants.install(model, family.variant)
    return _keep_in_fp32(model) if family.keep_fp32 else model


def variants() -> list[Family]:
    """The Qwen3-MoE family with each experts class made for the purpose (experts_variants.py)."""
    return [
        dataclasses.replace(_find_family(experts_variants.BASES.get(v, experts_variants.BASE)), variant=v)
        for v in experts_variants.CLASSES
    ]


def _keep_in_fp32(model: torch.nn.Module) -> torch.nn.Module:
    """Parameters and buffers the model class keeps in float32 (``_keep_in_fp32_modules_strict``) back
    in float32, as ``from_pretrained(dtype=torch.bfloat16)`` keeps them."""
    keep = getattr(model, "_keep_in_fp32_modules_strict", None) or []
    for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
        if tensor.is_floating_point() and any(re.search(rf"(^|\.){re.escape(k)}(\.|$)", name) for k in keep):
            tensor.data = tensor.data.float()
    return model


def _sub_configs(config) -> list:
    from transformers import PretrainedConfig

    subs = [v for k, v in vars(config).items() if isinstance(v, PretrainedConfig) and not k.startswith("_")]
    return subs + [s for sub in subs for s in _sub_configs(sub)]


def _no_dropout(model: torch.nn.Module) -> None:
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
        for name in ("jitter_noise", "router_jitter_noise", "moe_jitter_eps"):
            if isinstance(getattr(module, name, None), float):
                setattr(module, name, 0.0)


def inputs(family: Family, rank: int, length: int, batch: int = 2) -> dict:
    """This rank's batch for ``family``'s tiny model: token ids below ``INPUT_VOCAB`` (and, for an
    encoder-decoder, decoder ids too)."""
    g = torch.Generator().manual_seed(1000 + rank)
    ids = torch.randint(0, INPUT_VOCAB, (batch, length), generator=g)
    return {"input_ids": ids}


def loss_of(output) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out, loss)``: the model's first output (logits, or the last hidden state) and a loss every
    element of it reaches."""
    out = output[0]
    return out, out.square().mean()
