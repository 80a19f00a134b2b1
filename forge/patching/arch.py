"""The architecture table: data, read by the one generic walker in ``core.py``.

Each entry says, for one ``config.model_type``, where the kernels apply and with which numerics
(checked against the installed transformers' modeling code, 5.17 and 5.24; the MoE ones 5.25):

- ``norms``: attribute names of the RMSNorm modules (per decoder layer, plus the final ``norm``),
  with the casting convention and weight offset of ``forge.spec.rmsnorm``: llama/qwen/mistral
  normalise in fp32, cast back, then multiply by ``w`` (``casting="llama"``, offset 0); gemma and
  gemma2 multiply by ``1 + w`` in fp32 before the cast (``casting="gemma"``, offset 1).
- ``glu``: the MLP's gated activation, and ``act_attr`` the config field naming the activation
  (``GLU_ACTS``: the names each kernel computes exactly; e.g. exact-erf gelu differs from the
  tanh approximation). The walker picks each MLP's kernel from the activation module it calls,
  ``mlp.act_fn`` (``glu_of``), not from the config: a user may swap that module.
- ``rope``: the attention forward calls the module-level ``apply_rotary_pos_emb`` (HF's
  rotate_half convention); forge swaps it per attention instance, never in the HF module.
- ``logit_softcap_attr``: config field of the final logit soft-capping the CausalLM forward
  applies before the loss (gemma2), which the fused loss must reproduce.

gemma's embedding scaling (``embed_tokens`` multiplies by sqrt(hidden)) is left alone: forge
patches no embedding.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Arch:
    model_type: str
    norms: tuple[str, ...]
    norm_casting: str                 # forge.spec.rmsnorm casting: "llama" | "gemma"
    norm_offset: float
    glu: str                          # "swiglu" | "geglu"
    act_attr: str                     # config field holding the MLP activation name
    rope: bool = True                 # attention calls module-level apply_rotary_pos_emb
    logit_softcap_attr: str | None = None

    def expected_norms(self, num_layers: int) -> int:
        """RMSNorm modules in a model of ``num_layers`` layers: per-layer ones plus the final."""
        return (len(self.norms) - 1) * num_layers + 1


# Class-name suffixes the walker matches (together with the attribute names above and the
# model's own modeling module, so a foreign module is never patched by accident).
NORM_SUFFIX = "RMSNorm"
MLP_SUFFIX = "MLP"
ATTN_SUFFIX = "Attention"
ROPE_FUNCTION = "apply_rotary_pos_emb"
# where HF RMSNorms keep epsilon (llama family vs gemma family)
EPS_ATTRS = ("variance_epsilon", "eps")
# MLP submodules the fused GLU forward calls
MLP_PROJ = ("gate_proj", "up_proj", "down_proj")

# activation names each GLU kernel reproduces exactly (ACT2FN keys)
GLU_ACTS = {
    "swiglu": ("silu", "swish"),
    "geglu": ("gelu_pytorch_tanh",),
}

# the activation modules each GLU kernel computes exactly, by class (module, qualified name):
# the class itself, never a subclass, which may compute something else
GLU_ACT_CLASSES = {
    "swiglu": (("torch.nn.modules.activation", "SiLU"), ("transformers.activations", "SiLUActivation")),
    "geglu": (("transformers.activations", "GELUTanh"), ("transformers.activations", "PytorchGELUTanh")),
}


def glu_of(act_fn) -> str | None:
    """The GLU kernel whose activation is the module ``act_fn`` ("swiglu" / "geglu"), else None."""
    cls = type(act_fn)
    name = (cls.__module__, cls.__qualname__)
    return next((key for key, names in GLU_ACT_CLASSES.items() if name in names), None)


_LLAMA_NORMS = ("input_layernorm", "post_attention_layernorm", "norm")

ARCHS: dict[str, Arch] = {
    "llama": Arch("llama", _LLAMA_NORMS, "llama", 0.0, "swiglu", "hidden_act"),
    "mistral": Arch("mistral", _LLAMA_NORMS, "llama", 0.0, "swiglu", "hidden_act"),
    "qwen2": Arch("qwen2", _LLAMA_NORMS, "llama", 0.0, "swiglu", "hidden_act"),
    # per-head q/k norms (width head_dim), applied before RoPE
    "qwen3": Arch("qwen3", _LLAMA_NORMS + ("q_norm", "k_norm"), "llama", 0.0, "swiglu", "hidden_act"),
    # mixture of experts (transformers 5.x 3-D expert weights: forge.patching.experts); the dense
    # parts as above. olmoe's q/k norms span the whole projection (hidden, kv heads x head_dim)
    "qwen3_moe": Arch("qwen3_moe", _LLAMA_NORMS + ("q_norm", "k_norm"), "llama", 0.0, "swiglu", "hidden_act"),
    "mixtral": Arch("mixtral", _LLAMA_NORMS, "llama", 0.0, "swiglu", "hidden_act"),
    "olmoe": Arch("olmoe", _LLAMA_NORMS + ("q_norm", "k_norm"), "llama", 0.0, "swiglu", "hidden_act"),
    "gemma": Arch("gemma", _LLAMA_NORMS, "gemma", 1.0, "geglu", "hidden_act"),
    # sandwich norms: four per layer
    "gemma2": Arch("gemma2", _LLAMA_NORMS + ("pre_feedforward_layernorm", "post_feedforward_layernorm"),
                   "gemma", 1.0, "geglu", "hidden_activation", logit_softcap_attr="final_logit_softcapping"),
}

SUPPORTED = tuple(sorted(ARCHS))
MOE = ("mixtral", "olmoe", "qwen3_moe")  # the expert blocks: forge.patching.experts
DENSE = tuple(a for a in SUPPORTED if a not in MOE)
