"""Tiny random-weight checkpoints of many architectures, written in Hugging Face layout.

They borrow the demo model's tokenizer so `mlx_lm.load` takes them as it takes any model;
weights come from MLX's default initialisation under a fixed seed, in float32. Quantized
copies are made from them with mlx-lm's own converter.
"""

from __future__ import annotations

import json
from pathlib import Path

from orchard.node.model.random_weights import write_random_checkpoint

#: parameters mlx-lm's classes build as zeros and checkpoints train: gpt-oss's attention sinks
TRAINED_FROM_ZERO = ("self_attn.sinks",)
#: the same for one model_type only (the suffix names a built-random parameter in others): DeepSeek-V2's
#: expert router, whose zeros would tie every expert's score
TRAINED_FROM_ZERO_BY_TYPE = {"deepseek_v2": ("mlp.gate.weight",)}

_COMMON = dict(hidden_size=64, num_hidden_layers=2, intermediate_size=128, num_attention_heads=4,
               max_position_embeddings=2048, torch_dtype="float32")

_DEEPSEEK_V2 = dict(_COMMON, model_type="deepseek_v2", num_key_value_heads=4, max_position_embeddings=163840,
                    kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=12, n_routed_experts=4,
                    n_shared_experts=1, num_experts_per_tok=2, moe_intermediate_size=32, routed_scaling_factor=1.0,
                    topk_method="greedy", rms_norm_eps=1e-6, rope_theta=10_000.0, tie_word_embeddings=False,
                    rope_scaling=dict(type="yarn", factor=40, original_max_position_embeddings=4096, beta_fast=32,
                                      beta_slow=1, mscale=0.707, mscale_all_dim=0.707))

TINY_CONFIGS = {
    "qwen3": dict(_COMMON, model_type="qwen3", num_key_value_heads=2, head_dim=32, rms_norm_eps=1e-6,
                  rope_theta=1_000_000.0, tie_word_embeddings=True),
    "mistral": dict(_COMMON, model_type="mistral", num_key_value_heads=1, head_dim=16, rms_norm_eps=1e-5,
                    rope_theta=10_000.0, tie_word_embeddings=False, sliding_window=None),
    "qwen2": dict(_COMMON, model_type="qwen2", num_key_value_heads=2, rms_norm_eps=1e-6, rope_theta=1_000_000.0,
                  tie_word_embeddings=True, use_sliding_window=False, sliding_window=2048),
    # Llama 3.x: its rope keeps a frequency array computed at construction.
    "llama3": dict(_COMMON, model_type="llama", num_key_value_heads=2, rms_norm_eps=1e-5, rope_theta=500_000.0,
                   tie_word_embeddings=True,
                   rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                     original_max_position_embeddings=64)),
    "qwen3_moe": dict(_COMMON, model_type="qwen3_moe", num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-6,
                      rope_theta=1_000_000.0, tie_word_embeddings=False, num_experts=4, num_experts_per_tok=2,
                      decoder_sparse_step=1, mlp_only_layers=[], moe_intermediate_size=32, norm_topk_prob=True),
    # Qwen2-MoE's forward applies lm_head even when its config says the embeddings are tied.
    "qwen2_moe": dict(_COMMON, model_type="qwen2_moe", num_key_value_heads=2, rms_norm_eps=1e-6,
                      rope_theta=1_000_000.0, tie_word_embeddings=True, num_experts=4, num_experts_per_tok=2,
                      moe_intermediate_size=32, shared_expert_intermediate_size=64),
    "gemma": dict(_COMMON, model_type="gemma", num_key_value_heads=1, head_dim=32, rms_norm_eps=1e-6,
                  rope_theta=10_000.0),
    # Phi-3's long-context rope scales every frequency by a per-dimension factor.
    "phi3": dict(_COMMON, model_type="phi3", num_key_value_heads=2, rms_norm_eps=1e-5, rope_theta=10_000.0,
                 original_max_position_embeddings=512,
                 rope_scaling=dict(type="longrope", short_factor=[1.0 + i / 8 for i in range(8)],
                                   long_factor=[1.5 + i / 4 for i in range(8)])),
    "olmo2": dict(_COMMON, model_type="olmo2", num_key_value_heads=2, rms_norm_eps=1e-6, rope_theta=500_000.0,
                  tie_word_embeddings=False),
    "glm4": dict(_COMMON, model_type="glm4", num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-5,
                 rope_theta=10_000.0, partial_rotary_factor=0.5, attention_bias=True),
    "starcoder2": dict(_COMMON, model_type="starcoder2", num_key_value_heads=2, norm_epsilon=1e-5,
                       rope_theta=100_000.0, tie_word_embeddings=True),
    # Hunyuan: mixture of experts with a shared expert, query/key norms, and K/V shared by layer pairs.
    "hunyuan": dict(_COMMON, model_type="hunyuan", num_key_value_heads=2, rms_norm_eps=1e-5, rope_theta=10_000.0,
                    attention_bias=False, moe_topk=2, num_experts=4, num_shared_expert=1, use_mixed_mlp_moe=True,
                    use_qk_norm=True, use_cla=True, cla_share_factor=2, moe_intermediate_size=32,
                    rope_scaling=dict(type="dynamic", factor=1.0, alpha=1000.0)),
    # Granite divides the logits after the head, Cohere multiplies them (and runs attention and MLP in parallel).
    "granite": dict(_COMMON, model_type="granite", num_key_value_heads=2, rms_norm_eps=1e-5, rope_theta=10_000.0,
                    logits_scaling=4.0, attention_multiplier=0.125, embedding_multiplier=12.0,
                    residual_multiplier=0.25, attention_bias=False, mlp_bias=False, tie_word_embeddings=True),
    "cohere": dict(_COMMON, model_type="cohere", num_key_value_heads=2, rope_theta=8_000_000.0,
                   layer_norm_eps=1e-5, logit_scale=0.0625, use_qk_norm=False),
    # Mixtral's attention names its KV-head count num_key_value_heads.
    "mixtral": dict(_COMMON, model_type="mixtral", num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2,
                    rms_norm_eps=1e-5, rope_theta=1_000_000.0),
    # SmolLM3 reuses Llama's attention class (so Llama's module's attention call is routed) and
    # leaves the rope out of every fourth layer.
    "smollm3": dict(_COMMON, model_type="smollm3", num_hidden_layers=4, num_key_value_heads=2, rms_norm_eps=1e-6,
                    rope_theta=1_000_000.0, tie_word_embeddings=True, no_rope_layer_interval=4),
    # Mistral 3 (Mistral-Small-3.x): a multimodal wrapper whose text model is a Mistral under language_model.
    "mistral3": dict(model_type="mistral3", torch_dtype="float32", text_config=dict(
        _COMMON, model_type="mistral", num_key_value_heads=1, head_dim=16, rms_norm_eps=1e-5, rope_theta=1_000_000_000.0,
        tie_word_embeddings=False)),
    # EXAONE: its stack is transformer.h, attention at attn.attention, final norm ln_f, num_layers.
    "exaone": dict({k: v for k, v in _COMMON.items() if k != "num_hidden_layers"}, num_layers=2, model_type="exaone",
                   num_key_value_heads=2, layer_norm_epsilon=1e-5, rope_theta=1_000_000.0, tie_word_embeddings=True),
    # InternLM2 keeps its attention at layers[i].attention (fused wqkv, wo).
    "internlm2": dict(_COMMON, model_type="internlm2", num_key_value_heads=2, rms_norm_eps=1e-6, rope_theta=1_000_000.0,
                      bias=False, tie_word_embeddings=False),
    # Sliding windows (keys a query sees, itself included) shorter than the tests' prompts and
    # not a multiple of their block size of 4, so windows end inside blocks and chunks.
    # Gemma 3: windowed and global layers alternate (pattern 2), each kind with its own rope base.
    "gemma3_text": dict(_COMMON, model_type="gemma3_text", num_hidden_layers=4, num_key_value_heads=2, head_dim=32,
                        query_pre_attn_scalar=32, sliding_window=6, sliding_window_pattern=2, rms_norm_eps=1e-6,
                        rope_theta=1_000_000.0, rope_local_base_freq=10_000.0),
    # Gemma 3 as published (gemma-3-4b-it and up): the text model under a multimodal wrapper's language_model.
    "gemma3": dict(model_type="gemma3", torch_dtype="float32", text_config=dict(
        _COMMON, model_type="gemma3_text", num_hidden_layers=3, num_key_value_heads=2, head_dim=32,
        query_pre_attn_scalar=32, sliding_window=5, sliding_window_pattern=3, rms_norm_eps=1e-6)),
    # gpt-oss: learned attention sinks (randomised here, see write_tiny_model), windowed and full layers, experts.
    "gpt_oss": dict(_COMMON, model_type="gpt_oss", num_hidden_layers=3, num_key_value_heads=2, head_dim=16,
                    num_local_experts=4, num_experts_per_tok=2, sliding_window=5, rms_norm_eps=1e-5,
                    layer_types=["sliding_attention", "full_attention", "sliding_attention"], rope_theta=150_000.0),
    # A Llama config whose layer_types window some layers (as Mistral's and Ministral's newer configs do).
    "llama_swa": dict(_COMMON, model_type="llama", num_hidden_layers=3, num_key_value_heads=2, rms_norm_eps=1e-5,
                      rope_theta=500_000.0, sliding_window=7,
                      layer_types=["sliding_attention", "full_attention", "sliding_attention"]),
    # OLMo 3: three windowed layers to one full.
    "olmo3": dict(_COMMON, model_type="olmo3", num_hidden_layers=4, num_key_value_heads=2, rms_norm_eps=1e-6,
                  rope_theta=500_000.0, sliding_window=6),
    # Gemma 2: scores soft-capped (capped low, so the caps bite on random weights), logits soft-capped,
    # a query scale of its own. mlx-lm does not apply its configs' sliding_window, so the window caps
    # the context (node.model.loader): set past the tests' sequences, which stay where a window changes nothing.
    "gemma2": dict(_COMMON, model_type="gemma2", num_hidden_layers=3, num_key_value_heads=2, head_dim=32,
                   rms_norm_eps=1e-6, rope_theta=10_000.0, query_pre_attn_scalar=24, attn_logit_softcapping=2.0,
                   final_logit_softcapping=5.0, sliding_window=40),
    # Ministral 3: Llama 4's query scaling by position (original_max_position_embeddings small, so
    # the scale changes within the prompts), yarn rope, windowed and full layers by layer_types.
    "ministral3": dict(_COMMON, model_type="ministral3", num_hidden_layers=3, num_key_value_heads=2, head_dim=16,
                       rms_norm_eps=1e-5, sliding_window=5,
                       layer_types=["sliding_attention", "full_attention", "sliding_attention"],
                       rope_parameters=dict(rope_type="yarn", factor=2.0, original_max_position_embeddings=4,
                                            llama_4_scaling_beta=0.5, rope_theta=1_000_000.0)),
    # Ministral 3 as published (Ministral-3-8B-Instruct-2512): the text model under Mistral 3's wrapper.
    "mistral3_ministral3": dict(model_type="mistral3", torch_dtype="float32", text_config=dict(
        _COMMON, model_type="ministral3", num_hidden_layers=2, num_key_value_heads=1, head_dim=16, rms_norm_eps=1e-5,
        sliding_window=7, layer_types=["full_attention", "sliding_attention"], tie_word_embeddings=False,
        rope_parameters=dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=8,
                             llama_4_scaling_beta=0.1, rope_theta=1_000_000_000.0))),
    # MiniMax: sigmoid-routed experts, query/key norms over all heads, a partial rotary dim.
    "minimax": dict(_COMMON, model_type="minimax", num_key_value_heads=2, head_dim=16, num_experts_per_tok=2,
                    num_local_experts=4, shared_intermediate_size=0, rms_norm_eps=1e-5, rope_theta=1_000_000.0,
                    rotary_dim=8),
    # DeepSeek-V2 (-Lite's shape, shrunk): keys of 16 nope + 8 rope dims, values of 12, a dense first layer
    # then routed experts with a shared one, and -Lite's yarn rope (its mscale scales the softmax too).
    "deepseek_v2": dict(_DEEPSEEK_V2, num_hidden_layers=3, q_lora_rank=None, first_k_dense_replace=1,
                        moe_layer_freq=1),
    # DeepSeek-V2 (the full model's shape): queries through a low-rank projection, experts every second layer.
    "deepseek_v2_q_lora": dict(_DEEPSEEK_V2, num_hidden_layers=4, q_lora_rank=24, first_k_dense_replace=1,
                               moe_layer_freq=2),
}

#: Hybrid models: Gated DeltaNet layers (recurrent state, node.model.state_layers) between full-attention
#: layers (every second one here); small heads, so the CPU's sequential DeltaNet stays quick.
_GATED_DELTA = dict(linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=16, linear_value_head_dim=16,
                    linear_conv_kernel_dim=4, full_attention_interval=2)
HYBRID_CONFIGS = {
    "qwen3_next": dict(_COMMON, **_GATED_DELTA, model_type="qwen3_next", num_hidden_layers=4, num_key_value_heads=2,
                       head_dim=16, rms_norm_eps=1e-6, rope_theta=1_000_000.0, partial_rotary_factor=0.25,
                       num_experts=4, num_experts_per_tok=2, decoder_sparse_step=1, shared_expert_intermediate_size=64,
                       mlp_only_layers=[], moe_intermediate_size=32, norm_topk_prob=True, tie_word_embeddings=False),
    # Qwen3.5 as published: the text model under a multimodal wrapper's language_model.
    "qwen3_5": dict(model_type="qwen3_5", torch_dtype="float32", text_config=dict(
        _COMMON, **_GATED_DELTA, model_type="qwen3_5_text", num_hidden_layers=4, num_key_value_heads=2, head_dim=16,
        rms_norm_eps=1e-6, tie_word_embeddings=False,
        rope_parameters=dict(type="default", rope_theta=1_000_000.0, partial_rotary_factor=0.25))),
    # Qwen3.5-MoE: the same with routed experts and a shared expert in every layer.
    "qwen3_5_moe": dict(model_type="qwen3_5_moe", torch_dtype="float32", text_config=dict(
        _COMMON, **_GATED_DELTA, model_type="qwen3_5_moe_text", num_hidden_layers=4, num_key_value_heads=2, head_dim=16,
        rms_norm_eps=1e-6, tie_word_embeddings=False, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
        shared_expert_intermediate_size=64,
        rope_parameters=dict(type="default", rope_theta=1_000_000.0, partial_rotary_factor=0.25))),
}

#: Architectures the loader must refuse for what their loaded layers do (a rope that cannot
#: take per-token positions).
REFUSED_CONFIGS = {
    "llama_dynamic_ntk": dict(_COMMON, model_type="llama", num_key_value_heads=2, rms_norm_eps=1e-5,
                              rope_theta=10_000.0, rope_scaling=dict(type="dynamic", factor=2.0)),
    # DeepSeek-V3's multi-head latent attention caches a compressed KV and attends over keys and values
    # expanded from it, with a mask of its own.
    "deepseek_v3": dict(_DEEPSEEK_V2, model_type="deepseek_v3", num_hidden_layers=2, q_lora_rank=None,
                        first_k_dense_replace=1, moe_layer_freq=1, n_group=1, topk_group=1, topk_method="noaux_tc"),
}


def write_tiny_model(folder: Path, model_type: str, tokenizer_from: Path, seed: int = 7) -> Path:
    """Write the tiny config named `model_type` with random weights into `folder`; returns it."""
    vocab = json.loads((tokenizer_from / "config.json").read_text())["vocab_size"]
    config = dict({**TINY_CONFIGS, **HYBRID_CONFIGS, **REFUSED_CONFIGS}[model_type], vocab_size=vocab)
    if "text_config" in config:  # a multimodal wrapper: the text model states the vocabulary
        config["text_config"] = dict(config["text_config"], vocab_size=vocab)
    # zeros at construction would hide what trained-from-zero parameters do
    randomize = TRAINED_FROM_ZERO + TRAINED_FROM_ZERO_BY_TYPE.get(config["model_type"], ())
    return write_random_checkpoint(folder, config, tokenizer_from, seed, randomize=randomize)


def write_quantized_model(folder: Path, source: Path, bits: int, group_size: int, dtype: str | None = None) -> Path:
    """Quantize the checkpoint at `source` into `folder` with mlx-lm's own converter, as the
    mlx-community checkpoints are made (affine; embeddings and head too where their width allows).
    `dtype` casts the unquantized weights (norms, scales), which sets the activations' dtype."""
    from mlx_lm.convert import convert

    convert(str(source), str(folder), quantize=True, q_bits=bits, q_group_size=group_size, dtype=dtype)
    return folder
