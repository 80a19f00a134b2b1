"""Model presets at the published shapes (random weights: nothing is downloaded)."""
from __future__ import annotations

PRESETS = {
    "qwen2.5-0.5b": dict(model_type="qwen2", hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                         num_attention_heads=14, num_key_value_heads=2, vocab_size=151936,
                         tie_word_embeddings=True, rope_theta=1e6, rms_norm_eps=1e-6,
                         max_position_embeddings=32768, hidden_act="silu"),
    "qwen3-0.6b": dict(model_type="qwen3", hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                       num_attention_heads=16, num_key_value_heads=8, head_dim=128, vocab_size=151936,
                       tie_word_embeddings=True, rope_theta=1e6, rms_norm_eps=1e-6,
                       max_position_embeddings=40960, hidden_act="silu"),
    "gemma-2b": dict(model_type="gemma", hidden_size=2048, intermediate_size=16384, num_hidden_layers=18,
                     num_attention_heads=8, num_key_value_heads=1, head_dim=256, vocab_size=256000,
                     rms_norm_eps=1e-6, hidden_act="gelu_pytorch_tanh", hidden_activation="gelu_pytorch_tanh",
                     max_position_embeddings=8192, tie_word_embeddings=True),
    "gemma2-2b": dict(model_type="gemma2", hidden_size=2304, intermediate_size=9216, num_hidden_layers=26,
                      num_attention_heads=8, num_key_value_heads=4, head_dim=256, vocab_size=256000,
                      rms_norm_eps=1e-6, hidden_activation="gelu_pytorch_tanh", hidden_act="gelu_pytorch_tanh",
                      final_logit_softcapping=30.0, attn_logit_softcapping=50.0, query_pre_attn_scalar=256,
                      sliding_window=4096, max_position_embeddings=8192, tie_word_embeddings=True),
    # the sizes people fine-tune and serve (published shapes)
    "llama3-8b": dict(model_type="llama", hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                      num_attention_heads=32, num_key_value_heads=8, vocab_size=128256,
                      tie_word_embeddings=False, rope_theta=5e5, rms_norm_eps=1e-5,
                      max_position_embeddings=131072, hidden_act="silu"),
    "qwen2.5-7b": dict(model_type="qwen2", hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
                       num_attention_heads=28, num_key_value_heads=4, vocab_size=152064,
                       tie_word_embeddings=False, rope_theta=1e6, rms_norm_eps=1e-6,
                       max_position_embeddings=32768, hidden_act="silu"),
    # mixtures of experts (published shapes; transformers 5.x 3-D expert weights)
    "qwen3-30b-a3b": dict(model_type="qwen3_moe", hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
                          num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
                          num_experts=128, num_experts_per_tok=8, norm_topk_prob=True, decoder_sparse_step=1,
                          mlp_only_layers=[], vocab_size=151936, tie_word_embeddings=False, rope_theta=1e6,
                          rms_norm_eps=1e-6, max_position_embeddings=40960, hidden_act="silu"),
    "olmoe-1b-7b": dict(model_type="olmoe", hidden_size=2048, intermediate_size=1024, num_hidden_layers=16,
                        num_attention_heads=16, num_key_value_heads=16, num_experts=64, num_experts_per_tok=8,
                        norm_topk_prob=False, vocab_size=50304, tie_word_embeddings=False, rope_theta=1e4,
                        rms_norm_eps=1e-5, max_position_embeddings=4096, hidden_act="silu"),
    "mixtral-8x7b": dict(model_type="mixtral", hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                         num_attention_heads=32, num_key_value_heads=8, num_local_experts=8, num_experts_per_tok=2,
                         vocab_size=32000, tie_word_embeddings=False, rope_theta=1e6, rms_norm_eps=1e-5,
                         max_position_embeddings=32768, sliding_window=None, hidden_act="silu"),
    # --quick: a tiny qwen2 for CPU smoke tests
    "tiny": dict(model_type="qwen2", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, vocab_size=256, tie_word_embeddings=True,
                 rms_norm_eps=1e-6, max_position_embeddings=128, hidden_act="silu"),
    # and a tiny qwen3_moe (4 experts, top-2) for the MoE smoke tests
    "tiny-moe": dict(model_type="qwen3_moe", hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                     num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=4,
                     num_experts_per_tok=2, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[],
                     vocab_size=256, tie_word_embeddings=True, rms_norm_eps=1e-6, max_position_embeddings=128,
                     hidden_act="silu"),
}

MOE_TYPES = ("qwen3_moe", "mixtral", "olmoe")


def is_moe(name: str) -> bool:
    return PRESETS[name]["model_type"] in MOE_TYPES


def add_step_arguments(parser, batch: int = 4, seq_len: int = 1024) -> None:
    """The whole-model step's arguments: --model (a preset), --mode, --batch, --seq-len."""
    parser.add_argument("--model", default="qwen2.5-0.5b", choices=sorted(PRESETS))
    parser.add_argument("--mode", default="train", choices=["train", "infer"])
    parser.add_argument("--batch", type=int, default=batch)
    parser.add_argument("--seq-len", type=int, default=seq_len)
    parser.add_argument("--layers", type=int, default=None,
                        help="decoder layers (default: the preset's; fewer to fit a full fine-tune of a large model)")


def build(name: str, dtype, device, attn="sdpa", layers: int | None = None):
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = dict(PRESETS[name])
    mt = cfg.pop("model_type")
    if layers is not None:
        if not 1 <= layers <= cfg["num_hidden_layers"]:
            raise ValueError(f"--layers {layers}: {name} has {cfg['num_hidden_layers']} decoder layers")
        cfg["num_hidden_layers"] = layers
    config = AutoConfig.for_model(mt, **cfg)
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, attn_implementation=attn, dtype=dtype)
    return model
