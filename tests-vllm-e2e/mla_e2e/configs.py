"""The model, the configurations the check runs, their lanes and what must fail."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

VLLM_VERSION = "0.33.0"
SEED = 1234
LAYERS = 2
PROMPT_LENGTHS = (7, 33, 120, 300)  # 300 > max_num_batched_tokens: chunked context
MAX_TOKENS = 16
MAX_BATCHED_TOKENS = 128
KV_CACHE_BYTES = 1 << 30  # fixed: no memory profiling between concurrent engines
VOCAB = 4096
CONFIG: dict[str, Any] = {
    "architectures": ["DeepseekV2ForCausalLM"],
    "model_type": "deepseek_v2",
    "hidden_size": 1024,
    "intermediate_size": 2048,
    "moe_intermediate_size": 256,
    "num_hidden_layers": LAYERS,
    "num_attention_heads": 16,
    "num_key_value_heads": 16,
    "kv_lora_rank": 512,
    "q_lora_rank": None,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
    "vocab_size": VOCAB,
    "max_position_embeddings": 2048,
    "rope_theta": 10000.0,
    "rms_norm_eps": 1e-6,
    "first_k_dense_replace": LAYERS,  # dense MLPs only: no MoE kernels needed
    "n_routed_experts": 4,
    "n_shared_experts": 1,
    "num_experts_per_tok": 2,
    "tie_word_embeddings": False,
    "bos_token_id": 0,
    "eos_token_id": 1,
    "torch_dtype": "bfloat16",
}
OBSERVE = {"enabled": True, "interval": 1}


@dataclass(frozen=True)
class Run:
    backend: str
    eager: bool
    quant: Any  # mla_quant object, None (no additional_config) or "CALIBRATED"
    action: str  # generate | calibrate | install | expect_error
    timeout: float


RUNS: dict[str, Run] = {
    "triton_eager": Run("TRITON_MLA", True, None, "generate", 180),
    "quant_none_eager": Run("MLA_QUANT", True, {}, "generate", 180),
    "nvfp4_eager": Run("MLA_QUANT", True, {"recipe": "nvfp4", "observe": OBSERVE}, "generate", 180),
    "fp8_eager": Run("MLA_QUANT", True, {"recipe": "fp8", "observe": OBSERVE}, "generate", 180),
    "triton_graphs": Run("TRITON_MLA", False, None, "generate", 300),
    "quant_none_graphs": Run("MLA_QUANT", False, {}, "generate", 300),
    "nvfp4_graphs": Run("MLA_QUANT", False, {"recipe": "nvfp4"}, "generate", 300),
    # The write-once shadow KV path: the same function as on-read decode.
    "nvfp4_shadow_eager": Run(
        "MLA_QUANT",
        True,
        {"recipe": "nvfp4", "kv_path": "shadow", "observe": OBSERVE},
        "generate",
        180,
    ),
    "nvfp4_shadow_graphs": Run(
        "MLA_QUANT", False, {"recipe": "nvfp4", "kv_path": "shadow"}, "generate", 300
    ),
    "calibrate": Run("MLA_QUANT", True, {}, "calibrate", 180),
    "nvfp4_calibrated": Run("MLA_QUANT", True, "CALIBRATED", "generate", 180),
    "install_in_place": Run("TRITON_MLA", True, None, "install", 180),
    # Must fail inside the TP workers; the error must reach this process (see EXPECT).
    # A layer override whose pattern matches no layer: known only once the workers
    # have built the model, raised when the metadata builder binds the layers.
    "tp_error_bind": Run(
        "MLA_QUANT",
        True,
        {"recipe": "nvfp4", "layers": [{"pattern": "model.layers.9.*", "v": "fp8"}]},
        "expect_error",
        200,
    ),
    # Valid schema, but layer 1 alone gets a static P amax below 1, which the
    # prefill kernel refuses (docs/numerics.md "Edge cases we chose") at that layer's
    # first prefill.
    "tp_error_layer": Run(
        "MLA_QUANT",
        True,
        {
            "recipe": "nvfp4",
            "layers": [{"pattern": "model.layers.1.*", "p": {"format": "nvfp4", "amax": 0.5}}],
        },
        "expect_error",
        200,
    ),
    # A schema error: raised while each worker builds the model (before it reports
    # ready), so vLLM's parent only says that a worker failed to start.
    "tp_error_schema": Run("MLA_QUANT", True, {"recipe": "nvfp5"}, "expect_error", 200),
}
# What an expected failure must show: substrings of the exception raised in this
# process by LLM()/generate ("message", its causes included) and of the child's log
# ("log": the workers inherit its stdout/stderr, as they share a user's console).
EXPECT: dict[str, dict[str, tuple[str, ...]]] = {
    "tp_error_bind": {
        "message": ("mla_quant.layers[0].pattern", "model.layers.0.self_attn.attn"),
        "log": ("mla_quant.layers[0].pattern",),
    },
    "tp_error_layer": {
        "message": ("model.layers.1.self_attn.attn", "P's static amax"),
        "log": ("model.layers.1.self_attn.attn",),
    },
    "tp_error_schema": {"message": (), "log": ("additional_config.mla_quant.recipe",)},
}
# The default set at TP > 1, and the set a TP=1 reference run for --compare-tp takes.
TP_RUNS = (
    "triton_eager",
    "quant_none_eager",
    "nvfp4_eager",
    "triton_graphs",
    "quant_none_graphs",
    "nvfp4_graphs",
)
TP_DEFAULT = (*TP_RUNS, "tp_error_bind", "tp_error_layer", "tp_error_schema")
# Configurations in one lane run one after another (a comparison's pair, a
# dependency); lanes run concurrently with --jobs > 1, in this order of priority.
LANES: tuple[tuple[str, ...], ...] = (
    ("triton_graphs", "quant_none_graphs", "nvfp4_graphs", "nvfp4_shadow_graphs"),
    ("triton_eager", "quant_none_eager", "nvfp4_eager", "fp8_eager"),
    ("calibrate", "nvfp4_calibrated", "install_in_place", "nvfp4_shadow_eager"),
)
LANES_TP: tuple[tuple[str, ...], ...] = (
    ("triton_graphs", "quant_none_graphs"),
    ("triton_eager", "quant_none_eager", "nvfp4_eager"),
    ("nvfp4_graphs", "tp_error_schema"),
    ("tp_error_bind", "tp_error_layer"),
    ("fp8_eager", "calibrate", "nvfp4_calibrated", "install_in_place"),
)
DEPENDS = {"nvfp4_calibrated": "calibrate"}
MIN_USEFUL_SECONDS = 40.0  # do not start a configuration with less time left


def prompts() -> list[list[int]]:
    import random

    rng = random.Random(SEED)
    return [[rng.randrange(2, VOCAB) for _ in range(n)] for n in PROMPT_LENGTHS]
