"""Tiny random-weight model directories of many mlx-lm architectures, for tests.

``ARCHITECTURES`` maps a name to the ``config.json`` fields of a tiny model of one architecture,
in the field names its ``ModelArgs`` in mlx-lm reads: float32, at most 4 layers, hidden size at
most 128, vocabulary 512, ``max_position_embeddings`` 4096, 4 query and 2 key/value heads of 32
dimensions where the architecture lets a config choose, 4 experts with 2 per token for mixtures
of experts, a window of 16 tokens (``WINDOW``) with both sliding and global layers for
sliding-window models, at least one attention layer and one recurrent layer (SSM, short
convolution, linear attention) for hybrids, and tied embeddings where the class can tie them.
A name is the mlx-lm ``model_type`` (``mistral`` and ``kimi_k2`` are ones mlx-lm maps to another
module); a variant appends ``-<variant>``, e.g. ``gemma4_text-shared_kv``. ``mistral3``,
``qwen3_5`` and ``qwen3_5_moe`` keep their fields under ``text_config``, as their (multimodal)
checkpoints do. Every config also loads as a ``transformers`` config, since loading the
tokenizer reads ``config.json``.

``build_architecture(name, out)`` writes a directory that ``mlx_lm.load`` loads strictly:
``config.json``, ``model.safetensors``, and the tokenizer files of the ``tiny:llama`` model (a
512-token byte-level BPE, built on first use into ``$AGENTKV_HOME``), whose ``bos_token_id``,
``eos_token_id`` and ``pad_token_id`` it adds to the config. The weights are the parameters of
mlx-lm's own model class, initialized after ``mx.random.seed(0)`` and saved in the class's own
(already sanitized) layout, except where that initialization would leave a path dead: see
``_initial_value``. Building is deterministic (the same bytes every time) and reseeds MLX's
global random generator.

Limits of mlx-lm 0.32 that show with these models: ``batch_generate`` matches generating each
prompt alone for every architecture but ``jamba`` and ``recurrent_gemma``, whose recurrent
layers ignore the batch's left padding; ``gemma2`` uses one key/value head per query head
because its attention mishandles a batch's mask with grouped queries.
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import mlx.core as mx

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
_TOKEN_ID_FIELDS = ("bos_token_id", "eos_token_id", "pad_token_id")
_VECTOR_INIT_SCALE = 0.02
"""Standard deviation of the random values that replace an all-zero vector (a bias, ...)."""

WINDOW = 16
"""The sliding window of every sliding-window architecture."""

_COMMON = {
    "vocab_size": 512,
    "max_position_embeddings": 4096,
    "torch_dtype": "float32",
}
# The usual decoder dimensions: 4 query heads and 2 key/value heads of 32 dimensions.
_ATTENTION = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
}
# For architectures that derive the head size as hidden_size // num_attention_heads.
_ATTENTION_NO_HEAD_DIM = {
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
}
_MOE = {"num_experts_per_tok": 2, "moe_intermediate_size": 32}
_YARN = {
    "type": "yarn",
    "factor": 4.0,
    "original_max_position_embeddings": 1024,
    "beta_fast": 32,
    "beta_slow": 1,
    "mscale": 1.0,
    "mscale_all_dim": 1.0,
}
_SLIDING_FULL = ["sliding_attention", "full_attention"] * 2


# What the two Granite 4.0-H variants share: Mamba-2 layers around one attention layer.
_GRANITE_HYBRID = {
    "rms_norm_eps": 1e-5,
    "layer_types": ["mamba", "mamba", "attention", "mamba"],
    "position_embedding_type": "nope",
    "rope_theta": 10_000.0,
    "attention_bias": False,
    "embedding_multiplier": 12.0,
    "attention_multiplier": 1 / 32,
    "logits_scaling": 6.0,
    "residual_multiplier": 0.22,
    "mamba_n_heads": 8,
    "mamba_d_head": 32,
    "mamba_expand": 2,
    "mamba_d_state": 16,
    "mamba_d_conv": 4,
    "mamba_n_groups": 1,
    "mamba_proj_bias": False,
    "mamba_conv_bias": True,
    "tie_word_embeddings": True,
}
# What the two Nemotron-H variants share: their Mamba-2 blocks.
_NEMOTRON_H = {
    "layer_norm_epsilon": 1e-5,
    "attention_bias": False,
    "mlp_bias": False,
    "use_bias": False,
    "use_conv_bias": True,
    "mamba_num_heads": 8,
    "mamba_head_dim": 16,
    "mamba_proj_bias": False,
    "ssm_state_size": 16,
    "conv_kernel": 4,
    "n_groups": 1,
    "tie_word_embeddings": False,  # mlx-lm's nemotron_h always has an output head
}


def _config(model_type: str, *bases: dict, **fields) -> dict:
    config = {"model_type": model_type, **_COMMON}
    for base in bases:
        config |= base
    return _copy(config | fields)


def _copy(config: dict) -> dict:
    """A deep copy, so that no two configs share a list or dict."""
    return json.loads(json.dumps(config))


def _gemma4(**fields) -> dict:
    return (
        _config(
            "gemma4_text",
            _ATTENTION,
            rms_norm_eps=1e-6,
            global_head_dim=64,
            vocab_size_per_layer_input=512,
            hidden_size_per_layer_input=0,
            num_kv_shared_layers=0,
            sliding_window=WINDOW,
            sliding_window_pattern=2,
            layer_types=_SLIDING_FULL,
            rope_parameters={
                "full_attention": {
                    "partial_rotary_factor": 0.25,
                    "rope_theta": 1_000_000.0,
                    "rope_type": "proportional",
                },
                "sliding_attention": {"rope_theta": 10_000.0, "rope_type": "default"},
            },
            final_logit_softcapping=30.0,
            attention_k_eq_v=False,
            use_double_wide_mlp=False,
            enable_moe_block=False,
            tie_word_embeddings=True,
        )
        | fields
    )


def _qwen3_5_text(**fields) -> dict:
    # Three gated-delta-net layers, then one gated full-attention layer.
    return (
        _config(
            "qwen3_5_text",
            _ATTENTION,
            rms_norm_eps=1e-6,
            linear_num_value_heads=4,
            linear_num_key_heads=2,
            linear_key_head_dim=16,
            linear_value_head_dim=16,
            linear_conv_kernel_dim=4,
            full_attention_interval=4,
            layer_types=["linear_attention"] * 3 + ["full_attention"],
            rope_parameters={
                "rope_type": "default",
                "rope_theta": 10_000_000.0,
                "partial_rotary_factor": 0.25,
                "mrope_section": [2, 1, 1],
                "mrope_interleaved": True,
            },
            attention_bias=False,
            tie_word_embeddings=True,
        )
        | fields
    )


def _ministral3_text() -> dict:
    return _config(
        "ministral3",
        _ATTENTION,
        rms_norm_eps=1e-5,
        rope_parameters={
            "rope_type": "yarn",
            "rope_theta": 1_000_000.0,
            "factor": 4.0,
            "original_max_position_embeddings": 1024,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "mscale": 1.0,
            "mscale_all_dim": 1.0,
            "llama_4_scaling_beta": 0.1,
        },
        tie_word_embeddings=True,
    )


def _multimodal(model_type: str, text_config: dict) -> dict:
    return _copy({"model_type": model_type, "text_config": text_config, "torch_dtype": "float32"})


def _deepseek_v3(model_type: str, **fields) -> dict:
    return (
        _config(
            model_type,
            _MOE,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=4,
            q_lora_rank=64,
            kv_lora_rank=64,
            qk_rope_head_dim=32,
            qk_nope_head_dim=32,
            v_head_dim=32,
            n_routed_experts=4,
            n_shared_experts=1,
            first_k_dense_replace=1,
            moe_layer_freq=1,
            topk_method="noaux_tc",
            scoring_func="sigmoid",
            norm_topk_prob=True,
            n_group=1,
            topk_group=1,
            routed_scaling_factor=2.5,
            rms_norm_eps=1e-6,
            rope_theta=10_000.0,
            rope_scaling=_YARN,
            attention_bias=False,
            tie_word_embeddings=False,  # only mlx-lm's mistral4 of these can tie
        )
        | fields
    )


ARCHITECTURES: dict[str, dict] = {
    "llama": _config(
        "llama",
        _ATTENTION,
        rms_norm_eps=1e-5,
        rope_theta=500_000.0,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 4.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 1024,
        },
        attention_bias=False,
        mlp_bias=False,
        tie_word_embeddings=True,
    ),
    # mlx-lm maps model_type mistral to its llama class.
    "mistral": _config(
        "mistral",
        _ATTENTION,
        rms_norm_eps=1e-5,
        rope_theta=1_000_000.0,
        tie_word_embeddings=True,
    ),
    "mistral3": _multimodal("mistral3", _ministral3_text()),
    "ministral3": _ministral3_text(),
    "qwen2": _config(
        "qwen2",
        _ATTENTION_NO_HEAD_DIM,
        rms_norm_eps=1e-6,
        rope_theta=1_000_000.0,
        tie_word_embeddings=True,
    ),
    "qwen3": _config(
        "qwen3",
        _ATTENTION,
        rms_norm_eps=1e-6,
        rope_theta=1_000_000.0,
        tie_word_embeddings=True,
    ),
    "qwen3_moe": _config(
        "qwen3_moe",
        _ATTENTION,
        _MOE,
        rms_norm_eps=1e-6,
        rope_theta=1_000_000.0,
        num_experts=4,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        norm_topk_prob=True,
        tie_word_embeddings=True,
    ),
    "glm4_moe": _config(
        "glm4_moe",
        _ATTENTION,
        _MOE,
        rms_norm_eps=1e-5,
        rope_theta=1_000_000.0,
        rope_scaling=None,
        partial_rotary_factor=0.5,
        use_qk_norm=True,
        attention_bias=True,
        n_routed_experts=4,
        n_shared_experts=1,
        first_k_dense_replace=1,
        norm_topk_prob=True,
        n_group=1,
        topk_group=1,
        routed_scaling_factor=2.5,
        tie_word_embeddings=False,  # mlx-lm's glm4_moe always has an output head
    ),
    "olmo2": _config(
        "olmo2",
        _ATTENTION,
        rms_norm_eps=1e-6,
        rope_theta=500_000.0,
        tie_word_embeddings=True,
    ),
    "phi3": _config(
        "phi3",
        _ATTENTION_NO_HEAD_DIM,
        rms_norm_eps=1e-5,
        rope_theta=10_000.0,
        partial_rotary_factor=0.75,
        original_max_position_embeddings=1024,
        rope_scaling={
            "type": "longrope",
            "short_factor": [1.0 + 0.05 * i for i in range(12)],
            "long_factor": [1.0 + 0.5 * i for i in range(12)],
        },
        tie_word_embeddings=True,
    ),
    "cohere2": _config(
        "cohere2",
        _ATTENTION_NO_HEAD_DIM,
        head_dim=32,
        layer_norm_eps=1e-5,
        rope_theta=50_000.0,
        logit_scale=0.25,
        sliding_window=WINDOW,
        sliding_window_pattern=4,
        layer_types=["sliding_attention"] * 3 + ["full_attention"],
    ),
    "exaone4": _config(
        "exaone4",
        _ATTENTION,
        rms_norm_eps=1e-5,
        rope_theta=1_000_000.0,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 4.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 1024,
        },
        sliding_window=WINDOW,
        sliding_window_pattern="LLLG",
        layer_types=["sliding_attention"] * 3 + ["full_attention"],
        tie_word_embeddings=True,
    ),
    "seed_oss": _config(
        "seed_oss",
        _ATTENTION,
        rms_norm_eps=1e-6,
        rope_theta=10_000_000.0,
        attention_bias=True,
        attention_out_bias=False,
        mlp_bias=False,
        tie_word_embeddings=True,
    ),
    "minimax": _config(
        "minimax",
        _ATTENTION,
        rms_norm_eps=1e-6,
        rope_theta=5_000_000.0,
        rotary_dim=16,
        intermediate_size=32,
        num_local_experts=4,
        num_experts_per_tok=2,
        shared_intermediate_size=0,
        scoring_func="sigmoid",
        use_qk_norm=True,
        tie_word_embeddings=True,
    ),
    "gemma3_text": _config(
        "gemma3_text",
        _ATTENTION,
        rms_norm_eps=1e-6,
        rope_theta=1_000_000.0,
        rope_local_base_freq=10_000.0,
        query_pre_attn_scalar=32,
        sliding_window=WINDOW,
        sliding_window_pattern=2,
        layer_types=_SLIDING_FULL,
        hidden_activation="gelu_pytorch_tanh",
        tie_word_embeddings=True,
    ),
    "gpt_oss": _config(
        "gpt_oss",
        _ATTENTION,
        rms_norm_eps=1e-5,
        intermediate_size=32,
        num_local_experts=4,
        num_experts_per_tok=2,
        sliding_window=WINDOW,
        layer_types=_SLIDING_FULL,
        rope_theta=150_000,
        rope_scaling={
            "rope_type": "yarn",
            "factor": 4.0,
            "original_max_position_embeddings": 1024,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "truncate": False,
        },
        tie_word_embeddings=False,  # mlx-lm's gpt_oss always has an output head
    ),
    # Gemma 4 31B style: K = V on the global layers, which have wider heads.
    "gemma4_text": _gemma4(attention_k_eq_v=True, num_global_key_value_heads=1),
    # Gemma 4 E2B style: per-layer input embeddings; the last two layers (one sliding, one global,
    # with double-wide MLPs) compute no keys and values but reuse those of the last earlier layer
    # of their type, so make_prompt_cache gives two caches for four layers.
    "gemma4_text-shared_kv": _gemma4(
        num_key_value_heads=1,
        hidden_size_per_layer_input=16,
        num_kv_shared_layers=2,
        use_double_wide_mlp=True,
    ),
    # Gemma 4 26B-A4B style: a mixture-of-experts block beside each dense MLP.
    "gemma4_text-moe": _gemma4(
        attention_k_eq_v=True,
        num_global_key_value_heads=1,
        enable_moe_block=True,
        num_experts=4,
        top_k_experts=2,
        moe_intermediate_size=32,
    ),
    "qwen3_5": _multimodal("qwen3_5", _qwen3_5_text()),
    "qwen3_5_moe": _multimodal(
        "qwen3_5_moe",
        _qwen3_5_text(
            model_type="qwen3_5_moe_text",
            num_experts=4,
            num_experts_per_tok=2,
            decoder_sparse_step=1,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=32,
            norm_topk_prob=True,
        ),
    ),
    "qwen3_next": _config(
        "qwen3_next",
        _ATTENTION,
        _MOE,
        rms_norm_eps=1e-6,
        rope_theta=10_000_000.0,
        partial_rotary_factor=0.25,
        linear_num_value_heads=4,
        linear_num_key_heads=2,
        linear_key_head_dim=16,
        linear_value_head_dim=16,
        linear_conv_kernel_dim=4,
        full_attention_interval=4,
        num_experts=4,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        shared_expert_intermediate_size=32,
        norm_topk_prob=True,
        tie_word_embeddings=True,
    ),
    # Granite 4.0-H Tiny style: Mamba-2 layers and one attention layer (no position embedding),
    # each followed by a mixture of experts beside a shared MLP.
    "granitemoehybrid": _config(
        "granitemoehybrid",
        _ATTENTION_NO_HEAD_DIM,
        _GRANITE_HYBRID,
        intermediate_size=32,
        num_local_experts=4,
        num_experts_per_tok=2,
        shared_intermediate_size=64,
    ),
    # Granite 4.0-H Micro style: the same, with dense MLPs.
    "granitemoehybrid-dense": _config(
        "granitemoehybrid", _ATTENTION_NO_HEAD_DIM, _GRANITE_HYBRID, num_local_experts=0
    ),
    # Nemotron 3 Nano style: Mamba-2 (M), attention (*) and mixture-of-experts (E) blocks.
    "nemotron_h": _config(
        "nemotron_h",
        _ATTENTION,
        _NEMOTRON_H,
        hybrid_override_pattern="M*ME",
        moe_intermediate_size=32,
        moe_shared_expert_intermediate_size=64,
        n_routed_experts=4,
        n_shared_experts=1,
        num_experts_per_tok=2,
        n_group=1,
        topk_group=1,
        norm_topk_prob=True,
        routed_scaling_factor=2.5,
    ),
    # Nemotron-H / Nemotron Nano 2 style: Mamba-2, attention and dense MLP (-) blocks.
    "nemotron_h-dense": _config(
        "nemotron_h", _ATTENTION, _NEMOTRON_H, hybrid_override_pattern="M-*-"
    ),
    "lfm2": _config(
        "lfm2",
        _ATTENTION_NO_HEAD_DIM,
        norm_eps=1e-5,
        rope_theta=1_000_000.0,
        conv_bias=False,
        conv_L_cache=3,
        block_dim=128,
        block_ff_dim=256,
        block_multiple_of=64,
        block_ffn_dim_multiplier=1.0,
        block_auto_adjust_ff_dim=True,
        layer_types=["conv", "conv", "full_attention", "conv"],
        tie_word_embeddings=True,
    ),
    # Every Falcon-H1 layer runs attention and a Mamba-2 mixer side by side.
    "falcon_h1": _config(
        "falcon_h1",
        _ATTENTION,
        rms_norm_eps=1e-5,
        rope_theta=100_000_000_000.0,
        # Real checkpoints scale the tied output by lm_head_multiplier / embedding_multiplier
        # after the conversion folds embedding_multiplier into the embedding (mlx-lm's sanitize
        # does so only for Hugging Face weights); equal multipliers keep random logits unscaled.
        embedding_multiplier=1.0,
        lm_head_multiplier=1.0,
        mamba_d_ssm=64,
        mamba_n_heads=4,
        mamba_d_head=16,
        mamba_d_state=16,
        mamba_d_conv=4,
        mamba_n_groups=1,
        mamba_expand=1,
        mamba_conv_bias=True,
        mamba_proj_bias=False,
        mamba_rms_norm=True,
        mamba_norm_before_gate=False,
        tie_word_embeddings=True,
    ),
    "mamba2": _config(
        "mamba2",
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_heads=4,
        head_dim=32,
        state_size=16,
        n_groups=1,
        conv_kernel=4,
        layer_norm_epsilon=1e-5,
        use_bias=False,
        use_conv_bias=True,
        time_step_limit=[0.001, 100.0],
        time_step_rank="auto",
        tie_word_embeddings=True,
    ),
    # Multi-head latent attention, a dense first layer, then routed (in 2 groups) and shared
    # experts.
    "deepseek_v3": _deepseek_v3("deepseek_v3", n_group=2),
    # transformers does not know kimi_k2, and its generic config cannot take a rope_scaling
    # (loading the tokenizer reads config.json).
    "kimi_k2": _deepseek_v3("kimi_k2", routed_scaling_factor=2.827, rope_scaling=None),
    # Kimi Linear: three Kimi delta attention layers, then one NoPE latent-attention layer.
    "kimi_linear": _config(
        "kimi_linear",
        _ATTENTION,
        rms_norm_eps=1e-5,
        rope_theta=10_000.0,
        num_key_value_heads=4,
        model_max_length=4096,
        kv_lora_rank=64,
        qk_nope_head_dim=32,
        qk_rope_head_dim=32,
        v_head_dim=32,
        mla_use_nope=True,
        linear_attn_config={
            "kda_layers": [1, 2, 3],
            "full_attn_layers": [4],
            "head_dim": 16,
            "num_heads": 4,
            "short_conv_kernel_size": 4,
        },
        num_experts=4,
        num_experts_per_token=2,
        num_shared_experts=1,
        moe_intermediate_size=32,
        moe_router_activation_func="sigmoid",
        moe_renormalize=True,
        routed_scaling_factor=2.5,
        first_k_dense_replace=1,
        moe_layer_freq=1,
        use_grouped_topk=True,
        num_expert_group=1,
        topk_group=1,
        tie_word_embeddings=True,
    ),
    # GLM-5 style: DeepSeek V3.2 sparse attention (a lightning indexer picks index_topk keys).
    "glm_moe_dsa": _deepseek_v3(
        "glm_moe_dsa",
        index_head_dim=32,
        index_n_heads=2,
        index_topk=8,
        rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0},
        rope_scaling=None,
        indexer_rope_interleave=True,
    ),
    # Other popular families.
    "mixtral": _config(
        "mixtral",
        _ATTENTION_NO_HEAD_DIM,
        intermediate_size=32,
        rms_norm_eps=1e-5,
        rope_theta=1_000_000.0,
        num_local_experts=4,
        num_experts_per_tok=2,
        tie_word_embeddings=True,
    ),
    "qwen2_moe": _config(
        "qwen2_moe",
        _ATTENTION_NO_HEAD_DIM,
        _MOE,
        rms_norm_eps=1e-6,
        rope_theta=1_000_000.0,
        num_experts=4,
        shared_expert_intermediate_size=64,
        tie_word_embeddings=False,  # mlx-lm's qwen2_moe always has an output head
    ),
    "olmoe": _config(
        "olmoe",
        _ATTENTION,
        intermediate_size=32,
        rms_norm_eps=1e-5,
        rope_theta=10_000.0,
        num_experts=4,
        num_experts_per_tok=2,
        norm_topk_prob=False,
        tie_word_embeddings=True,
    ),
    # OLMo 3: three sliding-window layers, then a global one.
    "olmo3": _config(
        "olmo3",
        _ATTENTION,
        rms_norm_eps=1e-6,
        rope_theta=500_000.0,
        sliding_window=WINDOW,
        layer_types=["sliding_attention"] * 3 + ["full_attention"],
        tie_word_embeddings=True,
    ),
    # SmolLM3: every fourth layer has no rotary embedding.
    "smollm3": _config(
        "smollm3",
        _ATTENTION,
        rms_norm_eps=1e-6,
        rope_theta=5_000_000.0,
        no_rope_layer_interval=4,
        no_rope_layers=[1, 1, 1, 0],
        tie_word_embeddings=True,
    ),
    "granite": _config(
        "granite",
        _ATTENTION_NO_HEAD_DIM,
        rms_norm_eps=1e-5,
        rope_theta=10_000.0,
        attention_bias=False,
        mlp_bias=False,
        embedding_multiplier=12.0,
        attention_multiplier=1 / 32,
        logits_scaling=8.0,
        residual_multiplier=0.22,
        tie_word_embeddings=True,
    ),
    "granitemoe": _config(
        "granitemoe",
        _ATTENTION_NO_HEAD_DIM,
        intermediate_size=32,
        rms_norm_eps=1e-6,
        rope_theta=10_000.0,
        attention_bias=False,
        embedding_multiplier=12.0,
        attention_multiplier=1 / 32,
        logits_scaling=6.0,
        residual_multiplier=0.22,
        num_local_experts=4,
        num_experts_per_tok=2,
        tie_word_embeddings=True,
    ),
    # Hunyuan (A13B style): a mixture of experts beside a shared MLP; with cross-layer attention,
    # every second layer reuses the keys and values of the layer before.
    "hunyuan": _config(
        "hunyuan",
        _ATTENTION_NO_HEAD_DIM,
        _MOE,
        intermediate_size=64,
        rms_norm_eps=1e-5,
        rope_theta=10_000.0,
        rope_scaling={"type": "dynamic", "alpha": 1000.0, "factor": 1.0},
        attention_bias=False,
        use_qk_norm=True,
        moe_topk=2,
        num_experts=4,
        num_shared_expert=1,
        use_mixed_mlp_moe=True,
        use_cla=True,
        cla_share_factor=2,
        tie_word_embeddings=True,
    ),
    "hunyuan_v1_dense": _config(
        "hunyuan_v1_dense",
        _ATTENTION,
        rms_norm_eps=1e-5,
        rope_theta=10_000.0,
        rope_scaling={"type": "dynamic", "alpha": 1000.0, "factor": 1.0},
        use_qk_norm=True,
        tie_word_embeddings=True,
    ),
    "ernie4_5": _config(
        "ernie4_5",
        _ATTENTION,
        rms_norm_eps=1e-5,
        rope_theta=500_000.0,
        use_bias=False,
        tie_word_embeddings=True,
    ),
    "ernie4_5_moe": _config(
        "ernie4_5_moe",
        _ATTENTION,
        rms_norm_eps=1e-5,
        rope_theta=500_000.0,
        use_bias=False,
        moe_num_experts=4,
        moe_k=2,
        moe_intermediate_size=32,
        moe_num_shared_experts=1,
        moe_layer_start_index=1,
        moe_layer_interval=1,
        moe_use_aux_free=True,
        tie_word_embeddings=True,
    ),
    "glm4": _config(
        "glm4",
        _ATTENTION_NO_HEAD_DIM,
        head_dim=32,
        rms_norm_eps=1e-5,
        rope_theta=10_000.0,
        partial_rotary_factor=0.5,
        attention_bias=True,
    ),
    "gemma": _config("gemma", _ATTENTION, rms_norm_eps=1e-6, rope_theta=10_000.0),
    # One key/value head per query head: mlx-lm's gemma2 attention (written out, for the logit
    # soft-capping) broadcasts a batch's padding mask over the key/value heads when it groups
    # queries, so batch_generate fails or mixes up prompts with grouped-query attention.
    "gemma2": _config(
        "gemma2",
        _ATTENTION,
        num_key_value_heads=4,
        rms_norm_eps=1e-6,
        rope_theta=10_000.0,
        query_pre_attn_scalar=32,
        attn_logit_softcapping=50.0,
        final_logit_softcapping=30.0,
    ),
    "phi": _config(
        "phi",
        _ATTENTION_NO_HEAD_DIM,
        num_key_value_heads=4,
        layer_norm_eps=1e-5,
        rope_theta=10_000.0,
        partial_rotary_factor=0.5,
    ),
    "phimoe": _config(
        "phimoe",
        _ATTENTION_NO_HEAD_DIM,
        intermediate_size=32,
        rms_norm_eps=1e-5,
        rope_theta=10_000.0,
        num_local_experts=4,
        num_experts_per_tok=2,
        original_max_position_embeddings=4096,
    ),
    "starcoder2": _config(
        "starcoder2",
        _ATTENTION_NO_HEAD_DIM,
        norm_epsilon=1e-5,
        rope_theta=100_000.0,
        tie_word_embeddings=True,
    ),
    "cohere": _config(
        "cohere",
        _ATTENTION_NO_HEAD_DIM,
        layer_norm_eps=1e-5,
        rope_theta=10_000.0,
        logit_scale=0.25,
        use_qk_norm=True,
    ),
    "exaone_moe": _config(
        "exaone_moe",
        _ATTENTION,
        _MOE,
        rms_norm_eps=1e-5,
        rope_theta=1_000_000.0,
        sliding_window=WINDOW,
        layer_types=["sliding_attention"] * 3 + ["full_attention"],
        is_moe_layer=[False, True, True, True],
        num_experts=4,
        num_shared_experts=1,
        tie_word_embeddings=True,
    ),
    "deepseek_v2": _deepseek_v3("deepseek_v2", topk_method="greedy", n_group=1, topk_group=1),
    # DeepSeek V3.2: latent attention over the keys a lightning indexer picks.
    "deepseek_v32": _deepseek_v3("deepseek_v32", index_head_dim=32, index_n_heads=2, index_topk=8),
    # GLM-4.7-Flash style: latent attention without a query low-rank projection.
    "glm4_moe_lite": _deepseek_v3("glm4_moe_lite", q_lora_rank=None, rope_scaling=None),
    "lfm2_moe": _config(
        "lfm2_moe",
        _ATTENTION_NO_HEAD_DIM,
        _MOE,
        norm_eps=1e-5,
        rope_theta=1_000_000.0,
        conv_bias=False,
        conv_L_cache=3,
        layer_types=["conv", "conv", "full_attention", "conv"],
        num_experts=4,
        num_dense_layers=1,
        norm_topk_prob=True,
        use_expert_bias=True,
        routed_scaling_factor=1.0,
    ),
    # Jamba: Mamba layers and one attention layer; every second layer's MLP is a mixture of
    # experts.
    "jamba": _config(
        "jamba",
        _ATTENTION_NO_HEAD_DIM,
        rms_norm_eps=1e-6,
        attn_layer_offset=2,
        attn_layer_period=4,
        expert_layer_offset=1,
        expert_layer_period=2,
        mamba_d_conv=4,
        mamba_d_state=16,
        mamba_expand=2,
        mamba_dt_rank="auto",
        num_experts=4,
        num_experts_per_tok=2,
        tie_word_embeddings=True,
    ),
    "mamba": _config(
        "mamba",
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        state_size=16,
        conv_kernel=4,
        use_bias=False,
        use_conv_bias=True,
        time_step_rank=4,
        tie_word_embeddings=True,
    ),
    # RecurrentGemma: two RG-LRU recurrent blocks, then a local (window 16) attention block.
    "recurrent_gemma": _config(
        "recurrent_gemma",
        _ATTENTION_NO_HEAD_DIM,
        num_hidden_layers=3,
        num_key_value_heads=1,
        rms_norm_eps=1e-6,
        rope_theta=10_000.0,
        attention_bias=False,
        conv1d_width=4,
        logits_soft_cap=30.0,
        attention_window_size=WINDOW,
        block_types=["recurrent", "recurrent", "attention"],
        embeddings_scale_by_sqrt_dim=True,
    ),
    # Mistral Small 4 style latent attention and experts (its checkpoints nest this config as
    # mistral3's text_config).
    "mistral4": _deepseek_v3(
        "mistral4",
        rope_scaling=None,
        rope_parameters={
            "rope_type": "yarn",
            "rope_theta": 10_000.0,
            "factor": 4.0,
            "original_max_position_embeddings": 1024,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "mscale": 1.0,
            "mscale_all_dim": 1.0,
            "llama_4_scaling_beta": 0.1,
        },
        tie_word_embeddings=True,
    ),
    "apertus": _config(
        "apertus",
        _ATTENTION_NO_HEAD_DIM,
        rms_norm_eps=1e-5,
        rope_theta=12_000_000.0,
        attention_bias=False,
        mlp_bias=False,
        post_norm=False,
        qk_norm=True,
        tie_word_embeddings=True,
    ),
    "nemotron": _config(
        "nemotron",
        _ATTENTION,
        hidden_act="relu2",
        norm_eps=1e-5,
        rope_theta=10_000.0,
        partial_rotary_factor=0.5,
        tie_word_embeddings=True,
    ),
    "stablelm": _config(
        "stablelm",
        _ATTENTION_NO_HEAD_DIM,
        layer_norm_eps=1e-5,
        rope_theta=10_000.0,
        use_qkv_bias=True,
        partial_rotary_factor=0.25,
        qk_layernorm=False,
        use_parallel_residual=False,
    ),
    "helium": _config(
        "helium",
        _ATTENTION_NO_HEAD_DIM,
        head_dim=32,
        rms_norm_eps=1e-8,
        rope_theta=100_000.0,
        attention_bias=False,
        mlp_bias=False,
        tie_word_embeddings=False,  # mlx-lm's helium always has an output head
    ),
    "internlm3": _config(
        "internlm3",
        _ATTENTION_NO_HEAD_DIM,
        rms_norm_eps=1e-5,
        rope_theta=50_000_000.0,
        bias=False,
        qkv_bias=False,
        tie_word_embeddings=True,
    ),
    # Ling / Ring (Bailing) mixture of experts, dense first layer.
    "bailing_moe": _config(
        "bailing_moe",
        _ATTENTION_NO_HEAD_DIM,
        _MOE,
        rms_norm_eps=1e-6,
        rope_theta=600_000.0,
        num_experts=4,
        num_shared_experts=1,
        norm_topk_prob=True,
        first_k_dense_replace=1,
        use_qk_norm=True,
        partial_rotary_factor=0.5,
        moe_router_enable_expert_bias=True,
        score_function="sigmoid",
        n_group=1,
        topk_group=1,
        routed_scaling_factor=2.5,
        tie_word_embeddings=True,
    ),
    # Arcee AFMoE (Trinity): sliding and global layers, dense first layer, then experts.
    "afmoe": _config(
        "afmoe",
        _ATTENTION,
        _MOE,
        rms_norm_eps=1e-5,
        rope_theta=10_000.0,
        sliding_window=WINDOW,
        layer_types=["sliding_attention"] * 3 + ["full_attention"],
        num_experts=4,
        num_shared_experts=1,
        num_dense_layers=1,
        route_norm=True,
        route_scale=2.826,
        score_func="sigmoid",
        n_group=1,
        topk_group=1,
        mup_enabled=True,
        tie_word_embeddings=True,
    ),
    # Llama 4 (text of the multimodal checkpoint): chunked local attention (ChunkedKVCache) in
    # three layers of four, global attention without rotary positions in the fourth.
    "gemma3n": _multimodal(  # (mlx-lm's class reads the multimodal config only)
        "gemma3n",
        _config(
            "gemma3n_text",
            _ATTENTION,
            rms_norm_eps=1e-6,
            num_kv_shared_layers=2,  # (E2B's: the last layers reuse earlier KV)
            vocab_size_per_layer_input=512,
            hidden_size_per_layer_input=16,
            sliding_window=WINDOW,
            rope_local_base_freq=10_000.0,
            rope_theta=1_000_000.0,
            final_logit_softcapping=30.0,
            layer_types=_SLIDING_FULL,
            activation_sparsity_pattern=[0.95, 0.0, 0.0, 0.0],
            altup_num_inputs=4,
            altup_coef_clip=120.0,
            altup_correct_scale=True,
            altup_active_idx=0,
            laurel_rank=16,
            tie_word_embeddings=True,
        ),
    ),
    "kimi_vl": _multimodal("kimi_vl", _deepseek_v3("deepseek_v3")),  # (its text half)
    "llama4": _multimodal(
        "llama4",
        _config(
            "llama4_text",
            _ATTENTION,
            attention_bias=False,
            attention_chunk_size=WINDOW,
            interleave_moe_layer_step=1,
            intermediate_size=32,
            intermediate_size_mlp=128,
            num_experts_per_tok=1,
            num_local_experts=4,
            rms_norm_eps=1e-5,
            rope_scaling=None,
            rope_theta=500_000.0,
            use_qk_norm=True,
            tie_word_embeddings=False,
        ),
    ),
}


def _tokenizer_source() -> Path:
    from agentkv.models.tiny import tiny_model_dir

    return tiny_model_dir("tiny:llama")


def build_architecture(name: str, out: Path) -> Path:
    """Write a tiny random-weight model of architecture ``name`` into ``out``.

    Args:
        name: A key of ``ARCHITECTURES``.
        out: The model directory to write (created if missing; files in it are overwritten).

    Returns:
        ``out``, which ``mlx_lm.load`` loads.

    Raises:
        KeyError: ``name`` is not a known architecture.
    """
    import agentkv.engine  # noqa: F401  (loads the BLAS library before mlx)

    config = _copy(ARCHITECTURES[name])
    source = _tokenizer_source()
    source_config = json.loads((source / "config.json").read_text(encoding="utf-8"))
    config |= {field: source_config[field] for field in _TOKEN_ID_FIELDS}

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    for file in _TOKENIZER_FILES:
        if (source / file).exists():
            shutil.copyfile(source / file, out / file)
    _write_weights(config, out / "model.safetensors")
    text = json.dumps(config, indent=2, sort_keys=True) + "\n"
    (out / "config.json").write_text(text, encoding="utf-8")
    return out


def _write_weights(config: dict, path: Path) -> None:
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm.utils import _get_classes

    model_class, args_class = _get_classes(config)
    mx.random.seed(0)
    model = model_class(args_class.from_dict(_copy(config)))  # some classes edit their config
    weights = {
        key: _initial_value(key, value.astype(mx.float32))
        for key, value in tree_flatten(model.parameters())
    }
    text_config = config.get("text_config", config)
    if text_config.get("tie_word_embeddings", config.get("tie_word_embeddings")):
        # Some classes (gemma3_text) build a head even when tied and drop it on load if absent.
        weights = {k: v for k, v in weights.items() if not k.endswith("lm_head.weight")}
    mx.eval(weights)
    mx.save_safetensors(str(path), weights, metadata={"format": "mlx"})


def _initial_value(key: str, value: mx.array) -> mx.array:
    """The value to save for parameter ``key``, which the model class initialized to ``value``.

    mlx-lm's classes initialize what checkpoints overwrite anyway: some parameters to zeros
    (router weights, attention sinks, expert and norm biases, Cohere's query/key norm scales, the
    RG-LRU of RecurrentGemma), which would make routing arbitrary or a path dead; and SSM time
    steps so long that a state forgets everything within a few tokens.
    """
    import mlx.core as mx

    if key.endswith(("dt_bias", "dt_proj.bias")):  # SSMs (Mamba, Mamba-2), gated delta nets
        return _inverse_softplus(_log_uniform(0.001, 0.1, value.shape))
    if key.endswith("recurrent_param"):  # RG-LRU: softplus(p) = -log(a), a^2 in [0.81, 0.998]
        return _inverse_softplus(-0.5 * mx.log(mx.random.uniform(0.81, 0.998, value.shape)))
    if mx.any(value).item():
        return value
    if "norm" in key and key.endswith("weight"):
        return mx.ones(value.shape)
    if value.ndim < 2:
        return _VECTOR_INIT_SCALE * mx.random.normal(value.shape)
    # nn.Linear's initialization. Convolution weights are (out, kernel, in / groups); other
    # matrices (..., out, in).
    fan_in = math.prod(value.shape[1:]) if "conv" in key else value.shape[-1]
    return mx.random.uniform(-(fan_in**-0.5), fan_in**-0.5, value.shape)


def _log_uniform(low: float, high: float, shape: tuple[int, ...]) -> mx.array:
    import mlx.core as mx

    return mx.exp(mx.random.uniform(math.log(low), math.log(high), shape))


def _inverse_softplus(y: mx.array) -> mx.array:
    import mlx.core as mx

    return y + mx.log(-mx.expm1(-y))
